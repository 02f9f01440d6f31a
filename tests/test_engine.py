"""The proxy over a real vLLM CPU engine with the tiny model: logprobs, abort, weight updates (both
transports: the group broadcast and the ipc hand-over, weight_ipc.py, over shared memory here).

Reference logprobs come from transformers on the same float32 weights; they agree within 1e-4."""

import asyncio
import dataclasses
import os

import pytest
import torch

from proxy import LLMProxy, Sampling
from trainer import token_logprobs
from ext.colocate import IpcSender
from tools.local import push
from weight_sync import Sender

pytestmark = pytest.mark.engine
TOL = 1e-4


def ref_logprobs(model, prompt, tokens) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids))
    return lp[0, len(prompt):].tolist()


def perturbed(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


SENDERS: dict[tuple, object] = {}    # one weight-sync group (or ipc sender) per engine, as a run has


async def update(proxy: LLMProxy, weights: dict, version: int, mode: str = "keep",
                 bucket_bytes: int = 64 << 20, transport: str = "group"):
    """This process as trainer rank 0: broadcast `weights` straight into the engine's worker, or (ipc)
    hand them over as shared-memory buckets."""
    # one sender per engine and transport, as a run has (a second group of the same generation to one
    # worker is no run's case: its worker drops the first); the bucket size is the send's, per call
    key = (id(proxy), transport)
    if key not in SENDERS:
        SENDERS[key] = (Sender(timeout_s=60) if transport == "group" else [IpcSender(timeout_s=60)])
    for s in SENDERS[key] if transport == "ipc" else [SENDERS[key]]:
        s.spec0 = dataclasses.replace(s.spec0, bucket_bytes=bucket_bytes)
    await proxy.suspend(mode)
    await push([proxy], SENDERS[key], weights.items(), version)
    await proxy.resume()


async def wait_for_tokens(proxy: LLMProxy, n: int, timeout: float = 60):
    """Wait (condition, not a guess) until the proxy has streamed at least n more tokens."""
    start = proxy.num_tokens
    async with asyncio.timeout(timeout):
        while proxy.num_tokens - start < n:
            await asyncio.sleep(0.001)


def test_tokenizer_round_trip(hf):
    _, tok = hf
    for text in ["12+345=", "guess: 7\nhigher"]:
        assert tok.decode(tok.encode(text)) == text


def test_generate_logprobs_match_transformers(vllm_proxy, hf):
    lt, proxy = vllm_proxy
    model, tok = hf
    prompts = [tok.encode(p) for p in ["12+34=", "7+5=", "305+99=", "1+1="]]
    async def main():
        return await asyncio.gather(*[proxy.generate(p, Sampling(max_tokens=24, ignore_eos=True))
                                      for p in prompts])
    cs = lt.run(main())
    for p, c in zip(prompts, cs):
        assert len(c.token_ids) == 24 and c.finish_reason == "length" and c.versions == [proxy.version] * 24
        diff = max(abs(a - b) for a, b in zip(c.logprobs, ref_logprobs(model, p, c.token_ids)))
        assert diff < TOL, diff


def test_sampling_temperature_logprobs_are_of_the_distribution_sampled(vllm_proxy, hf, tiny_model_dir):
    """--temperature 0.7 (the engine still holds the initial weights here): the engine reports each sampled
    token's log-prob under softmax(logits / 0.7), the distribution it drew from (vLLM's processed logprobs;
    its default, raw, reports T = 1's), and a Trainer at the same temperature computes the same in the
    forward the loss uses, within TOL. In the same batch, an evaluation's greedy and T = 1 requests come
    back with T = 1 log-probs (evaluation samples are never trained). The weight-sync probe compares at
    T = 1 on both sides (the engine scores it as prompt logprobs, which vLLM takes from the raw logits)."""
    from buffer import Sample
    from trainer import TrainConfig, Trainer, collate
    from buffer import PROBE_TEXT
    model, tok = hf
    lt, proxy = vllm_proxy
    prompts = [tok.encode(p) for p in ["12+34=", "7+5=", "305+99=", "1+1="]]
    temps = [0.7, 0.7, 0.0, 1.0]

    async def main():
        return await asyncio.gather(*[proxy.generate(p, Sampling(max_tokens=24, temperature=t,
                                                                 ignore_eos=True))
                                      for p, t in zip(prompts, temps)])
    cs = lt.run(main())
    for p, c, t in zip(prompts, cs, temps):       # the engine against transformers' logits (T: 1 for greedy)
        assert len(c.token_ids) == 24
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1]   # [24, V]
        want = (logits / (t or 1.0)).log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert max(abs(a - b) for a, b in zip(c.logprobs, want.tolist())) < TOL, t
        if t == 0.7:                                              # T = 1's would be far off
            assert max(abs(a - b) for a, b in zip(c.logprobs, ref_logprobs(model, p, c.token_ids))) > 0.05
    tr = Trainer(str(tiny_model_dir), TrainConfig(), temperature=0.7)
    for p, c in [(p, c) for p, c, t in zip(prompts, cs, temps) if t == 0.7]:
        with torch.no_grad():
            trained = tr.logprobs(collate([Sample("t", "g", p, c.token_ids, c.logprobs, [1] * 24, [0] * 24,
                                                  0.0)], "cpu"))[0, len(p):].tolist()
        assert max(abs(a - b) for a, b in zip(c.logprobs, trained)) < TOL
    probe = tok.encode(PROBE_TEXT)
    engine = lt.run(proxy.score(probe))
    assert max(abs(a - b) for a, b in zip(engine, tr.probe_logprobs(probe))) < TOL


