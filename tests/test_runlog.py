"""runlog.py, ext/trackers.py, ext/timeline.py and ext/quiet.py without engines: the tensorboard tracker
against metrics.jsonl, the
missing-package messages, ETA and summary, the events' size bounds, the rank-side recording in the
proxy, the controller forwarding the acks' events, and the log filter."""

import asyncio
import importlib.util
import itertools
import json
import logging

from types import SimpleNamespace

import pytest
import torch

import runlog
from buffer import Ack, LocalQueues, Phase, SampleBuffer
from config import Extensions, parse_cli
from ext import quiet
from conftest import run_virtual
from controller import AsyncController, ControllerConfig
from tools.fake_engine import FakeTimedEngine
from proxy import LLMProxy, Sampling
from runlog import RunLog
from task import Problem
from ext.timeline import EventLog, RankEvents
from train import Config

pytestmark = pytest.mark.fast


def make_log(tmp_path, *flags) -> RunLog:
    """Trainer rank 0's RunLog for train.py's flags, with the extensions they turn on (a tracker, the
    timeline, evaluation) started as in a run."""
    cfg = parse_cli(Config, ["--out-dir", str(tmp_path), *flags])
    exts = Extensions.start(cfg)
    exts.call("on_controller", SimpleNamespace(taps=[], events=None), None)
    return RunLog(cfg, exts)


def step_args(i: int, time_step: float = 2.0, probe=None) -> tuple:
    """What train.py hands RunLog.step for step i (the keys RunLog reads, plus a few others)."""
    info = {"time_wait_rollout": 0.5, "reward_mean": 0.1 * i, "reward_trained_mean": 0.1 * i + 0.05,
            "staleness_max": i % 3, "staleness_mean": (i % 3) / 2, "samples_dropped_stale": i,
            "groups_filtered": 2, "samples_failed": 0, "samples_surplus": 0, "num_samples": 16,
            "num_tokens": 160, "response_len_mean": 4.0}
    train = {"loss": -0.25 * i, "grad_norm": 1.5 + i, "clip_frac": 0.0}
    sync = {"time_weight_sync": 0.25, "time_wait_previous_sync": 0.01, "time_broadcast": 0.2,
            "synced_version": i - 1, "sync_probe_max_diff": probe, "rollout_utilisation": 0.75,
            "time_receive": 0.02, "time_engine_load": 0.07}
    return i, i, info, train, sync, 1.0, time_step


def test_tensorboard_scalars_match_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log = make_log(tmp_path, "--steps", "4", "--tracker", "tensorboard")
    for i in range(1, 5):
        log.step(*step_args(i, probe=1e-6 * i if i % 2 else None))    # None (not probed): left out
    log.finish()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    numeric = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    assert set(acc.Tags()["scalars"]) == numeric and "reward_mean" in numeric and "loss" in numeric
    for key in numeric:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        assert [s for s, _ in got] == [s for s, _ in want], key
        # float32 in the file
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), key
    assert [e.step for e in acc.Scalars("sync_probe_max_diff")] == [1, 3]


def test_a_fresh_run_replaces_old_tensorboard_files(tmp_path):
    for _ in range(2):
        log = make_log(tmp_path, "--steps", "1", "--tracker", "tensorboard")
        log.step(*step_args(1))
        log.finish()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1


@pytest.mark.parametrize("name", ["wandb", "trackio", "tensorboard"])
def test_a_missing_tracker_package_is_named_before_anything_starts(monkeypatch, capsys, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a, **k: None if n == name else real(n, *a, **k))
    with pytest.raises(SystemExit):
        parse_cli(Config, ["--tracker", name])
    err = capsys.readouterr().err
    assert f"--tracker {name} needs the optional package '{name}'" in err and f"pip install {name}" in err
    assert parse_cli(Config, ["--tracker", "none"]).ext["trackers"].tracker == "none"     # none needs nothing


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio_get_the_same_keys(monkeypatch, tmp_path, name):
    """With a stand-in module (the real packages are optional and not installed here): init with the
    project and config, one log call per step with the row's numeric keys, finish at the end."""
    import importlib.machinery
    import types
    calls = []
    fake = types.ModuleType(name)
    fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
    fake.init = lambda **kw: calls.append(("init", kw))
    fake.log = lambda metrics, **kw: calls.append(("log", metrics, kw))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(__import__("sys").modules, name, fake)
    (tmp_path / "myrun").mkdir()
    log = make_log(tmp_path / "myrun", "--steps", "2", "--tracker", name, "--tracker-project", "proj")
    for i in (1, 2):
        log.step(*step_args(i))
    log.finish()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "proj" and calls[0][1]["name"] == "myrun"
    assert calls[0][1]["config"]["ext"]["trackers"]["tracker"] == name and calls[-1] == ("finish",)
    rows = [json.loads(line) for line in (tmp_path / "myrun" / "metrics.jsonl").read_text().splitlines()]
    logged = [c[1] for c in calls if c[0] == "log"]
    assert logged == [{k: v for k, v in r.items() if v is not None} for r in rows]
    if name == "wandb":
        assert [c[2] for c in calls if c[0] == "log"] == [{"step": 1}, {"step": 2}]


