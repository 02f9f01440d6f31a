"""tools/plot.py on a recorded run (no engines): the PNGs, their panels, the timeline's figures.

tests/data/run_small is the metrics.jsonl and events.jsonl of a real run (checkpoint removed):
    torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1 --steps 6 --batch-groups 4 \\
        --group-size 4 --redundant 2 --max-concurrency 16 --out-dir tests/data/run_small
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import plot
from tools.plot import PlotConfig, Timeline, lanes, length, subtract, union

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "data" / "run_small"
PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_the_pngs_with_their_panels(tmp_path):
    written = plot.plot_run(PlotConfig(run_dir=str(RUN), out_dir=str(tmp_path), compare=str(RUN)))
    assert set(written) == {str(tmp_path / n)
                            for n in ("metrics.png", "timeline.png", "timeline_compare.png")}
    for path in written:
        data = Path(path).read_bytes()
        assert data.startswith(PNG) and len(data) > 20_000, path        # a real picture, not an empty canvas
    assert written[str(tmp_path / "metrics.png")] == ["reward per step", "step time: wait / train / sync",
                                                      "staleness per step"]
    (title,) = written[str(tmp_path / "timeline.png")]
    assert ("async ratio 2, 6 steps" in title and "engine idle" in title
            and "trainer waits for rollout" in title)
    assert len(written[str(tmp_path / "timeline_compare.png")]) == 2


def test_the_command_line_takes_the_run_dir(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.plot", str(RUN), "--out-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "metrics.png").exists() and (tmp_path / "timeline.png").exists()
    r = subprocess.run([sys.executable, "-m", "tools.plot", str(tmp_path / "nothing")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no metrics.jsonl" in r.stderr


def test_timeline_reads_every_kind_of_event():
    tl = Timeline(str(RUN))
    assert len(tl.steps) == 6 and tl.ranks == [0] and tl.async_ratio == 2 and tl.missing == 0
    assert {p["name"] for p in tl.phases} == {"receive", "suspend", "load", "resume"}
    assert len(tl.reqs) > 6 * 16                      # 16 samples per step, and filtered groups' too
    for q in tl.reqs:
        assert q["t"][0] <= q["t"][1] and 0 <= q["v"][0] <= q["v"][1] <= 6
    for s in tl.steps:                                # the trainer's spans follow each other
        assert s["collect"][0] <= s["collect"][1] <= s["train"][1] <= s["wait_sync"][1] <= s["broadcast"][1]
    st = tl.stats()
    assert 0.0 < st["engine_idle"][0] < 1.0 and st["trainer"]["train"] > 0.0
    # the trainer's row covers the time shown
    assert sum(st["trainer"].values()) == pytest.approx(1.0, abs=0.05)
    assert len(Timeline(str(RUN), from_step=3, to_step=4).steps) == 2


def test_the_timeline_draws_the_last_session_of_a_resumed_run(tmp_path):
    events = (RUN / "events.jsonl").read_text().splitlines()
    later = [json.loads(e) for e in events]
    shift = later[-1]["t"] + 100 - later[0]["t"]      # the same run again, 100 s after the first ended

    def moved(e):
        e = dict(e)
        for k in ("t", "collect", "train", "wait_sync", "broadcast"):
            if k in e:
                e[k] = [x + shift for x in e[k]] if isinstance(e[k], list) else e[k] + shift
        return e
    second = [moved(e) for e in later]
    second[0]["step"] = 6
    for e in second:
        if e["ev"] == "step":
            e["version"] += 6
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in later + second))
    (tmp_path / "metrics.jsonl").write_text((RUN / "metrics.jsonl").read_text())
    tl = Timeline(str(tmp_path))
    assert len(tl.steps) == 6 and tl.steps[0]["version"] == 7 and tl.step0 == 6
    assert tl.t0 > later[-1]["t"]


def test_interval_helpers():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert length([(0, 2), (3, 5)], 1, 4) == 2
    spans = [(0, 5), (1, 2), (2, 3), (2.5, 6), (5, 7)]
    ln = lanes(spans)
    assert ln == [0, 1, 1, 2, 0]                      # a lane is reused once its last span ended
    for lane in set(ln):                              # no two spans of a lane overlap
        mine = sorted(s for s, l in zip(spans, ln) if l == lane)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:]))
