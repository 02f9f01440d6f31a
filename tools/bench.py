"""bench.py: the paper's rollout speedups, measured for real on this machine, side by side in one run.

    .venv/bin/python -m tools.bench                     # 2 real vLLM CPU engines + the real trainer, ~4 min
    .venv/bin/python -m tools.bench --steps 10 --batch-groups 8 --group-size 8

Real parts: two vLLM engines (one core each) behind LLMProxy, the project's EnvManager, AsyncController,
SampleBuffer and Trainer (real optimizer steps on the tiny model), real weight updates into the engines
after every step. The same engines serve every configuration in turn, so start-up is paid once:

    sync            async ratio 0, queue scheduling, prompt replication        (the baseline)
    async1, async2  async ratio 1 and 2
    batch_rollout   async ratio 0, every admitted prompt must finish (barrier), 50% redundant prompts
    queue_rollout   async ratio 0, the step ends when enough prompts finished, same redundant prompts
    no_replication  async ratio 0, one task per prompt: all its samples on one engine

Long-tailed response lengths: every prompt draws a target length from a lognormal (median 12 tokens,
sigma 1.0, capped to fit the 128-token context) and its responses are exactly that long (ignore_eos).
Each configuration trains the same number of samples (steps x batch). Printed: one JSON object with
seconds per step of each configuration and the ratios.

Deliberate differences from train.py, for a one-process benchmark: the trainer runs in a thread of
this process, and so does weight-sync rank 0 (weight_sync.Sender: the same gloo broadcast into the
engines' workers, on a store of its own); dynamic filtering is off (responses of forced length
carry no meaningful reward, and filtering would make the number of generated groups random). On 2
shared cores, rollout and training compete for the same CPU, so async gains here are smaller than
on separate GPUs: the simulator (sim.py) covers the paper's scale.
"""

import argparse
import asyncio
import json
import math
import random
import time

import torch


def problems(seed: int, median: float, sigma: float, cap: int):
    """Endless addition problems, each with a long-tailed target response length."""
    import task
    rng = random.Random(seed)
    while True:
        p = task.make_problem(rng)
        p.target_len = max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))
        yield p


async def run_config(name, overrides, args, proxies, trainer, sender, tokenizer) -> dict:
    from buffer import LocalQueues, SampleBuffer
    from tools.local import run_local
    from controller import AsyncController, ControllerConfig, WholeBatch, rl_step
    from env_manager import EnvManager, RolloutConfig
    import ext.longtail  # noqa: F401  (problems with a target_len: exactly that many tokens, EOS ignored)
    from weight_sync import weight_layout

    buffer = SampleBuffer(LocalQueues(len(proxies)), who=f"bench {name}", timeout_s=300)
    ccfg = ControllerConfig(**{"batch_groups": args.batch_groups, "group_size": args.group_size,
                               "filter_groups": False, "redundant": 0, "timeout_s": 300, **overrides})
    ctrl = AsyncController(ccfg, buffer, problems(args.seed, args.median_len, args.sigma, args.cap),
                           len(proxies), version=proxies[0].version)
    # every configuration reuses generation 0 of the sender's group (the same engines: no replacement)
    spec, layout = sender.spec(0, len(proxies)), weight_layout(trainer.named_weights())
    send = lambda g: sender.send(g, trainer.iter_full_state(), layout)     # in sync_weights' thread
    rcfg = RolloutConfig(max_concurrency=args.max_concurrency, max_tokens=8, max_model_len=124)
    managers = [EnvManager(p, buffer, tokenizer, r, rcfg)
                for r, p in enumerate(proxies)]

    async def train(batch, advantages, version):       # in a thread: the event loop keeps serving rollout
        return await asyncio.to_thread(trainer.train_step, batch, advantages), None

    async def loop():
        step_times, stale = [], []
        for step in range(args.steps + 1):                  # step 0 is a warm-up, not timed
            t0 = time.perf_counter()
            info = (await rl_step(ctrl, WholeBatch(train, ccfg.group_size), send, layout, spec)).info
            if args.verbose:
                print(f"    {name} step {step}: {time.perf_counter() - t0:.2f}s, "
                      f"wait {info['time_wait_rollout']:.2f}s, "
                      f"{info['num_samples']} samples, {ctrl.groups_admitted} groups admitted", flush=True)
            if step > 0:
                step_times.append(time.perf_counter() - t0)
                stale.append(info["staleness_max"])
        return step_times, stale

    step_times, stale = await run_local(ctrl, managers, loop(), timeout_s=300 * (args.steps + 2))
    per_step = sum(step_times) / len(step_times)
    print(f"  {name:15s} {per_step:6.2f} s/step   staleness max {max(stale)}", flush=True)
    return {"s_per_step": round(per_step, 3), "staleness_max": max(stale)}