def test_an_unknown_tracker_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        parse_cli(Config, ["--tracker", "mlflow"])
    assert "none, tensorboard, wandb, trackio" in capsys.readouterr().err


def test_progress_line_has_an_eta_and_the_summary_adds_up(tmp_path, capsys):
    log = make_log(tmp_path, "--steps", "5")
    log.t_start, log.t_ready = 1000.0, 1030.0                       # 30 s of start-up
    log.step(*step_args(1, time_step=2.0))
    assert capsys.readouterr().out.rstrip().endswith("| eta 8.0s")   # 2 s per step, 4 steps left
    log.step(*step_args(2, time_step=4.0))
    assert capsys.readouterr().out.rstrip().endswith("| eta 9.0s")   # mean of the last steps: 3 s, 3 left
    s = log.summary(t_end=1040.0)                                   # 10 s after start-up, 2 steps
    assert s.startswith("run done: 2 steps in 40.0s (start-up 30.0s, then 5.00s per step)")
    assert "0.100 (first 1 steps) -> 0.200 (last 1)" in s
    # of 10 s: wait 2 x 0.5, train 2 x 1.0, sync 2 x 0.25, the rest 6 s
    assert "wait for rollout 10% | train 20% | weight sync 5% | rest 65%" in s
    assert "3 dropped as stale, 4 groups filtered" in s
    assert f"python -m tools.plot {tmp_path}" in s and str(tmp_path / "events.jsonl") in s


def test_eval_metrics_are_summarised_when_present(tmp_path):
    log = make_log(tmp_path, "--steps", "3", "--eval-every", "1")
    for i in range(1, 4):
        args = step_args(i)
        args[2]["eval_accuracy"] = 0.5 + 0.1 * i if i != 2 else None
        log.step(*args)
    assert "eval_accuracy 0.600 (step 1) -> 0.800 (step 3)" in log.summary()


def test_a_long_run_keeps_a_bounded_record_and_the_same_summary(tmp_path, capsys):
    """RunLog keeps the first and last 10 rows and sums, not every row (a soak run's trainer grew by
    its rows): after 1000 steps the summary is what the whole list of rows gives."""
    log = make_log(tmp_path, "--steps", "1000")
    log.t_start, log.t_ready = 0.0, 10.0
    for i in range(1, 1001):
        args = step_args(i)
        args[2]["reward_mean"] = i / 1000
        log.step(*args)
    capsys.readouterr()
    assert len(log.first) == 10 and len(log.recent) == 10
    s = log.summary(t_end=2010.0)
    assert "0.005 (first 10 steps) -> 0.996 (last 10)" in s       # means of 1..10 and 991..1000, / 1000
    assert f"{sum(range(1, 1001))} dropped as stale, 2000 groups filtered" in s
    assert "wait for rollout 25% | train 50% | weight sync 12%" in s        # of 2000 s: 500, 1000, 250


def test_event_log_caps_request_events_not_steps(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", max_requests=3, fresh=True)
    log.extend([{"ev": "req", "rank": 0, "t": [1.0, 2.0], "v": [0, 0], "n": 1, "finish": "stop"}] * 5)
    log.add({"ev": "step", "version": 1, "collect": [0.123456789, 1.0]})
    log.extend([{"ev": "dropped", "rank": 1, "n": 7}])
    log.flush()
    log.extend([{"ev": "req", "rank": 0, "t": [3.0, 4.0], "v": [1, 1], "n": 1, "finish": "stop"}] * 2)
    log.flush()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["ev"] for e in lines] == ["req", "req", "req", "step", "dropped"]
    assert lines[3]["collect"] == [0.1235, 1.0]                       # times to 0.1 ms
    assert (log.requests_written, log.requests_not_written, log.requests_dropped_by_ranks) == (3, 4, 7)
    again = EventLog(tmp_path / "events.jsonl", max_requests=3, fresh=False)   # a resumed run appends
    again.add({"ev": "start", "t": 5.0})
    again.flush()
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 6
    EventLog(tmp_path / "events.jsonl", max_requests=3, fresh=True)            # a fresh one starts over
    assert not (tmp_path / "events.jsonl").exists()


def test_no_events_file_with_max_events_0(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"ev": "start", "t": 1.0}\n')     # an older run's
    log = make_log(tmp_path, "--steps", "1", "--max-events", "0")
    log.step(*step_args(1))
    log.finish()
    assert not any(getattr(e, "log", None) for e in log.exts) and not (tmp_path / "events.jsonl").exists()


