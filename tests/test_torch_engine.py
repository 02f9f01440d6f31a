"""ext/torch_engine.py: the plain-torch engine of the one-process mode, behind the real LLMProxy, against the
trainer's logprobs (same float32 weights: within float32's rounding, LOGP_TOL), and without vLLM."""

import asyncio
import subprocess
import sys

from pathlib import Path

import pytest
import torch

from buffer import Sample
from ext.torch_engine import TorchEngine
from model import token_logprobs
from proxy import EngineError, LLMProxy, Sampling
from test_proxy import check_engine_interface
from trainer import TrainConfig, Trainer, collate

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-5          # the same forward on both sides (score: the probe)
# A sampled token's logprob: the engine computes it in a forward over the context so far, the trainer over
# the whole sequence. In float32 that alone moves it by up to ~1.1e-5 here (the trainer against itself on the
# prefix: measured 7e-6 at T = 1, 1.05e-5 at T = 0.7, as sdpa sums over more keys in another order); a
# wrong temperature, position or weight is off by 1e-3 or more.
LOGP_TOL = 3e-5
EOS = 1              # the tiny model's
PROMPTS = ["12+34=", "7+5=", "305+99=", "1+1=", "480+7=", "66+66="]


def prompts(hf):
    return [hf[1].encode(p) for p in PROMPTS]


def trainer_logprobs(tr: Trainer, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's logprobs of `tokens` after `prompt`, in the forward the loss uses."""
    n = len(tokens)
    with torch.no_grad():
        mb = collate([Sample("t", "g", prompt, tokens, [0.0] * n, [1] * n, [0] * n, 0.0)], "cpu")
        return tr.logprobs(mb)[0, len(prompt):].tolist()


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


async def wait_for(cond, timeout: float = 30):
    """Wait until cond() holds (a condition checked between the engine's steps, not a guessed delay)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0)


def perturb(tr: Trainer, seed: int, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def test_torch_engine_implements_the_engine_interface(tiny_model_dir):
    """As test_proxy.py's check of every backend: each method of proxy.Engine, async where the interface's
    is, with its parameters' names; stream an async generator."""
    check_engine_interface(TorchEngine)
    engine = TorchEngine.from_dir(tiny_model_dir)
    assert engine.dead is False and engine.eos_ids == {EOS}


def test_concurrent_requests_share_batched_steps(tiny_model_dir, hf):
    """Six concurrent generate() calls through the proxy: each complete and consistent, EOS ends a request
    ("stop") unless ignore_eos, and all of them ran in the same steps: as many forwards as the longest
    took tokens, not one per token. max_num_seqs=2: four requests of 5 tokens take 2 x 5 steps. Same seed,
    same tokens."""
    ps = prompts(hf)

    async def run(seed):
        engine = TorchEngine.from_dir(tiny_model_dir, seed=seed)
        proxy = LLMProxy(engine)
        cs = await asyncio.gather(*[proxy.generate(p, Sampling(max_tokens=8, ignore_eos=i % 3 == 0,
                                                               stream_interval=1 + i % 3))
                                    for i, p in enumerate(ps)])
        proxy.shutdown()
        return engine.num_steps, cs

    steps, cs = asyncio.run(run(seed=0))
    for i, c in enumerate(cs):
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) and c.versions == [0] * len(c.token_ids)
        if i % 3 == 0:
            assert c.finish_reason == "length" and len(c.token_ids) == 8
        elif c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 8 and EOS not in c.token_ids
    assert any(c.finish_reason == "stop" for c in cs)         # the tiny model ends its answers
    assert steps == max(len(c.token_ids) for c in cs) < sum(len(c.token_ids) for c in cs)
    again = asyncio.run(run(seed=0))[1]
    assert [c.token_ids for c in again] == [c.token_ids for c in cs]

    async def two_seats():
        engine = TorchEngine.from_dir(tiny_model_dir, max_num_seqs=2)
        proxy = LLMProxy(engine)
        cs = await asyncio.gather(*[proxy.generate(p, Sampling(max_tokens=5, ignore_eos=True))
                                    for p in ps[:4]])
        proxy.shutdown()
        return engine.num_steps, cs
    steps, cs = asyncio.run(two_seats())
    assert steps == 10 and all(len(c.token_ids) == 5 for c in cs)


