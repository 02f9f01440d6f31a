"""judge_study.py: an LLM judge as the reward (ext/judge.py), measured on the real system, side by side.

    .venv/bin/python -m tools.judge_study                   # everything below (~17 min on 2 cores)
    .venv/bin/python -m tools.judge_study --seeds 0 --steps 6 --pairs 100     # a quick look
    .venv/bin/python -m tools.judge_study --agreement-only --judge DIR       # table 1 alone, of any judge

The embedded student (.cache/tiny-qwen2) and judge (.cache/tiny-judge, built on first use), every run
`torchrun train.py` (1 trainer, 1 rollout rank, and with the judge 1 judge rank: real vLLM engines), the
same steps, batch and seeds (tools/distill_study.job):

1. The judge against the verifier on --pairs held-out (problem, response) pairs, the responses the student
   samples at temperature 1: agreement and the confusion table (the verdict p(yes) / (p(yes) + p(no))
   thresholded at 0.5; agreement() here).
2. Training with the judge's reward alone (--reward none: no verifier) against the verifier's, async ratio
   2: held-out reward per step, scored by the verifier in both (ext/eval.py; env_manager's eval_reward_fn),
   and the verifier's reward of the samples each run trained on (the judged runs: --judge-audit).
3. With the judge on, async ratio 2 against 0: seconds per step, against the verifier's runs at the same
   ratio (the judge's extra seconds a step), the seconds a sample's verdict took, and the verdict's share of
   a trajectory's time (from its env's reset to its verdict, judge_share): the share env-level async has to
   hide behind other trajectories' generation.

Writes results/judge.json (every run's rows) and results/judge.md (the tables).
"""

import argparse
import json
import time
from pathlib import Path

from tools.distill_study import curve, held_out_of, job, mean

ROOT = Path(__file__).resolve().parent.parent