def test_rank_events_keep_the_newest_and_count_the_rest():
    ev = RankEvents(rank=2, cap=3)
    for i in range(5):
        ev.phase("load", float(i), i + 0.5, version=i)
    out = ev.take()
    assert [e["version"] for e in out[:3]] == [2, 3, 4]
    assert out[3] == {"ev": "dropped", "rank": 2, "n": 2}
    assert ev.take() == []                                            # taken: the next ack starts empty


def test_proxy_records_requests_and_the_weight_update_phases():
    """A request spanning a weight update (keep mode) is recorded with its first and last token's
    versions; suspend, load and resume are recorded in order; nothing is recorded when off."""
    async def main():
        p = LLMProxy(FakeTimedEngine(t0=1.0, k=0.0, load_s=2.0), rank=1, timeout_s=30.0)
        assert p.take_events() is None
        await p.generate([1], Sampling(max_tokens=2, ignore_eos=True))             # not recorded: off
        p.events = RankEvents(rank=1)
        task = asyncio.create_task(p.generate([1], Sampling(max_tokens=6, ignore_eos=True)))
        await asyncio.sleep(3.5)
        await p.suspend("keep")
        await p.update_weights([("w", torch.zeros(2))], version=1)
        await p.resume()
        await task
        await p.generate([1], Sampling(max_tokens=2, ignore_eos=True))
        return p.take_events()
    events = run_virtual(main())
    reqs = [e for e in events if e["ev"] == "req"]
    assert [(e["rank"], e["v"], e["n"], e["finish"]) for e in reqs] == [(1, [0, 1], 6, "length"),
                                                                        (1, [1, 1], 2, "length")]
    assert [(e["name"], e["version"]) for e in events if e["ev"] == "phase"] == [("suspend", 0), ("load", 1),
                                                                                 ("resume", 1)]
    for e in events:
        assert e["t"][0] <= e["t"][1]


def test_controller_forwards_each_acks_events_once():
    async def main():
        cfg = ControllerConfig(batch_groups=1, group_size=2)
        c = AsyncController(cfg, SampleBuffer(LocalQueues(2), "test"),
                            (Problem("1+1=", "2") for _ in itertools.count()), num_rollout_ranks=2)
        got = []
        c.events = type("Sink", (), {"add": got.append, "extend": got.extend})()
        for r in (0, 1):
            await c.buffer.put_ack(Ack(r, Phase.READY, engine={"busy_s": 0.0, "idle_s": 1.0}))
        await c.wait_ready()
        await c.sync_weights(1, send_fn=lambda spec: None)
        for r in (0, 1):
            await c.buffer.put_ack(Ack(r, Phase.SYNCED, 1, engine={"busy_s": 0.5, "idle_s": 1.0},
                                       timings={"receive_s": 0.1, "load_s": 0.1},
                                       events=[{"ev": "req", "rank": r}]))
        await c.finish_sync()
        await c.finish_sync()                                         # nothing in flight: nothing again
        return got
    assert sorted(e["rank"] for e in asyncio.run(main())) == [0, 1]   # no collect ran: no step event either


def test_known_noise_is_dropped_and_repeats_are_shown_once():
    f = quiet.KnownNoise()

    def rec(msg, *args):
        return logging.LogRecord("vllm.x", logging.WARNING, "x.py", 1, msg, args, None)
    assert not f.filter(rec("%s: Failed to load weights", "RotaryEmbedding"))
    assert f.filter(rec("Failed to reset prefix cache because some blocks (%d) are not freed yet", 3))
    assert not f.filter(rec("Failed to reset prefix cache because some blocks (%d) are not freed yet", 5))
    assert f.filter(rec("KV cache is full: %d requests preempted", 2))          # another warning: shown
    assert f.repeats == 1


def test_quiet_setup_respects_the_user_and_verbose(monkeypatch):
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "HF_HUB_DISABLE_PROGRESS_BARS",
                 "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS", quiet.QUIET_MARK):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(quiet, "_filter_now", lambda: None)       # leave this process's logging alone
    monkeypatch.setattr(quiet.warnings, "filterwarnings", lambda *a, **k: None)
    quiet.quiet(verbose=True)
    assert "VLLM_LOGGING_LEVEL" not in quiet.os.environ
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")                  # the user's choice wins
    quiet.quiet(verbose=False)
    env = quiet.os.environ
    assert env["VLLM_LOGGING_LEVEL"] == "ERROR" and env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    config = json.load(open(env["VLLM_LOGGING_CONFIG_PATH"]))
    assert config["loggers"]["vllm"]["level"] == "ERROR"
    assert config["filters"]["known_noise"]["()"] == "ext.quiet.KnownNoise"


def test_fmt_s():
    assert [runlog.fmt_s(x) for x in (4.04, 65, 3725)] == ["4.0s", "1m05s", "1h02m"]
