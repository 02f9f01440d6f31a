"""bench_lora.py: full fine-tuning against LoRA rank 8 and 32, side by side in one run, on the real system
(torchrun train.py: 1 trainer rank + 1 engine, the default layout).

    .venv/bin/python tiny_model.py --out-dir .cache/qwen2-103m --hidden 1024 --layers 8 --heads 16 \\
        --intermediate 2816 --sft-steps 0              # the 103M model (random weights; ~2 min, once)
    .venv/bin/python -m tools.bench_lora               # ~15 min on 2 cores

Two models, each run at --lora-rank 0 (full), 8 and 32 with the same seed and batch:
    103M     the 103M random Qwen2 (0.41 GB in float32): --batch-groups 2 --group-size 4 --max-tokens 4
             --no-filter-groups --steps 6 (what a sync and a step cost; it has nothing to learn)
    tiny     the embedded model on the default task, --steps 80 (as `bash run.sh`): does LoRA learn?
LoRA runs use --lora-lr (adapters want a larger step than full weights; full runs keep train.py's --lr).

Printed per run, from its metrics.jsonl (steps 2..: start-up apart) and its final checkpoint:
    sync MB        what every weight sync sends: the checkpoint's weights file (model.safetensors, or
                   the adapter's adapter_model.safetensors; on CPU the engine's dtype is the trainer's)
    s/sync         the rollout side's sync, from the SYNC command to the engine running again
                   (time_engine_load), mean over the syncs after the first
    optimizer MB   trainer rank 0's optimizer state (optimizer_state_mb)
    peak GB        trainer rank 0's peak memory (mem_peak_gb: on CPU its process's peak resident set,
                   torch and the model's libraries included)
    s/step         median step time
    reward         first 10 -> last 10 steps' mean reward (tiny), and the gain
Prints a markdown table (README, "LoRA") and the JSON it came from.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from tools.bench_weight_sync import RUNS
from tools.jobs import run_to_end, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent   # the repository root
# name -> (train.py args, model dir or None for the embedded default): bench_weight_sync's two runs
MODELS = {"103M": RUNS["103M"], "tiny": RUNS["default"]}


def run(args, model: str, rank: int, out: Path) -> dict:
    train_args, model_dir = MODELS[model]
    steps = args.steps_103m if model == "103M" else args.steps_tiny
    cmd = torchrun_cmd(*train_args, *(["--model", str(ROOT / model_dir)] if model_dir else []),
                       "--steps", str(steps), "--out-dir", str(out), "--save-every", "0", "--overwrite",
                       "--seed", str(args.seed), *(["--lora-rank", str(rank), "--lr", str(args.lora_lr)]
                                                   if rank else []))
    t = time.monotonic()
    rows = run_to_end(cmd, out, "bench_lora", args.timeout_s)
    synced = [r for r in rows[1:] if "time_engine_load" in r]       # rows reporting a sync (not the first)
    weights = out / "checkpoint" / ("adapter_model.safetensors" if rank else "model.safetensors")
    rewards = [r["reward_mean"] for r in rows]
    return {"model": model, "lora_rank": rank, "steps": steps,
            "sync_mb": round(weights.stat().st_size / 1e6, 3),
            "s_per_sync": round(statistics.fmean(r["time_engine_load"] for r in synced[1:]), 4),
            "optimizer_mb": round(rows[-1]["optimizer_state_mb"], 3),
            "peak_gb": round(max(r["mem_peak_gb"] for r in rows), 3),
            "s_per_step": round(statistics.median(r["time_step"] for r in rows[1:]), 3),
            "reward_first10": round(statistics.fmean(rewards[:10]), 3),
            "reward_last10": round(statistics.fmean(rewards[-10:]), 3),
            "wall_s": round(time.monotonic() - t, 1)}


def table(results: list[dict]) -> str:
    lines = ["| model | training | sync MB | s/sync | optimizer MB | trainer peak GB | s/step | "
             "reward first 10 -> last 10 |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        gain = r["reward_last10"] - r["reward_first10"]
        reward = (f"{r['reward_first10']:.3f} -> {r['reward_last10']:.3f} ({gain:+.3f})"
                  if r["model"] == "tiny" else "-")
        training = f"LoRA rank {r['lora_rank']}" if r["lora_rank"] else "full"
        lines.append(f"| {r['model']} | {training} | {r['sync_mb']:.3f} | {r['s_per_sync']:.4f} | "
                     f"{r['optimizer_mb']:.3f} | {r['peak_gb']:.2f} | {r['s_per_step']:.3f} | {reward} |")
    return "\n".join(lines)


def main(args):
    if "103M" in args.models and not (ROOT / MODELS["103M"][1] / "config.json").exists():
        raise SystemExit("bench_lora: build the 103M model first (see the docstring)")
    out_root = Path(args.out_dir).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    results = []
    for model in args.models:
        for rank in args.ranks:
            print(f"bench_lora: {model}, lora rank {rank} ...", flush=True)
            results.append(run(args, model, rank, out_root / f"{model}-r{rank}"))
            print(f"  {json.dumps(results[-1])}", flush=True)
    ratios = {}
    for model in args.models:
        full = next((r for r in results if r["model"] == model and r["lora_rank"] == 0), None)
        for r in results:
            if full and r["model"] == model and r["lora_rank"]:
                ratios[f"{model} r{r['lora_rank']}"] = {
                    "sync_bytes_full_over_lora": round(full["sync_mb"] / r["sync_mb"], 1),
                    "s_per_sync_full_over_lora": round(full["s_per_sync"] / r["s_per_sync"], 2),
                    "optimizer_full_over_lora": round(full["optimizer_mb"] / r["optimizer_mb"], 1),
                    "s_per_step_full_over_lora": round(full["s_per_step"] / r["s_per_step"], 2)}
    print(table(results))
    print(json.dumps({"results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[0, 8, 32], help="--lora-rank values (0 = full)")
    ap.add_argument("--lora-lr", type=float, default=2e-3, help="the LoRA runs' --lr")
    ap.add_argument("--steps-103m", type=int, default=6)
    ap.add_argument("--steps-tiny", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="runs/bench_lora")
    ap.add_argument("--timeout-s", type=float, default=1200, help="per run")
    main(ap.parse_args())
