"""domains_study.py: what asynchrony does to a mixture of domains, and what holding the mix costs
(ext/domains.py: --domains, --domain-mix quota | admit).

    .venv/bin/python -m tools.domains_study            # both parts
    .venv/bin/python -m tools.domains_study sim        # the simulator part alone
    .venv/bin/python -m tools.domains_study real       # the real-engine part alone
    .venv/bin/python -m tools.domains_study sim --steps 6 --batch-groups 64     # a quick look

Two domains of different trajectory time, each policy at async ratio 0, 2 and 8: quota (each step's batch
holds the weights; admission covers each domain's quota, then fills the spare places by Little's law), admit
(prompts admitted by weight, the first groups ready trained: naive async RL), and in the simulator also
quota/weight (the quota, its spare places held by weight alone: what the admission rule adds).

- sim: tools/sim.py, the real controller, buffer, env managers and this policy on fake timed engines; 128
  GPUs (the split the ideal bound calls balanced for the long domain), B x G = 256 x 8 + 64 redundant
  prompts, dynamic filtering on. Domain "long" has the paper's long-tailed lengths (tools.sim.RLVR's:
  lognormal median 400 tokens, sigma 1, cap 8k), domain "short" short ones (median 100, sigma 0.3, cap 1k);
  weight 0.5 each, the same pass rates and verifier latency. A prompt's length median is tied to its
  difficulty (tools.sim.Workload), so a policy that trains what finishes first also trains easier prompts:
  the reward per domain shows it.
- real: torchrun train.py as bash run.sh lays it out (1 trainer + 1 vLLM rollout rank, the embedded model),
  --domains examples/domains.yaml (arith 0.6: the addition task, one turn; chain 0.4: a running sum over
  three turns), --steps 20 --no-filter-groups (the issue's Check), seed 0; figures over steps 6-20.

Per run: per domain the trained share's error |share - weight| (the mean over the steps after the warm-up,
and the worst of them), the mean staleness, the mean reward, seconds per trajectory; the run's seconds per
step and samples dropped as stale per step. Writes results/domains.md (the tables), results/domains.json
(every run's rows) and results/domains.png (--out: elsewhere). Real time (2 cores, quiet): 9 minutes, the sim
part ~3 (9 runs), the real part ~6 (6 runs of ~65 s, ~40 s of it the engine's start).
"""

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
RATIOS = (0, 2, 8)
MIXES = ("quota", "admit")
# the simulator also runs the quota with its spare places held in proportion to the weights alone (not by
# Little's law, ext/domains.py's default): what the admission rule adds to the quota's cost
SIM_MIXES = ("quota", "quota/weight", "admit")
SEED_BITS = 40              # a sim prompt's seed: its domain's index above this bit, its number below


# ---------------------------------------------------------------------------------------------
# the simulator part


class MixedWorkload:
    """tools/sim.py's Workload, one per domain: a prompt's seed carries its domain's index (the bits above
    SEED_BITS), so the fake engine's length hook and SimEnv's pass rate read the domain's own workload."""

    def __init__(self, configs: list, pass_rates: dict | None = None):
        from tools import sim
        self.parts = [sim.Workload(c) for c in configs]
        self.pass_rates = pass_rates or {}       # domain index -> a fixed pass rate (tests: 0, every group
                                                 # filtered)

    def prompt(self, seed: int):
        p, log_len, plen = self.parts[seed >> SEED_BITS].prompt(seed)
        return self.pass_rates.get(seed >> SEED_BITS, p), log_len, plen

    def length(self, seed: int, rng) -> int:
        return self.parts[seed >> SEED_BITS].length(seed, rng)

    def length_of_prompt(self, prompt_ids, rng) -> int:
        from tools import sim
        return self.length(prompt_ids[0] - sim.Tok.SEED_ID, rng)