def test_outputs_follow_stream_interval_and_carry_spans(tiny_model_dir):
    """stream_interval 3: the first token at once, then 3 at a time, the end with the rest; the last output
    carries the finish reason and the spans under the version set_version gave (None before any). A request
    with Sampling.seed draws the same tokens whatever else runs."""
    async def main():
        engine = TorchEngine.from_dir(tiny_model_dir)
        outs = {}
        for label in (None, 4):
            if label is not None:
                await engine.set_version(label)
            outs[label] = [o async for o in engine.stream(f"r{label}", [5, 6, 7],
                                                          Sampling(max_tokens=8, ignore_eos=True,
                                                                   stream_interval=3))]
        seeded = Sampling(max_tokens=8, ignore_eos=True, seed=7)      # its own generator: the same tokens
        alone = [o async for o in engine.stream("alone", [5, 6, 7], seeded)]
        other = engine.stream("other", [8, 9], Sampling(max_tokens=8, ignore_eos=True))
        await anext(other)                                           # (another request draws first)
        beside = [o async for o in engine.stream("beside", [5, 6, 7], seeded)]
        assert [t for o in alone for t in o[0]] == [t for o in beside for t in o[0]]
        await other.aclose()
        engine.shutdown()
        return outs
    for label, outs in asyncio.run(main()).items():
        assert [len(ids) for ids, *_ in outs] == [1, 3, 3, 1]
        assert [len(lps) for _, lps, *_ in outs] == [1, 3, 3, 1]
        assert [o[2] for o in outs] == [None, None, None, "length"]
        assert [o[3] for o in outs] == [None, None, None, [(label, 0, 8)]]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_the_trainers(tiny_model_dir, hf, temperature):
    """Each sampled token's logprob is the trainer's (Trainer.logprobs at the same temperature) within 3e-5,
    for prompts of different lengths in one batch. At 0.7 T = 1's would be far off; at 0 (greedy) each token
    is the argmax and its logprob is T = 1's, as vLLM reports."""
    ps = prompts(hf)

    async def main():
        proxy = LLMProxy(TorchEngine.from_dir(tiny_model_dir, seed=1))
        cs = await asyncio.gather(*[proxy.generate(p, Sampling(max_tokens=12, temperature=temperature,
                                                               ignore_eos=True)) for p in ps])
        proxy.shutdown()
        return cs
    cs = asyncio.run(main())
    tr = Trainer(str(tiny_model_dir), TrainConfig(), temperature=temperature or 1.0)
    for p, c in zip(ps, cs):
        assert len(c.token_ids) == 12
        assert max_diff(c.logprobs, trainer_logprobs(tr, p, c.token_ids)) < LOGP_TOL
        if temperature == 0.7:
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                t1 = token_logprobs(hf[0], ids, torch.ones_like(ids))[0, len(p):].tolist()
            assert max_diff(c.logprobs, t1) > 0.05
        if temperature == 0.0:
            with torch.no_grad():
                logits = hf[0](input_ids=torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1]
            assert c.token_ids == logits.argmax(-1).tolist()


