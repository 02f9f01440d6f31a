"""LoRA (lora.py): settings refused before anything starts, the trainer trains the adapter only (one rank
and FSDP2 over two), the adapter checkpoint round trip, the merge command, and adapter-only weight
syncs into a real vLLM engine (logprobs equal to the trainer's base + adapter)."""

import asyncio
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from ext.lora import LoraConfig, check_lora, engine_kwargs, is_adapter_tensor, lora_weights, serve_adapter
from trainer import TrainConfig, Trainer, collate, token_logprobs
from test_trainer import _fsdp_worker, free_port, make_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADV = [1.0, -1.0, 1.0, -1.0]


TRAIN_KW = dict(loss="ppo", lr=1e-2, warmup_steps=0)       # adapters want a large step


def lora_trainer(model_dir, adapter_dir=""):
    return Trainer(str(model_dir), TrainConfig(**TRAIN_KW),
                   weights=lora_weights(LoraConfig(lora_rank=8), adapter_dir))


def seq_logprobs(model, samples) -> torch.Tensor:
    t = collate(samples, "cpu")
    model.eval()
    with torch.no_grad():
        return token_logprobs(model, t["input_ids"], t["attn"]) * t["mask"]


def kept_cache_logprobs(old, new, prompt: list[int], tokens: list[int], b: int) -> list[float]:
    """Logprobs of `tokens` after `prompt` when the KV cache of prompt + tokens[:b] is `old`'s and
    `new` computes the rest on top of it (a request kept across a weight update)."""
    ids = torch.tensor([prompt + tokens])
    p = len(prompt)
    with torch.no_grad():
        head = old(input_ids=ids[:, :p + b], use_cache=True)
        rest = new(input_ids=ids[:, p + b:], past_key_values=head.past_key_values, use_cache=True)
    logp = torch.cat([head.logits, rest.logits], 1)[0, :-1].float().log_softmax(-1)   # [T-1, V]
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[p - 1:].tolist()


@pytest.mark.parametrize("kw, flag", [
    (dict(lora_rank=-1), "--lora-rank"), (dict(lora_alpha=-2.0), "--lora-alpha"),
    (dict(lora_dropout=1.0), "--lora-dropout"), (dict(lora_rank=8, lora_targets=" , "), "--lora-targets")])
def test_bad_settings_name_their_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        LoraConfig(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(lora_targets="q_proj,qkv"), "--lora-targets: 'qkv' is no linear module"),
    (dict(lora_rank=100_000), "--lora-rank 100000 exceeds"),
])
def test_settings_the_model_cannot_take_are_refused_naming_the_flag(tiny_model_dir, kw, message):
    with pytest.raises(ValueError, match=message):
        check_lora(LoraConfig(**{"lora_rank": 8, **kw}), str(tiny_model_dir))
    check_lora(LoraConfig(lora_rank=8), str(tiny_model_dir))      # the defaults fit the tiny model


def test_only_the_adapter_trains_and_is_what_the_engines_get(tiny_model_dir):
    samples = make_samples(tiny_model_dir)
    tr = lora_trainer(tiny_model_dir)
    base = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    before = seq_logprobs(tr.model, samples).sum(1)
    tr.train_step(samples, ADV)
    after = seq_logprobs(tr.model, samples).sum(1)
    assert all(d * a > 0 for d, a in zip((after - before).tolist(), ADV))     # it learns, along the advantage
    for n, p in tr.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), n                                    # the base never moves
    named = tr.named_weights()
    assert named and all(is_adapter_tensor(n) and ".default." not in n for n, _ in named)
    assert {n for n, _ in named} == {n.replace(".default.", ".") for n, p in tr.model.named_parameters()
                                     if p.requires_grad}
    num_adapter = sum(t.numel() for _, t in named)
    state = tr.opt.state_dict()["state"]
    assert sum(s["exp_avg"].numel() for s in state.values()) == num_adapter    # optimizer state: adapter only


def test_fsdp2_two_ranks_train_the_same_adapter_as_one_process(tiny_model_dir, tmp_path):
    samples = make_samples(tiny_model_dir)
    single = lora_trainer(tiny_model_dir)
    single.train_step(samples, ADV)
    ref = dict(single.full_state())
    out = tmp_path / "fsdp.pt"
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(tiny_model_dir), samples, ADV, str(out), TRAIN_KW, 8),
             nprocs=2)
    got = torch.load(out)
    assert set(got) == set(ref) and all(is_adapter_tensor(n) for n in got)
    # Adam's first step divides by |g| + 1e-8: gradients equal to ~1e-7 (float32 reduction order) leave up to
    # ~5e-5 between the weights where |g| ~ 1e-8 (PEFT's own init gave 2e-5 and 4.9e-5 at seeds 1 and 3)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-4
    assert max(ref[k].abs().max().item() for k in ref if ".lora_B." in k) > 0     # it did train


