"""plot.py: pictures of a run, from its out_dir (metrics.jsonl and events.jsonl, format in timeline.py).

    python -m tools.plot runs/default                          # -> runs/default/metrics.png, timeline.png
    python -m tools.plot runs/r0 --compare runs/r2 --out-dir results/timeline   # + timeline_compare.png

metrics.png, one panel per question, per step: is it learning (reward, and any eval_* metric)?
where does a step's time go (waiting for rollout / training / weight sync / the rest)? how stale
are the samples it trains on (against the async ratio)?

domains.png, a run with --domains (ext/domains.py): a panel per domain, per step its trained share against
its weight, its reward, its held-out greedy reward; the title its staleness and seconds per trajectory.

timeline.png, the asynchronous pipeline in wall-clock time (seconds from the first step shown):
- "trainer": each step's collect (waiting for a batch), train, waiting for the previous sync's acks,
  and the weight broadcast;
- per rollout rank, "sync": the engine's suspend, load (the broadcast received into the engine,
  weight_sync.py) and resume (runs recorded before weight_sync.py also show "receive": the broadcast
  arriving at the rank while the engine generated); and "requests": every engine request from start to
  finish, one line each, stacked in lanes (the stack's height is the number in flight), coloured by the
  policy version of its tokens. A request whose tokens span a weight update (suspend mode "keep") changes
  colour at that rank's resume. Red shading: the engine is suspended.
The title gives the figures the README quotes: engine idle (no request in flight, or suspended) and
the trainer's time waiting for rollout, as fractions of the time shown. With --compare, both runs'
timelines share one time axis: how much sooner the same steps end is what asynchrony buys.

Simplifications: the timeline draws the last session of a resumed run; a run whose events.jsonl
was capped (--max-events) shows its first requests only (the title says how many are missing).
"""

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

from config import opt, parse_cli

TRAINER_PHASES = {"collect": "0.75", "train": "tab:blue", "wait_sync": "gold", "broadcast": "tab:red"}
RANK_PHASES = {"receive": "tab:purple", "suspend": "tab:pink", "load": "darkred", "resume": "tab:orange"}


@dataclass
class PlotConfig:
    run_dir: str = opt("", "a run's out_dir: metrics.jsonl and events.jsonl")
    out_dir: str = opt("", "where the PNGs go; empty = RUN_DIR")
    compare: str = opt("", "another run's out_dir: both timelines on one time axis in timeline_compare.png")
    from_step: int = opt(0, "timeline: start at this step (0 = the first)")
    to_step: int = opt(0, "timeline: end after this step (0 = the last)")

    def __post_init__(self):
        for d in filter(None, (self.run_dir, self.compare)):
            if not (Path(d) / "metrics.jsonl").exists():
                raise ValueError(f"{d}: no metrics.jsonl there; give a run's --out-dir")
        if self.from_step < 0 or self.to_step < 0:
            raise ValueError("--from-step and --to-step must be >= 0")