def test_keep_suspend_splits_versions_at_the_update(tiny_model_dir, hf):
    """suspend("keep") -> load_state(the trainer's new weights) + update_weights(None, 1) -> resume: the
    request running across it keeps going; its tokens sampled before are version 0 with the old weights'
    logprobs, the ones after are version 1 with the new weights'."""
    tr = Trainer(str(tiny_model_dir), TrainConfig())
    prompt = prompts(hf)[0]

    async def main():
        engine = TorchEngine.from_dir(tiny_model_dir)
        proxy = LLMProxy(engine)
        task = asyncio.create_task(proxy.generate(prompt, Sampling(max_tokens=20, ignore_eos=True),
                                                  request_id="across"))
        await wait_for(lambda: proxy.tokens_so_far("across") >= 5)
        await proxy.suspend("keep")
        before = engine.num_steps                       # one request: one token a step
        perturb(tr, seed=1)
        assert engine.load_state(tr.iter_full_state()) == len(tr.named_weights())
        assert await proxy.update_weights(None, 1) is None
        for _ in range(5):                               # suspended: no step runs
            await asyncio.sleep(0)
        assert engine.num_steps == before
        await proxy.resume()
        c = await task
        proxy.shutdown()
        return before, c
    n, c = asyncio.run(main())
    assert 5 <= n < 20 and c.finish_reason == "length" and c.num_resubmits == 0
    assert c.versions == [0] * n + [1] * (20 - n)
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        old = token_logprobs(hf[0], ids, torch.ones_like(ids))[0, len(prompt):].tolist()
    new = trainer_logprobs(tr, prompt, c.token_ids)
    assert max_diff(c.logprobs[:n], old[:n]) < LOGP_TOL
    assert max_diff(c.logprobs[n:], new[n:]) < LOGP_TOL
    assert max_diff(new[n:], old[n:]) > 1e-3                # (the update did change them)


def test_abort_pause_abort_and_a_closed_stream_end_requests(tiny_model_dir, hf):
    """proxy.abort ends a request with "abort" and what it had; pause("abort") ends every request (the
    running and the waiting); a stream closed early leaves the engine."""
    ps = prompts(hf)

    async def main():
        engine = TorchEngine.from_dir(tiny_model_dir, max_num_seqs=2)
        proxy = LLMProxy(engine)
        task = asyncio.create_task(proxy.generate(ps[0], Sampling(max_tokens=50, ignore_eos=True),
                                                  request_id="ab"))
        await wait_for(lambda: proxy.tokens_so_far("ab") >= 3)
        await proxy.abort(["ab"])
        c = await task
        assert c.finish_reason == "abort" and 3 <= len(c.token_ids) < 50
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)

        streams = [engine.stream(f"s{i}", p, Sampling(max_tokens=50, ignore_eos=True))
                   for i, p in enumerate(ps[:3])]          # two seats: the third waits
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await wait_for(lambda: firsts[0].done() and firsts[1].done())
        assert len(engine.running) == 2 and len(engine.waiting) == 1
        await engine.pause("abort")
        lasts = [[o async for o in s][-1] for s in streams[:2]]
        assert all(o[2] == "abort" for o in lasts)
        assert (await firsts[2])[2] == "abort" and await anext(streams[2], None) is None
        assert not engine.running and not engine.waiting
        await engine.resume()

        s = engine.stream("closed", ps[0], Sampling(max_tokens=50, ignore_eos=True))
        await anext(s)
        assert len(engine.running) == 1
        await s.aclose()
        assert not engine.running and not engine.waiting
        proxy.shutdown()
    asyncio.run(main())


