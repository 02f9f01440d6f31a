"""The cited tools that start vLLM engines in their own process (bench, bench_proxy, bench_rollout --real,
sim_vs_real), each run as its command runs (tests/toolrun.py) at tiny settings, on two real engines: the
session's (conftest's vllm_proxy, the same tiny model) and one more started once for this module: an engine
costs ~35 s to start here, these tools would start six.

LLMProxy.start_vllm hands a tool engine `rank` of the two (its keywords still checked against what an
engine takes), a tool's shutdown leaves them running, and asyncio.run runs on their event loop, the
session engine's loop thread (an engine serves the loop it started on). The weights a tool leaves in the
engines are the next one's start; each tool's weight sync forms a group of its own (a new Sender), which the
engines' workers join. Both start on the tiny model's weights at one version, and the session's engine
gets them back at the end."""

import asyncio
import contextlib
import dataclasses
import inspect
import io
import json
import sys

import pytest

from test_study import restore_weights
from toolrun import finite, last_json, run_tool

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engines(vllm_proxy, tiny_model_dir):
    """(the session engine's LoopThread, [its LLMProxy: engine 0, that of engine 1 on core 1]), both with
    bench.py's batch size (64)."""
    from proxy import LLMProxy, Sampling
    lt, first = vllm_proxy
    second = lt.run(LLMProxy.start_vllm(str(tiny_model_dir), rank=1, cpu_cores="1", max_num_seqs=64,
                                        timeout_s=120), timeout=400)
    try:
        lt.run(second.generate([5, 6, 7], Sampling(max_tokens=2)))      # warm
        # both on the tiny model's weights at one version, as two fresh engines (the session's has served
        # other tests: its version counts on; bench's controller starts at engine 0's)
        restore_weights(lt, [first, second], tiny_model_dir)
        yield lt, [first, second]
    finally:
        second.shutdown()
        restore_weights(lt, first, tiny_model_dir)        # (the tools trained the session engine's weights)


def engine_keywords() -> set[str]:
    """What LLMProxy.start_vllm's **engine_kwargs may name: VLLMEngine.start's own parameters, or vLLM's
    AsyncEngineArgs' fields (it passes the rest on)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_engine import VLLMEngine
    own = [n for n, p in inspect.signature(VLLMEngine.start).parameters.items()
           if p.kind is not p.VAR_KEYWORD and n != "model_dir"]
    return {*own, *(f.name for f in dataclasses.fields(AsyncEngineArgs))}


@pytest.fixture
def shared(engines, monkeypatch):
    """The module's engines behind LLMProxy.start_vllm; returns the list of (rank, keywords) asked for."""
    from proxy import LLMProxy
    lt, proxies = engines
    real_start, real_shutdown, allowed, asked = LLMProxy.start_vllm, LLMProxy.shutdown, engine_keywords(), []

    async def start_vllm(cls, model_dir: str, *args, **kwargs):
        bound = inspect.signature(real_start).bind(model_dir, *args, **kwargs)   # (a TypeError: a stale call)
        rank, engine_kwargs = bound.arguments.get("rank", 0), bound.arguments.get("engine_kwargs", {})
        unknown = set(engine_kwargs) - allowed
        assert not unknown, f"start_vllm({', '.join(sorted(unknown))}=...): no engine takes these"
        asked.append((rank, engine_kwargs))
        return proxies[rank]

    monkeypatch.setattr(LLMProxy, "start_vllm", classmethod(start_vllm))
    monkeypatch.setattr(LLMProxy, "shutdown", lambda self: None if self in proxies else real_shutdown(self))
    monkeypatch.setattr(asyncio, "run", lambda main, **kw: lt.run(main, timeout=600))
    yield asked
    from proxy import Status
    for p in proxies:               # the tool left them running, nothing in flight
        assert (p.status, p.num_in_flight) == (Status.RUNNING, 0)