def read_jsonl(path: Path) -> list[dict]:
    return ([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.exists() else [])


def last_session(events: list[dict]) -> list[dict]:
    starts = [i for i, e in enumerate(events) if e["ev"] == "start"]
    return events[starts[-1]:] if starts else events


# ---------------------------------------------------------------------------------------------
# interval arithmetic (seconds)


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(spans, lo: float, hi: float) -> float:
    """Total length of (disjoint) spans inside [lo, hi]."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def subtract(spans, holes) -> list[tuple[float, float]]:
    """Disjoint spans minus disjoint holes."""
    out = []
    for a, b in spans:
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
        if a < b:
            out.append((a, b))
    return out


def lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane per span (in the given order, sorted by start), the lowest free one: no two spans of
    a lane overlap, so the number of lanes in use at time t is the number in flight."""
    free: list[int] = []                        # lanes whose last span has ended
    busy: list[tuple[float, int]] = []          # (end, lane) heap
    out, n = [], 0
    for a, b in spans:
        while busy and busy[0][0] <= a:
            heapq.heappush(free, heapq.heappop(busy)[1])
        lane = heapq.heappop(free) if free else n
        n = max(n, lane + 1)
        heapq.heappush(busy, (b, lane))
        out.append(lane)
    return out


# ---------------------------------------------------------------------------------------------
# the timeline


class Timeline:
    """One run's events, cut to the steps asked for; the figures the title reports."""

    def __init__(self, run_dir: str, from_step: int = 0, to_step: int = 0):
        self.run_dir = run_dir
        ev = last_session(read_jsonl(Path(run_dir) / "events.jsonl"))
        if not any(e["ev"] == "step" for e in ev):
            raise ValueError(f"{run_dir}: events.jsonl has no steps (a run with --max-events 0, or one that "
                             f"ended before its first step)")
        start = next((e for e in ev if e["ev"] == "start"), {})
        self.async_ratio = start.get("async_ratio")
        self.step0 = start.get("step", 0)                # steps done before this session (resume)
        steps = [e for e in ev if e["ev"] == "step"]
        v0 = steps[0]["version"] - 1                     # step k of the session trains version v0 + k
        lo, hi = from_step or self.step0 + 1, to_step or self.step0 + len(steps)
        self.steps = [s for s in steps if lo <= s["version"] - v0 + self.step0 <= hi]
        if not self.steps:
            raise ValueError(f"{run_dir}: no steps in {lo}..{hi}")
        self.t0 = self.steps[0]["collect"][0]
        self.t1 = self.steps[-1]["broadcast"][1]
        self.reqs = [e for e in ev if e["ev"] == "req" and e["t"][1] >= self.t0 and e["t"][0] <= self.t1]
        self.phases = [e for e in ev if e["ev"] == "phase" and e["name"] in RANK_PHASES
                       and e["t"][1] >= self.t0 and e["t"][0] <= self.t1]
        self.ranks = sorted({e["rank"] for e in self.reqs + self.phases})
        end = next((e for e in ev if e["ev"] == "end"), {})
        self.missing = end.get("requests_not_written", 0) + sum(e["n"] for e in ev if e["ev"] == "dropped")

    def suspended(self, rank: int) -> list[tuple[float, float]]:
        """[suspend start, resume end] of each of this rank's weight updates."""
        mine = [p for p in self.phases if p["rank"] == rank]
        sus = sorted(p["t"][0] for p in mine if p["name"] == "suspend")
        res = sorted(p["t"][1] for p in mine if p["name"] == "resume")
        return [(a, next((b for b in res if b >= a), a)) for a in sus]

    def stats(self) -> dict:
        """Fractions of [t0, t1]: each rank's engine idle (nothing in flight, or suspended), and the
        trainer's time in each of its phases."""
        span = self.t1 - self.t0
        idle = {}
        for r in self.ranks:
            busy = subtract(union([tuple(q["t"]) for q in self.reqs if q["rank"] == r]),
                            union(self.suspended(r)))
            idle[r] = 1.0 - length(busy, self.t0, self.t1) / span
        trainer = {k: sum(length([tuple(s[k])], self.t0, self.t1) for s in self.steps) / span
                   for k in TRAINER_PHASES}
        return {"seconds": span, "steps": len(self.steps), "s_per_step": span / len(self.steps),
                "engine_idle": idle, "trainer": trainer, "requests": len(self.reqs)}

    def title(self) -> str:
        st = self.stats()
        idle = ", ".join(f"{v:.0%}" for v in st["engine_idle"].values())
        return (f"{self.run_dir}: async ratio {self.async_ratio}, {st['steps']} steps in "
                f"{st['seconds']:.1f}s ({st['s_per_step']:.2f} s/step) | engine idle {idle} | "
                f"trainer waits for rollout "
                f"{st['trainer']['collect']:.0%}, trains {st['trainer']['train']:.0%}"
                + (f" | {self.missing} requests not recorded" if self.missing else ""))

    def draw(self, ax, norm, cmap):
        """Draw on `ax`, versions coloured by cmap(norm(version))."""
        from matplotlib.collections import LineCollection

        o = self.t0
        y, ticks, labels = 0.0, [], []
        # trainer row, on top; the version each step produces written on its train span
        for k, color in TRAINER_PHASES.items():
            ax.broken_barh([(s[k][0] - o, s[k][1] - s[k][0]) for s in self.steps], (y, 0.8), color=color)
        if len(self.steps) <= 40:
            for s in self.steps:
                ax.text((s["train"][0] + s["train"][1]) / 2 - o, y + 0.4, f"v{s['version']}", ha="center",
                        va="center", fontsize=7, color="white")
        ticks.append(y + 0.4), labels.append("trainer")
        y -= 1.2
        for r in self.ranks:
            mine = [p for p in self.phases if p["rank"] == r]
            for name, color in RANK_PHASES.items():
                ax.broken_barh([(p["t"][0] - o, p["t"][1] - p["t"][0]) for p in mine if p["name"] == name],
                               (y, 0.6), color=color)
            ticks.append(y + 0.3), labels.append(f"rank {r} sync")
            # requests, in lanes, a band of height 4 below the sync row
            reqs = sorted((q for q in self.reqs if q["rank"] == r), key=lambda q: q["t"][0])
            lane = lanes([tuple(q["t"]) for q in reqs])
            n = max(lane, default=0) + 1
            band_top, h = y - 0.3, 4.0
            # new weights from here
            switch = {p["version"]: p["t"][1] for p in mine if p["name"] == "resume"}
            segs, colors = [], []
            for q, ln in zip(reqs, lane):
                yy = band_top - (ln + 0.5) * h / n
                a, (v, v_last) = q["t"][0], q["v"]
                # a request that spans weight updates changes colour
                for nv in range(v + 1, v_last + 1):
                    t = switch.get(nv)
                    if t is not None and a < t < q["t"][1]:
                        segs.append([(a - o, yy), (t - o, yy)]), colors.append(cmap(norm(v)))
                        a, v = t, nv
                segs.append([(a - o, yy), (q["t"][1] - o, yy)]), colors.append(cmap(norm(v_last)))
            ax.add_collection(LineCollection(segs, colors=colors, linewidths=max(0.3, min(2.0, 60 / n))))
            ax.broken_barh([(a - o, b - a) for a, b in self.suspended(r)],
                           (band_top - h, h + 1.0),   # this rank's rows
                           color="tab:red", alpha=0.1, lw=0)
            ticks.append(band_top - h / 2), labels.append(f"rank {r} requests\n({n} lanes max)")
            y = band_top - h - 1.0
        ax.set_ylim(y + 0.6, 1.0)
        ax.set_yticks(ticks, labels)
        ax.set_xlabel("seconds")
        ax.set_title(self.title(), fontsize=9)


def plot_timeline(timelines: list[Timeline], path: Path) -> list[str]:
    """The timelines one above the other on one time axis (seconds from each one's first step)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    versions = [v for tl in timelines for q in tl.reqs for v in q["v"]] or [0]
    lo, hi = min(versions), max(versions)
    cmap = plt.get_cmap("viridis", hi - lo + 1)                       # one colour per version
    norm = plt.Normalize(lo - 0.5, hi + 0.5)
    rows = [2.2 + 1.6 * len(tl.ranks) for tl in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, sum(rows) + 1.2), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": rows})
    for tl, ax in zip(timelines, axes[:, 0]):
        tl.draw(ax, norm, cmap)
    axes[0, 0].set_xlim(0, max(tl.t1 - tl.t0 for tl in timelines))    # shared: the longest run, whole
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes[:, 0].tolist(), fraction=0.02,
                       pad=0.01, label="policy version of the tokens")
    bar.set_ticks(range(lo, hi + 1, max(1, (hi - lo + 1) // 10)))
    handles = [Patch(color=c, label=f"trainer: {k}") for k, c in TRAINER_PHASES.items()] + \
              [Patch(color=c, label=f"rank: {k}") for k, c in RANK_PHASES.items()] + \
              [Patch(color="tab:red", alpha=0.15, label="engine suspended")]
    fig.legend(handles=handles, loc="lower center", ncol=9, fontsize=8, frameon=False,
               bbox_to_anchor=(0.45, -0.03))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [ax.get_title() for ax in axes[:, 0]]


# ---------------------------------------------------------------------------------------------
# per-step metrics


def plot_metrics(rows: list[dict], path: Path, async_ratio: int | None) -> list[str]:
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in rows]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    reward = [r["reward_mean"] for r in rows]
    a1.plot(steps, reward, ".", color="tab:blue", alpha=0.5, label="reward (step's rollouts)")
    avg = [sum(reward[max(0, i - 9):i + 1]) / len(reward[max(0, i - 9):i + 1]) for i in range(len(reward))]
    a1.plot(steps, avg, "-", color="tab:blue", label="moving average, 10 steps")
    for key in sorted({k for r in rows for k in r if k.startswith("eval_")}):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        a1.plot(*zip(*pts), "o-", label=key)
    a1.set_title("reward per step")
    a1.legend(fontsize=8)
    parts = {"wait for rollout": [r["time_wait_rollout"] for r in rows],
             "train": [r["time_train"] for r in rows],
             "weight sync": [r["time_weight_sync"] for r in rows]}
    parts["rest"] = [max(0.0, r["time_step"] - sum(p[i] for p in parts.values())) for i, r in enumerate(rows)]
    bottom = [0.0] * len(rows)
    for (name, vals), color in zip(parts.items(), ("0.6", "tab:blue", "tab:red", "tab:green")):
        a2.bar(steps, vals, bottom=bottom, color=color, label=name, width=0.9)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_ylabel("seconds")
    a2.set_title("step time: wait / train / sync")
    a2.legend(fontsize=8)
    a3.plot(steps, [r["staleness_max"] for r in rows], drawstyle="steps-mid", label="max")
    a3.plot(steps, [r["staleness_mean"] for r in rows], label="mean")
    if async_ratio is not None:
        a3.axhline(async_ratio, ls="--", color="k", lw=0.8, label=f"async ratio {async_ratio}")
    a3.set_ylabel("versions behind")
    a3.set_title("staleness per step")
    a3.set_xlabel("step")
    a3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [a1.get_title(), a2.get_title(), a3.get_title()]


def domain_names(rows: list[dict]) -> list[str]:
    """The domains of a --domains run (ext/domains.py), in the file's order: its rows' domain/NAME/share
    keys."""
    first = rows[0] if rows else {}
    return [k.split("/")[1] for k in first if k.startswith("domain/") and k.endswith("/share")]


def plot_domains(rows: list[dict], path: Path) -> list[str]:
    """domains.png, a panel per domain of a --domains run: per step its trained share against its weight, its
    trained samples' reward and, with --eval-every, its held-out greedy reward."""
    import matplotlib.pyplot as plt
    names = domain_names(rows)
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.6 * len(names) + 0.6), sharex=True, squeeze=False)

    def series(key):
        return [float("nan") if r.get(key) is None else r[key] for r in rows]

    def mean(key):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else float("nan")
    for name, ax in zip(names, axes[:, 0]):
        k = f"domain/{name}/"
        ax.plot(steps, series(k + "share"), "-", color="tab:blue", label="trained share")
        ax.plot(steps, series(k + "weight"), ":", color="k", label="weight")
        ax.plot(steps, series(k + "reward_mean"), ".-", color="tab:green", alpha=0.6,
                label="reward (trained)")
        evals = [(r["step"], r[k + "eval_greedy"]) for r in rows if r.get(k + "eval_greedy") is not None]
        if evals:
            ax.plot(*zip(*evals), "o-", color="tab:red", label="held-out greedy")
        ax.set_title(f"{name}: weight {mean(k + 'weight'):.2f}, trained share {mean(k + 'share'):.3f}, "
                     f"staleness {mean(k + 'staleness_mean'):.2f}, {mean(k + 'time_mean'):.2f}s a trajectory",
                     fontsize=9)
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [ax.get_title() for ax in axes[:, 0]]


