"""bench_e2e.py: the whole system against a plain synchronous loop, to the same reward, in one run.

    .venv/bin/python -m tools.bench_e2e                 # naive, then the system at ratio 0 and 2 (~6 min)
    .venv/bin/python -m tools.bench_e2e --steps 80 --target 0.5 --seeds 0 1

Three ways to train the embedded tiny model on the default task, with the same seed, task, batch
(--batch-groups x --group-size), response budget, learning rate and loss:

    naive    one process, no engines, no queues: transformers `generate` (sampling at temperature 1,
             logprobs from its logits), then the same Trainer.train_step; every group trained (no
             dynamic filtering), torch on all cores
    sync     `torchrun train.py --async-ratio 0`: the real system, synchronous (the default layout)
    async    `torchrun train.py --async-ratio 2`: the real system, asynchronous

For each: seconds per step (median), the step at which the 10-step average of the per-step reward
(the mean reward of that step's rollouts, as in train.py's progress line) first reaches --target
and the seconds of training until then (the sum of the step times so far: start-up excluded), and
the whole command's wall time (start-up included). Printed as one JSON object with the ratios.

What this does not make equal, on purpose: the system filters groups whose rewards are all equal
(DAPO's dynamic sampling, on by default) and naive does not; that is part of what the system buys.
"""

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from tools.jobs import torchrun_cmd

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


# ---------------------------------------------------------------------------------------------
# naive: generate with transformers, then one Trainer step


def naive(args, seed: int) -> dict:
    import torch

    import task
    import tiny_model
    from buffer import Sample
    from controller import problem_stream
    from losses import group_advantages
    from trainer import TrainConfig, Trainer
    from transformers import AutoTokenizer

    t_start = time.monotonic()
    torch.set_num_threads(os.cpu_count())
    model_dir = str(tiny_model.ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = Trainer(model_dir, TrainConfig(loss=args.loss, lr=args.lr, micro_batch=args.micro_batch,
                                             seed=seed))
    torch.manual_seed(seed)
    problems = problem_stream(None, seed, make=task.make_problem)
    B, G, eos = args.batch_groups, args.group_size, tok.eos_token_id
    step_times, rewards = [], []
    for step in range(args.naive_steps):
        t0 = time.monotonic()
        batch = [next(problems) for _ in range(B)]
        # B*G rows, a group's rows together
        prompts = [tok.encode(p.prompt) for p in batch for _ in range(G)]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])        # left-padded [B*G, width]
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        trainer.model.eval()
        with torch.no_grad():
            out = trainer.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                         top_k=0, top_p=1.0, max_new_tokens=args.max_tokens, eos_token_id=eos,
                                         pad_token_id=tok.pad_token_id, output_logits=True,
                                         return_dict_in_generate=True)
        new = out.sequences[:, width:]                                          # [B*G, T]
        logp = torch.stack(out.logits, 1).float().log_softmax(-1)               # [B*G, T, V]
        taken = logp.gather(-1, new[..., None]).squeeze(-1)                     # [B*G, T]
        samples = []
        for i, row in enumerate(new.tolist()):
            n = row.index(eos) + 1 if eos in row else len(row)                  # through EOS, as the engine
            p = batch[i // G]
            text = tok.decode(row[:n], skip_special_tokens=True)
            samples.append(Sample(f"{step}.{i}", f"{step}.{i // G}", prompts[i], row[:n],
                                  taken[i, :n].tolist(), [1] * n, [step] * n, task.reward(p, text)))
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
# the system: torchrun train.py, its metrics.jsonl read back


def system(args, seed: int, async_ratio: int, out_dir: Path) -> dict:
    cmd = torchrun_cmd("--steps", str(args.steps), "--async-ratio", str(async_ratio),
                       "--out-dir", str(out_dir), "--save-every", "0", "--seed", str(seed),
                       "--loss", args.loss, "--lr", str(args.lr), "--batch-groups", str(args.batch_groups),
                       "--group-size", str(args.group_size),
                       "--max-tokens", str(args.max_tokens), "--micro-batch", str(args.micro_batch))
    t = time.monotonic()
    with open(out_dir.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            timeout=args.timeout_s).returncode
    wall = time.monotonic() - t
    if rc != 0:
        raise SystemExit(f"bench_e2e: {' '.join(cmd)} failed (exit {rc}); see {out_dir.with_suffix('.log')}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    out = summarise([r["time_step"] for r in rows], [r["reward_mean"] for r in rows], wall, args.target)
    out["sync_share"] = round(sum(r["time_weight_sync"] for r in rows) / sum(r["time_step"] for r in rows), 4)
    return out


def main(args):
    out_root = Path(args.out_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    res: dict[str, list[dict]] = {"naive": [], "sync": [], "async": []}
    for seed in args.seeds:
        print(f"bench_e2e: seed {seed}: naive ...", flush=True)
        res["naive"].append(naive(args, seed))
        for name, ratio in (("sync", 0), ("async", 2)):
            print(f"bench_e2e: seed {seed}: system, async ratio {ratio} ...", flush=True)
            res[name].append(system(args, seed, ratio, out_root / f"{name}-seed{seed}"))
        for name in res:
            print(f"  {name:6s} {json.dumps(res[name][-1])}", flush=True)

    def mean(name, key):
        vals = [r[key] for r in res[name]]
        return statistics.fmean(vals) if all(v is not None for v in vals) else None

    def ratio(a, b, key):   # a / b, None when either never reached the target
        x, y = mean(a, key), mean(b, key)
        return round(x / y, 3) if x and y else None

    print(json.dumps({
        "setup": {"batch": f"{args.batch_groups}x{args.group_size}", "max_tokens": args.max_tokens,
                  "lr": args.lr,
                  "loss": args.loss, "target": args.target, "seeds": args.seeds, "system_steps": args.steps},
        "runs": res,
        "ratios": {"async_over_sync_s_per_step": ratio("sync", "async", "s_per_step"),
                   "naive_over_async_seconds_to_target": ratio("naive", "async", "seconds_to_target"),
                   "naive_over_async_wall": ratio("naive", "async", "wall_s"),
                   "naive_over_sync_seconds_to_target": ratio("naive", "sync", "seconds_to_target")},
    }, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80, help="system steps per run (train.py --steps)")
    ap.add_argument("--naive-steps", type=int, default=300, help="naive: at most this many steps; it stops "
                    "once the target is reached and it has run --steps")
    ap.add_argument("--target", type=float, default=0.5, help="10-step average reward to reach")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch-groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--loss", default="ppo")
    ap.add_argument("--out-dir", default="runs/bench_e2e")
    ap.add_argument("--timeout-s", type=float, default=1200, help="per system run")
    ap.add_argument("--verbose", action="store_true")
    main(ap.parse_args())