def simulate_mix(cfg, domains: list, workloads: list, mix: str = "quota", patience: int = 0,
                 pass_rates: dict | None = None, observe=None, setup=None) -> dict:
    """One simulated run of a mixture: `domains` (ext.domains.Domain, weights summing to 1) and a
    tools.sim.SimConfig per domain (its lengths), the run's own cfg for the rest; mix: quota, admit, or
    quota/weight (the quota, spare places by weight alone). Returns tools.sim.simulate's result with
    "domains":
    each step's per-domain metrics (ext.domains.Tracker.metrics, its policy's end_step figures merged),
    "counters" (the policy's) and "log" (what the controller said)."""
    from ext import domains as dm
    from task import Problem
    from tools import sim
    dm.register_envs(domains, judged=False)
    def prompts(d):         # the domain's prompts, each with a seed of its own that names the domain
        first = (d.index << SEED_BITS) + (cfg.seed << 24)
        return (Problem(f"{d.name}{k}", "", meta={"sim_seed": first + k}) for k in itertools.count())
    stream = dm.Mix(domains, {d.name: prompts(d) for d in domains})
    held, per_step = {}, []

    def setup_mix(ctrl):
        mode, _, spare = mix.partition("/")
        held["policy"] = policy = dm.DomainMix(ctrl.cfg, domains, stream, mode, patience, spare or "little")
        ctrl.admission = policy
        held["tracker"] = tracker = dm.Tracker(domains, policy, ctrl.cfg, "sim")
        ctrl.taps.insert(0, tracker.tap)
        ctrl.log = held.setdefault("log", []).append
        if setup is not None:
            setup(ctrl)

    def observe_mix(ctrl, step):
        row = {**held["tracker"].metrics(step.batch, ctrl.version - 1),
               **{k: v for k, v in step.info.items() if k.startswith("domain/")}}
        per_step.append(row)
        if observe is not None:
            observe(ctrl, step)
    out = sim.simulate(cfg, problems=(stream.make() for _ in itertools.count()), setup=setup_mix,
                       observe=observe_mix, workload=MixedWorkload(workloads, pass_rates), finisher=dm.finish)
    out.update(domains=per_step, counters=held["policy"].counters(None), log=held.get("log", []))
    return out


def sim_configs(steps: int, batch_groups: int, chunk: int):
    """(the run's SimConfig at 128 GPUs, the long domain's, the short domain's)."""
    from tools import sim
    long = replace(sim.RLVR, batch_groups=batch_groups, redundant=batch_groups // 4, steps=steps,
                   warmup=min(3, steps - 2), chunk=chunk)
    r = sim.best_split(long, 128)
    run = replace(long, rollout_gpus=r, train_gpus=128 - r)
    short = replace(run, len_median=100, len_sigma=0.3, len_sigma_prompt=0.2, max_tokens=1024)
    return run, long, short


