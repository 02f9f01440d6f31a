"""study.py: the paper's Takeaway 4 measured for real: do off-policy losses train as well asynchronously?

    .venv/bin/python -m tools.study                               # the whole study (constants below), ~26 min
    .venv/bin/python -m tools.study --losses ppo,tis --ratios 0,8 --seeds 0 --steps 10    # a quick look

The claim (ROLL Flash, Takeaway 4): with off-policy corrections, training at async ratio 2 or 8
reaches the same reward as synchronous training. Here: every loss in LOSSES at every ratio in RATIOS,
SEEDS seeds each, on the embedded task (addition, the tiny model), the same number of samples per run
(STEPS x BATCH_GROUPS x GROUP_SIZE), and a freshest-first run per ratio > 0 to show what the sample
order does to staleness. Per run: final reward (held-out problems, the final weights, greedy and
mean@EVAL_K at temperature 1), the training reward of the last 10 steps, the staleness actually
seen (mean and max over trained samples), clip fraction, and wall time.

Real parts, as bench.py: one vLLM engine (core 1) behind LLMProxy, the project's EnvManager,
AsyncController, SampleBuffer and Trainer (core 0, a thread of this process). The engine is started
once; every run rebuilds the trainer from the tiny model and loads the initial weights into the
engine, so runs start from the same policy. Weight-sync rank 0 (weight_sync.Sender) is this process:
the same gloo broadcast into the engine's worker as train.py's, on a store of its own.

Writes results/study.json (every run), results/study.md (the table) and results/study.png.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# ---- the study's constants (what the README's table was made with)
# ppo = GRPO's clipped objective; LOSS+CORRECTION adds --is-correction (ppo+X is decoupled_ppo+X: one
# objective, PPO clipped against pi_prox times X's weight, so the correction is crossed with ppo alone)
LOSSES = ("ppo", "ppo+tis", "ppo+icepop", "decoupled_ppo", "tis", "cispo", "topr", "gspo")
RATIOS = (0, 2, 8)
SEEDS = (0, 1, 2)
STEPS = 60                 # batches per run (7680 samples)
BATCH_GROUPS = 16          # prompts per step
GROUP_SIZE = 8             # samples per prompt
REDUNDANT = 4              # extra prompts admitted for dynamic filtering
MINI_BATCHES = 2           # optimizer steps per batch: decoupled_ppo's clip acts from the second one
# not train.py's 3e-4: at 3e-4 one step moves this tiny policy so far that 4-5 versions of staleness cost
# every loss 6-10 points, and 1e-4 learns more at ratio 0 (README's study section; results/study_lr3e-4)
LR = 1e-4
EVAL_PROMPTS = 256         # held-out problems, the same for every run (mean@4 over 1024 samples: +-0.015)
EVAL_K = 4                 # samples per held-out problem at temperature 1 (mean@k)

ROOT = Path(__file__).resolve().parent.parent   # the repository root


async def run_one(loss: str, ratio: int, seed: int, order: str, args, proxy, sender, initial, model_dir,
                  tokenizer, steps: int) -> dict:
    """One training run of `steps` steps from the initial weights; returns its figures (steps 0: the
    initial policy's evaluation alone)."""
    import task
    from buffer import LocalQueues, SampleBuffer
    from tools.local import run_local
    from controller import AsyncController, ControllerConfig, WholeBatch, rl_step
    from task import problem_stream
    from ext.eval import Evaluation
    from env_manager import EnvManager, RolloutConfig
    from trainer import TrainConfig, Trainer
    from tools.local import push
    from weight_sync import weight_layout

    t_start = time.monotonic()
    torch.manual_seed(seed)
    base, _, correction = loss.partition("+")         # "ppo+tis": --loss ppo --is-correction tis
    trainer = Trainer(model_dir, TrainConfig(loss=base, is_correction=correction or "none", lr=args.lr,
                                             mini_batches=args.mini_batches, seed=seed))
    version = proxy.version + 1                       # the engine back to the initial weights
    await proxy.suspend("keep")
    await push([proxy], sender, initial, version)     # generation 0 of sender's group, as the syncs below
    await proxy.resume()
    buffer = SampleBuffer(LocalQueues(1), f"study {loss} ratio {ratio} seed {seed}", timeout_s=300)
    ctrl = AsyncController(ControllerConfig(batch_groups=args.batch_groups, group_size=args.group_size,
                                            async_ratio=ratio, redundant=args.redundant, sample_order=order,
                                            timeout_s=300), buffer,
                           problem_stream(None, seed, make=task.make_problem), 1, version=version)
    spec, layout = sender.spec(0, 1), weight_layout(trainer.named_weights())
    send = lambda g: sender.send(g, trainer.iter_full_state(), layout)   # in sync_weights' thread
    manager = EnvManager(proxy, buffer, tokenizer, 0, RolloutConfig(max_tokens=8, max_model_len=128))

    async def train(batch, advantages, version):     # in a thread: rollout goes on meanwhile
        return await asyncio.to_thread(trainer.train_step, batch, advantages, version), None

    async def loop():
        await ctrl.wait_ready()
        rows = []
        for _ in range(steps):
            step = await rl_step(ctrl, WholeBatch(train, args.group_size), send, layout, spec)
            # (--trace) the pipeline after the step: the tasks admitted and not started yet
            rows.append({**step.info, **step.metrics, "tasks_queued": ctrl.buffer.num_queued_tasks()})
        await ctrl.finish_sync()
        # the final weights
        ev = Evaluation(ctrl)
        await ev.start(task.make_problems(args.eval_prompts, seed=1_000_003), args.eval_k)
        return rows, await ev.finish()

    rows, evaluation = await run_local(ctrl, [manager], loop(), timeout_s=300 * (steps + 2))
    result = {"loss": loss, "async_ratio": ratio, "seed": seed, "sample_order": order,
              "eval_greedy": evaluation["eval_greedy"],
              "eval_mean_at_k": evaluation[f"eval_mean_at_{args.eval_k}"]}
    if not rows:
        return result
    last = rows[-10:]
    return {**result, "train_reward_last10": statistics.fmean(r["reward_mean"] for r in last),
            "train_reward_first": rows[0]["reward_mean"],
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "clip_frac": statistics.fmean(r["clip_frac"] for r in rows),
            # k3 estimate of KL(mu || pi) over the trained tokens: how far the policy had moved from the one
            # that sampled them (staleness + the optimizer steps within the batch)
            "approx_kl": statistics.fmean(r["approx_kl"] for r in rows),
            # --is-correction: tokens it truncated (tis) or dropped (mis, icepop); the engine/trainer gap
            **({"is_corrected_frac": statistics.fmean(r["is_corrected_frac"] for r in rows),
                "mismatch_kl": statistics.fmean(r["mismatch_kl"] for r in rows)}
               if "is_corrected_frac" in rows[0] else {}),
            "samples_dropped_stale": sum(r["samples_dropped_stale"] for r in rows),
            # per step (--trace): the staleness trained, the tasks still queued, the rollout wait, training
            "trace": [{k: r[k] for k in ("staleness_mean", "tasks_queued", "time_wait_rollout",
                                         "time_trainer_busy", "groups_filtered", "reward_mean")}
                      for r in rows],
            "samples": sum(r["num_samples"] for r in rows), "wall_s": time.monotonic() - t_start}


def order_of(loss: str) -> tuple:
    """Tables and plots list the losses in LOSSES' order, each with its corrections after it."""
    base, _, correction = loss.partition("+")
    return (LOSSES.index(base) if base in LOSSES else len(LOSSES), correction)


def table(runs: list[dict]) -> str:
    """Markdown: per (loss, ratio, order), mean +- std over seeds."""
    def ms(xs):
        return f"{statistics.fmean(xs):.3f} +- {statistics.pstdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"
    keys = sorted({(r["loss"], r["async_ratio"], r["sample_order"]) for r in runs},
                  key=lambda k: (order_of(k[0]), k[2] != "oldest", k[1]))
    out = ["| loss | async ratio | order | seeds | eval mean@k | eval greedy | train reward (last 10) | "
           "staleness mean / max | KL(mu, pi) | clip frac | wall s |", "|---" * 11 + "|"]
    for loss, ratio, order in keys:
        rs = [r for r in runs if (r["loss"], r["async_ratio"], r["sample_order"]) == (loss, ratio, order)]
        out.append(f"| {loss} | {ratio} | {order} | {len(rs)} | {ms([r['eval_mean_at_k'] for r in rs])} | "
                   f"{ms([r['eval_greedy'] for r in rs])} | {ms([r['train_reward_last10'] for r in rs])} | "
                   f"{statistics.fmean(r['staleness_mean'] for r in rs):.2f} / "
                   f"{max(r['staleness_max'] for r in rs)} | "
                   f"{statistics.fmean(r.get('approx_kl', float('nan')) for r in rs):.4f} | "
                   f"{statistics.fmean(r['clip_frac'] for r in rs):.3f} | "
                   f"{statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    return "\n".join(out)


def plot(runs: list[dict], path: Path, start: float):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    losses = sorted({r["loss"] for r in runs}, key=order_of)
    ratios = sorted({r["async_ratio"] for r in runs})
    for i, loss in enumerate(losses):            # one line per loss: final reward against the ratio
        pts = [(j, [r["eval_mean_at_k"] for r in runs if (r["loss"], r["async_ratio"], r["sample_order"])
                    == (loss, ratio, "oldest")]) for j, ratio in enumerate(ratios)]
        pts = [(j + (i - len(losses) / 2) * 0.02, xs) for j, xs in pts if xs]     # x: nudged apart
        ax.errorbar([x for x, _ in pts], [statistics.fmean(xs) for _, xs in pts],
                    yerr=[statistics.pstdev(xs) if len(xs) > 1 else 0 for _, xs in pts], marker="o",
                    capsize=2, color=f"C{i}", ls="--" if "+" in loss else "-", label=loss)
    ax.axhline(start, color="grey", ls="--", lw=1, label=f"initial policy {start:.3f}")
    ax.set_xticks(range(len(ratios)), [f"async ratio {r}" for r in ratios])
    ax.set_ylabel("held-out reward (mean@k)")
    ax.set_ylim(max(0.0, start - 0.1), None)
    ax.set_title("final reward (mean and std over seeds)")
    ax.legend(fontsize=8, ncol=2)
    for order, marker in (("oldest", "o"), ("freshest", "s")):
        pts = [(r["async_ratio"], r["staleness_mean"]) for r in runs if r["sample_order"] == order]
        if pts:
            ax2.scatter(*zip(*pts), marker=marker, label=f"{order} first", alpha=0.6)
    ax2.set_xlabel("async ratio")
    ax2.set_ylabel("staleness (versions), mean over a run")
    ax2.set_title("staleness of the trained samples")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args):
    if args.plot_only:            # redraw from the study.json of an earlier run
        data = json.loads((Path(args.out_dir) / "study.json").read_text())
        return plot(data["runs"], Path(args.out_dir) / "study.png", data["initial"])
    from ext.quiet import quiet
    quiet()                       # before vLLM loads: library logs at warning level
    from transformers import AutoTokenizer

    import tiny_model
    from proxy import LLMProxy, Sampling
    from trainer import Trainer, TrainConfig
    from weight_sync import Sender

    model_dir = str(tiny_model.ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the engine: core 1
    proxy = await LLMProxy.start_vllm(model_dir, rank=0, cpu_cores="1", max_num_seqs=64)
    os.sched_setaffinity(0, {0})                      # the trainer and the event loop: core 0
    torch.set_num_threads(1)
    initial = Trainer(model_dir, TrainConfig()).full_state()
    sender = Sender(timeout_s=300)                    # weight-sync rank 0, on a store of its own
    await proxy.generate(tokenizer.encode("1+1="), Sampling(max_tokens=2))     # warm-up
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(loss, ratio, seed, "oldest") for loss in args.losses for ratio in args.ratios
            for seed in args.seeds]
    if args.order_loss:
        plan += [(args.order_loss, r, seed, "freshest") for r in args.ratios if r > 0 for seed in args.seeds]
    runs, t0 = [], time.monotonic()
    start = (await run_one("ppo", 0, 0, "oldest", args, proxy, sender, initial, model_dir, tokenizer,
                           steps=0))["eval_mean_at_k"]
    print(f"study: the initial policy's held-out reward (mean@{args.eval_k}) is {start:.3f}; "
          f"{len(plan)} runs of {args.steps} steps x {args.batch_groups}x{args.group_size} samples",
          flush=True)
    try:
        for i, (loss, ratio, seed, order) in enumerate(plan):
            r = await run_one(loss, ratio, seed, order, args, proxy, sender, initial, model_dir, tokenizer,
                              args.steps)
            runs.append(r)
            done = time.monotonic() - t0
            print(f"  [{i + 1}/{len(plan)}] {loss:13s} ratio {ratio} seed {seed} {order:8s} | eval mean@k "
                  f"{r['eval_mean_at_k']:.3f} greedy {r['eval_greedy']:.3f} | "
                  f"stale mean {r['staleness_mean']:.2f} max {r['staleness_max']} | {r['wall_s']:.0f}s | "
                  f"eta {done / (i + 1) * (len(plan) - i - 1):.0f}s",
                  flush=True)
    finally:
        proxy.shutdown()
    traces = [r.pop("trace", None) for r in runs]      # (study.json keeps the figures; --trace the steps)
    if args.trace:
        Path(args.trace).write_text(json.dumps([{"loss": r["loss"], "async_ratio": r["async_ratio"],
                                                 "seed": r["seed"], "steps": t}
                                                for r, t in zip(runs, traces)]))
    (out / "study.json").write_text(json.dumps({"constants": vars(args), "initial": start, "runs": runs},
                                               indent=1))
    wall = time.monotonic() - t0
    (out / "study.md").write_text(
        f"`python -m tools.study {' '.join(sys.argv[1:])}`: {len(runs)} runs of {args.steps} steps x "
        f"{args.batch_groups}x{args.group_size} samples, {args.mini_batches} mini-batches, lr {args.lr}; "
        f"the initial policy's held-out reward (mean@{args.eval_k} over {args.eval_prompts} problems) is "
        f"{start:.3f}; {wall / 60:.1f} min in all.\n\n"
        + table(runs) + "\n")
    plot(runs, out / "study.png", start)
    print(table(runs))
    print(f"wrote {out / 'study.json'}, {out / 'study.md'}, {out / 'study.png'} ({wall:.0f}s)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--losses", type=lambda x: x.split(","), default=list(LOSSES),
                    help="comma-separated; LOSS+CORRECTION adds --is-correction (e.g. ppo+tis, "
                         "decoupled_ppo+icepop)")
    ap.add_argument("--ratios", type=lambda x: [int(v) for v in x.split(",")], default=list(RATIOS))
    ap.add_argument("--seeds", type=lambda x: [int(v) for v in x.split(",")], default=list(SEEDS))
    ap.add_argument("--order-loss", default="ppo", help="the loss of the freshest-first runs ('' = none)")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch-groups", type=int, default=BATCH_GROUPS)
    ap.add_argument("--group-size", type=int, default=GROUP_SIZE)
    ap.add_argument("--redundant", type=int, default=REDUNDANT)
    ap.add_argument("--mini-batches", type=int, default=MINI_BATCHES)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS)
    ap.add_argument("--eval-k", type=int, default=EVAL_K)
    ap.add_argument("--out-dir", default=str(ROOT / "results"))
    ap.add_argument("--plot-only", action="store_true", help="redraw study.png from out-dir's study.json")
    ap.add_argument("--trace", default="", help="also write every run's steps here (JSON): staleness, tasks "
                                                "queued, waits; how a run's pipeline fills")
    asyncio.run(main(ap.parse_args()))
