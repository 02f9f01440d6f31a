"""distill_study.py: on-policy distillation (ext/distill.py) measured on the real system, side by side.

    .venv/bin/python -m tools.distill_study                  # everything below (~40 min on 2 cores)
    .venv/bin/python -m tools.distill_study --kinds distill --ratios 2 --seeds 0 --steps 6   # a quick look

Every run is `torchrun train.py` (1 trainer, 1 rollout rank, and with a teacher 1 teacher rank: real vLLM
engines), the embedded student (.cache/tiny-qwen2) and teacher (.cache/tiny-teacher, built on first use:
`python -m ext.distill --build`), the same --steps, batch, learning rate and loss, per seed the same problems.
Three kinds:

    rl        the verifier's reward alone (train.py's defaults)
    distill   the teacher's per-token log-probs alone: --reward none --distill-coef COEF --no-filter-groups
    both      the verifier's reward plus the teacher's: --distill-coef COEF --no-filter-groups (the teacher's
              per-token gap clipped at 1 nat: --distill-clip's auto with a reward)

Progress is measured on the held-out set (ext/eval.py, every --eval-every steps: the same problems each
round): the held-out reward (mean@k at temperature 1) and, with a teacher, eval_teacher_kl, the reverse KL to
the teacher of the held-out samples (ext/distill.py). The per-step teacher_kl of the trained batch moves by
~0.4 nats from step to step with the batch's mix of problems, too much to read a trend from; before training,
both are measured here outside the system on the same held-out problems (held_out_of, held_out_kl). Three
questions, each a table in results/distill.md:

1. RL vs distillation vs both at --ratios' first entry (2): held-out reward per step and the gap to the
   teacher's own held-out reward (measured on the same held-out problems) at the end; held-out reverse KL to
   the teacher per step (distill and both).
2. Distillation at async ratio 0, 2 and 8: the held-out reward it ends at, the held-out reverse KL to the
   teacher before training and at the end (each seed's change), and the staleness each reached (does it
   tolerate staleness as the paper's Takeaway 4 says PPO does?).
3. The teacher's cost at ratio 2: seconds per step of rl against both (the same objective's reward, plus
   the teacher), the seconds a sample waits for its teacher's answer, and how much of scoring a step's
   samples is hidden behind generation: 1 - (extra seconds per step) / (seconds the teacher engine takes
   to score one step's samples at once, measured here on an engine of its own).

Writes results/distill.json (every run's rows), results/distill.md (the tables) and results/distill.png.
"""

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from tools import jobs
from tools.jobs import torchrun_cmd

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("rl", "distill", "both")
MAX_TOKENS = 8                # a response's tokens: the embedded model's --max-tokens


def teacher_args(teacher: str, coef: float) -> list[str]:
    return ["--teacher", teacher, "--teacher-gpus", "1", "--distill-coef", str(coef), "--no-filter-groups"]


def kind_args(kind: str, teacher: str, coef: float) -> list[str]:
    return {"rl": [], "distill": teacher_args(teacher, coef) + ["--reward", "none"],
            "both": teacher_args(teacher, coef)}[kind]


def run(kind: str, ratio: int, seed: int, args, out_root: Path) -> dict:
    """One torchrun job to its end; its figures and per-step rows."""
    return job(kind, kind_args(kind, args.teacher, args.coef), 2 if kind == "rl" else 3, ratio, seed, args,
               out_root, "distill_study")