def figures(rows: list[dict], names: list[str], weights: dict, warmup: int) -> dict:
    """Per domain: share error (mean over the steps after `warmup`, and the worst of them), staleness, reward,
    trajectory seconds."""
    later = rows[warmup:] or rows
    out = {}
    for n in names:
        k = f"domain/{n}/"
        err = [abs(r[k + "share"] - weights[n]) for r in later]
        vals = lambda key: [r[k + key] for r in later if r.get(k + key) is not None]   # noqa: E731
        out[n] = {"share": statistics.fmean(r[k + "share"] for r in later),
                  "share_err_mean": statistics.fmean(err), "share_err_max": max(err),
                  "staleness": _mean(vals("staleness_mean")),
                  "reward": _mean(vals("reward_mean")), "time_s": _mean(vals("time_mean")),
                  "failed": sum(r.get(k + "failed") or 0 for r in later)}
    return out


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def run_sim(args) -> list[dict]:
    from ext.domains import Domain
    run, long, short = sim_configs(args.steps, args.batch_groups, args.chunk)
    domains = [Domain("long", "embedded", 0.5, index=0), Domain("short", "embedded", 0.5, index=1)]
    results = []
    for ratio in args.ratios:
        for mix in args.sim_mixes:
            t = time.time()
            r = simulate_mix(replace(run, async_ratio=ratio), domains, [long, short], mix)
            f = figures(r["domains"], ["long", "short"], {"long": 0.5, "short": 0.5}, run.warmup)
            results.append({"part": "sim", "ratio": ratio, "mix": mix, "step_s": r["step_s"],
                            "dropped_stale": r["dropped_stale"], "domains": f, "rows": r["domains"],
                            "real_s": round(time.time() - t, 1)})
            print(f"  sim ratio {ratio} {mix}: {r['step_s']:.1f} s/step, "
                  + ", ".join(f"{n} share {v['share']:.3f}" for n, v in f.items())
                  + f" ({time.time() - t:.0f} s)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# the real part


EXAMPLE = ROOT / "examples" / "domains.yaml"


def run_real(args) -> list[dict]:
    from ext.domains import load_domains
    from tools import jobs
    domains = load_domains(str(EXAMPLE))
    names, weights = [d.name for d in domains], {d.name: d.weight for d in domains}
    out_root = ROOT / "runs" / "domains_study"
    out_root.mkdir(parents=True, exist_ok=True)
    results = []
    for ratio in args.ratios:
        for mix in args.mixes:
            out = out_root / f"{mix}_r{ratio}"
            cmd = jobs.torchrun_cmd("--domains", str(EXAMPLE), "--domain-mix", mix,
                                    "--async-ratio", str(ratio), "--steps", str(args.real_steps),
                                    "--no-filter-groups", "--seed", "0", "--out-dir", str(out), "--overwrite",
                                    "--save-every", "0")
            t = time.time()
            rows = jobs.run_to_end(cmd, out, f"domains_study {mix} ratio {ratio}", timeout_s=args.timeout_s)
            f = figures(rows, names, weights, 5)          # steps 6 onwards, as the Check
            results.append({"part": "real", "ratio": ratio, "mix": mix,
                            "step_s": statistics.median(r["time_step"] for r in rows[5:]),
                            "dropped_stale": statistics.fmean(r["samples_dropped_stale"] for r in rows[5:]),
                            "domains": f, "rows": [{k: v for k, v in r.items() if k.startswith("domain/")
                                                    or k in ("step", "time_step", "samples_dropped_stale")}
                                                   for r in rows],
                            "real_s": round(time.time() - t, 1)})
            print(f"  real ratio {ratio} {mix}: {results[-1]['step_s']:.2f} s/step, "
                  + ", ".join(f"{n} share {v['share']:.3f}" for n, v in f.items())
                  + f" ({time.time() - t:.0f} s)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# the tables and the picture


def table(results: list[dict], part: str) -> list[str]:
    rows = [r for r in results if r["part"] == part]
    if not rows:
        return []
    names = list(rows[0]["domains"])
    head = (["async ratio", "--domain-mix", "s/step", "stale drops/step"]
            + [f"{n}: {x}" for n in names for x in ("share", "err mean", "err worst", "staleness", "reward",
                                                     "s/trajectory")])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["ratio"], r["mix"], f"{r['step_s']:.2f}", f"{r['dropped_stale']:.1f}"]
        for n in names:
            d = r["domains"][n]
            cells += [f"{d['share']:.3f}", f"{d['share_err_mean']:.3f}", f"{d['share_err_max']:.3f}",
                      f"{d['staleness']:.2f}", f"{d['reward']:.3f}", f"{d['time_s']:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def cost_lines(results: list[dict], part: str) -> list[str]:
    """What the quota costs in seconds per step, and the drift admission alone leaves, per ratio."""
    out = []
    by = {(r["ratio"], r["mix"]): r for r in results if r["part"] == part}
    for ratio in sorted({r for r, _ in by}):
        q, a = by.get((ratio, "quota")), by.get((ratio, "admit"))
        if q and a:
            worst = max(a["domains"].values(), key=lambda d: d["share_err_mean"])
            w = by.get((ratio, "quota/weight"))
            cost = lambda r: f"{r['step_s'] / a['step_s'] - 1:+.0%}"       # noqa: E731
            out.append(f"- ratio {ratio}: the quota costs {cost(q)} seconds per step"
                       + (f" ({cost(w)} with its spare places by weight)" if w else "")
                       + f"; admission alone leaves a mean share error of {worst['share_err_mean']:.3f} "
                       f"(worst step {worst['share_err_max']:.3f}) against the quota's "
                       f"{max(d['share_err_mean'] for d in q['domains'].values()):.3f}")
    return out


def plot(results: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = [p for p in ("sim", "real") if any(r["part"] == p for r in results)]
    fig, axes = plt.subplots(len(parts), 2, figsize=(12, 4 * len(parts)), squeeze=False)
    for row, part in zip(axes, parts):
        rs = [r for r in results if r["part"] == part]
        names = list(rs[0]["domains"])
        first = names[0]
        for r in rs:
            shares = [x[f"domain/{first}/share"] for x in r["rows"]]
            row[0].plot(range(1, len(shares) + 1), shares, "-" if r["mix"] == "quota" else "--",
                        label=f"{r['mix']}, ratio {r['ratio']}")
        w = rs[0]["rows"][0][f"domain/{first}/weight"]
        row[0].axhline(w, color="k", lw=0.8, ls=":", label=f"weight {w:.2f}")
        row[0].set_xlabel("step"), row[0].set_ylabel(f"trained share of {first}")
        row[0].set_title(f"{part}: the mix per step ({first})", fontsize=9)
        row[0].legend(fontsize=7)
        for mix, marker in (("quota", "o-"), ("admit", "s--")):
            xs = [r["ratio"] for r in rs if r["mix"] == mix]
            row[1].plot(xs, [r["step_s"] for r in rs if r["mix"] == mix], marker, label=f"{mix}: s/step")
        row[1].set_xlabel("async ratio"), row[1].set_ylabel("seconds per step")
        ax2 = row[1].twinx()
        for mix, marker in (("quota", "o:"), ("admit", "s:")):
            xs = [r["ratio"] for r in rs if r["mix"] == mix]
            err = [max(d["share_err_mean"] for d in r["domains"].values()) for r in rs if r["mix"] == mix]
            ax2.plot(xs, err, marker, color="tab:red", label=f"{mix}: share error")
        ax2.set_ylabel("mean share error (worst domain)", color="tab:red")
        row[1].legend(fontsize=7, loc="upper left"), ax2.legend(fontsize=7, loc="upper right")
        row[1].set_title(f"{part}: what the quota costs, what admission alone drifts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: list[dict], args, seconds: float):
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    cmd = "python -m tools.domains_study" + ("" if args.part == "all" else f" {args.part}")
    lines = ["# Several domains in one run: the mix under asynchrony", "",
             f"`{cmd}` ({seconds / 60:.0f} min here); ext/domains.py, --domain-mix quota | admit.", ""]
    if any(r["part"] == "sim" for r in results):
        run, _, _ = sim_configs(args.steps, args.batch_groups, args.chunk)
        lines += ["## Simulator, 128 GPUs", "",
                  f"{run.rollout_gpus} rollout + {run.train_gpus} trainer GPUs, {run.batch_groups} x "
                  f"{run.group_size} + {run.redundant} redundant prompts, {args.steps} steps (the first "
                  f"{run.warmup} left out); long: median 400 tokens, sigma 1, cap 8k; short: median 100, "
                  f"sigma 0.3, cap 1k; weights 0.5 each. Virtual time.", "",
                  *table(results, "sim"), "", *cost_lines(results, "sim"), ""]
    if any(r["part"] == "real" for r in results):
        lines += ["## Real CPU engines", "",
                  f"`torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1 --domains "
                  f"examples/domains.yaml --domain-mix MIX --async-ratio R --steps {args.real_steps} "
                  f"--no-filter-groups --seed 0`; steps 6-{args.real_steps} (arith 0.6, one turn; chain 0.4, "
                  f"three turns).", "",
                  *table(results, "real"), "", *cost_lines(results, "real"), ""]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(results, out.with_suffix(".png"))
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", default="all", choices=("all", "sim", "real"))
    ap.add_argument("--ratios", type=int, nargs="+", default=list(RATIOS))
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES, help="real: the policies")
    ap.add_argument("--sim-mixes", nargs="+", default=list(SIM_MIXES), choices=SIM_MIXES,
                    help="sim: the policies (quota/weight: the quota, its spare places by weight alone)")
    ap.add_argument("--steps", type=int, default=12, help="sim: steps per run")
    ap.add_argument("--batch-groups", type=int, default=256, help="sim: B")
    ap.add_argument("--chunk", type=int, default=128, help="sim: real tokens per fake-engine token")
    ap.add_argument("--real-steps", type=int, default=20, help="real: steps per run")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="real: one run's limit")
    ap.add_argument("--out", default=str(RESULTS / "domains"), help="writes OUT.json, OUT.md and OUT.png")
    args = ap.parse_args(argv)
    import ext
    ext.load()
    t = time.time()
    results = (run_sim(args) if args.part in ("all", "sim") else []) + \
        (run_real(args) if args.part in ("all", "real") else [])
    write(results, args, time.time() - t)


if __name__ == "__main__":
    sys.exit(main())
