"""bench_rollout.py: a rollout rank's Python cost per token at GPU token rates, measured.

    .venv/bin/python -m tools.bench_rollout              # fake engine at GPU rates, stream interval 1 vs 16
    .venv/bin/python -m tools.bench_rollout --real       # + the real CPU engine: raw AsyncLLM vs the proxy
    git worktree add ../before27 8109493                 # the rank before issue 27's cuts
    .venv/bin/python -m tools.bench_rollout --before ../before27     # side by side, alternating (~12 min)

A GPU engine decodes a few hundred sequences every 5-30 ms: tens of thousands of tokens per second,
which one rollout rank's Python (LLMProxy reading the engine's outputs, EnvManager's slots and
trajectories, the reward, the sample queue's client, the timeline's events) must keep up with.

Part 1, the fake engine at GPU rates. This process is one rollout rank, pinned to one core, running
that code unchanged over tools/fake_engine.FakeTimedEngine in real time (--max-concurrency requests
in flight, a decode step every --step-ms + --per-seq-ms per running sequence, responses of
--min-len to --max-len tokens, lognormal around --median-len: a long tail). The trainer side is
another process: it serves the queues (buffer.ManagerQueues, as train.py's trainer rank 0) through a
manager process, keeps the task queue full and drains the samples. Per --stream-intervals setting,
after a warm-up: tokens/s delivered to the proxy, and this process's CPU seconds (minus the fake
engine's own step loop, which stands for an engine core in another process) per 1,000 tokens and per
sample, then a cProfile breakdown by component in a second, shorter pass (cProfile slows everything:
its shares are what to read, not its totals).

Part 2 (--real), the floor: the same requests (--real-requests x --real-tokens, ignore_eos) on one real
vLLM CPU engine (tiny model), straight into AsyncLLM with final-only outputs (one output per
request: what vLLM's front end alone costs) and with per-token deltas, and through LLMProxy at
each stream interval; this process's CPU per 1,000 tokens (the engine core is its own process),
rounds interleaved, medians.

--before DIR: the comparison, side by side. Each repeat runs, one after the other, DIR's own copy of
this benchmark at stream interval 1 (its rank as it was), this tree's at --stream-intervals' last
value, and this tree's with --fast-step-ms steps (an engine above 51,200 tokens/s: can the rank keep
up?); medians and ranges over --repeats, as a table.
"""

import argparse
import asyncio
import collections
import cProfile
import gc
import json
import math
import multiprocessing as mp
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AUTHKEY = b"bench-rollout"

# cProfile's functions by file -> the component they belong to (first match wins)
COMPONENTS = [("fake engine (excluded)", ("fake_engine.py",)), ("proxy", ("proxy.py",)),
              ("env manager, trajectories", ("env_manager.py", "rollout.py")),    # (and the prompt format)
              ("timeline events", ("timeline.py",)),
              ("reward, ext/ envs", ("task.py", "/ext/")),
              ("queue client (pickle, sockets, its threads)",
               ("buffer.py", "multiprocessing", "pickle", "socket", "concurrent/futures", "threading")),
              ("tokenizer decode", ("tokenizers", "transformers")),
              ("event loop (asyncio)", ("asyncio", "selectors", "epoll", "_asyncio"))]


def trainer_side(port: int, stop, num_tasks_queued: int, seed: int, lengths: tuple, out, core: int):
    """The other process: serves the queues, keeps num_tasks_queued tasks waiting, drains samples. It
    and its queue server run off the rank's core, as trainer rank 0 would."""
    os.sched_setaffinity(0, set(range(os.cpu_count())) - {core} or {core})
    sys.path.insert(0, str(ROOT))
    import task as task_mod
    from buffer import ManagerQueues, RolloutTask
    q = ManagerQueues.serve("127.0.0.1", port, AUTHKEY, 1)
    rng, n, samples, tokens = random.Random(seed), 0, 0, 0
    median, sigma, low, high = lengths
    while not stop.is_set():
        want = num_tasks_queued - q.qsize("tasks")
        if want > 0:
            tasks = []
            for _ in range(want):
                length = min(high, max(low, int(rng.lognormvariate(math.log(median), sigma))))
                p = replace(task_mod.make_problem(rng), target_len=length)   # exactly this many tokens
                tasks.append(RolloutTask(f"t{n}", f"g{n}", p))
                n += 1
            q.q("tasks").put_many(tasks)
        got = q.get_many_nowait("samples", 4096)
        samples += len(got)
        tokens += sum(len(s.response_ids) for s in got)
        time.sleep(0.005)
    out.put({"samples_drained": samples, "tokens_drained": tokens})
    q.shutdown()