def test_adapter_checkpoint_round_trip_and_merge(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    samples = make_samples(tiny_model_dir)
    tr = lora_trainer(tiny_model_dir)
    tr.train_step(samples, ADV)
    want = seq_logprobs(tr.model, samples)
    tr.save_checkpoint(str(tmp_path), {"step": 1, "version": 1, "data_position": 4}, str(tiny_model_dir))
    ck = tmp_path / "checkpoint"
    assert (ck / "adapter_model.safetensors").exists() and not (ck / "model.safetensors").exists()
    # PEFT loads it on the base
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                                dtype=torch.float32), ck)
    assert (seq_logprobs(peft_model, samples) - want).abs().max().item() < 1e-5
    # a resumed trainer: the same adapter and optimizer state
    tr2 = lora_trainer(tiny_model_dir, adapter_dir=str(ck))
    tr2.load_optimizer(ck)
    assert (seq_logprobs(tr2.model, samples) - want).abs().max().item() < 1e-6
    moments = [t.opt.state_dict()["state"][0]["exp_avg"] for t in (tr, tr2)]
    assert torch.equal(*moments)
    # the merge command: a full HF model dir with the same logprobs
    merged = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "ext.lora", "merge", str(tiny_model_dir), str(ck), str(merged)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    # (W + BA)x against Wx + B(Ax): the same to float32 rounding
    assert (seq_logprobs(full, samples) - want).abs().max().item() < 1e-4
    bad = subprocess.run([sys.executable, "-m", "ext.lora", "merge", str(tiny_model_dir), str(tmp_path),
                          str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no adapter_config.json" in bad.stderr


@pytest.mark.engine
def test_adapter_only_sync_reaches_the_engine_and_kept_requests_switch_to_it(tiny_model_dir):
    """A real vLLM engine with LoRA on: the base model's logprobs before any sync; after an adapter-only
    sync, the trainer's base + adapter logprobs (and not the base's); a second sync, in keep mode under
    4 running requests, replaces the first, and those requests go on with the new adapter."""
    import copy

    from proxy import LLMProxy, Sampling
    from test_engine import ref_logprobs, wait_for_tokens
    from tools.local import push
    from weight_sync import Sender
    from buffer import PROBE_TEXT
    from transformers import AutoTokenizer

    probe = AutoTokenizer.from_pretrained(tiny_model_dir).encode(PROBE_TEXT)
    samples = make_samples(tiny_model_dir)
    tr = lora_trainer(tiny_model_dir)
    base = tr.probe_logprobs(probe)

    async def main():
        cfg = LoraConfig(lora_rank=8)
        proxy = await LLMProxy.start_vllm(str(tiny_model_dir), max_num_seqs=4, max_model_len=64,
                                          **engine_kwargs(cfg),
                                          on_engine=lambda e: serve_adapter(e, cfg, str(tiny_model_dir)))
        sender = Sender()

        async def sync(version):
            await proxy.suspend("keep")
            await push([proxy], sender, tr.named_weights(), version)
            await proxy.resume()
        try:
            first = await proxy.engine.score(probe)
            tr.train_step(samples, ADV)
            await sync(1)
            one = (await proxy.engine.score(probe), tr.probe_logprobs(probe))
            old = copy.deepcopy(tr.model)
            running = [asyncio.create_task(proxy.generate(probe, Sampling(max_tokens=40, ignore_eos=True)))
                       for _ in range(4)]
            await wait_for_tokens(proxy, 16)
            tr.train_step(samples, ADV)
            await sync(2)
            done = await asyncio.gather(*running)
            return first, one, (await proxy.engine.score(probe), tr.probe_logprobs(probe)), old, done
        finally:
            proxy.shutdown()

    def gap(xs, ys):
        return max(abs(x - y) for x, y in zip(xs, ys))

    first, (after1, want1), (after2, want2), old, done = asyncio.run(main())
    assert gap(first, base) < 1e-4
    assert gap(after1, want1) < 1e-4 < gap(want1, base)        # the adapter, and it changed the model
    assert gap(after2, want2) < 1e-4 < gap(want2, want1)       # the second replaced the first
    for c in done:                                             # kept across the sync, not resubmitted
        n_old = c.versions.count(1)
        assert c.num_resubmits == 0 and 0 < n_old < 40 and c.versions == [1] * n_old + [2] * (40 - n_old)
        # after the switch: the new adapter over the KV cache kept from before it (computed under the old
        # one), which is what keep mode means; the boundary found within a token or two of the versions'
        old_ref = ref_logprobs(old, probe, c.token_ids)
        tail = slice(n_old + 3, None)
        best = min(gap(c.logprobs[tail], kept_cache_logprobs(old, tr.model, probe, c.token_ids, b)[tail])
                   for b in range(max(0, n_old - 3), n_old + 2))
        assert best < 1e-3 < gap(c.logprobs[tail], old_ref[tail]), best
        assert gap(c.logprobs[:n_old], old_ref[:n_old]) < 1e-4      # before it: exactly the old adapter
