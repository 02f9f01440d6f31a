"""sim_vs_real.py: the simulator's engine model against real vLLM engines, on this machine.

    .venv/bin/python -m tools.sim_vs_real                  # 2 vLLM CPU engines, one core each; ~4 min
    .venv/bin/python -m tools.sim_vs_real --repeats 3      # the spread over repeats (the cores are shared)

Per repeat:
1. calibrate: keep n requests in flight on each real engine (n in N_SWEEP, prompts of PROMPT_LENS
   tokens, the run's response lengths, a new request as soon as one ends), measure the seconds per
   decode step, and fit the fake engine's step time t0 + k * n + k_ctx * (context tokens) by least
   squares; time a weight update (broadcast into both engines + load + resume) of the tiny model's
   real tensors (weight_sync.push: gloo, from this process), the fake engine's load_s;
2. real: the project's AsyncController, SampleBuffer and one EnvManager per engine over the two real
   proxies, `steps` timed steps (after one warm-up step) of collect -> training (a sleep of train_s)
   -> weight sync through the real protocol with the tiny model's tensors (sent as train.py does,
   from a weight_sync.Sender in this process), for each async ratio;
3. sim: the same code, same settings, same problem stream (same prompts and response lengths), over
   FakeTimedEngines with the constants of step 1, on a fast-forwarded event loop.
Printed: one JSON object with the fitted constants and, per async ratio, seconds per step and engine
utilisation (LLMProxy's busy fraction: in flight and not suspended) both ways, and their ratios.

Deliberate choices: training is the same modelled sleep both ways (the trainer would compete with the
engines for the 2 cores and that is not what is compared); response lengths are forced
(Problem.target_len, lognormal as in bench.py) so that both runs generate the same tokens; the KV
budget of the fake engine is the real one (VLLM_CPU_KVCACHE_SPACE over the tiny model's bytes per
token), far from binding here; the fake engine has no prefill term (the fit's context term absorbs
the tiny prompts' prefill).
"""

import argparse
import asyncio
import json
import statistics
import time

N_SWEEP = (1, 4, 16, 64)    # requests kept in flight per engine in the calibration (64 = max_num_seqs here)
PROMPT_LENS = (4, 40)       # prompt tokens in the calibration: two context levels, so k_ctx can be fitted
CAL_REQUESTS = 6            # requests per in-flight slot in one calibration run
KV_GIB = 1                  # VLLM_CPU_KVCACHE_SPACE of each engine (VLLMEngine.start's default), GiB
MAX_NUM_SEQS = 64           # vLLM max_num_seqs of each engine, and the EnvManagers' max_concurrency