async def rollout_rank(args, interval: int, port: int, seconds: float, profile: bool) -> dict:
    """This process as rollout rank 0 for `seconds` after a warm-up; its figures."""
    from transformers import AutoTokenizer

    import tiny_model
    from buffer import ManagerQueues, SampleBuffer
    from env_manager import EnvManager, RolloutConfig
    import ext.longtail  # noqa: F401  (problems with a target_len: exactly that many tokens, EOS ignored)
    from proxy import LLMProxy
    from ext.timeline import RankEvents
    from tools.fake_engine import FakeTimedEngine

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model.ensure_tiny_model(log=lambda *a: None)))
    transport = ManagerQueues.connect("127.0.0.1", port, AUTHKEY, 1)
    blocked = time_calls(transport, ("exchange", "get_many_nowait", "qsize", "put_many"))  # round trips
    buffer = SampleBuffer(transport, "rollout rank 0", 60)
    engine = FakeTimedEngine(t0=args.step_ms / 1e3, k=args.per_seq_ms / 1e3,
                             max_num_seqs=args.max_concurrency, vocab_size=40, seed=0)
    proxy = LLMProxy(engine, rank=0, timeout_s=60)
    proxy.events = RankEvents(0)
    cfg = RolloutConfig(max_concurrency=args.max_concurrency, max_tokens=args.max_len,
                        max_model_len=args.max_len + 64, stream_interval=interval)
    manager = EnvManager(proxy, buffer, tokenizer, 0, cfg, freshness=1_000_000)
    gc.freeze()         # as train.py's rollout rank after its start-up
    run = asyncio.ensure_future(manager.run())

    def snapshot():
        return {"t": time.monotonic(), "cpu": time.process_time(), "engine_cpu": engine.cpu_s,
                "steps": engine.num_steps, "blocked": blocked["s"], "calls": blocked["n"],
                "tokens": proxy.num_tokens, "samples": manager.counters["samples_sent"]}
    await asyncio.sleep(args.warmup_s)
    proxy.events.take()
    a = snapshot()
    prof = cProfile.Profile(time.process_time) if profile else None    # CPU time: waiting counts nothing
    if prof:
        prof.enable()
    await asyncio.sleep(seconds)
    if prof:
        prof.disable()
    b = snapshot()
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    dt, tokens, samples = b["t"] - a["t"], b["tokens"] - a["tokens"], b["samples"] - a["samples"]
    rank_cpu = (b["cpu"] - a["cpu"]) - (b["engine_cpu"] - a["engine_cpu"])
    out = {"stream_interval": interval, "seconds": dt, "tokens_per_s": tokens / dt, "samples": samples,
           "rank_cpu_share": rank_cpu / dt,
           "rank_cpu_ms_per_1k_tokens": 1e3 * rank_cpu / max(tokens, 1) * 1e3,
           "rank_cpu_ms_per_sample": 1e3 * rank_cpu / max(samples, 1),
           "engine_cpu_share": (b["engine_cpu"] - a["engine_cpu"]) / dt,
           "engine_steps_per_s": (b["steps"] - a["steps"]) / dt,
           "tokens_per_step": tokens / max(b["steps"] - a["steps"], 1),     # the batch the slots kept full
           # the queue client's round trips to the trainer's server, as a share of wall time (the event
           # loop stood still that long while they were synchronous; now they run in threads)
           "queue_calls_per_s": (b["calls"] - a["calls"]) / dt,
           "queue_round_trip_share": (b["blocked"] - a["blocked"]) / dt,
           "engine_nominal_tokens_per_s": args.max_concurrency / (args.step_ms + args.per_seq_ms
                                                                   * args.max_concurrency) * 1e3}
    if prof:
        out["breakdown_ms_per_1k_tokens"] = breakdown(prof, tokens)
    return out