def test_score_equals_the_trainers_probe_and_follows_loads(tiny_model_dir, hf):
    """score() is Trainer.probe_logprobs within 1e-5, before and after the trainer's weights move and are
    loaded; a load while a request runs unpaused, a wrong name or shape, or a missing weight is refused, and a
    sync from a weight-sync group it cannot join fails naming the group's address."""
    from buffer import PROBE_TEXT
    probe = hf[1].encode(PROBE_TEXT)
    tr = Trainer(str(tiny_model_dir), TrainConfig())
    engine = TorchEngine.from_dir(tiny_model_dir)

    async def main():
        assert max_diff(await engine.score(probe), tr.probe_logprobs(probe)) < TOL
        before = tr.probe_logprobs(probe)
        perturb(tr, seed=2)
        s = engine.stream("running", probe[:4], Sampling(max_tokens=8, ignore_eos=True))
        await anext(s)
        with pytest.raises(RuntimeError, match="pause first"):     # not under a running request
            engine.load_state(tr.iter_full_state())
        await engine.pause("keep")
        engine.load_state(tr.iter_full_state())
        after = tr.probe_logprobs(probe)
        assert max_diff(await engine.score(probe), after) < TOL and max_diff(before, after) > 1e-3
        named = tr.named_weights()
        for bad in ([("nope", named[0][1])] + named, [(named[0][0], named[0][1][:1])] + named, named[1:]):
            with pytest.raises(ValueError):
                engine.load_state(bad)
        from weight_sync import GroupSpec
        with pytest.raises(RuntimeError, match="joining the weight-sync group at 127.0.0.1:1 failed"):
            await engine.receive_weights(GroupSpec("127.0.0.1", 1, "x", 0, 2, timeout_s=2), 1, None)
    asyncio.run(main())
    engine.shutdown()
    engine.shutdown()                        # idempotent


def test_requests_that_cannot_run_fail_naming_themselves(tiny_model_dir):
    """A prompt + max_tokens beyond the model's context (128), or top_p < 1: the request fails at once, its
    error naming it (through the proxy: EngineError); the engine goes on."""
    async def main():
        proxy = LLMProxy(TorchEngine.from_dir(tiny_model_dir))
        with pytest.raises(EngineError, match="long-one.*120 tokens.*context of 128"):
            await proxy.generate([5] * 120, Sampling(max_tokens=9), request_id="long-one")
        with pytest.raises(EngineError, match="nucleus.*top_p"):
            await proxy.generate([5, 6], Sampling(max_tokens=4, top_p=0.9), request_id="nucleus")
        c = await proxy.generate([5] * 120, Sampling(max_tokens=8, ignore_eos=True))   # exactly fits
        proxy.shutdown()
        return c
    c = asyncio.run(main())
    assert len(c.token_ids) == 8 and c.finish_reason == "length"


def test_a_failed_step_fails_every_request_and_the_engine_is_dead(tiny_model_dir):
    """A forward that raises: every waiting generate() fails with EngineError, and `dead` says so."""
    async def main():
        engine = TorchEngine.from_dir(tiny_model_dir)
        proxy = LLMProxy(engine)

        def broken(contexts):
            raise MemoryError("out of memory, say")
        engine._last_logits = broken
        got = await asyncio.gather(*[proxy.generate([5, 6], Sampling(max_tokens=4)) for _ in range(3)],
                                   return_exceptions=True)
        assert all(isinstance(e, EngineError) and "scheduler failed" in str(e) for e in got), got
        assert engine.dead
        with pytest.raises(EngineError, match="dead|died"):     # (the stream, or the watchdog)
            await proxy.generate([5, 6], Sampling(max_tokens=4))
        proxy.shutdown()
    asyncio.run(main())


def test_runs_where_vllm_cannot_be_imported(tiny_model_dir):
    """With vLLM made unimportable, the engine imports, generates through the proxy and scores."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import asyncio\n"
        "from ext.torch_engine import TorchEngine\n"
        "from proxy import LLMProxy, Sampling\n"
        "async def main():\n"
        "    proxy = LLMProxy(TorchEngine.from_dir(sys.argv[1]))\n"
        "    c = await proxy.generate([5, 6, 7], Sampling(max_tokens=4, ignore_eos=True))\n"
        "    assert len(c.token_ids) == 4 and len(await proxy.score([5, 6, 7])) == 2\n"
        "    proxy.shutdown()\n"
        "asyncio.run(main())\n"
        "print('vllm modules:', [m for m in sys.modules if m.split('.')[0] == 'vllm' and sys.modules[m]])\n")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vllm modules: []" in r.stdout
