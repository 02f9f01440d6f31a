"""bench_weight_sync.py: the weight sync before and after weights went straight into the engines, or
the two transports of this tree (the group broadcast, the ipc hand-over), side by side in one run, on
the real system (torchrun train.py, 1 trainer rank + 1 engine).

    git worktree add ../before 314ce2d                 # the last commit of the old path
    .venv/bin/python tiny_model.py --out-dir .cache/qwen2-103m --hidden 1024 --layers 8 --heads 16 \
        --intermediate 2816 --sft-steps 0              # the 103M model (random weights; ~2 min, once)
    .venv/bin/python -m tools.bench_weight_sync --before ../before      # ~8 min on 2 cores
    .venv/bin/python -m tools.bench_weight_sync --transports   # group vs ipc (this tree): 17 min, busy cores

before: trainer rank 0 -> gloo broadcast -> the rollout rank -> .cpu() -> safetensors bytes ->
collective_rpc("stage_weights") -> the engine's worker -> reload_weights; the rank receives while
its engine generates, then suspends for the load. after (this tree, weight_sync.py): the rank
suspends, trainer rank 0 broadcasts into the engine's worker, each bucket is loaded as it arrives.
--transports: this tree twice, --weight-transport group (that broadcast, gloo here) and ipc
(weight_ipc.py: the buckets handed over in shared memory, CUDA IPC's CPU twin); the same runs.

Two runs per tree: the 103M Qwen2 (hidden 1024, 8 layers, tiny tokenizer, 0.41 GB in float32) with
`--batch-groups 2 --group-size 4 --max-tokens 4 --no-filter-groups --steps 5`, and the default run
(the embedded tiny model, `--steps 80`, as `bash run.sh`). From each run's metrics.jsonl, steps 2..
(after start-up; row k reports the acks of sync k - 1):

    s/sync      end to end on the rollout side, from the SYNC command to the engine running again on
                the new weights: before: receive + suspend/load/resume; after: suspend/receive/resume.
                The mean over the syncs after the first; the first (after: it forms the weight-sync
                group and vLLM's first reload sets itself up) is shown apart
    GB/s        the model's bytes (its safetensors) / s/sync
    vLLM load   after only: the engine worker's time not spent waiting in the broadcast (vLLM's
                own reload_weights: copies into the parameters, CPU weight prepacking)
    sync share  the trainer's time in sync_weights / step time (what the trainer waits for)
    util        the engine's busy fraction between syncs (rollout_utilisation)

Prints a markdown table (README, "Weight sync") and the JSON it came from.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from tools.jobs import run_to_end, torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent   # the repository root
RUNS = {   # name -> (train.py args, model dir or None for the embedded default)
    "103M": (["--batch-groups", "2", "--group-size", "4", "--max-tokens", "4", "--no-filter-groups"],
             ".cache/qwen2-103m"),
    "default": ([], None),
}


def model_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def model_dir(name: str, args) -> Path | None:
    """The run's model dir (None: train.py's embedded default); the 103M one must have been built."""
    model = RUNS[name][1] and (args.model_103m or RUNS[name][1])
    if model and not (ROOT / model / "config.json").exists():
        raise SystemExit(f"bench_weight_sync: no model in {ROOT / model}: build the 103M model first "
                         f"(see the docstring)")
    return ROOT / model if model else None


def run(tree: Path, name: str, model: Path | None, steps: int, out: Path, timeout_s: float,
        label: str = "", extra: tuple = ()) -> dict:
    args = RUNS[name][0]
    model_dir = model or ROOT / ".cache/tiny-qwen2"
    cmd = torchrun_cmd(*args, *(["--model", str(model)] if model else []), "--steps", str(steps),
                       "--out-dir", str(out), "--save-every", "0", "--overwrite", *extra)
    t = time.monotonic()
    rows = run_to_end(cmd, out, "bench_weight_sync", timeout_s, cwd=tree, env={"OMP_NUM_THREADS": "1"})[1:]
    after = "time_vllm_load" in rows[-1]
    # rows that report a sync (the first row reports the start-up check, not a sync)
    synced = [r for r in rows if "time_engine_load" in r]
    per_sync = [r["time_engine_load"] + (0.0 if after else r["time_receive"]) for r in synced]
    s_sync = statistics.fmean(per_sync[1:])          # the first sync forms the weight-sync group: apart
    gb = model_bytes(model_dir) / 1e9
    return {"tree": label or ("after" if after else "before"), "run": name, "steps": steps,
            "model_gb": round(gb, 3),
            "s_per_sync": round(s_sync, 3), "gb_per_s": round(gb / s_sync, 2),
            "first_sync_s": round(per_sync[0], 3),
            "vllm_load_s": (round(statistics.fmean(r["time_vllm_load"] for r in synced[1:]), 3)
                            if after else None),
            "sync_share": round(sum(r["time_weight_sync"] for r in rows) / sum(r["time_step"] for r in rows),
                                4),
            "util": round(statistics.fmean(r["rollout_utilisation"] for r in synced), 3),
            "wall_s": round(time.monotonic() - t, 1)}


def table(results: list[dict]) -> str:
    lines = ["| run | path | s/sync | GB/s | first sync s | vLLM load s | sync share | engine util |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        load = f"{r['vllm_load_s']:.3f}" if r["vllm_load_s"] is not None else "-"
        lines.append(f"| {r['run']} ({r['model_gb']} GB) | {r['tree']} | {r['s_per_sync']:.3f} | "
                     f"{r['gb_per_s']:.2f} | "
                     f"{r['first_sync_s']:.3f} | {load} | {r['sync_share']:.1%} | {r['util']:.2f} |")
    return "\n".join(lines)


def transports(args):
    """This tree's two transports on the same runs, one after the other, and their ratio."""
    out_root = Path(args.out_dir).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    models = {name: model_dir(name, args) for name in args.runs}     # (fail before any run starts)
    results, ratios = [], {}
    for name in args.runs:
        pair = []
        for transport in ("group", "ipc"):
            print(f"bench_weight_sync: {name}, --weight-transport {transport} ...", flush=True)
            pair.append(run(ROOT, name, models[name], args.steps if name == "103M" else args.default_steps,
                            out_root / f"{name}-{transport}", args.timeout_s, transport,
                            ("--weight-transport", transport)))
            print(f"  {json.dumps(pair[-1])}", flush=True)
        results += pair
        # group s/sync over ipc s/sync: above 1, the hand-over is the faster
        ratios[name] = {"group_over_ipc_s_per_sync": round(pair[0]["s_per_sync"] / pair[1]["s_per_sync"], 2)}
    print(table(results))
    print(json.dumps({"results": results, "ratios": ratios}, indent=2))