def fit(rows: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """(n, mean context, seconds per step) rows -> (t0, k, k_ctx) >= 0 of t0 + k*n + k_ctx*n*context, least
    squares over the non-negative fits of each subset of the terms (n and n*context are nearly collinear
    at the tiny model's short contexts, so an unconstrained fit can trade one for a negative other)."""
    import itertools

    import torch
    b = torch.tensor([[s] for _, _, s in rows], dtype=torch.float64)
    a = torch.tensor([[1.0, n, n * ctx] for n, ctx, _ in rows], dtype=torch.float64)
    best = None
    for cols in ([0, *c] for r in range(3) for c in itertools.combinations([1, 2], r)):
        x = torch.linalg.lstsq(a[:, cols], b).solution
        err = float(((a[:, cols] @ x - b) ** 2).sum())
        if (x >= 0).all() and (best is None or err < best[0]):
            coef = [0.0, 0.0, 0.0]
            for c, v in zip(cols, x.flatten().tolist()):
                coef[c] = v
            best = (err, coef)
    return tuple(best[1])


async def closed_loop(proxy, n: int, plen: int, lengths: list[int], vocab: int) -> float:
    """Keep n requests in flight on one engine (a new one as soon as one ends: continuous batching with
    arrivals, prefills and departures, as in a run) and return the seconds per decode step, measured
    until the first of the n request streams runs dry (all n in flight until then)."""
    from proxy import Sampling
    t, tokens0, first_dry = time.perf_counter(), proxy.num_tokens, asyncio.Event()

    async def stream(i):
        for j, length in enumerate(lengths[i::n]):
            prompt = [2 + (i + j + x) % (vocab - 2) for x in range(plen)]
            await proxy.generate(prompt, Sampling(max_tokens=length, ignore_eos=True))
        first_dry.set()
    tasks = [asyncio.ensure_future(stream(i)) for i in range(n)]
    async with asyncio.timeout(300):
        await first_dry.wait()
    dt, tokens = time.perf_counter() - t, proxy.num_tokens - tokens0
    async with asyncio.timeout(300):
        await asyncio.gather(*tasks)
    return n * dt / tokens


async def calibrate(proxies, sender, weights, vocab: int, args) -> dict:
    """Both engines at once (as in a run: they share the front-end process), each in closed loops over
    N_SWEEP x PROMPT_LENS with the run's response lengths; then weight syncs (suspend -> broadcast into
    both engines and load -> resume), one broadcast to both engines as in a run."""
    from tools import bench
    from tools.local import push
    rows = []
    for plen in PROMPT_LENS:
        for n in N_SWEEP:
            gen = bench.problems(args.seed + n + plen, args.median_len, 1.0, 124 - plen - 4)
            lengths = [next(gen).target_len for _ in range(CAL_REQUESTS * n)]
            ctx = plen + sum(x * x for x in lengths) / (2 * sum(lengths))   # time-weighted mean context
            t, cpu = time.perf_counter(), time.process_time()
            steps = await asyncio.gather(*[closed_loop(p, n, plen, lengths, vocab) for p in proxies])
            rows += [(n, ctx, s) for s in steps]
            if n == max(N_SWEEP):
                front_cpu = (time.process_time() - cpu) / (time.perf_counter() - t)

    async def sync():             # the engines are paused for the transfer: the fake engine's load_s
        # models both
        await asyncio.gather(*[p.suspend("keep") for p in proxies])
        t = time.perf_counter()
        await push(proxies, sender, weights, proxies[0].version)     # generation 0, as run()'s syncs
        await asyncio.gather(*[p.resume() for p in proxies])
        return time.perf_counter() - t
    loads = [await sync() for _ in range(3)]
    t0, k, k_ctx = fit(rows)
    return {"t0": t0, "k": k, "k_ctx": k_ctx, "load_s": statistics.median(loads),
            "front_end_cores_at_64": front_cpu,
            "max_abs_residual_ms": 1e3 * max(abs(t0 + k * n + k_ctx * n * c - s) for n, c, s in rows)}


async def run(proxies, tokenizer, weights, args, alpha: int, sender=None) -> dict:
    """The trainer loop of train.py with training modelled as a sleep; event-loop time (real or virtual).
    sender: weight-sync rank 0 of real engines; None: fake engines, which model the transfer themselves."""
    from tools import bench
    from buffer import LocalQueues, SampleBuffer
    from tools.local import run_local
    from controller import AsyncController, ControllerConfig, WholeBatch, rl_step
    from env_manager import EnvManager, RolloutConfig
    import ext.longtail  # noqa: F401  (problems with a target_len: exactly that many tokens, EOS ignored)
    from weight_sync import weight_layout

    buffer = SampleBuffer(LocalQueues(len(proxies)), "sim_vs_real", 300)
    ccfg = ControllerConfig(batch_groups=args.batch_groups, group_size=args.group_size, async_ratio=alpha,
                            redundant=0, filter_groups=False, timeout_s=300)
    ctrl = AsyncController(ccfg, buffer, bench.problems(args.seed, args.median_len, 1.0, 110), len(proxies),
                           version=proxies[0].version)

    layout = weight_layout(weights)
    spec = sender.spec(0, len(proxies)) if sender else None
    async def modelled_send(spec):          # fake engines: the trainer waits until every engine has the
        async with asyncio.timeout(300):    # weights (TimeoutError: the modelled weight sync never ended)
            while any(p.version <= ctrl.version for p in proxies):
                await asyncio.sleep(0.005)
    send = (lambda g: sender.send(g, weights, layout)) if sender else modelled_send
    rcfg = RolloutConfig(max_concurrency=MAX_NUM_SEQS, max_tokens=8, max_model_len=124)
    managers = [EnvManager(p, buffer, tokenizer, r, rcfg) for r, p in enumerate(proxies)]
    loop = asyncio.get_running_loop()

    async def train(batch, advantages, version):     # training modelled as a sleep
        await asyncio.sleep(args.train_s)
        return {}, None

    async def steps():
        times, utils, waits, syncs = [], [], [], []
        for step in range(args.steps + 1):                  # step 0: warm-up, not counted
            t = loop.time()
            s = await rl_step(ctrl, WholeBatch(train, ccfg.group_size), send, layout, spec)
            if step == 0:
                t_start, tokens0, cpu0 = loop.time(), sum(p.num_tokens for p in proxies), time.process_time()
            else:
                times.append(loop.time() - t)
                utils.append(s.sync["rollout_utilisation"])
                waits.append(s.info["time_wait_rollout"])
                syncs.append(s.sync["time_weight_sync"])
        tok_s = (sum(p.num_tokens for p in proxies) - tokens0) / (loop.time() - t_start)
        # this process: controller, managers, proxies
        front_cpu = (time.process_time() - cpu0) / (loop.time() - t_start)
        return {"s_per_step": statistics.fmean(times), "utilisation": statistics.fmean(utils),
                "rollout_wait_s": statistics.fmean(waits), "sync_s": statistics.fmean(syncs),
                "tokens_per_s": tok_s, "front_end_cores": front_cpu}

    return await run_local(ctrl, managers, steps(), timeout_s=300 * (args.steps + 2))


def run_sim(consts: dict, tokenizer, weights, args, alpha: int, kv_tokens: int) -> dict:
    import looptime

    from tools.fake_engine import FakeTimedEngine
    from proxy import LLMProxy

    async def main():
        proxies = [LLMProxy(FakeTimedEngine(t0=consts["t0"], k=consts["k"], k_ctx=consts["k_ctx"],
                                            kv_tokens=kv_tokens, max_num_seqs=MAX_NUM_SEQS,
                                            load_s=consts["load_s"], vocab_size=tokenizer.vocab_size, seed=r),
                            rank=r, timeout_s=120)
                   for r in range(2)]
        try:
            return await run(proxies, tokenizer, weights, args, alpha)
        finally:
            for p in proxies:
                p.shutdown()
    loop = looptime.new_event_loop(noop_cycles=0)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


async def real_repeats(args, model_dir, tokenizer, weights, kv_tokens) -> list[dict]:
    from proxy import LLMProxy
    from weight_sync import Sender
    proxies = [await LLMProxy.start_vllm(model_dir, rank=r, cpu_cores=str(r), max_num_seqs=MAX_NUM_SEQS,
                                         kv_cache_gib=KV_GIB, timeout_s=120) for r in range(2)]
    # weight-sync rank 0 (the trainer's side), on a store of its own
    sender = Sender(timeout_s=120)
    out = []
    try:
        # warm-up: first batches are slow
        await calibrate(proxies, sender, weights, tokenizer.vocab_size, args)
        for rep in range(args.repeats):
            consts = await calibrate(proxies, sender, weights, tokenizer.vocab_size, args)
            real = {a: await run(proxies, tokenizer, weights, args, a, sender) for a in args.alphas}
            out.append({"consts": consts, "real": real})
            print(f"repeat {rep}: {json.dumps(out[-1])}", flush=True)
    finally:
        for p in proxies:
            p.shutdown()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1,
                    help="calibrate + real runs, repeated on the same engines")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (plus one warm-up)")
    ap.add_argument("--alphas", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2],
                    help="async ratios")
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--median-len", type=float, default=24, help="median forced response length, tokens")
    ap.add_argument("--train-s", type=float, default=0.5, help="modelled training time per step, seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    import tiny_model
    model_dir = str(tiny_model.ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weights = list(load_file(f"{model_dir}/model.safetensors").items())
    with open(f"{model_dir}/config.json") as f:
        c = json.load(f)
    kv_bytes = (2 * c["num_hidden_layers"] * c["num_key_value_heads"]
                * (c["hidden_size"] // c["num_attention_heads"]) * 4)
    kv_tokens = KV_GIB * 2 ** 30 // kv_bytes                      # float32 K and V per token, all layers
    out = asyncio.run(real_repeats(args, model_dir, tokenizer, weights, kv_tokens))
    for o in out:                                                      # the engines are gone: simulate
        o["sim"] = {a: run_sim(o["consts"], tokenizer, weights, args, a, kv_tokens) for a in args.alphas}
    summary = {}
    for a in args.alphas:
        r = [o["real"][a]["s_per_step"] for o in out]
        s = [o["sim"][a]["s_per_step"] for o in out]
        ru = [o["real"][a]["utilisation"] for o in out]
        su = [o["sim"][a]["utilisation"] for o in out]
        summary[f"alpha{a}"] = {
            "real_s_per_step": r, "sim_s_per_step": s, "sim_over_real_s": [x / y for x, y in zip(s, r)],
            "real_utilisation": ru, "sim_utilisation": su,
            "sim_over_real_util": [x / y for x, y in zip(su, ru)]}
    print(json.dumps({"setup": {"engines": 2, "batch": f"{args.batch_groups}x{args.group_size}",
                                "steps": args.steps, "train_s": args.train_s, "median_len": args.median_len,
                                "kv_tokens": kv_tokens},
                      "constants": [o["consts"] for o in out], "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
