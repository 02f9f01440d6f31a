"""LLMProxy semantics on the timed fake engine, in fast-forwarded virtual time (looptime)."""

import asyncio
import re

import pytest
import torch

from conftest import run_virtual
from tools.fake_engine import FakeTimedEngine, lognormal_lengths
from proxy import EngineError, LLMProxy, Sampling, Status


def make_proxy(**engine_kwargs) -> LLMProxy:
    return LLMProxy(FakeTimedEngine(**engine_kwargs), rank=3, timeout_s=30.0)


WEIGHTS = [("w", torch.zeros(4))]


def engine_interface() -> dict[str, tuple[bool, list[str]]]:
    """proxy.Engine's methods as its docstring lists them: name -> (async, its parameters' names)."""
    from proxy import Engine
    found = re.findall(r"^ +(async )?def (\w+)\(([^)]*)\)", Engine.__doc__, re.M)
    return {name: (bool(a), [p.split("=")[0].strip() for p in params.split(",")])
            for a, name, params in found}


def check_engine_interface(cls):
    """cls has every method of proxy.Engine, async where the interface's is, taking the interface's parameters
    by the same names (the proxy calls some by keyword); its stream is an async generator."""
    import inspect
    interface = engine_interface()
    assert len(interface) == 10 and interface["stream"] == (False, ["self", "request_id", "prompt_token_ids",
                                                                    "sampling", "cache_salt"])
    for meth, (is_async, want) in interface.items():
        impl = getattr(cls, meth, None)
        assert impl is not None, f"{cls.__name__} lacks {meth}"
        assert list(inspect.signature(impl).parameters)[:len(want)] == want, (cls.__name__, meth)
        if meth == "stream":
            assert inspect.isasyncgenfunction(impl), f"{cls.__name__}.stream is not an async generator"
        else:
            assert inspect.iscoroutinefunction(impl) == is_async, (cls.__name__, meth)


@pytest.mark.fast
@pytest.mark.parametrize("backend", ["vllm_engine:VLLMEngine", "tools.fake_engine:FakeTimedEngine"])
def test_every_backend_implements_the_engine_interface(backend):
    """proxy.Engine, written down: each backend has every method its docstring lists
    (check_engine_interface)."""
    import importlib
    module, name = backend.split(":")
    check_engine_interface(getattr(importlib.import_module(module), name))


@pytest.mark.fast
def test_generate_returns_tokens_logprobs_versions():
    async def main():
        p = make_proxy(length_sampler=lambda rng: 5)
        c = await p.generate([1, 2, 3], Sampling(max_tokens=16))
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 5
        assert c.finish_reason == "stop" and c.versions == [0] * 5
        c = await p.generate([1, 2, 3], Sampling(max_tokens=3))
        assert len(c.token_ids) == 3 and c.finish_reason == "length"
        c = await p.generate([1], Sampling(max_tokens=7, ignore_eos=True))
        assert len(c.token_ids) == 7 and c.finish_reason == "length"
        s = p.stats()
        assert s["completed"] == 3 and s["tokens"] == 15 and s["in_flight"] == 0
    run_virtual(main())


@pytest.mark.fast
def test_continuous_batching_time_model():
    """16 requests of 10 tokens share 10 decode steps of t0 + k*16 seconds each, not 160 steps."""
    async def main():
        p = make_proxy(t0=1.0, k=0.1, length_sampler=lambda rng: 10)
        t0 = asyncio.get_running_loop().time()
        await asyncio.gather(*[p.generate([1], Sampling(max_tokens=64)) for _ in range(16)])
        return asyncio.get_running_loop().time() - t0
    assert run_virtual(main()) == pytest.approx(10 * (1.0 + 0.1 * 16), rel=0.02)