def agreement(judge_dir: str, n: int, rule: str = "yes") -> dict:
    """The judge against the verifier on n held-out (problem, response) pairs, the responses the embedded
    student samples (temperature 1): agreement and the confusion table, the verdict thresholded at 0.5."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import task
    import tiny_model
    from ext.judge import Judge, JudgeConfig, fill, plain, read_template, render, yes_probability
    student_dir = tiny_model.ensure_tiny_model()
    stok = AutoTokenizer.from_pretrained(student_dir)
    student = AutoModelForCausalLM.from_pretrained(student_dir).float().eval()
    problems = task.make_problems(n, seed=2_000_003)
    torch.manual_seed(0)
    responses = []
    for i in range(0, n, 256):                   # sampled answers, as training sees them
        chunk = problems[i:i + 256]
        prompts = [stok.encode(p.prompt) for p in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        attn = (ids != 0).long()
        with torch.no_grad():
            out = student.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                   top_k=0, max_new_tokens=8, eos_token_id=stok.eos_token_id, pad_token_id=0)
        responses += [stok.decode(o[width:], skip_special_tokens=True) for o in out]
    jtok = AutoTokenizer.from_pretrained(judge_dir)
    judge = AutoModelForCausalLM.from_pretrained(judge_dir).float().eval()
    part = JudgeConfig(judge=judge_dir, judge_gpus=1, judge_rule=rule)
    sections = read_template(Judge.template(part), "template")
    yes, no = (plain(jtok, w)[0] for w in ("yes", "no"))
    table = {"tp": 0, "fp": 0, "tn": 0, "fn": 0}
    for p, r in zip(problems, responses):
        ids = torch.tensor([render(jtok, fill(sections, p.prompt, r, p.answer))])
        with torch.no_grad():
            logp = judge(ids).logits[0, -1].log_softmax(-1)
        says = yes_probability(logp[yes].item(), logp[no].item()) >= 0.5
        right = task.reward(p, r) > 0
        table[("t" if says == right else "f") + ("p" if says else "n")] += 1
    return {"pairs": n, "agreement": (table["tp"] + table["tn"]) / n,
            "verifier_correct": sum(task.reward(p, r) > 0 for p, r in zip(problems, responses)) / n, **table}


def tables(res: dict) -> str:
    a, runs, ag = res["args"], res["runs"], res["agreement"]

    def truth(run):                 # the verifier's reward of a run's trained samples, per step
        return run["reward_verifier"] if run["kind"] == "judge" else run["reward_trained"]

    def by(kind, ratio):
        return [r for r in runs if r["kind"] == kind and r["ratio"] == ratio]
    lines = [f"Command: `{res['command']}` ({a['steps']} steps of {a['batch_groups']}x8, seeds {a['seeds']}, "
             f"held-out mean@{a['eval_k']} over {a['eval_prompts']} problems every {a['eval_every']} steps; "
             f"{res['date']}).", "",
             f"### 1. The judge against the verifier ({ag['pairs']} held-out pairs, the student's answers)",
             "",
             "| agreement | verifier says right | judge yes, verifier right | judge yes, verifier wrong | "
             "judge no, verifier wrong | judge no, verifier right |", "|---|---|---|---|---|---|",
             f"| {ag['agreement']:.1%} | {ag['verifier_correct']:.1%} | {ag['tp']} | {ag['fp']} | "
             f"{ag['tn']} | {ag['fn']} |", ""]
    kinds = [k for k in ("verifier", "judge") if by(k, 2)]
    if kinds:
        steps = [s for s, _, _ in curve(by(kinds[0], 2))]
        lines += [f"### 2. Held-out reward (the verifier's) per step, trained on each reward (ratio 2, mean "
                  f"of {len(a['seeds'])} seeds)", "",
                  f"Before training (the student outside the system, mean@{max(a['eval_k'], 8)}): "
                  f"{res['student_held_out']:.3f}. The reward trained on: the mean of the first and of the "
                  "last 5 steps' samples. The verifier's reward of the trained samples (the judged runs: "
                  "--judge-audit, a record only): the same 5 steps' trained batches.", "",
                  "| reward trained on | " + " | ".join(f"step {s}" for s in steps)
                  + " | reward trained on, first 5 -> last 5 steps | the verifier's reward of the trained "
                  "samples, first 5 -> last 5 | s/step |",
                  "|---" * (len(steps) + 4) + "|"]
        for k in kinds:
            rs = by(k, 2)
            lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for _, _, v in curve(rs))
                         + f" | {mean(mean(r['reward'][:5]) for r in rs):.3f} -> "
                         f"{mean(mean(r['reward'][-5:]) for r in rs):.3f} | "
                         f"{mean(mean(truth(r)[:5]) for r in rs):.3f} -> "
                         f"{mean(mean(truth(r)[-5:]) for r in rs):.3f} | "
                         f"{mean(r['s_per_step'] for r in rs):.2f} |")
        lines.append("")
    rows = [(ratio, by("judge", ratio)) for ratio in (2, 0) if by("judge", ratio)]
    if rows:
        lines += ["### 3. The judge's latency, async ratio 2 against 0", "",
                  "The judge's extra seconds a step: s/step with it against the verifier's runs at the same "
                  "ratio and seeds. A verdict's share of a trajectory is time the trajectory waits; what the "
                  "step does not pay of it, other trajectories' generation and verdicts covered.", "",
                  "| ratio | runs | s/step | s/step, verifier | the judge's extra s/step "
                  "| a verdict's seconds | its share of a trajectory | unparsed |",
                  "|---|---|---|---|---|---|---|---|"]
        for ratio, rs in rows:
            seeds = {r["seed"] for r in rs}
            base = mean(r["s_per_step"] for r in by("verifier", ratio) if r["seed"] in seeds)
            judged = mean(r["s_per_step"] for r in rs)
            lines.append(f"| {ratio} | {len(rs)} | {judged:.2f} | "
                         + (f"{base:.2f} | +{judged - base:.2f} | " if base is not None else "- | - | ")
                         + f"{mean(mean(r['time_judge']) for r in rs):.3f} | "
                         f"{mean(mean(r['judge_share']) for r in rs):.0%} | "
                         f"{sum(sum(r['judge_unparsed']) for r in rs)} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--ratio0-seeds", default="0", help="seeds of the judged runs at async ratio 0")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-groups", type=int, default=16, help="prompts per step (x 8 samples)")
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--eval-k", type=int, default=2)
    ap.add_argument("--judge", default=str(ROOT / ".cache" / "tiny-judge"))
    ap.add_argument("--timeout-s", type=float, default=1200, help="per run")
    ap.add_argument("--runs-dir", default="/tmp/judge_study", help="the runs' out dirs and logs")
    ap.add_argument("--out", default=str(ROOT / "results" / "judge"), help="writes OUT.json, OUT.md")
    ap.add_argument("--agreement-only", action="store_true",
                    help="only table 1, the judge against the verifier on --pairs pairs (printed; nothing "
                         "written)")
    args = ap.parse_args()
    import tiny_model
    from ext.judge import TEST_JUDGE, TINY_JUDGE, ensure_tiny_judge
    if Path(args.judge).resolve() in (TINY_JUDGE, TEST_JUDGE):       # (the embedded ones: built on first use)
        ensure_tiny_judge(test=Path(args.judge).resolve() == TEST_JUDGE)
    seeds = [int(s) for s in args.seeds.split(",")]
    seeds0 = [int(s) for s in args.ratio0_seeds.split(",") if s]
    judged = ["--judge", args.judge, "--judge-gpus", "1", "--reward", "none", "--judge-audit"]
    plan = ([("verifier", [], 2, 2, s) for s in seeds] + [("judge", judged, 3, 2, s) for s in seeds]
            + [("judge", judged, 3, 0, s) for s in seeds0] + [("verifier", [], 2, 0, s) for s in seeds0])
    out_root = Path(args.runs_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ag = agreement(args.judge, args.pairs)
    if args.agreement_only:
        print(json.dumps({"judge": args.judge, **ag}))
        return
    student = held_out_of(str(tiny_model.ensure_tiny_model(log=lambda *a: None)), args)
    print(f"judge_study: agreement {ag['agreement']:.1%} on {args.pairs} pairs "
          f"({time.monotonic() - t0:.0f}s); {len(plan)} runs of {args.steps} steps", flush=True)
    runs = []
    for i, (kind, train_args, nproc, ratio, seed) in enumerate(plan):
        t0 = time.monotonic()
        runs.append(job(kind, train_args, nproc, ratio, seed, args, out_root, "judge_study"))
        r = runs[-1]
        print(f"  [{i + 1}/{len(plan)}] {kind} ratio {ratio} seed {seed}: {time.monotonic() - t0:.0f}s, "
              f"{r['s_per_step']:.2f} s/step, held-out {[round(e[2], 3) for e in r['evals']]}, train reward "
              f"{mean(r['reward'][:5]):.3f} -> {mean(r['reward'][-5:]):.3f}", flush=True)
    res = {"command": "python -m tools.judge_study" + "".join(
               f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if v != ap.get_default(k) and k not in ("runs_dir", "out")),
           "date": time.strftime("%Y-%m-%d"), "args": {**vars(args), "seeds": seeds}, "agreement": ag,
           "student_held_out": student, "runs": runs}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = tables(res)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