def job(kind: str, train_args: list[str], nproc: int, ratio: int, seed: int, args, out_root: Path,
        who: str) -> dict:
    """`torchrun train.py` on nproc ranks (the extensions' served ranks included) to its end, with the study's
    steps, batch and held-out evaluation: its figures and per-step series."""
    out = out_root / f"{kind}_r{ratio}_s{seed}"
    cmd = torchrun_cmd("--out-dir", str(out), "--overwrite", "--steps", str(args.steps), "--seed", str(seed),
                       "--async-ratio", str(ratio), "--eval-every", str(args.eval_every),
                       "--eval-prompts", str(args.eval_prompts), "--eval-k", str(args.eval_k),
                       "--batch-groups", str(args.batch_groups), "--save-every", "0", *train_args)
    cmd[cmd.index("--nproc-per-node") + 1] = str(nproc)
    t0 = time.monotonic()
    rows = jobs.run_to_end(cmd, out, f"{who} {kind} ratio {ratio} seed {seed}", timeout_s=args.timeout_s)
    wall = time.monotonic() - t0
    key = f"eval_mean_at_{args.eval_k}"
    clock = [0.0]                  # seconds of training until each version (the weights after k steps)
    for r in rows:
        clock.append(clock[-1] + r["time_step"])
    # (version evaluated, seconds of training until it, held-out reward)
    evals = [(r["eval_version"], round(clock[r["eval_version"]], 1), r[key]) for r in rows if key in r]
    return {"kind": kind, "ratio": ratio, "seed": seed, "wall_s": round(wall, 1), "evals": evals,
            # (version evaluated, held-out reverse KL to the teacher): with a teacher
            "eval_kl": [(r["eval_version"], r["eval_teacher_kl"]) for r in rows if "eval_teacher_kl" in r],
            "s_per_step": statistics.median(r["time_step"] for r in rows),
            "teacher_kl": [r.get("teacher_kl") for r in rows],
            "time_teacher": statistics.fmean(r["time_teacher"] for r in rows) if "time_teacher" in rows[0]
            else None,
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "reward": [r["reward_mean"] for r in rows],
            "reward_trained": [r["reward_trained_mean"] for r in rows],
            **{k: [r.get(k) for r in rows] for k in ("time_judge", "judge_share", "judge_unparsed",
                                                     "reward_verifier") if k in rows[-1]}}