@pytest.mark.fast
def test_kv_budget_preempts_the_newest_sequence_and_recomputes_it():
    """4 KV blocks of 4 tokens, two requests of 1 prompt + 10 tokens (3 blocks each at the end). Both fit
    until their 8th token; then the newer one (b) is preempted, a finishes alone at step 10, and b is
    readmitted (its 8-token context prefilled again) and ends 3 steps later. Unlimited KV: both at 10."""
    async def main(kv_tokens):
        p = make_proxy(t0=1.0, k=0.0, kv_tokens=kv_tokens, block_size=4)
        loop = asyncio.get_running_loop()

        async def one(rid):
            c = await p.generate([1], Sampling(max_tokens=10, ignore_eos=True), request_id=rid)
            return loop.time(), c
        (ta, a), (tb, b) = await asyncio.gather(one("a"), one("b"))
        assert len(a.token_ids) == len(b.token_ids) == 10
        return ta, tb, p.engine
    ta, tb, e = run_virtual(main(16))
    assert (ta, tb) == (pytest.approx(10.0), pytest.approx(13.0))
    assert e.num_preemptions == 1 and e.tokens_prefilled == 1 + 1 + 8 and e.blocks_used == 0
    ta, tb, e = run_virtual(main(None))
    assert (ta, tb) == (pytest.approx(10.0), pytest.approx(10.0)) and e.num_preemptions == 0


@pytest.mark.fast
def test_step_time_grows_with_context_and_prefill():
    """One request, 10-token prompt, 5 tokens: steps read 10, 11, 12, 13, 14 tokens of KV at 0.1 s each,
    and the first step also prefills the 10 prompt tokens at 0.01 s each."""
    async def main():
        p = make_proxy(t0=1.0, k=0.5, k_ctx=0.1, k_prefill=0.01, length_sampler=lambda rng: 5)
        await p.generate(list(range(10)), Sampling(max_tokens=16))
        return asyncio.get_running_loop().time()
    assert run_virtual(main()) == pytest.approx(5 * (1.0 + 0.5) + 0.1 * (10 + 11 + 12 + 13 + 14) + 0.01 * 10)


@pytest.mark.fast
def test_requests_wait_for_a_seat_when_max_num_seqs_is_reached():
    async def main():
        p = make_proxy(t0=1.0, k=0.0, max_num_seqs=2, length_sampler=lambda rng: 4)
        loop = asyncio.get_running_loop()

        async def one():
            await p.generate([1], Sampling(max_tokens=8))
            return loop.time()
        return sorted(await asyncio.gather(*[one() for _ in range(5)]))
    assert run_virtual(main()) == [pytest.approx(t) for t in (4, 4, 8, 8, 12)]


@pytest.mark.fast
def test_abort_returns_partial_output():
    async def main():
        p = make_proxy(t0=1.0, k=0.0)
        task = asyncio.create_task(p.generate([1], Sampling(max_tokens=100, ignore_eos=True), request_id="x"))
        await asyncio.sleep(10.5)                 # 10 decode steps of 1 s
        await p.abort(["x"])
        c = await task
        assert c.finish_reason == "abort" and len(c.token_ids) == 10 and c.num_resubmits == 0
    run_virtual(main())


@pytest.mark.fast
@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weight_update_under_running_requests(mode):
    """16 requests in flight survive suspend -> update -> resume; later tokens carry the new version."""
    async def main():
        p = make_proxy(t0=1.0, k=0.0, load_s=5.0)
        tasks = [asyncio.create_task(p.generate([1], Sampling(max_tokens=20, ignore_eos=True)))
                 for _ in range(16)]
        await asyncio.sleep(8.5)
        await p.suspend(mode)
        assert p.status == Status.SUSPENDED
        await p.update_weights(WEIGHTS, version=1)
        await p.resume()
        done = await asyncio.gather(*tasks)
        for c in done:
            assert c.finish_reason == "length" and len(c.token_ids) == 20
            assert c.versions == sorted(c.versions) and c.versions[0] == 0 and c.versions[-1] == 1
            n_old = c.versions.count(0)
            assert 8 <= n_old <= 9
            # the fake engine marks which weights produced a token: -1 before any load, -1/2 after one
            assert c.logprobs[:n_old] == [-1.0] * n_old and set(c.logprobs[n_old:]) == {-0.5}
            assert min(c.versions) == 0
            assert c.num_resubmits == (1 if mode == "abort" else 0)
        return p.stats()
    s = run_virtual(main())
    assert s["resubmits"] == (16 if mode == "abort" else 0)