def test_abort_returns_partial_output(vllm_proxy):
    lt, proxy = vllm_proxy

    async def main():
        task = asyncio.create_task(proxy.generate([5, 6, 17], Sampling(max_tokens=100, ignore_eos=True),
                                                  request_id="ab"))
        await wait_for_tokens(proxy, 3)
        await proxy.abort(["ab"])
        return await task
    c = lt.run(main())
    assert c.finish_reason == "abort" and 3 <= len(c.token_ids) < 100 and len(c.logprobs) == len(c.token_ids)


def test_weight_update_keep_mode_16_in_flight(vllm_proxy, hf):
    """16 requests keep running across suspend(keep) -> load -> resume and finish under the new weights."""
    lt, proxy = vllm_proxy
    model, tok = hf
    v0 = proxy.version
    prompt = tok.encode("12+34=")

    async def main():
        tasks = [asyncio.create_task(proxy.generate(prompt, Sampling(max_tokens=100, ignore_eos=True)))
                 for _ in range(16)]
        await wait_for_tokens(proxy, 32)
        await update(proxy, perturbed(model, seed=1), v0 + 1, mode="keep")
        done = await asyncio.gather(*tasks)
        await update(proxy, dict(model.named_parameters()), v0 + 2)   # restore for later tests
        return done
    for c in lt.run(main()):
        assert c.finish_reason == "length" and len(c.token_ids) == 100 and c.num_resubmits == 0
        assert c.versions == sorted(c.versions) and c.versions[0] == v0 and c.versions[-1] == v0 + 1
        assert min(c.versions) == v0


def test_weight_update_abort_mode_partial_rollout(vllm_proxy, hf):
    """suspend(abort): the proxy resubmits prompt + tokens so far; every token's logprob is exact
    under the weights of its version (the resubmitted prefill recomputes the cache with new weights)."""
    lt, proxy = vllm_proxy
    model, tok = hf
    v0 = proxy.version
    new = perturbed(model, seed=2)
    prompt = tok.encode("305+99=")

    async def main():
        tasks = [asyncio.create_task(proxy.generate(prompt, Sampling(max_tokens=100, ignore_eos=True)))
                 for _ in range(4)]
        await wait_for_tokens(proxy, 8)
        await update(proxy, new, v0 + 1, mode="abort")
        done = await asyncio.gather(*tasks)
        await update(proxy, dict(model.named_parameters()), v0 + 2)
        return done
    done = lt.run(main())
    new_model = type(model)(model.config).eval()
    new_model.load_state_dict(new, strict=False)
    new_model.tie_weights()
    for c in done:
        assert len(c.token_ids) == 100 and c.num_resubmits == 1 and c.finish_reason == "length"
        n_old = c.versions.count(v0)
        assert 0 < n_old < 100 and c.versions == [v0] * n_old + [v0 + 1] * (100 - n_old)
        ref_old = ref_logprobs(model, prompt, c.token_ids)
        ref_new = ref_logprobs(new_model, prompt, c.token_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs[:n_old], ref_old[:n_old])) < TOL
        assert max(abs(a - b) for a, b in zip(c.logprobs[n_old:], ref_new[n_old:])) < TOL


def test_probe_logprobs_follow_weight_updates(vllm_proxy, hf):
    lt, proxy = vllm_proxy
    model, tok = hf
    probe = tok.encode("123+456=579")
    new = perturbed(model, seed=3)
    new_model = type(model)(model.config).eval()
    new_model.load_state_dict(new, strict=False)
    new_model.tie_weights()
    v0 = proxy.version
    before = lt.run(proxy.score(probe))
    lt.run(update(proxy, new, v0 + 1))
    after = lt.run(proxy.score(probe))
    lt.run(update(proxy, dict(model.named_parameters()), v0 + 2))
    ref_old = ref_logprobs(model, probe[:1], probe[1:])
    ref_new = ref_logprobs(new_model, probe[:1], probe[1:])
    assert max(abs(a - b) for a, b in zip(before, ref_old)) < TOL
    assert max(abs(a - b) for a, b in zip(after, ref_new)) < TOL
    assert max(abs(a - b) for a, b in zip(ref_old, ref_new)) > 1e-2   # the update really changed them


