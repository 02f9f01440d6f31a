"""Lab 6's grader: token_versions() and resubmission() on tables of cases, then both inside the real
proxy.LLMProxy (in place of its own labelling and resubmission) for a request that crosses a weight sync: over
a fake engine whose outputs reach the proxy late (virtual time), in "keep" and "abort" modes, and over the
plain-torch engine with the embedded model, whose log-probs say which weights sampled each token."""

import asyncio
from dataclasses import replace

import looptime
import pytest
import torch

from labs.grading import load
from proxy import LLMProxy, Sampling
from tools.fake_engine import FakeTimedEngine

impl = load("lab6_weight_sync")
torch.set_num_threads(1)       # (the engine's forwards are tiny: more threads only spin against each other)

# (spans, n, submitted) -> versions
VERSIONS = [(([(None, 0, 5)], 5, 3), [3] * 5),                       # never labelled: the submit version
            (([(0, 0, 9), (1, 9, 20)], 20, 0), [0] * 9 + [1] * 11),   # crossed one sync
            (([(None, 0, 2), (4, 2, 3)], 3, 3), [3, 3, 4]),
            (([(7, 0, 4)], 4, 6), [7] * 4),                          # labelled: the label, not submitted
            (([(2, 0, 1), (3, 1, 1), (4, 1, 3)], 3, 2), [2, 4, 4]),    # an empty span (two loads, no token)
            (([], 0, 5), [])]
# (spans, n): spans that do not cover the tokens
BAD_SPANS = [([(0, 0, 4)], 5), ([(0, 0, 4), (1, 4, 7)], 6), (None, 3)]
# (prompt, tokens so far, max_tokens) -> (the next engine request's prompt, its max_tokens)
RESUBMIT = [(([1, 2, 3], [7, 8], 10), ([1, 2, 3, 7, 8], 8)), (([5], [], 4), ([5], 4)),
            (([1], list(range(10, 19)), 20), ([1, *range(10, 19)], 11))]


def versions_case(spans, n: int, submitted: int, want: list[int]) -> str:
    """'' when token_versions() answers this case right, else what is wrong, in words."""
    got = impl.token_versions(spans, n, submitted)
    if got == want:
        return ""
    return (f"token_versions(spans={spans}, n={n}, submitted={submitted}) returned {got}, want {want}: each "
            f"span (version, start, end) labels tokens start..end-1; version None is the submit version")


def resubmit_case(prompt, tokens, max_tokens, want) -> str:
    """'' when resubmission() answers this case right, else what is wrong, in words."""
    got = impl.resubmission(list(prompt), list(tokens), max_tokens)
    if tuple(got) == want:
        return ""
    return (f"resubmission(prompt_ids={prompt}, token_ids={tokens}, max_tokens={max_tokens}) returned "
            f"{got}, want {want}: the engine continues the response where it was cut, with what is left of "
            f"its budget")


def tables_pass():
    """The pure functions first, before the proxy runs them: the first wrong case fails here, in words."""
    for args, want in VERSIONS:
        if why := versions_case(*args, want):
            raise AssertionError(f"the token_versions() table fails first: {why}")
    for args, want in RESUBMIT:
        if why := resubmit_case(*args, want):
            raise AssertionError(f"the resubmission() table fails first: {why}")


@pytest.mark.parametrize("args, want", VERSIONS, ids=[f"case{i}" for i in range(len(VERSIONS))])
def test_token_versions_table(args, want):
    assert not (why := versions_case(*args, want)), why


@pytest.mark.parametrize("spans, n", BAD_SPANS, ids=["short", "long", "none"])
def test_spans_that_do_not_cover_the_tokens_are_an_error(spans, n):
    try:
        got = impl.token_versions(spans, n, 0)
    except ValueError:
        return
    raise AssertionError(f"token_versions(spans={spans}, n={n}, submitted=0) returned {got}: the spans do "
                         f"not cover the request's {n} tokens, raise ValueError (the engine is wrong)")