class LateOutputs(FakeTimedEngine):
    """Outputs reach the proxy only while `delivering` is set; meanwhile they queue in order. vLLM's
    outputs pass through its output handler, an asyncio task behind the engine core, so a step's
    tokens can reach the proxy after pause (even after the weight load) returned."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.delivering = asyncio.Event()
        self.delivering.set()

    async def stream(self, *args, **kwargs):
        async for item in super().stream(*args, **kwargs):
            await self.delivering.wait()
            yield item


@pytest.mark.fast
@pytest.mark.parametrize("interval", [1, 16])
@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_tokens_delivered_after_a_weight_update_keep_the_version_that_sampled_them(mode, interval):
    """Tokens sampled with version 0 reach the proxy only after the load of version 1 (and the
    resume): each still carries version 0. The fake engine's logprob says which weights sampled a
    token: -1 before any load, -1/2 after one."""
    async def main():
        p = LLMProxy(LateOutputs(t0=1.0, k=0.0, load_s=5.0), rank=3, timeout_s=30.0)
        tasks = [asyncio.create_task(p.generate([1], Sampling(max_tokens=20, ignore_eos=True,
                                                              stream_interval=interval))) for _ in range(4)]
        await asyncio.sleep(4.5)                  # 4 tokens each (interval 16: the first), read by the proxy
        p.engine.delivering.clear()               # tokens 5..9 (the 9th: the step in flight at suspend)
        await asyncio.sleep(4.0)                  # are sampled with version 0 but wait
        await p.suspend(mode)
        await p.update_weights(WEIGHTS, version=1)
        await p.resume()
        p.engine.delivering.set()
        return await asyncio.gather(*tasks)
    for c in run_virtual(main()):
        assert len(c.token_ids) == len(c.versions) == 20 and c.finish_reason == "length"
        assert c.versions == [{-1.0: 0, -0.5: 1}[lp] for lp in c.logprobs]
        assert c.versions == [0] * 9 + [1] * 11 and c.num_resubmits == (1 if mode == "abort" else 0)


@pytest.mark.fast
def test_stream_interval_batches_outputs_and_an_abort_delivers_the_rest():
    """As vLLM's stream_interval: the first token at once, then every `interval` tokens, then the end;
    an abort brings the tokens generated and not yet delivered."""
    async def main():
        e = FakeTimedEngine(t0=1.0, k=0.0)
        outs = [o async for o in e.stream("a", [1], Sampling(10, ignore_eos=True, stream_interval=4))]
        assert [len(ids) for ids, _, _, _ in outs] == [1, 4, 4, 1] and outs[-1][2] == "length"
        assert outs[-1][3] == [(None, 0, 10)]                      # the spans: one, the initial weights

        async def read():
            return [o async for o in e.stream("b", [1], Sampling(10, ignore_eos=True, stream_interval=4))]
        reader = asyncio.create_task(read())
        await asyncio.sleep(6.5)                                   # 6 tokens: 1 + 4 delivered, 1 pending
        await e.abort(["b"])
        outs = await reader
        assert [len(ids) for ids, _, _, _ in outs] == [1, 4, 1] and outs[-1][2] == "abort"
    run_virtual(main())


@pytest.mark.fast
def test_no_new_work_starts_while_suspended():
    async def main():
        p = make_proxy(t0=1.0, k=0.0, length_sampler=lambda rng: 3)
        await p.suspend("keep")
        task = asyncio.create_task(p.generate([1], Sampling(max_tokens=8)))
        await asyncio.sleep(100)
        assert not task.done() and p.engine.num_steps == 0
        await p.update_weights(WEIGHTS, version=4)
        await p.resume()
        c = await task
        assert c.versions == [4, 4, 4]
    run_virtual(main())


@pytest.mark.fast
def test_update_weights_requires_suspend():
    async def main():
        p = make_proxy()
        with pytest.raises(RuntimeError, match="suspend"):
            await p.update_weights(WEIGHTS, version=1)
        with pytest.raises(ValueError, match="mode"):
            await p.suspend("pause")
    run_virtual(main())


@pytest.mark.fast
def test_hung_engine_raises_naming_rank_and_phase():
    async def main():
        p = make_proxy()
        p.engine.hang = True
        with pytest.raises(EngineError, match=r"rank 3.*generate"):
            await p.generate([1], Sampling(max_tokens=4))
        with pytest.raises(EngineError, match=r"rank 3.*suspend"):
            await p.suspend("keep")
        return asyncio.get_running_loop().time()
    # the watchdog fires within timeout_s * (1 + 1/8), then suspend's own 30 s timeout: virtual time
    assert 60.0 <= run_virtual(main()) <= 30 * 1.125 + 30 + 1


@pytest.mark.fast
def test_dead_engine_process_fails_its_requests_at_once():
    """A backend that can tell its process died (VLLMEngine.dead: vLLM's errored flag) fails the
    waiting requests within a second or two, not after timeout_s of silence: vLLM does not always
    wake a request's stream when its engine core is SIGKILLed."""
    async def main():
        p = make_proxy()
        p.engine.hang = True          # the stream goes silent, as with a killed engine core
        p.engine.dead = True          # and the backend knows it
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineError, match=r"rank 3: the engine process died"):
            await p.generate([1], Sampling(max_tokens=4))
        return asyncio.get_running_loop().time() - t0
    assert run_virtual(main()) <= 2.0             # timeout_s is 30 here


