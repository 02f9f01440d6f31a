"""bench_e2e.py: the whole system against a plain loop, to the same reward, in one run.

    .venv/bin/python -m tools.bench_e2e                 # naive, then the system at ratio 0 and 2 (~6 min)
    .venv/bin/python -m tools.bench_e2e --steps 80 --target 0.5 --seeds 0 1
    .venv/bin/python -m tools.bench_e2e --env calc --env-latency-s 0.5 --env-latency-sigma 1.0 \\
        --max-concurrency 256 --steps 40 --target 0.7           # the agentic workload (see below)

Three ways to train the embedded tiny model on the default task, with the same seed, task, batch
(--batch-groups x --group-size), response budget, learning rate and loss:

    naive    one process, no engines, no queues: transformers `generate` (sampling at temperature 1,
             logprobs from its logits), then the same Trainer.train_step; every group trained (no
             dynamic filtering), torch on all cores
    sync     `torchrun train.py --async-ratio 0`: the real system, synchronous (the default layout)
    async    `torchrun train.py --async-ratio 2`: the real system, asynchronous

The agentic workload (--env calc: the calculator tool env, its calls run in the real sandbox, every
env reset and step delayed by a lognormal draw of median --env-latency-s and --env-latency-sigma, as
train.py's flags of those names do; several turns per trajectory) has four:

    lockstep      one process, transformers `generate` for every live trajectory of the batch at once,
                  then all of their env calls, and the next turn only when the last of those returned
                  (the plain multi-turn loop); the same env code (env_manager.run_trajectory, the same
                  retries and env deadline), then the same Trainer.train_step, every group trained
    sync, async   as above, with the env flags
    redundant     async, plus --env-redundancy: each group starts more trajectories than it keeps and
                  aborts the rest once --group-size of them finished (the paper's redundant env rollout)

For each: seconds per step (median), the step at which the 10-step average of the per-step reward
(the mean reward of that step's rollouts, as in train.py's progress line) first reaches --target
and the seconds of training until then (the sum of the step times so far: start-up excluded), and
the whole command's wall time (start-up included). Printed as one JSON object with the ratios.

What this does not make equal, on purpose: the system filters groups whose rewards are all equal
(DAPO's dynamic sampling, on by default) and naive and lockstep do not; that is part of what the
system buys. Naive and lockstep run torch on both cores; the system splits them between its engine and
its trainer.
"""

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from tools.jobs import run_to_end, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent   # the repository root


def reached(rewards: list[float], target: float, window: int = 10) -> int | None:
    """First step (1-based) at which the mean of the last `window` rewards is >= target."""
    for k in range(window, len(rewards) + 1):
        if sum(rewards[k - window:k]) / window >= target:
            return k
    return None


def summarise(step_times: list[float], rewards: list[float], wall_s: float, target: float) -> dict:
    k = reached(rewards, target)
    return {"s_per_step": round(statistics.median(step_times), 3), "steps": len(rewards),
            "steps_to_target": k, "seconds_to_target": round(sum(step_times[:k]), 1) if k else None,
            "wall_s": round(wall_s, 1), "reward_first10": round(statistics.fmean(rewards[:10]), 3),
            "reward_last10": round(statistics.fmean(rewards[-10:]), 3)}


def sample_batch(model, contexts: list[list[int]], max_tokens: int, eos_ids: set[int],
                 pad_id: int) -> list[tuple[list[int], list[float], str]]:
    """Up to max_tokens sampled after each context at temperature 1, all rows in one transformers
    `generate`: per row (token ids through the first EOS, their logprobs, "stop" | "length")."""
    import torch

    width = max(map(len, contexts))
    ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts])    # left-padded [N, width]
    attn = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_tokens, eos_token_id=sorted(eos_ids),
                             pad_token_id=pad_id, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, width:]                                          # [N, T]
    logp = torch.stack(out.logits, 1).float().log_softmax(-1)               # [N, T, V]
    taken = logp.gather(-1, new[..., None]).squeeze(-1)                     # [N, T]
    rows = []
    for i, row in enumerate(new.tolist()):
        n = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))   # through EOS, as the engine
        rows.append((row[:n], taken[i, :n].tolist(), "stop" if row[n - 1] in eos_ids else "length"))
    return rows