def time_calls(obj, names: tuple) -> dict:
    """Wrap obj's methods `names` (plain or async) to add up their wall time: {"s": seconds, "n": calls}."""
    acc = {"s": 0.0, "n": 0}
    for name in names:
        fn = getattr(obj, name)
        if asyncio.iscoroutinefunction(fn):
            async def timed(*a, fn=fn, **k):
                t = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    acc["s"] += time.perf_counter() - t
                    acc["n"] += 1
        else:
            def timed(*a, fn=fn, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    acc["s"] += time.perf_counter() - t
                    acc["n"] += 1
        setattr(obj, name, timed)
    return acc


def breakdown(prof: cProfile.Profile, tokens: int) -> dict:
    """cProfile's own time per function, summed by component (COMPONENTS), ms per 1,000 tokens. A
    function of no component (a builtin, random.py, the stdlib) is charged to its callers' components in
    proportion to the time each call edge took, up the call graph (so the fake engine's calls into
    random stay excluded with it)."""
    stats = pstats.Stats(prof).stats

    def component(file, func):
        where = file if file != "~" else func           # builtins by name ("<method 'dumps' of ...>")
        return next((c for c, keys in COMPONENTS if any(k in where for k in keys)), None)

    memo: dict = {}

    def owners(key, depth: int = 0) -> dict:           # component -> share of this function's time
        if key in memo:
            return memo[key]
        own = component(key[0], key[2])
        callers = stats[key][4] if key in stats else {}
        weights = {c: edge[3] for c, edge in callers.items() if c != key}
        if own or not weights or depth > 12 or not sum(weights.values()):
            out = {own or "other": 1.0}
        else:
            out, total = collections.defaultdict(float), sum(weights.values())
            memo[key] = {"other": 1.0}                  # (a cycle back here: charged to other)
            for c, w in weights.items():
                for name, share in owners(c, depth + 1).items():
                    out[name] += share * w / total
        memo[key] = dict(out)
        return memo[key]

    totals = collections.defaultdict(float)
    for key, (_, _, tottime, _, _) in stats.items():
        for name, share in owners(key).items():
            totals[name] += tottime * share
    return {k: round(1e6 * v / max(tokens, 1), 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def fake_engine_part(args) -> list[dict]:
    os.sched_setaffinity(0, {args.core})          # the rank alone on one core (its trainer side: the others)
    rows = []
    for interval in args.stream_intervals:
        for profile in (False, True):
            port = 29000 + random.randrange(1000)
            ctx = mp.get_context("spawn")        # (the trainer side imports nothing of this process's)
            stop, out = ctx.Event(), ctx.Queue()
            side = ctx.Process(
                target=trainer_side, args=(port, stop, 2 * args.max_concurrency, 0,
                                           (args.median_len, args.sigma, args.min_len, args.max_len), out,
                                           args.core))
            side.start()
            try:
                seconds = args.profile_s if profile else args.seconds
                r = asyncio.run(rollout_rank(args, interval, port, seconds, profile))
            finally:
                stop.set()
                drained = out.get(timeout=60)
                side.join(60)
            if profile:
                rows[-1]["breakdown_ms_per_1k_tokens"] = r["breakdown_ms_per_1k_tokens"]
            else:
                rows.append({**r, **drained})
                print(f"  stream interval {interval:3d}: {r['tokens_per_s']:8.0f} tokens/s "
                      f"(engine's nominal {r['engine_nominal_tokens_per_s']:.0f}), rank CPU "
                      f"{r['rank_cpu_ms_per_1k_tokens']:.1f} ms per 1k tokens, "
                      f"{r['rank_cpu_ms_per_sample']:.2f} ms per sample, {100 * r['rank_cpu_share']:.0f}% "
                      f"of the core", flush=True)
    return rows


async def real_part(args) -> dict:
    """The real CPU engine: raw AsyncLLM (final-only; per-token deltas) and the proxy, CPU per 1k tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    import tiny_model
    from proxy import LLMProxy, Sampling

    model_dir = str(tiny_model.ensure_tiny_model(log=lambda *a: None))
    proxy = await LLMProxy.start_vllm(model_dir, rank=0, cpu_cores="1", max_num_seqs=args.real_requests)
    llm = proxy.engine.llm
    prompts = [[5 + i % 20, 6, 7, 8] for i in range(args.real_requests)]

    async def raw(kind, tag):
        params = SamplingParams(max_tokens=args.real_tokens, temperature=1.0, ignore_eos=True, logprobs=0,
                                output_kind=kind, detokenize=False)

        async def one(i, p):
            n = 0
            async for out in llm.generate({"prompt_token_ids": p}, params, f"{tag}-{i}"):
                o = out.outputs[0]
                n = n + len(o.token_ids) if kind == RequestOutputKind.DELTA else len(o.token_ids)
                _ = [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs or [])]   # what any caller reads
            return n
        return sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))

    async def via_proxy(interval):
        cs = await asyncio.gather(*[proxy.generate(p, Sampling(args.real_tokens, ignore_eos=True,
                                                              stream_interval=interval)) for p in prompts])
        return sum(len(c.token_ids) for c in cs)

    runs = {"raw AsyncLLM, final-only outputs": lambda r: raw(RequestOutputKind.FINAL_ONLY, f"fo{r}"),
            "raw AsyncLLM, per-token deltas": lambda r: raw(RequestOutputKind.DELTA, f"d{r}")}
    for interval in args.stream_intervals:
        runs[f"LLMProxy, stream interval {interval}"] = lambda r, i=interval: via_proxy(i)
    figures = {name: [] for name in runs}
    await raw(RequestOutputKind.FINAL_ONLY, "warm")
    for r in range(args.real_rounds):               # interleaved: each round runs every configuration
        for name, fn in runs.items():
            t, cpu = time.monotonic(), time.process_time()
            tokens = await fn(r)
            wall, cpu = time.monotonic() - t, time.process_time() - cpu
            figures[name].append((tokens / wall, 1e6 * cpu / tokens))
    proxy.shutdown()
    out = {name: {"tokens_per_s": statistics.median(x for x, _ in v),
                  "cpu_ms_per_1k_tokens": statistics.median(y for _, y in v)} for name, v in figures.items()}
    for name, v in out.items():
        print(f"  {name:36s} {v['tokens_per_s']:7.0f} tokens/s, {v['cpu_ms_per_1k_tokens']:6.1f} ms CPU "
              f"per 1k tokens (this process)", flush=True)
    return out


def compare(args) -> list[dict]:
    """--before: (name, tree, extra args) run as subprocesses, alternating, args.repeats times; a table."""
    interval, step, fast = str(args.stream_intervals[-1]), str(args.step_ms), str(args.fast_step_ms)
    runs = [("before: interval 1, queue calls on the loop", Path(args.before).resolve(),
             ["--stream-intervals", "1", "--step-ms", step]),
            (f"now: interval {interval}", ROOT, ["--stream-intervals", interval, "--step-ms", step]),
            (f"now: interval {interval}, {fast} ms steps", ROOT,
             ["--stream-intervals", interval, "--step-ms", fast])]
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "max_concurrency", "per_seq_ms", "median_len", "sigma", "min_len", "max_len", "warmup_s", "seconds",
        "profile_s", "core")]
    got = {name: [] for name, _, _ in runs}
    for r in range(args.repeats):
        for name, tree, extra in runs:
            out = Path(tempfile.mkdtemp(prefix="bench-rollout-")) / "out.json"
            cmd = [sys.executable, "-m", "tools.bench_rollout", *common, *extra, "--out", str(out)]
            subprocess.run(cmd, cwd=tree, check=True, capture_output=True, timeout=1800)
            row = json.loads(out.read_text())["fake_engine"][0]
            got[name].append(row)
            print(f"  repeat {r + 1}/{args.repeats}, {name}: {row['tokens_per_s']:.0f} tokens/s, "
                  f"{row['rank_cpu_ms_per_1k_tokens']:.2f} ms CPU per 1k tokens", flush=True)

    def cell(name, key, fmt):       # (an older tree's bench may lack a figure)
        xs = sorted(row[key] for row in got[name] if key in row)
        if not xs:
            return "-"
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(xs[0])}-{fmt.format(xs[-1])})"
    names = [name for name, _, _ in runs]
    print(f"\n| {args.repeats} repeats: median (range) | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for label, key, fmt in (("engine's nominal tokens/s", "engine_nominal_tokens_per_s", "{:.0f}"),
                            ("tokens/s delivered", "tokens_per_s", "{:.0f}"),
                            ("rank CPU per 1,000 tokens, ms", "rank_cpu_ms_per_1k_tokens", "{:.2f}"),
                            ("rank CPU per sample, ms", "rank_cpu_ms_per_sample", "{:.2f}"),
                            ("rank's share of its core", "rank_cpu_share", "{:.2f}"),
                            ("queue round trips (share of wall time; now in threads)",
                             "queue_round_trip_share", "{:.2f}")):
        print(f"| {label} | " + " | ".join(cell(n, key, fmt) for n in names) + " |")
    ratio = (statistics.median(r["rank_cpu_ms_per_1k_tokens"] for r in got[names[0]])
             / statistics.median(r["rank_cpu_ms_per_1k_tokens"] for r in got[names[1]]))
    print(f"\nrank CPU per 1,000 tokens, before / now: {ratio:.1f}x (medians)")
    for name in names:      # cProfile's shares (its own overhead inflates every part; read the shares)
        parts = got[name][0].get("breakdown_ms_per_1k_tokens", {})
        total = sum(v for k, v in parts.items() if not k.startswith("fake engine")) or 1
        print(f"{name}: cProfile shares of the rank's CPU (main thread, repeat 1): " + ", ".join(
            f"{k} {100 * v / total:.0f}%" for k, v in parts.items() if not k.startswith("fake engine")
            and v / total >= 0.02))
    return [{"name": n, "rows": got[n]} for n in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stream-intervals", type=lambda x: [int(v) for v in x.split(",")], default=[1, 16])
    ap.add_argument("--max-concurrency", type=int, default=256, help="requests in flight (the engine batch)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="a decode step's fixed time, ms")
    ap.add_argument("--per-seq-ms", type=float, default=0.0,
                    help="a decode step's time per running sequence, ms (0.1: 5-30 ms steps at 256)")
    ap.add_argument("--median-len", type=int, default=500)
    ap.add_argument("--sigma", type=float, default=0.6)
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=2000)
    ap.add_argument("--warmup-s", type=float, default=8.0, help="before measuring (slots fill, lengths mix)")
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window, per setting")
    ap.add_argument("--profile-s", type=float, default=8.0, help="the cProfile pass, per setting")
    ap.add_argument("--core", type=int, default=0, help="the core this rank is pinned to")
    ap.add_argument("--real", action="store_true", help="also part 2, the real CPU engine")
    ap.add_argument("--real-requests", type=int, default=64)
    ap.add_argument("--real-tokens", type=int, default=64)
    ap.add_argument("--real-rounds", type=int, default=3)
    ap.add_argument("--out", default="", help="also write the figures here (JSON)")
    ap.add_argument("--before", default="", help="a worktree of the code before: side by side (docstring)")
    ap.add_argument("--repeats", type=int, default=3, help="--before: alternating repeats")
    ap.add_argument("--fast-step-ms", type=float, default=4.0, help="--before: the faster engine's step, ms")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ext.quiet import quiet
    quiet()
    if args.before:
        if not (Path(args.before) / "tools" / "bench_rollout.py").exists():
            raise SystemExit(f"bench_rollout: --before {args.before}: no tools/bench_rollout.py there "
                             f"(git worktree add ../before27 8109493)")
        rows = compare(args)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return
    print(f"part 1: one rollout rank on core {args.core}, fake engine: {args.max_concurrency} in flight, "
          f"steps of {args.step_ms} ms + {args.per_seq_ms} ms per sequence, responses {args.min_len}-"
          f"{args.max_len} tokens (median {args.median_len})", flush=True)
    result = {"args": vars(args), "fake_engine": fake_engine_part(args)}
    if args.real:
        os.sched_setaffinity(0, set(range(os.cpu_count())))
        print("part 2: the real CPU engine (tiny model), this process's CPU", flush=True)
        result["real_engine"] = asyncio.run(real_part(args))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