def test_bench_runs_every_configuration_on_real_engines(shared):
    out = run_tool("tools.bench", ["--steps", "1", "--batch-groups", "2", "--group-size", "4",
                                   "--max-concurrency", "8"])
    res = last_json(out)
    assert [rank for rank, _ in shared] == [0, 1]
    assert set(res["configs"]) == {"sync", "async1", "async2", "batch_rollout", "queue_rollout",
                                   "no_replication"}
    for name, c in res["configs"].items():        # (async1, async2: ratio 1, 2; the others: 0)
        assert finite(c["s_per_step"]) and c["s_per_step"] > 0, name
        assert 0 <= c["staleness_max"] <= (int(name[-1]) if name.startswith("async") else 0), name
    assert set(res["speedup"]) == {"async1_vs_sync", "async2_vs_sync", "queue_vs_batch_rollout",
                                   "replication_on_vs_off"}
    assert all(finite(v) and v > 0 for v in res["speedup"].values())


def test_bench_proxy_throughput_and_weight_update(shared):
    out = run_tool("tools.bench_proxy", ["--num-requests", "8", "--max-tokens", "4", "--rounds", "2",
                                         "--updates", "2"])
    res = last_json(out)
    assert [rank for rank, _ in shared] == [0]
    assert len(res["raw_tokens_per_s"]) == len(res["proxy_tokens_per_s"]) == 2
    assert all(x > 0 for x in res["raw_tokens_per_s"] + res["proxy_tokens_per_s"])
    assert finite(res["proxy_over_raw"], res["weight_mb"]) and res["weight_mb"] > 0
    assert set(res["weight_update_ms"]) == {"suspend_ms", "load_ms", "resume_ms", "total_ms"}
    assert all(finite(v) and v >= 0 for v in res["weight_update_ms"].values())


def test_bench_rollout_real_raw_and_through_the_proxy(shared, tmp_path):
    path = tmp_path / "rollout.json"
    run_tool("tools.bench_rollout", [
        "--real", "--stream-intervals", "4", "--max-concurrency", "8", "--median-len", "8", "--min-len", "4",
        "--max-len", "16", "--warmup-s", "0.5", "--seconds", "1", "--profile-s", "0.5",
        "--real-requests", "4", "--real-tokens", "8", "--real-rounds", "1", "--out", str(path)])
    res = json.loads(path.read_text())
    assert [row["stream_interval"] for row in res["fake_engine"]] == [4]
    assert set(res["real_engine"]) == {"raw AsyncLLM, final-only outputs", "raw AsyncLLM, per-token deltas",
                                       "LLMProxy, stream interval 4"}
    for name, v in res["real_engine"].items():
        assert finite(v["tokens_per_s"], v["cpu_ms_per_1k_tokens"]) and v["tokens_per_s"] > 0, name


def test_sim_vs_real_calibrates_and_compares(shared, monkeypatch):
    from tools import sim_vs_real
    # the calibration's sweep, small: 1 and 2 requests in flight, one request each, two prompt lengths
    monkeypatch.setattr(sim_vs_real, "N_SWEEP", (1, 2))
    monkeypatch.setattr(sim_vs_real, "CAL_REQUESTS", 1)
    monkeypatch.setattr(sys, "argv", ["sim_vs_real", "--steps", "1", "--batch-groups", "2",
                                      "--group-size", "4", "--median-len", "4", "--train-s", "0.05"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        sim_vs_real.main()
    res = last_json(out.getvalue())
    assert [rank for rank, _ in shared] == [0, 1]
    [consts] = res["constants"]
    assert finite(consts["t0"], consts["k"], consts["k_ctx"], consts["load_s"]) and consts["t0"] >= 0
    assert set(res["summary"]) == {"alpha0", "alpha2"}
    for alpha, s in res["summary"].items():
        figures = (s["real_s_per_step"] + s["sim_s_per_step"] + s["sim_over_real_s"] + s["real_utilisation"]
                   + s["sim_utilisation"])
        assert len(figures) == 5 and all(finite(x) and x > 0 for x in figures), alpha
