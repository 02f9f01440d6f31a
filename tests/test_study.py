"""tools/study.py (the off-policy study), run for real with tiny settings: two short runs and a freshest-first
run, the files it writes, and the figures each run must carry. In this process as the command runs it
(tests/toolrun.py), on the session's engine (conftest's vllm_proxy, the same tiny model: the tool's own
engine start cost ~30 s), which it leaves on the tiny model's weights again."""

import asyncio
import json
import os
import threading

import pytest
import torch

from toolrun import run_tool

pytestmark = pytest.mark.engine


def restore_weights(lt, proxies, model_dir):
    """The session engine (and any other of `proxies`, a list or one) back on the tiny model's own weights,
    all at one version: the next after the highest of theirs (each user of vllm_proxy leaves its weights as it
    found them; its version counts on)."""
    from transformers import AutoModelForCausalLM

    from tools.local import push
    from weight_sync import Sender
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tied = model.config.tie_word_embeddings              # (a tied head is the embedding: not sent)
    named = [(n, t) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")]

    proxies = proxies if isinstance(proxies, list) else [proxies]

    async def main():
        version = max(p.version for p in proxies) + 1
        for p in proxies:
            await p.suspend("keep")
        await push(proxies, Sender(timeout_s=120), named, version)
        for p in proxies:
            await p.resume()
    lt.run(main())


def test_study_runs_and_writes_its_table_and_plot(tmp_path, vllm_proxy, tiny_model_dir, monkeypatch):
    from proxy import LLMProxy
    lt, shared = vllm_proxy
    real_shutdown, asked = LLMProxy.shutdown, []

    async def start_vllm(cls, model_dir, *args, **kwargs):
        asked.append(model_dir)
        return shared
    monkeypatch.setattr(LLMProxy, "start_vllm", classmethod(start_vllm))
    monkeypatch.setattr(LLMProxy, "shutdown", lambda self: None if self is shared else real_shutdown(self))
    monkeypatch.setattr(asyncio, "run", lambda main, **kw: lt.run(main, timeout=900))
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        run_tool("tools.study", [*"--losses decoupled_ppo --ratios 0,2 --seeds 0 --steps 3 --batch-groups 4 "
                                   "--group-size 4 --redundant 2 --eval-prompts 8 --eval-k 2".split(),
                                 "--out-dir", str(tmp_path), "--trace", str(tmp_path / "trace.json")])
    finally:       # the tool pins its event loop's thread (and the threads it starts) to core 0, torch to 1
        torch.set_num_threads(threads)
        for t in threading.enumerate():
            if t.native_id is not None:
                os.sched_setaffinity(t.native_id, cores)
        restore_weights(lt, shared, tiny_model_dir)
    assert asked == [str(tiny_model_dir)]
    data = json.loads((tmp_path / "study.json").read_text())
    runs = data["runs"]
    assert [(x["loss"], x["async_ratio"], x["sample_order"]) for x in runs] == [
        ("decoupled_ppo", 0, "oldest"), ("decoupled_ppo", 2, "oldest"), ("ppo", 2, "freshest")]
    for x in runs:
        assert x["samples"] == 3 * 4 * 4                        # the same number of samples in every run
        assert 0 <= x["eval_mean_at_k"] <= 1 and 0 <= x["eval_greedy"] <= 1
        assert x["staleness_max"] <= x["async_ratio"]
    assert runs[0]["staleness_max"] == 0 and 0 <= data["initial"] <= 1
    assert "| decoupled_ppo | 2 | oldest | 1 |" in (tmp_path / "study.md").read_text()
    assert (tmp_path / "study.png").stat().st_size > 10_000
    trace = json.loads((tmp_path / "trace.json").read_text())          # --trace: every run's steps
    assert [len(t["steps"]) for t in trace] == [3, 3, 3] and trace[1]["async_ratio"] == 2
    assert all(s["tasks_queued"] >= 0 and s["staleness_mean"] <= t["async_ratio"]
               for t in trace for s in t["steps"])