# ---------------------------------------------------------------------------------------------
# naive: generate with transformers, then one Trainer step


def naive(args, seed: int) -> dict:
    import torch

    import task
    import tiny_model
    from buffer import Sample
    from task import problem_stream
    from rollout import RolloutConfig
    from losses import group_advantages
    from trainer import TrainConfig, Trainer
    from transformers import AutoTokenizer

    t_start = time.monotonic()
    torch.set_num_threads(os.cpu_count())
    model_dir = str(tiny_model.ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    # the reply budget as train.py resolves it (device, embedded model): 8 tokens unless --max-tokens
    max_tokens = RolloutConfig(max_tokens=args.max_tokens).resolved(model_dir, "cpu", True).max_tokens
    trainer = Trainer(model_dir, TrainConfig(loss=args.loss, lr=args.lr, micro_batch=args.micro_batch,
                                             seed=seed))
    torch.manual_seed(seed)
    problems = problem_stream(None, seed, make=task.make_problem)
    B, G = args.batch_groups, args.group_size
    step_times, rewards = [], []
    for step in range(args.naive_steps):
        t0 = time.monotonic()
        batch = [next(problems) for _ in range(B)]
        prompts = [tok.encode(p.prompt) for p in batch for _ in range(G)]    # B*G rows, a group's together
        rows = sample_batch(trainer.model, prompts, max_tokens, {tok.eos_token_id}, tok.pad_token_id)
        samples = [Sample(f"{step}.{i}", f"{step}.{i // G}", prompts[i], ids, logprobs, [1] * len(ids),
                          [step] * len(ids), task.reward(batch[i // G], text))
                   for i, (ids, logprobs, _) in enumerate(rows)
                   for text in [tok.decode(ids, skip_special_tokens=True)]]
        r = torch.tensor([s.reward for s in samples])
        trainer.train_step(samples, group_advantages(r, G).tolist())
        step_times.append(time.monotonic() - t0)
        rewards.append(r.mean().item())
        if args.verbose:
            print(f"    naive step {step + 1}: {step_times[-1]:.2f}s reward {rewards[-1]:.3f}", flush=True)
        if reached(rewards, args.target) and len(rewards) >= args.steps:
            break
    return summarise(step_times, rewards, time.monotonic() - t_start, args.target)


# ---------------------------------------------------------------------------------------------
# lockstep: the plain multi-turn loop, every turn of the batch together


class LockstepProxy:
    """What run_trajectory asks of an LLMProxy (rank, version, generate), served lockstep: a generate
    call waits until every live trajectory of the batch has made one (a trajectory leaves when it
    ends), then one sample_batch answers them all. So a turn starts only once the last env call of the
    turn before returned. Generation blocks the event loop, which is idle then: every trajectory is
    waiting here."""
    rank = 0

    def __init__(self, sample_fn, live: int, version: int):
        self.sample_fn = sample_fn      # (contexts, max_tokens) -> sample_batch's rows
        self.live, self.version = live, version
        self.waiting: list[tuple[list[int], int, asyncio.Future]] = []   # (context, max_tokens, answer)

    async def generate(self, prompt_token_ids, sampling, request_id=None):
        from proxy import Completion

        answer = asyncio.get_running_loop().create_future()
        self.waiting.append((list(prompt_token_ids), sampling.max_tokens, answer))
        self._maybe_run()
        ids, logprobs, finish = await answer
        return Completion(request_id or "", list(prompt_token_ids), ids, logprobs, [self.version] * len(ids),
                          finish)

    def leave(self):
        self.live -= 1
        self._maybe_run()

    def _maybe_run(self):
        if not self.waiting or len(self.waiting) < self.live:
            return
        batch, self.waiting = self.waiting, []
        rows = self.sample_fn([c for c, _, _ in batch], max(n for _, n, _ in batch))
        for (_, n, answer), (ids, logprobs, finish) in zip(batch, rows):
            if len(ids) > n:                       # this row's budget (room left under the context cap)
                ids, logprobs, finish = ids[:n], logprobs[:n], "length"
            answer.set_result((ids, logprobs, finish))


def lockstep(args, seed: int) -> dict:
    import torch

    import task
    import tiny_model
    from buffer import RolloutTask
    from task import problem_stream
    from ext.calc import ensure_calc_model
    from ext.deadlines import DeadlineConfig, EnvDeadline
    from ext.faults import FaultConfig
    from ext.verifiers import VerifierConfig
    from rollout import ENVS, PromptFormat, RolloutConfig, run_trajectory
    from losses import group_advantages
    from trainer import TrainConfig, Trainer
    from transformers import AutoTokenizer

    t_start = time.monotonic()
    torch.set_num_threads(os.cpu_count())
    model_dir = str(ensure_calc_model() if args.env == "calc" else tiny_model.ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    # (as train.py resolves them: --env calc's replies get 16 tokens)
    rc = RolloutConfig(max_tokens=args.max_tokens or (16 if args.env == "calc" else 0))
    rc = rc.resolved(model_dir, "cpu", True)
    fmt = PromptFormat(tok, rc.chat_template)
    trainer = Trainer(model_dir, TrainConfig(loss=args.loss, lr=args.lr, micro_batch=args.micro_batch,
                                             seed=seed))
    torch.manual_seed(seed)
    problems = problem_stream(None, seed, make=task.make_problem)
    wrap = FaultConfig(env_latency_s=args.env_latency_s, env_latency_sigma=args.env_latency_sigma,
                       env_hang_rate=args.env_hang_rate).wrapper(seed * 1000) or (lambda env: env)
    deadline = EnvDeadline.of(rc, DeadlineConfig(), VerifierConfig().reward_timeout_s)   # as a rollout rank's
    B, G, pad_id = args.batch_groups, args.group_size, tok.pad_token_id
    step_times, rewards, turns, failed = [], [], [], 0
    for step in range(args.naive_steps):
        t0 = time.monotonic()
        tasks = [RolloutTask(f"{step}.{g}.{i}", f"{step}.{g}", p, env=args.env)
                 for g, p in enumerate(next(problems) for _ in range(B)) for i in range(G)]
        proxy = LockstepProxy(lambda ctx, n: sample_batch(trainer.model, ctx, n, fmt.eos_ids, pad_id),
                              live=len(tasks), version=step)

        async def one(t: RolloutTask, index: int):
            try:
                return await run_trajectory(proxy, lambda: wrap(ENVS[t.env](t.problem, 0)), fmt, rc, t, index,
                                            deadline=deadline)
            finally:
                proxy.leave()

        async def rollouts():     # (every env call has its deadline; this bounds the step as a whole)
            try:
                async with asyncio.timeout(args.timeout_s):
                    return await asyncio.gather(*(one(t, i) for i, t in enumerate(tasks)))
            except TimeoutError:
                raise SystemExit(f"bench_e2e: lockstep, seed {seed}, step {step + 1}: the rollouts took "
                                 f"longer than --timeout-s {args.timeout_s:g} s") from None

        samples = asyncio.run(rollouts())
        groups = [samples[g * G:(g + 1) * G] for g in range(B)]
        # a trajectory that failed every retry (None) drops its group (rare: a tool's errors score 0)
        kept = [s for grp in groups if all(grp) for s in grp]
        failed += len(samples) - len(kept)
        r = torch.tensor([s.reward for s in kept])
        trainer.train_step(kept, group_advantages(r, G).tolist(), version=step)
        step_times.append(time.monotonic() - t0)
        rewards.append(r.mean().item())
        turns.append(statistics.fmean(s.num_turns for s in kept))
        if args.verbose:
            print(f"    lockstep step {step + 1}: {step_times[-1]:.2f}s reward {rewards[-1]:.3f} "
                  f"turns {turns[-1]:.2f}", flush=True)
        if reached(rewards, args.target) and len(rewards) >= args.steps:
            break
    out = summarise(step_times, rewards, time.monotonic() - t_start, args.target)
    out.update(turns_mean=round(statistics.fmean(turns), 3), samples_dropped_failed=failed)
    return out


# ---------------------------------------------------------------------------------------------
# the system: torchrun train.py, its metrics.jsonl read back


def system(args, seed: int, async_ratio: int, out_dir: Path, env_redundancy: int = 0, extra=()) -> dict:
    cmd = torchrun_cmd(*extra, "--steps", str(args.steps), "--async-ratio", str(async_ratio),
                       "--out-dir", str(out_dir), "--save-every", "0", "--seed", str(seed),
                       "--loss", args.loss, "--lr", str(args.lr), "--batch-groups", str(args.batch_groups),
                       "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
                       "--micro-batch", str(args.micro_batch), "--max-concurrency", str(args.max_concurrency),
                       *(("--env", args.env, "--env-latency-s", str(args.env_latency_s),
                          "--env-latency-sigma", str(args.env_latency_sigma),
                          "--env-hang-rate", str(args.env_hang_rate),
                          "--env-redundancy", str(env_redundancy)) if args.env else ()),
                       *(("--response-len-median", str(args.response_len_median),
                          "--response-len-sigma", str(args.response_len_sigma)) if args.response_len_median
                         else ()))
    t = time.monotonic()
    rows = run_to_end(cmd, out_dir, "bench_e2e", args.timeout_s)
    wall = time.monotonic() - t
    out = summarise([r["time_step"] for r in rows], [r["reward_mean"] for r in rows], wall, args.target)
    out["sync_share"] = round(sum(r["time_weight_sync"] for r in rows) / sum(r["time_step"] for r in rows), 4)
    out.update(staleness_max=max(r["staleness_max"] for r in rows),
               staleness_mean=round(statistics.fmean(r["staleness_mean"] for r in rows), 3))
    if args.rollpacker:     # the share of generated tokens aborts threw away; tail batching's rounds
        gen = sum(r.get("tokens_generated", 0) for r in rows)
        out.update(aborted_share=round(sum(r.get("tokens_aborted", 0) for r in rows) / max(gen, 1), 4),
                   long_rounds=sum(r.get("round") == "long" for r in rows),
                   trainer_busy=round(sum(r.get("time_trainer_busy", 0) for r in rows)
                                      / sum(r["time_step"] for r in rows), 3))
    if args.env:
        out.update(turns_mean=round(statistics.fmean(r["turns_mean"] for r in rows), 3),
                   samples_failed=sum(r["samples_failed"] for r in rows),
                   samples_surplus=sum(r["samples_surplus"] for r in rows))
    return out


def main(args):
    out_root = Path(args.out_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    # name -> how to run it for a seed
    runs = {"sync": lambda seed: system(args, seed, 0, out_root / f"sync-seed{seed}"),
            "async": lambda seed: system(args, seed, 2, out_root / f"async-seed{seed}")}
    if args.rollpacker:          # RollPacker's five, on a long-tail length workload
        tail = ("--tail-batching", "--tail-oversample", str(args.tail_oversample))
        stream = ("--stream-trainer",)
        base, runs = "sync", {
            "sync": runs["sync"],
            "sync_tail": lambda seed: system(args, seed, 0, out_root / f"sync_tail-seed{seed}", extra=tail),
            "sync_tail_stream": lambda seed: system(args, seed, 0, out_root / f"sync_tail_stream-seed{seed}",
                                                    extra=(*tail, *stream)),
            "async": runs["async"],
            "async_tail": lambda seed: system(args, seed, 2, out_root / f"async_tail-seed{seed}", extra=tail)}
    elif args.env:
        base = "lockstep"
        runs = {"lockstep": lambda seed: lockstep(args, seed), **runs,
                "redundant": lambda seed: system(args, seed, 2, out_root / f"redundant-seed{seed}",
                                                 env_redundancy=args.env_redundancy)}
    else:
        base = "naive"
        runs = {"naive": lambda seed: naive(args, seed), **runs}
    unknown = set(args.runs or ()) - set(runs)
    if unknown:
        raise SystemExit(f"bench_e2e: --runs {' '.join(sorted(unknown))}: this workload runs "
                         f"{', '.join(runs)}")
    runs = {name: run for name, run in runs.items() if not args.runs or name in args.runs}
    res: dict[str, list[dict]] = {name: [] for name in runs}
    for seed in args.seeds:
        for name, run in runs.items():
            print(f"bench_e2e: seed {seed}: {name} ...", flush=True)
            res[name].append(run(seed))
            print(f"  {name:9s} {json.dumps(res[name][-1])}", flush=True)

    def mean(name, key):
        if name not in res:                  # not run (--runs)
            return None
        vals = [r[key] for r in res[name]]
        return statistics.fmean(vals) if all(v is not None for v in vals) else None

    def ratio(a, b, key):   # a / b, None when either never reached the target
        x, y = mean(a, key), mean(b, key)
        return round(x / y, 3) if x and y else None

    ratios = {"async_over_sync_s_per_step": ratio("sync", "async", "s_per_step"),
              f"{base}_over_async_seconds_to_target": ratio(base, "async", "seconds_to_target"),
              f"{base}_over_async_wall": ratio(base, "async", "wall_s"),
              f"{base}_over_sync_seconds_to_target": ratio(base, "sync", "seconds_to_target")}
    if args.rollpacker:
        ratios = {f"sync_over_{name}_{key}": ratio("sync", name, key) for name in runs if name != "sync"
                  for key in ("s_per_step", "seconds_to_target")}
    if args.env:
        ratios.update(async_over_redundant_s_per_step=ratio("async", "redundant", "s_per_step"),
                      async_over_redundant_seconds_to_target=ratio("async", "redundant", "seconds_to_target"),
                      lockstep_over_redundant_seconds_to_target=ratio(base, "redundant", "seconds_to_target"))
    print(json.dumps({
        "setup": {"batch": f"{args.batch_groups}x{args.group_size}", "max_tokens": args.max_tokens,
                  "lr": args.lr, "loss": args.loss, "target": args.target, "seeds": args.seeds,
                  "system_steps": args.steps, "max_concurrency": args.max_concurrency,
                  **({"response_len_median": args.response_len_median,
                      "response_len_sigma": args.response_len_sigma, "tail_oversample": args.tail_oversample}
                     if args.rollpacker else {}),
                  **({"env": args.env, "env_latency_s": args.env_latency_s,
                      "env_latency_sigma": args.env_latency_sigma, "env_hang_rate": args.env_hang_rate,
                      "env_redundancy": args.env_redundancy}
                     if args.env else {})},
        "runs": res, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80, help="system steps per run (train.py --steps)")
    ap.add_argument("--naive-steps", type=int, default=300, help="naive and lockstep: at most this many "
                    "steps; they stop once the target is reached and they have run --steps")
    ap.add_argument("--target", type=float, default=0.5, help="10-step average reward to reach")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch-groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=0, help="per model turn; 0 = train.py's default (8; 16 "
                    "with --env calc)")
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--loss", default="ppo")
    ap.add_argument("--max-concurrency", type=int, default=64, help="the system's trajectories in flight per "
                    "rollout rank (train.py --max-concurrency)")
    ap.add_argument("--env", default="", choices=["", "calc"], help="calc: the agentic workload (lockstep, "
                    "sync, async, redundant) instead of the single-turn one (naive, sync, async)")
    ap.add_argument("--env-latency-s", type=float, default=0.5, help="--env: the median injected env latency "
                    "per reset and step, seconds")
    ap.add_argument("--env-latency-sigma", type=float, default=1.0, help="--env: its lognormal sigma")
    ap.add_argument("--env-hang-rate", type=float, default=0.0, help="--env: the chance an env call never "
                    "returns (a stuck tool: only the env deadline ends it, and the trajectory is retried)")
    ap.add_argument("--env-redundancy", type=int, default=2, help="--env: the redundant run's extra "
                    "trajectories per group")
    ap.add_argument("--rollpacker", action="store_true", help="RollPacker's comparison instead: sync, "
                    "sync_tail, sync_tail_stream, async (ratio 2), async_tail, on a long-tail length "
                    "workload")
    ap.add_argument("--response-len-median", type=float, default=0.0, help="train.py's: each prompt's "
                    "response is exactly lognormal(this, --response-len-sigma) tokens; 0 = off "
                    "(--rollpacker: 8)")
    ap.add_argument("--response-len-sigma", type=float, default=1.0)
    ap.add_argument("--tail-oversample", type=float, default=1.5, help="--rollpacker: train.py's")
    ap.add_argument("--runs", nargs="+", help="only these (default: all of the workload's; ratios need both "
                    "sides)")
    ap.add_argument("--out-dir", default="runs/bench_e2e")
    ap.add_argument("--timeout-s", type=float, default=1200, help="per system run, and per lockstep step's "
                    "rollouts")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.rollpacker and not args.response_len_median:
        args.response_len_median = 8.0
    main(args)