def held_out_of(model_dir: str, args) -> float:
    """A model's held-out reward outside the system: mean@k at temperature 1 on the problems ext/eval.py
    holds out for seed 0 (the teacher's line to reach; the student's start, to check it against the runs')."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import task
    import tiny_model
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    held = task.make_problems(args.eval_prompts, seed=0 + 1_000_003)        # ext/eval.Eval.held_out's
    torch.manual_seed(0)
    return statistics.fmean(tiny_model.sample_accuracy(model, tok, held, greedy=False, seed=k)
                            for k in range(max(args.eval_k, 8)))


def held_out_kl(student_dir: str, teacher_dir: str, args, seed: int) -> tuple[float, float]:
    """The student's held-out reverse KL to the teacher outside the system, as eval_teacher_kl measures it in
    a run: --eval-k samples at temperature 1 of each problem ext/eval.py holds out for `seed`, the mean over
    their tokens of log p_student - log p_teacher (the runs' value before training); and the share of its sum
    on the tokens where the response departs from the right answer (a wrong digit, one too many or too
    few: the first token that differs, and every one after it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import task
    student, teacher = (AutoModelForCausalLM.from_pretrained(d).float().eval()
                        for d in (student_dir, teacher_dir))
    tok = AutoTokenizer.from_pretrained(student_dir)
    g, diffs, wrong = torch.Generator().manual_seed(seed), [], []
    with torch.no_grad():
        for p in task.make_problems(args.eval_prompts, seed=seed + 1_000_003):     # ext/eval.Eval.held_out's
            prompt, right = tok.encode(p.prompt), tok.encode(p.answer) + [tok.eos_token_id]
            for _ in range(args.eval_k):
                ids = list(prompt)
                while len(ids) < len(prompt) + MAX_TOKENS and ids[-1:] != [tok.eos_token_id]:
                    logits = student(torch.tensor([ids])).logits[0, -1]
                    ids.append(torch.multinomial(torch.softmax(logits, -1), 1, generator=g).item())
                x = torch.tensor([ids])
                lp = [torch.log_softmax(m(x).logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
                      [len(prompt) - 1:] for m in (student, teacher)]               # [response tokens]
                response = ids[len(prompt):]
                first = next((j for j, t in enumerate(response) if j >= len(right) or t != right[j]),
                             len(response))
                diffs += (lp[0] - lp[1]).tolist()
                wrong += [j >= first for j in range(len(response))]
    total = sum(diffs)
    return statistics.fmean(diffs), (sum(d for d, w in zip(diffs, wrong) if w) / total if total else 0.0)


def scored_samples(teacher: str, n: int) -> list[list[int]]:
    """n default-task samples (prompt, answer, EOS) as the teacher's tokens."""
    import task
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(teacher)
    return [tok.encode(p.prompt + p.answer) + [tok.eos_token_id] for p in task.make_problems(n, seed=5)]


async def time_scoring(proxy, seqs: list[list[int]]) -> float:
    """Seconds an engine takes to score seqs at once (median of 5, after one warm-up)."""
    await asyncio.gather(*[proxy.score(s) for s in seqs])
    times = []
    for _ in range(5):
        t0 = time.monotonic()
        await asyncio.gather(*[proxy.score(s) for s in seqs])
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def score_time(teacher: str, n: int) -> float:
    """Seconds the teacher's engine takes to score n default-task samples at once: what a step's scoring would
    add if it ran after generation instead of beside it."""
    from proxy import LLMProxy
    seqs = scored_samples(teacher, n)

    async def main():
        proxy = await LLMProxy.start_vllm(teacher, rank=0, timeout_s=300, startup_timeout_s=600,
                                          enforce_eager=True, max_num_seqs=min(n, 256))
        try:
            return await time_scoring(proxy, seqs)
        finally:
            proxy.shutdown()
    return asyncio.run(main())


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def curve(runs: list[dict]) -> list[tuple]:
    """The seeds' mean held-out reward per evaluated step: [(step, seconds, reward)]."""
    steps = sorted({e[0] for r in runs for e in r["evals"]})
    out = []
    for s in steps:
        at = [e for r in runs for e in r["evals"] if e[0] == s]
        if len(at) == len(runs):
            out.append((s, statistics.fmean(e[1] for e in at), statistics.fmean(e[2] for e in at)))
    return out


def kl_curve(runs: list[dict], before: dict) -> list[tuple]:
    """The seeds' mean held-out reverse KL to the teacher per evaluated step, [(step, nats)], from step 0:
    before training (before: seed -> held_out_kl)."""
    steps = sorted({v for r in runs for v, _ in r["eval_kl"]})
    out = [(0, statistics.fmean(before[str(r["seed"])] for r in runs))] if runs and before else []
    for s in steps:
        at = [kl for r in runs for v, kl in r["eval_kl"] if v == s]
        if len(at) == len(runs):
            out.append((s, statistics.fmean(at)))
    return out


def tables(res: dict) -> str:
    runs, teacher, k, before = res["runs"], res["teacher_held_out"], res["args"]["eval_k"], res["kl_before"]

    def by(kind, ratio):
        return [r for r in runs if r["kind"] == kind and r["ratio"] == ratio]
    a = res["args"]
    lines = [f"Command: `{res['command']}` ({a['steps']} steps of {a['batch']}, seeds {a['seeds']}, "
             f"--distill-coef {a['coef']}, held-out mean@{k} and reverse KL to the teacher over "
             f"{a['eval_prompts']} problems every {a['eval_every']} steps; {res['date']}).", "",
             f"The teacher's held-out reward (mean@{max(k, 8)}, same problems): **{teacher:.3f}**; the "
             f"student's before training: {res['student_held_out']:.3f}."
             + (f" The student's held-out reverse KL to the teacher before training: "
                f"{statistics.fmean(before.values()):.2f} nats a token, "
                f"{statistics.fmean(res['kl_before_wrong'].values()):.0%} of it on the tokens where its "
                f"answer departs from the right one (from the first wrong, missing or extra digit on)."
                if before else ""), ""]
    r0 = a["ratios"][0] if 2 not in a["ratios"] else 2
    present = [kind for kind in KINDS if by(kind, r0)]
    if present:
        steps = [s for s, _, _ in curve(by(present[0], r0))]
        lines += [f"### 1. RL, distillation, both (async ratio {r0}, mean of {len(a['seeds'])} seeds)", "",
                  "Held-out reward (mean@k, the verifier's):", "",
                  "| kind | " + " | ".join(f"step {s}" for s in steps) + " | s/step | gap to the teacher at "
                  "the end |", "|---" * (len(steps) + 3) + "|"]
        for kind in present:
            c, s_step = curve(by(kind, r0)), mean(r["s_per_step"] for r in by(kind, r0))
            lines.append(f"| {kind} | " + " | ".join(f"{v:.3f}" for _, _, v in c)
                         + f" | {s_step:.2f} | {teacher - c[-1][2]:+.3f} |")
        taught = [kind for kind in present if kind != "rl" and kl_curve(by(kind, r0), before)]
        if taught:
            ksteps = [s for s, _ in kl_curve(by(taught[0], r0), before)]
            lines += ["", "Held-out reverse KL to the teacher (eval_teacher_kl, nats a token; step 0: before "
                      "training, measured outside the system on the same problems):", "",
                      "| kind | " + " | ".join(f"step {s}" for s in ksteps) + " |",
                      "|---" * (len(ksteps) + 1) + "|"]
            for kind in taught:
                c = kl_curve(by(kind, r0), before)
                lines.append(f"| {kind} | " + " | ".join(f"{v:.3f}" for _, v in c) + " |")
        lines.append("")
    dist = [r for r in sorted(a["ratios"]) if by("distill", r)]
    if dist:
        lines += ["### 2. Distillation alone at each async ratio", "",
                  "| ratio | final held-out | held-out KL to the teacher, before -> end | each seed's change "
                  "| staleness mean (max) | s/step |", "|---|---|---|---|---|---|"]
        for r in dist:
            rs, c = by("distill", r), kl_curve(by("distill", r), before)
            change = ", ".join(f"{x['eval_kl'][-1][1] - before[str(x['seed'])]:+.3f}" for x in rs
                               if x["eval_kl"] and before)
            stale = f"{mean(x['staleness_mean'] for x in rs):.2f} ({max(x['staleness_max'] for x in rs)})"
            lines.append(f"| {r} | {mean(x['evals'][-1][2] for x in rs):.3f} | "
                         + (f"{c[0][1]:.3f} -> {c[-1][1]:.3f}" if c else "-") + f" | {change or '-'} | "
                         f"{stale} | {mean(x['s_per_step'] for x in rs):.2f} |")
        lines.append("")
    if by("rl", r0) and by("both", r0):
        plain = mean(x["s_per_step"] for x in by("rl", r0))
        with_t = mean(x["s_per_step"] for x in by("both", r0))
        extra, batch = with_t - plain, res["score_s"]
        lines += [f"### 3. The teacher's cost at async ratio {r0}", "",
                  "| s/step without | s/step with | extra | a sample's wait for its teacher | scoring a "
                  "step's samples at once | hidden behind generation |", "|---|---|---|---|---|---|",
                  f"| {plain:.2f} | {with_t:.2f} | {extra:+.2f} | "
                  f"{mean(x['time_teacher'] for x in by('both', r0)):.2f} s | {batch:.2f} s | "
                  f"{max(0.0, 1 - extra / batch):.0%} |", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs, a = res["runs"], res["args"]
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    r0 = 2 if 2 in a["ratios"] else a["ratios"][0]
    for kind in KINDS:
        c = curve([r for r in runs if r["kind"] == kind and r["ratio"] == r0])
        if c:
            ax[0].plot([s for s, _, _ in c], [v for _, _, v in c], marker="o", label=kind)
            ax[1].plot([t for _, t, _ in c], [v for _, _, v in c], marker="o", label=kind)
    for x in ax[:2]:
        x.axhline(res["teacher_held_out"], color="k", ls="--", label="teacher")
        x.set_ylabel(f"held-out mean@{a['eval_k']}")
        x.legend()
    ax[0].set_xlabel("step")
    ax[1].set_xlabel("seconds of training")
    ax[0].set_title(f"RL vs distillation vs both (ratio {r0})")
    for r in sorted(a["ratios"]):
        c = kl_curve([x for x in runs if x["kind"] == "distill" and x["ratio"] == r], res["kl_before"])
        if c:
            ax[2].plot([s for s, _ in c], [v for _, v in c], marker="o", label=f"ratio {r}")
    ax[2].set_xlabel("step")
    ax[2].set_ylabel("eval_teacher_kl (nats a token)")
    ax[2].set_title("distillation alone: held-out reverse KL to the teacher")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: rl, distill, both")
    ap.add_argument("--ratios", default="2,0,8", help="the first is the ratio the kinds are compared at; "
                                                       "distillation alone runs at every one")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-groups", type=int, default=16, help="prompts per step (x 8 samples)")
    ap.add_argument("--coef", type=float, default=1.0, help="--distill-coef")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--eval-k", type=int, default=2)
    ap.add_argument("--teacher", default=str(ROOT / ".cache" / "tiny-teacher"))
    ap.add_argument("--timeout-s", type=float, default=1200, help="per run")
    ap.add_argument("--runs-dir", default="/tmp/distill_study", help="the runs' out dirs and logs")
    ap.add_argument("--out", default=str(ROOT / "results" / "distill"), help="writes OUT.json, .md, .png")
    args = ap.parse_args()
    import tiny_model
    from controller import ControllerConfig
    from ext.distill import TEACHER_DIR, ensure_tiny_teacher
    tiny_model.ensure_tiny_model()
    if args.teacher == str(TEACHER_DIR):
        ensure_tiny_teacher()
    kinds, ratios = args.kinds.split(","), [int(r) for r in args.ratios.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    plan = [(k, ratios[0], s) for k in kinds for s in seeds]
    plan += [("distill", r, s) for r in ratios[1:] for s in seeds if "distill" in kinds]
    out_root = Path(args.runs_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    print(f"distill_study: {len(plan)} runs of {args.steps} steps", flush=True)
    runs = []
    for i, (kind, ratio, seed) in enumerate(plan):
        t0 = time.monotonic()
        runs.append(run(kind, ratio, seed, args, out_root))
        r = runs[-1]
        kl = [round(x, 3) for _, x in r["eval_kl"]]
        print(f"  [{i + 1}/{len(plan)}] {kind} ratio {ratio} seed {seed}: {time.monotonic() - t0:.0f}s, "
              f"{r['s_per_step']:.2f} s/step, held-out {[round(e[2], 3) for e in r['evals']]}, staleness "
              f"{r['staleness_mean']:.2f}" + (f", held-out KL to the teacher {kl}" if kl else ""), flush=True)
    cc = ControllerConfig()
    before = ({s: held_out_kl(str(tiny_model.DEFAULT_DIR), args.teacher, args, s) for s in seeds}
              if set(kinds) - {"rl"} else {})
    res = {"command": "python -m tools.distill_study" + "".join(
               f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if v != ap.get_default(k) and k not in ("runs_dir", "out")),
           "date": time.strftime("%Y-%m-%d"),
           "args": {**vars(args), "ratios": ratios, "seeds": seeds,
                    "batch": f"{args.batch_groups}x{cc.group_size}"},
           "teacher_held_out": held_out_of(args.teacher, args),
           "student_held_out": held_out_of(str(tiny_model.DEFAULT_DIR), args),
           # per seed: (the held-out KL to the teacher before training, the share of it on wrong tokens)
           **{key: {str(s): v[i] for s, v in before.items()}
              for i, key in enumerate(("kl_before", "kl_before_wrong"))},
           "score_s": (score_time(args.teacher, args.batch_groups * cc.group_size) if "both" in kinds
                       else None),
           "runs": runs}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = tables(res)
    out.with_suffix(".md").write_text(md + "\n")
    plot(res, out.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