def main(args):
    if args.transports:
        return transports(args)
    before = Path(args.before).resolve()
    if not (before / "train.py").exists():
        raise SystemExit(f"bench_weight_sync: --before {before}: no train.py there; make it with "
                         f"`git worktree add {args.before} 314ce2d`")
    if not (before / ".cache").exists():          # the embedded model: the same build, not a second one
        (before / ".cache").symlink_to(ROOT / ".cache")
    models = {name: model_dir(name, args) for name in args.runs}
    out_root = Path(args.out_dir).resolve()       # (the runs have their tree as cwd)
    out_root.mkdir(parents=True, exist_ok=True)
    results, ratios = [], {}
    for name in args.runs:
        pair = []
        for label, tree in (("before", before), ("after", ROOT)):
            print(f"bench_weight_sync: {name}, {label} ...", flush=True)
            pair.append(run(tree, name, models[name], args.steps if name == "103M" else args.default_steps,
                            out_root / f"{name}-{label}", args.timeout_s))
            print(f"  {json.dumps(pair[-1])}", flush=True)
        results += pair
        ratios[name] = {"speedup_s_per_sync": round(pair[0]["s_per_sync"] / pair[1]["s_per_sync"], 1)}
    print(table(results))
    print(json.dumps({"results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="a checkout of the old path (git worktree add DIR 314ce2d)")
    ap.add_argument("--transports", action="store_true",
                    help="instead: this tree's --weight-transport group and ipc, side by side")
    ap.add_argument("--model-103m", default="", help="the 103M model dir, if not .cache/qwen2-103m")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--steps", type=int, default=5, help="103M run: train.py --steps")
    ap.add_argument("--default-steps", type=int, default=80,
                    help="default run: train.py --steps (80: the default)")
    ap.add_argument("--out-dir", default="runs/bench_weight_sync")
    ap.add_argument("--timeout-s", type=float, default=1200, help="per run")
    parsed = ap.parse_args()
    if not parsed.transports and not parsed.before:
        ap.error("--before DIR (the old path's checkout) or --transports")
    main(parsed)