@pytest.mark.parametrize("args, want", RESUBMIT, ids=[f"case{i}" for i in range(len(RESUBMIT))])
def test_resubmission_table(args, want):
    assert not (why := resubmit_case(*args, want)), why


# --- inside the real proxy

class StudentProxy(LLMProxy):
    """The project's proxy with the student's pieces: every engine request's tokens are labelled by
    token_versions(), and a request resubmitted after an "abort"-mode suspend is what resubmission() says."""

    def _versions(self, eid, spans, n, submitted):
        return impl.token_versions(spans, n, submitted)

    async def _consume(self, eid, prompt, sampling, c):
        if c.num_resubmits:              # the proxy resubmits after an abort: the student's continuation
            budget = sampling.max_tokens + len(c.token_ids)          # (the request's whole budget)
            prompt, left = impl.resubmission(list(c.prompt_token_ids), list(c.token_ids), budget)
            sampling = replace(sampling, max_tokens=left)
        return await super()._consume(eid, prompt, sampling, c)


class LateOutputs(FakeTimedEngine):
    """A fake engine (one token a second, virtual time) whose outputs reach the proxy only while `delivering`
    is set, as vLLM's can after a weight load (tests/test_proxy.py's); it records every engine request."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.delivering, self.requests = asyncio.Event(), []
        self.delivering.set()

    async def stream(self, request_id, prompt_token_ids, sampling, cache_salt=None):
        self.requests.append((list(prompt_token_ids), sampling.max_tokens))
        async for item in super().stream(request_id, prompt_token_ids, sampling, cache_salt):
            await self.delivering.wait()
            yield item


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_request_that_crosses_a_sync(mode):
    """20 tokens, 9 sampled by version 0 (tokens 5..9 reach the proxy only after version 1 is loaded), 11 by
    version 1. The fake engine's log-prob says which weights sampled a token: -1 before any load, -1/2
    after one. keep: one engine request; abort: a second one continues the first."""
    tables_pass()

    async def main():
        engine = LateOutputs(t0=1.0, k=0.0, load_s=5.0)
        p = StudentProxy(engine, rank=0, timeout_s=30.0)
        task = asyncio.create_task(p.generate([1], Sampling(max_tokens=20, ignore_eos=True)))
        await asyncio.sleep(4.5)                  # 4 tokens read by the proxy
        engine.delivering.clear()                 # tokens 5..9 (the 9th: the step in flight at suspend)
        await asyncio.sleep(4.0)                  # are sampled by version 0 but wait
        await p.suspend(mode)
        await p.update_weights([], version=1)
        await p.resume()
        engine.delivering.set()
        c = await task
        p.shutdown()
        return c, engine.requests
    loop = looptime.new_event_loop()
    try:
        c, requests = loop.run_until_complete(main())
    finally:
        loop.close()
    by_logprob = [{-1.0: 0, -0.5: 1}[lp] for lp in c.logprobs]
    assert len(c.token_ids) == 20, (
        f"--suspend-mode {mode}: the completion has {len(c.token_ids)} tokens, want 20 (its budget), "
        f"engine requests (prompt, max_tokens): {requests}")
    assert c.versions == [0] * 9 + [1] * 11, (
        f"--suspend-mode {mode}: the tokens' versions are {c.versions}; the weights that sampled them (from "
        f"their log-probs) were {by_logprob}")
    if mode == "keep":
        assert requests == [([1], 20)], f"keep: the request stays in the engine, yet it saw {requests}"
    else:
        first9 = c.token_ids[:9]
        assert requests == [([1], 20), ([1, *first9], 11)], (
            f"abort: the engine saw the requests (prompt, max_tokens) {requests}; after the abort it should "
            f"see the prompt plus the 9 tokens so far, for the 11 tokens left: {([1, *first9], 11)}")


# --- over the real model

@pytest.fixture(scope="module")
def model_dir() -> str:
    import tiny_model
    return str(tiny_model.ensure_tiny_model(log=lambda *a: None))


def cross_a_sync(model_dir: str, mode: str, new_weights: bool, interrupt: bool = True):
    """One greedy request of 20 tokens on the plain-torch engine, a sync after 9 of them (none with
    interrupt False): the weights perturbed (new_weights) or the same ones, labelled version 1. Returns the
    Completion, and the log-probs of its tokens under the old and under the new weights."""
    from transformers import AutoTokenizer

    from ext.torch_engine import TorchEngine

    async def main():
        engine = TorchEngine.from_dir(model_dir, max_num_seqs=4, seed=0)
        p = StudentProxy(engine, rank=0, timeout_s=30.0)
        prompt = AutoTokenizer.from_pretrained(model_dir).encode("12+34=")
        greedy = Sampling(max_tokens=20, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(p.generate(prompt, greedy, request_id="r"))
        old = {k: v.clone() for k, v in engine.model.state_dict().items()}
        g = torch.Generator().manual_seed(0)
        new = ({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()} if new_weights
               else old)
        async with asyncio.timeout(30):
            while interrupt and p.tokens_so_far("r") < 9:
                await asyncio.sleep(0)        # (the engine takes one step, one token, between two of these)
            if interrupt:
                await p.suspend(mode)
                engine.load_state(new.items())
                await p.update_weights(None, version=1)
                await p.resume()
            c = await task
            ids = prompt + c.token_ids
            under_new = (await engine.score(ids))[len(prompt) - 1:]
            engine.load_state(old.items())
            under_old = (await engine.score(ids))[len(prompt) - 1:]
        p.shutdown()
        return c, under_old, under_new
    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_with_the_real_model_each_tokens_version_names_the_weights_that_sampled_it(model_dir, mode):
    """New weights after 9 or so tokens: the tokens labelled 0 have the old weights' log-probs, those
    labelled 1 the new weights' (a behaviour log-prob is of the policy that sampled the token)."""
    tables_pass()
    c, under_old, under_new = cross_a_sync(model_dir, mode, new_weights=True)
    k = c.versions.count(0)
    assert len(c.token_ids) == len(c.versions) == 20, (
        f"--suspend-mode {mode}: {len(c.token_ids)} tokens and {len(c.versions)} versions, want 20 of each")
    assert c.versions == [0] * k + [1] * (20 - k) and 9 <= k < 20, (
        f"--suspend-mode {mode}: versions {c.versions}: the sync came after 9 or so tokens")
    for i, (v, lp) in enumerate(zip(c.versions, c.logprobs)):
        want = under_old[i] if v == 0 else under_new[i]
        assert abs(lp - want) < 1e-4, (
            f"--suspend-mode {mode}: token {i} is labelled version {v}, but its log-prob {lp:.5f} is the "
            f"{'new' if abs(lp - under_new[i]) < 1e-4 else 'old'} weights' (old {under_old[i]:.5f}, new "
            f"{under_new[i]:.5f})")


def test_with_the_real_model_an_abort_changes_nothing_when_the_weights_do_not(model_dir):
    """Greedy decoding, the same weights before and after the sync: a request aborted and resubmitted
    (partial rollout) ends with exactly the tokens of one that never was interrupted."""
    tables_pass()
    plain, _, _ = cross_a_sync(model_dir, "abort", new_weights=False, interrupt=False)
    c, _, _ = cross_a_sync(model_dir, "abort", new_weights=False)
    assert c.num_resubmits == 1, f"the sync in abort mode should resubmit the request once: {c.num_resubmits}"
    assert c.token_ids == plain.token_ids, (
        f"aborted after {c.versions.count(0)} tokens and resubmitted, the greedy answer is {c.token_ids}; "
        f"uninterrupted it is {plain.token_ids}")