async def main(args):
    from transformers import AutoTokenizer

    import tiny_model
    from proxy import LLMProxy
    from trainer import TrainConfig, Trainer
    from weight_sync import Sender

    model_dir = str(tiny_model.ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    proxies = [await LLMProxy.start_vllm(model_dir, rank=r, cpu_cores=str(r),
                                         max_num_seqs=args.max_concurrency)
               for r in range(2)]
    trainer = Trainer(model_dir, TrainConfig(loss="ppo", lr=1e-5, seed=args.seed))
    sender = Sender(timeout_s=300)                      # weight-sync rank 0, on a store of its own
    redundant = args.batch_groups // 2
    configs = {
        "sync": dict(async_ratio=0),
        "async1": dict(async_ratio=1),
        "async2": dict(async_ratio=2),
        "batch_rollout": dict(async_ratio=0, rollout_mode="batch", redundant=redundant),
        "queue_rollout": dict(async_ratio=0, rollout_mode="queue", redundant=redundant),
        "no_replication": dict(async_ratio=0, replicate=False),
    }
    print(f"bench: {args.steps} steps x {args.batch_groups}x{args.group_size} samples per configuration",
          flush=True)
    res = {}
    try:
        # warm-up, not reported: the engines' first batches of each shape and the trainer's first
        # steps are slow, and would penalise whichever configuration ran first
        await run_config("warm-up", configs["sync"], argparse.Namespace(**{**vars(args), "steps": 3}),
                         proxies, trainer, sender, tokenizer)
        for name, overrides in configs.items():
            if args.only and name not in args.only.split(","):
                continue
            res[name] = await run_config(name, overrides, args, proxies, trainer, sender, tokenizer)
    finally:
        for p in proxies:
            p.shutdown()
    s = {k: v["s_per_step"] for k, v in res.items()}
    pairs = {"async1_vs_sync": ("sync", "async1"), "async2_vs_sync": ("sync", "async2"),
             "queue_vs_batch_rollout": ("batch_rollout", "queue_rollout"),
             "replication_on_vs_off": ("no_replication", "sync")}
    print(json.dumps({
        "setup": {"engines": 2, "steps": args.steps, "batch": f"{args.batch_groups}x{args.group_size}",
                  "length": f"lognormal median {args.median_len} sigma {args.sigma} cap {args.cap}"},
        "configs": res,
        "speedup": {k: round(s[slow] / s[fast], 3) for k, (slow, fast) in pairs.items()
                    if slow in s and fast in s},
    }, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration (plus one warm-up)")
    ap.add_argument("--batch-groups", type=int, default=8, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    ap.add_argument("--median-len", type=float, default=12, help="median response length, tokens")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of response lengths")
    ap.add_argument("--cap", type=int, default=110, help="max response length, tokens")
    ap.add_argument("--max-concurrency", type=int, default=64, help="trajectories in flight per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="a line per step")
    ap.add_argument("--only", default="", help="comma-separated configurations to run (default: all)")
    asyncio.run(main(ap.parse_args()))