def check_updates_land(lt, proxy, model, tok, tied: bool, transport: str = "group"):
    """Three updates in several buckets each (about 20 here: buckets of 256 KiB), over `transport`; after each
    the engine's logprobs of a probe are the reference model's under the same weights (parameters
    cannot be compared: on CPU vLLM prepacks linear layers, whose .weight then reads as zeros)."""
    from weight_sync import plan_buckets, weight_layout
    assert len(plan_buckets(weight_layout(model.named_parameters()), 1 << 18)) >= 8
    assert model.config.tie_word_embeddings == tied
    probe = tok.encode("123+456=579")
    v0 = proxy.version
    ref_model = type(model)(model.config).eval()
    for k in range(1, 4):
        new = perturbed(model, seed=10 + k, scale=0.1)
        if tied:
            # HF checkpoints of tied models carry no head: the engine re-ties it
            new.pop("lm_head.weight", None)
        lt.run(update(proxy, new, v0 + k, bucket_bytes=1 << 18, transport=transport))
        ref_model.load_state_dict(new, strict=False)
        if tied:
            ref_model.tie_weights()
        got, ref = lt.run(proxy.score(probe)), ref_logprobs(ref_model, probe[:1], probe[1:])
        assert max(abs(a - b) for a, b in zip(got, ref)) < TOL, k
        assert proxy.version == v0 + k
    lt.run(update(proxy, dict(model.named_parameters()), v0 + 4, transport=transport))   # restore


def test_several_updates_land_exactly_tied_embeddings(vllm_proxy, hf):
    lt, proxy = vllm_proxy
    check_updates_land(lt, proxy, *hf, tied=True)


def test_several_ipc_updates_land_exactly_tied_embeddings(vllm_proxy, hf):
    """The ipc transport: this process as trainer rank 0, the buckets in shared memory (the CPU twin of
    CUDA IPC), handed to the engine's worker through a TCPStore; the same loads as the broadcast's."""
    lt, proxy = vllm_proxy
    check_updates_land(lt, proxy, *hf, tied=True, transport="ipc")


@pytest.fixture(scope="module")
def untied(tiny_model_dir, tmp_path_factory):
    """(LoopThread, LLMProxy, model, tokenizer): the tiny model with its own lm_head (untied), in a dir
    where only the tokenizer names the EOS (no generation_config.json, none in config.json), on an
    engine of its own."""
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from conftest import LoopThread
    path = tmp_path_factory.mktemp("untied")
    tied = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = tied.config
    cfg.tie_word_embeddings = False
    cfg.eos_token_id = cfg.bos_token_id = None
    model = Qwen2ForCausalLM(cfg).eval()
    model.load_state_dict(tied.state_dict(), strict=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(tied.model.embed_tokens.weight + 0.01)   # a head of its own
    model.save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    tok.save_pretrained(path)
    lt = LoopThread()
    proxy = lt.run(LLMProxy.start_vllm(str(path), rank=0, timeout_s=120))
    ipc = proxy.engine.ipc_dir                    # the engine's IPC sockets live in a dir of its own ...
    assert ipc and os.listdir(ipc)
    yield lt, proxy, model, tok
    proxy.shutdown()
    lt.close()
    assert not os.path.exists(ipc)                # ... removed at shutdown (vLLM leaves them in /tmp)


def test_the_engine_stops_on_the_tokenizers_eos_without_a_tokenizer_of_its_own(untied):
    """The engine runs without a tokenizer (skip_tokenizer_init: the front end's per-request borrow of
    it cost 12.5% of the rollout rank), so the proxy names the tokenizer's EOS in every request. Here
    nothing else names it: without that, greedy answers run on past their <eos> to max_tokens."""
    lt, proxy, _, tok = untied
    assert proxy.engine.stop_token_ids == [tok.eos_token_id]
    for text in ("37+485=", "12+7=", "100+23="):
        c = lt.run(proxy.generate(tok.encode(text), Sampling(max_tokens=12, temperature=0)))
        assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id, (text, c.token_ids)
        assert tok.eos_token_id not in c.token_ids[:-1]
    # ignore_eos still runs to max_tokens, past every EOS
    c = lt.run(proxy.generate(tok.encode("37+485="), Sampling(max_tokens=12, temperature=0, ignore_eos=True)))
    assert c.finish_reason == "length" and len(c.token_ids) == 12 and tok.eos_token_id in c.token_ids


def test_several_updates_land_exactly_untied_embeddings(untied):
    """The tiny model with its own lm_head (untied): the head travels as a weight of its own."""
    lt, proxy, model, tok = untied
    check_updates_land(lt, proxy, model, tok, tied=False)
    check_updates_land(lt, proxy, model, tok, tied=False, transport="ipc")   # the same engine, ipc
