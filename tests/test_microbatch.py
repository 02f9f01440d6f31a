"""microbatch.py: chunked log-probs and entropy equal to the unchunked ones (values and gradients, plain and
PEFT models), their memory at Qwen's vocabulary, and token-budget packing."""

import random

import pytest
import torch

from model import PolicyNet, pack_by_tokens, token_logprobs
from tools.bench_trainer import padded_share


def full_logprobs(model, ids, attn):
    """The unchunked reference (trainer.token_logprobs as it was): [B, T, V] logits, their log_softmax, the
    taken tokens' entries; and every position's entropy [B, T-1]."""
    logits = model(input_ids=ids, attention_mask=attn).logits               # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)                        # [B, T-1, V]
    taken = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)                   # [B, T-1]
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.cat([torch.zeros_like(taken[:, :1]), taken * attn[:, 1:]], dim=1), entropy.detach()


def batch(seed=0):
    """3 right-padded rows (lengths 12, 7, 10) and a response mask that skips some tokens (an env's)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 60, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    attn[2, 10:] = 0
    ids = ids * attn
    mask = torch.zeros(3, 12)
    mask[0, 4:12] = 1
    mask[1, 3:7] = 1
    mask[2, 5:10] = 1
    mask[2, 7] = 0
    return ids, attn, mask


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def built_models(tiny_model_dir):
    """The tiny model, and the same under a LoRA adapter whose B is non-zero (so the adapter matters): loaded
    and wrapped once for the module (models hands each test copies)."""
    from transformers import AutoModelForCausalLM

    from ext import lora
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                     lora.LoraConfig(lora_rank=4))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return {"plain": plain, "lora": peft}


@pytest.fixture
def models(built_models):
    """built_models' two, copied for this test (a test casts them, trains them, leaves gradients on them)."""
    import copy
    return {kind: copy.deepcopy(m) for kind, m in built_models.items()}


@pytest.mark.parametrize("kind", ["plain", "lora"])
@pytest.mark.parametrize("chunk", [1, 5, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_logprobs_and_gradients_equal_the_unchunked(models, kind, chunk, dtype):
    """At the mask's positions: the same logprobs, the same entropy, the same gradient of any loss on them;
    0 elsewhere. chunk 1 and 5 split the 17 selected positions across chunks. float32: within 1e-6 relative
    (logprobs near -8 are 1e-6 apart at 1 ulp), gradients within 1e-4 of their largest entry: a [5, H] x
    [H, V] product rounds unlike a [36, H] x [H, V] one, and weight gradients sum the chunks in another order
    (seen up to 1.1e-5 of it, run to run, under the LoRA model). float64: the same function, to 1e-12."""
    model = models[kind].to(dtype).train()
    ids, attn, mask = batch()
    weights = torch.randn(3, 12, generator=torch.Generator().manual_seed(2))    # a loss weighing each token
    ref, ref_ent = full_logprobs(model, ids, attn)
    (ref * mask * weights).sum().backward()
    want = grads(model)
    model.zero_grad(set_to_none=True)
    ent = []
    got = token_logprobs(PolicyNet(model, chunk), ids, attn, mask, entropy=ent)
    (got * weights).sum().backward()
    have = grads(model)
    sel = mask.bool()
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert ((got[sel] - ref[sel]).abs() / ref[sel].abs().clamp(min=1)).max().item() < tol
    assert got[~sel].abs().max().item() == 0                        # only the mask's positions are computed
    assert (ent[0] - ref_ent[sel[:, 1:]]).abs().max().item() < 10 * tol   # at the position before each
    assert set(have) == set(want) and len(want) > 0
    scale = max(g.abs().max().item() for g in want.values())
    grad_tol = 1e-4 if dtype == torch.float32 else tol
    assert max((have[n] - want[n]).abs().max().item() for n in want) < grad_tol * scale
    if kind == "lora":
        assert all(".lora_" in n or not p.requires_grad for n, p in model.named_parameters())


def test_default_selection_is_every_real_token_as_before(models):
    model = models["plain"].eval()
    ids, attn, _ = batch(3)
    with torch.no_grad():
        assert (token_logprobs(model, ids, attn) - full_logprobs(model, ids, attn)[0]).abs().max() < 1e-6


def test_a_chunked_backward_needs_8x_less_memory_than_full_logits_at_qwens_vocabulary():
    """One log-prob forward+backward of a one-layer model with Qwen's vocabulary (151,936): today's
    [B, T, V] logits at B 8 x T 1024 would take ~20 GB (not on this machine), so it is measured at B 1,
    where its extra memory is an eighth of B 8's (the logits are B x T x V); the chunked one at B 8 itself.
    Each in a fresh process, peak RSS over the pass (tools/bench_trainer.py logprobs prints the table); the
    two processes run at once, one thread each (each measures its own RSS)."""
    import concurrent.futures

    from tools.bench_trainer import run_case
    # (hidden 64: a quarter of the bench's matmuls; T 1024, half its: the ratio was 10.2 here, 2 min -> 40 s)
    kw = dict(seq=1024, vocab=151_936, hidden=64)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        full = pool.submit(run_case, "logprobs", batch=1, mode="full", **kw)
        chunked = pool.submit(run_case, "logprobs", batch=8, mode="chunked", **kw)
    today_b1, chunked_b8 = full.result()["extra_mib"], chunked.result()["extra_mib"]
    assert (8 * today_b1) / chunked_b8 >= 8, (today_b1, chunked_b8)      # today's at B 8 / chunked at B 8


def test_pack_by_tokens_respects_the_budget_and_keeps_every_sample_once():
    rng = random.Random(0)
    lengths = [min(4000, 20 + int(rng.lognormvariate(5, 1.2))) for _ in range(300)]
    parts = pack_by_tokens(lengths, 1024)
    assert sorted(i for p in parts for i in p) == list(range(300))
    for p in parts:
        longest = max(lengths[i] for i in p)
        assert len(p) * longest <= 1024 or len(p) == 1          # a sample over budget goes alone
        assert lengths[p[0]] == longest                          # longest first
    assert padded_share(parts, lengths) < 0.1
    assert pack_by_tokens([], 64) == [] and pack_by_tokens([100, 5], 64) == [[0], [1]]