@pytest.mark.fast
def test_engine_call_on_a_dead_engine_fails_at_once():
    """vLLM's utility calls (pause, load) wait forever for a killed engine core's answer: the proxy
    asks the backend whether it is dead every second and fails the call, instead of waiting out
    timeout_s (30 s here)."""
    async def main():
        p = make_proxy()
        p.engine.dead = False

        async def never():
            await asyncio.Event().wait()
        p.engine.pause = lambda mode: never()
        asyncio.get_running_loop().call_later(5.0, setattr, p.engine, "dead", True)   # killed 5 s in
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(EngineError, match=r"rank 3: the engine process died during suspend"):
            await p.suspend("keep")
        return asyncio.get_running_loop().time() - t0
    assert 5.0 <= run_virtual(main()) <= 6.5


@pytest.mark.fast
def test_after_shutdown_calls_fail_clearly():
    async def main():
        p = make_proxy()
        p.shutdown()
        with pytest.raises(EngineError, match="after shutdown"):
            await p.generate([1], Sampling(max_tokens=2))
    run_virtual(main())


@pytest.mark.fast
def test_utilisation_counts_busy_time():
    async def main():
        p = make_proxy(t0=1.0, k=0.0, length_sampler=lambda rng: 10)
        await p.generate([1], Sampling(max_tokens=10))   # 10 s busy
        await asyncio.sleep(10)                          # 10 s idle
        return p.stats()
    s = run_virtual(main())
    assert s["busy_s"] == pytest.approx(10.0, abs=0.1) and s["utilisation"] == pytest.approx(0.5, abs=0.01)
    assert s["latency_p50_s"] == pytest.approx(10.0, abs=0.1)


@pytest.mark.fast
def test_long_tailed_default_lengths():
    import random
    rng = random.Random(0)
    lengths = sorted(lognormal_lengths(median=64, sigma=1.0)(rng) for _ in range(2000))
    assert 55 <= lengths[1000] <= 75           # median near 64
    assert lengths[-20] > 5 * lengths[1000]    # a long tail: the top 1% is several times the median


@pytest.mark.fast
def test_sampling_validates():
    with pytest.raises(ValueError, match="max_tokens"):
        Sampling(max_tokens=0)


@pytest.mark.parametrize("cuda, flag, eager", [(False, None, True), (True, None, False), (True, True, True)])
def test_engines_capture_cuda_graphs_on_gpu_unless_told_not_to(monkeypatch, cuda, flag, eager):
    """enforce_eager: always on CPU; on GPU vLLM's default (CUDA graphs) unless --enforce-eager."""
    from vllm_engine import VLLMEngine
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(VLLMEngine, "_start", classmethod(lambda cls, args: seen.setdefault("args", args)))
    VLLMEngine.start("/nonexistent-model", enforce_eager=flag)
    assert seen["args"].enforce_eager is eager