def plot_run(cfg: PlotConfig) -> dict[str, list[str]]:
    """Write the PNGs; returns {path: its panels' titles}."""
    import matplotlib
    matplotlib.use("Agg")
    out = Path(cfg.out_dir or cfg.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    start = next((e for e in read_jsonl(Path(cfg.run_dir) / "events.jsonl") if e["ev"] == "start"), {})
    written = {str(out / "metrics.png"): plot_metrics(rows, out / "metrics.png", start.get("async_ratio"))}
    if domain_names(rows):                                       # (a --domains run: a panel per domain)
        written[str(out / "domains.png")] = plot_domains(rows, out / "domains.png")
    if (Path(cfg.run_dir) / "events.jsonl").exists():
        tl = Timeline(cfg.run_dir, cfg.from_step, cfg.to_step)
        written[str(out / "timeline.png")] = plot_timeline([tl], out / "timeline.png")
        if cfg.compare:
            other = Timeline(cfg.compare, cfg.from_step, cfg.to_step)
            written[str(out / "timeline_compare.png")] = plot_timeline([tl, other],
                                                                       out / "timeline_compare.png")
    return written


def main():
    cfg = parse_cli(PlotConfig, doc=__doc__, positional=("run_dir",))
    for path, titles in plot_run(cfg).items():
        print(path)
        for t in titles:
            print(f"  {t}")


if __name__ == "__main__":
    main()
