"""fake_engine.py: FakeTimedEngine, a stand-in for vLLM for unit tests and the simulator only.

It speaks the same six backend calls as proxy.VLLMEngine (stream, abort, pause, resume,
load_weights, score), so LLMProxy runs unchanged on top of it. Time is asyncio.sleep only: under a
fast-forwarded event loop (looptime) an hour of decoding takes milliseconds of real time.

Model of an engine with continuous batching:
- each decode step takes `t0 + k * num_running` seconds (memory-bound decoding: a bigger batch costs
  a little more per step) and gives every running request (up to `max_num_seqs`) one token;
- a request arriving mid-step joins at the next step (no prefill cost modelled);
- a request's response length is drawn from `length_sampler(rng)` (long-tailed lognormal by default),
  capped at its max_tokens; with ignore_eos it is exactly max_tokens; `respond(prompt_ids)` may
  script the tokens instead (environment tests);
- the logprob of every token is -1 / (1 + number of weight loads so far), so a test can tell which
  weights produced a token.
"""

import asyncio
import math
import random
from dataclasses import dataclass, field


def lognormal_lengths(median: float = 64, sigma: float = 1.0, cap: int = 4096):
    """Long-tailed response lengths: lognormal with the given median, capped."""
    return lambda rng: max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


@dataclass
class _FakeRequest:
    target: int                         # tokens this request will generate
    end_reason: str                     # "stop" (drew EOS) or "length" (hit max_tokens)
    script: list[int] | None            # scripted tokens, if any
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0


class FakeTimedEngine:
    """Fake, timed engine (no model): for tests and sim.py, never for training."""

    def __init__(self, t0: float = 0.02, k: float = 0.0002, max_num_seqs: int = 256,
                 length_sampler=None, respond=None, vocab_size: int = 64, load_s: float = 0.5,
                 seed: int = 0):
        self.t0, self.k = t0, k                 # decode step time = t0 + k * running, seconds
        self.max_num_seqs = max_num_seqs
        self.length_sampler = length_sampler or lognormal_lengths()
        self.respond = respond                  # optional: prompt_ids -> list of response token ids
        self.vocab_size = vocab_size
        self.load_s = load_s                    # time to load one set of weights, seconds
        self.rng = random.Random(seed)
        self.running: dict[str, _FakeRequest] = {}
        self.paused = False
        self.hang = False                       # tests: True makes the engine stop answering
        self.num_loads = 0
        self.num_steps = 0
        self._wake = asyncio.Event()
        self._step_done = asyncio.Event()
        self._step_done.set()
        self._loop_task: asyncio.Task | None = None

    def _ensure_loop(self):
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self):
        while True:
            if self.paused or not self.running or self.hang:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self.running.items())[: self.max_num_seqs]
            self._step_done.clear()
            await asyncio.sleep(self.t0 + self.k * len(batch))
            self.num_steps += 1
            logprob = -1.0 / (1 + self.num_loads)
            for eid, r in batch:
                if eid not in self.running:     # aborted during the step
                    continue
                tok = r.script[r.generated] if r.script else self.rng.randrange(2, self.vocab_size)
                r.generated += 1
                reason = r.end_reason if r.generated >= r.target else None
                r.queue.put_nowait(([tok], [logprob], reason))
                if reason:
                    del self.running[eid]
            self._step_done.set()

    # --- backend calls (see proxy.VLLMEngine)
    async def stream(self, request_id, prompt_token_ids, sampling):
        if self.hang:
            await asyncio.Event().wait()        # never answers
        script = self.respond(list(prompt_token_ids)) if self.respond else None
        if script is not None:
            want = max(1, len(script))
        elif sampling.ignore_eos:
            want = sampling.max_tokens + 1      # never draws EOS
        else:
            want = self.length_sampler(self.rng)
        target = min(want, sampling.max_tokens)
        r = _FakeRequest(target, "stop" if want <= sampling.max_tokens else "length", script)
        self.running[request_id] = r
        self._ensure_loop()
        self._wake.set()
        try:
            while True:
                item = await r.queue.get()
                yield item
                if item[2] is not None:
                    return
        finally:  # a cancelled or closed stream must not keep taking decode steps
            self.running.pop(request_id, None)

    async def abort(self, request_ids):
        for eid in request_ids:
            r = self.running.pop(eid, None)
            if r is not None:
                r.queue.put_nowait(([], [], "abort"))

    async def pause(self, mode: str):
        if self.hang:
            await asyncio.Event().wait()
        self.paused = True
        await self._step_done.wait()            # like vLLM: the step in flight finishes first
        if mode == "abort":
            await self.abort(list(self.running))

    async def resume(self):
        self.paused = False
        self._wake.set()

    async def load_weights(self, buckets):
        for _ in buckets:                       # consume the (real) serialized buckets
            pass
        await asyncio.sleep(self.load_s)
        self.num_loads += 1

    async def score(self, token_ids):
        return [-1.0 / (1 + self.num_loads)] * (len(token_ids) - 1)

    def shutdown(self):
        if self._loop_task is not None:
            self._loop_task.cancel()
