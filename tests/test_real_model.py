"""A model dir that looks like a real one (byte-level BPE, ChatML template, 1024-token context:
conftest.chat_model) through the whole system with 300+ token prompts (torchrun on the plain-torch engine,
--engine torch: the run's subject is the model dir and the data, not vLLM), then through a real vLLM engine
(the run's checkpoint: it loads, it scores as transformers does, its prefix cache follows weight updates)."""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import LoopThread

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent


def hf_logprobs(model, ids: list[int]) -> list[float]:
    from trainer import token_logprobs
    t = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model, t, torch.ones_like(t))[0, 1:].tolist()


@pytest.fixture(scope="module")
def trained(chat_model, tmp_path_factory) -> dict:
    """torchrun, one trainer and one rollout rank (--engine torch), --model DIR --data FILE, 3 steps:
    {"out", "stdout"}."""
    from tools.jobs import free_port_pair
    out = tmp_path_factory.mktemp("real-model") / "run"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()),
           "train.py", "--rollout-gpus", "1", "--train-gpus", "1", "--engine", "torch",
           "--model", str(chat_model["dir"]), "--data", str(chat_model["data"]), "--steps", "3",
           "--max-tokens", "16",
           "--batch-groups", "2", "--group-size", "4", "--redundant", "0", "--no-filter-groups",
           "--max-concurrency", "16", "--check-sync-every", "1", "--timeout-s", "300", "--save-every", "0",
           "--out-dir", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return {"out": out, "stdout": r.stdout}


@pytest.fixture(scope="module")
def checkpoint_engine(trained):
    """(LoopThread, LLMProxy, ids, logprobs): a real vLLM engine started from the run's checkpoint (the
    trained weights as a model dir, its 1024-token context), and its prompt logprobs of 40 random ids,
    scored at once, before any test updates its weights."""
    from proxy import LLMProxy
    ids = [int(i) for i in torch.randint(3, 500, (40,))]
    lt = LoopThread()
    proxy = lt.run(LLMProxy.start_vllm(str(trained["out"] / "checkpoint"), rank=0, timeout_s=120,
                                       max_model_len=1024))
    try:
        scored = lt.run(proxy.score(ids), timeout=120)
        yield lt, proxy, ids, scored
    finally:
        proxy.shutdown()
        lt.close()


def test_the_whole_system_on_a_real_looking_model_and_long_prompts(trained, checkpoint_engine):
    """torchrun, one trainer and one rollout rank, --model DIR --data FILE: steps complete, no sample
    fails, every prompt is 300+ tokens, engine and trainer agree after every sync, and the trained
    weights load in transformers and in vLLM (their logprobs agree)."""
    from transformers import AutoModelForCausalLM
    out, stdout = trained["out"], trained["stdout"]
    assert "context 1024" in stdout and "up to 16 tokens" in stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]
    for x in rows:
        assert x["samples_failed"] == 0 and x["num_samples"] == 8 and x["prompts_rejected"] == 0
        assert x["num_tokens"] / x["num_samples"] >= 300
        assert x["sync_probe_max_diff"] is not None and x["sync_probe_max_diff"] < 1e-4
    stats = json.loads((out / "rollout_stats.json").read_text())
    assert stats["rollout_ranks"][0]["samples_failed"] == 0
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint", dtype=torch.float32).eval()
    _, _, ids, engine = checkpoint_engine
    assert max(abs(a - b) for a, b in zip(engine, hf_logprobs(model, ids))) < 1e-4


def test_prefix_cache_never_serves_old_weights_after_an_update(chat_model, checkpoint_engine):
    """Keep mode: a long request holds cache blocks across the update, so vLLM refuses to reset its
    prefix cache. A prompt several blocks long, cached under the old weights (the engine of the run's
    checkpoint, shared with the test above), is asked again after the update: its logprobs must be the
    new weights' (the cache is salted by policy version)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout import PromptFormat
    from proxy import Sampling
    from tools.local import push
    from weight_sync import Sender
    tok = AutoTokenizer.from_pretrained(chat_model["dir"])
    rows = [json.loads(x) for x in chat_model["data"].read_text().splitlines()]
    prompt, other = (PromptFormat(tok).first(r["question"]) for r in rows[:2])
    assert len(prompt) >= 300                                   # several cache blocks
    model = AutoModelForCausalLM.from_pretrained(chat_model["dir"], dtype=torch.float32).eval()
    torch.manual_seed(1)
    new = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in model.named_parameters()]
    lt, proxy, _, _ = checkpoint_engine
    v0 = proxy.version

    async def main():
        before = await proxy.generate(prompt, Sampling(max_tokens=4))        # caches the prompt's blocks
        tokens = proxy.num_tokens
        # a request that needs hundreds of decode steps; suspend as soon as its first token is out
        hold = asyncio.ensure_future(proxy.generate(other, Sampling(max_tokens=1024 - len(other) - 8,
                                                                    ignore_eos=True)))
        while proxy.num_tokens == tokens:
            assert not hold.done(), hold
            await asyncio.sleep(0.005)
        await proxy.suspend("keep")
        await push([proxy], Sender(timeout_s=60), new, v0 + 1)     # this process as trainer rank 0
        await proxy.resume()
        after = await proxy.generate(prompt, Sampling(max_tokens=4))
        held = await hold
        return before, after, held
    before, after, held = lt.run(main(), timeout=300)
    assert held.versions[0] == v0 and held.versions[-1] == v0 + 1  # the held request spanned the update
    model.load_state_dict(dict(new), strict=False)
    ref = hf_logprobs(model, prompt + after.token_ids)[len(prompt) - 1:]
    assert max(abs(a - b) for a, b in zip(after.logprobs, ref)) < 1e-4
