"""tools/bench_rollout.py run for real with tiny settings: one rollout rank's code over the fake engine,
the trainer side in its own process, both stream intervals, the figures and the breakdown it prints."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_rollout_measures_each_stream_interval(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "tools.bench_rollout", "--stream-intervals", "1,4",
                        "--max-concurrency", "16", "--median-len", "20", "--min-len", "8", "--max-len", "40",
                        "--warmup-s", "1", "--seconds", "2", "--profile-s", "1", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = json.loads(out.read_text())["fake_engine"]
    assert [row["stream_interval"] for row in rows] == [1, 4]
    for row in rows:
        # samples flowed end to end: sent by the rank, drained by the trainer side, every token counted
        assert row["samples"] > 0 and row["samples_drained"] > 0
        assert row["tokens_drained"] >= 8 * row["samples_drained"]       # responses of 8 to 40 tokens
        assert row["tokens_per_s"] > 0 and row["rank_cpu_ms_per_1k_tokens"] > 0
        parts = row["breakdown_ms_per_1k_tokens"]
        assert {"proxy", "env manager, trajectories", "event loop (asyncio)"} <= set(parts)
    assert "stream interval" in r.stdout
