"""fake_engine.py: FakeTimedEngine, a stand-in for vLLM for unit tests and the simulator only.

    proxy = LLMProxy(FakeTimedEngine(max_num_seqs=64, kv_tokens=None), rank=0)   # as vllm_engine.VLLMEngine

It speaks the same backend calls as vllm_engine.VLLMEngine (stream, abort, pause, resume, receive_weights,
set_version, score, sleep, wake), so LLMProxy runs unchanged on top of it. Time is asyncio.sleep only: under a
fast-forwarded event loop (looptime) an hour of decoding takes milliseconds of real time.

What it models: one vLLM engine with continuous batching and a paged KV cache (vLLM V1's FCFS
scheduler): at most max_num_seqs running, KV blocks of block_size within kv_tokens (None: no memory
limit), preemption of the most recently admitted sequence by recompute, a step time linear in the
running sequences, their context and the tokens prefilled; response lengths from length_of_prompt,
length_sampler or a scripted respond(); logprob -1 / (1 + weight loads so far) per token; like vLLM,
each token is labelled with the version of the weights that sampled it (set_version), and a request's
last output carries the spans of its tokens per version.

Simplifications, on purpose: no token budget per step (a long prefill is one step, not chunked);
no prefix caching; preemption by recompute only (no swap). The constants' units are seconds and
tokens of this engine: tools/sim.py derives them for an 8B model on an 80 GB GPU, and
tools/sim_vs_real.py fits them to real vLLM CPU engines.

Design notes (the model, rule by rule): DESIGN.md#fake_enginepy
"""

import asyncio
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field


def lognormal_lengths(median: float = 64, sigma: float = 1.0, cap: int = 4096):
    """Long-tailed response lengths: lognormal with the given median, capped."""
    return lambda rng: max(1, min(cap, int(rng.lognormvariate(math.log(median), sigma))))


@dataclass
class _FakeRequest:
    prompt_len: int                     # tokens of the prompt (context before the first new token)
    target: int                         # tokens this request will generate
    end_reason: str                     # "stop" (drew EOS) or "length" (hit max_tokens)
    script: list[int] | None            # scripted tokens, if any
    version_starts: list = field(default_factory=list)   # [(version label, first token index)], as vLLM
    interval: int = 1                   # tokens per output (Sampling.stream_interval), as vLLM's frontend
    pending_ids: list = field(default_factory=list)      # generated, not yet delivered
    pending_lps: list = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    blocks: int = 0                     # KV blocks held (0 while waiting)

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated

    def spans(self) -> list[tuple[int | None, int, int]]:
        """(version, start, end) over this request's tokens: what vLLM's last output carries."""
        ends = [start for _, start in self.version_starts[1:]] + [self.generated]
        return [(v, start, end) for (v, start), end in zip(self.version_starts, ends)]


class FakeTimedEngine:
    """Fake, timed engine (no model): for tests and tools/sim.py, never for training."""

    def __init__(self, t0: float = 0.02, k: float = 0.0002, max_num_seqs: int = 256,
                 length_sampler=None, respond=None, vocab_size: int = 64, load_s: float = 0.5,
                 seed: int = 0, kv_tokens: int | None = None, block_size: int = 16, k_ctx: float = 0.0,
                 k_prefill: float = 0.0, length_of_prompt=None):
        self.t0, self.k = t0, k                 # s per decode step at batch 0;
                                                # s per running sequence per step
        self.k_ctx = k_ctx                      # s per context token of the running sequences per step
                                                # (KV read)
        self.k_prefill = k_prefill              # s per prefilled token
                                                # (admission, recompute after preemption)
        self.max_num_seqs = max_num_seqs        # sequences decoding at once, at most
        self.block_size = block_size            # tokens per KV block
        # KV budget; None: unlimited
        self.num_blocks = None if kv_tokens is None else kv_tokens // block_size
        self.length_sampler = length_sampler or lognormal_lengths()
        self.length_of_prompt = length_of_prompt   # optional: (prompt_ids, rng) -> response length
        self.respond = respond                  # optional: prompt_ids -> list of response token ids
        self.vocab_size = vocab_size
        self.load_s = load_s                    # time to load one set of weights, seconds
        self.rng = random.Random(seed)
        self.running: dict[str, _FakeRequest] = {}   # every request in the engine: decoding or waiting
        self.decoding: list[str] = []           # admitted (holding KV blocks), in admission order
        self.waiting: deque[str] = deque()      # not admitted: new (tail) or preempted (head)
        self.blocks_used = 0
        self.paused = False
        self.asleep = False                     # sleep(): colocated mode's memory release
        self.hang = False                       # tests: True makes the engine stop answering
        self.num_loads = 0
        self.version: int | None = None         # the weights' label (set_version); None: the initial ones
        self.num_steps = 0
        self.num_preemptions = 0
        self.tokens_prefilled = 0
        self.busy_s = 0.0                       # time spent in decode steps (engine utilisation)
        self.cpu_s = 0.0                        # CPU seconds of its own step loop (benchmarks subtract it)
        self._wake = asyncio.Event()
        self._step_done = asyncio.Event()
        self._step_done.set()
        self._loop_task: asyncio.Task | None = None

    def _ensure_loop(self):
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    # --- the scheduler: KV blocks, preemption, admission

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _free_blocks(self) -> float:
        return math.inf if self.num_blocks is None else self.num_blocks - self.blocks_used

    def _release(self, eid: str):
        r = self.running[eid]
        self.blocks_used -= r.blocks
        r.blocks = 0

    def _schedule(self) -> int:
        """Grow, preempt and admit for the next step; returns the tokens to prefill in it."""
        preempted = False
        for eid in list(self.decoding):          # every running sequence needs room for its next token
            if eid not in self.decoding:         # preempted below, to make room for an older one
                continue
            r = self.running[eid]
            need = self._blocks(r.context + 1) - r.blocks
            while need > self._free_blocks() and self.decoding:
                victim = self.decoding.pop()     # the most recently admitted
                self._release(victim)
                self.waiting.appendleft(victim)
                self.num_preemptions += 1
                preempted = True
                if victim == eid:
                    break
            if eid in self.decoding:
                r.blocks += need
                self.blocks_used += need
        prefill = 0
        while not preempted and self.waiting and len(self.decoding) < self.max_num_seqs:
            r = self.running[self.waiting[0]]
            need = self._blocks(r.context + 1)
            if need > self._free_blocks():
                if not self.decoding and self.num_blocks is not None and need > self.num_blocks:
                    raise RuntimeError(f"fake engine: a request of {r.context} tokens can never fit "
                                       f"{self.num_blocks * self.block_size} KV tokens")
                break
            self.decoding.append(self.waiting.popleft())
            r.blocks = need
            self.blocks_used += need
            prefill += r.context
        return prefill

    async def _step_loop(self):
        # A step ends dt after the previous one ended, not dt after this loop gets round to it: the
        # loop's own Python (scheduling, delivering outputs) stands for an engine process's work and
        # must not lengthen the steps of a real-time benchmark sharing a core with it. (Virtual time
        # is unchanged: there Python takes no time.) Idle, or a step or more behind: from now.
        loop = asyncio.get_running_loop()
        last_end = -math.inf
        while True:
            if self.paused or not self.running or self.hang:
                self._wake.clear()
                await self._wake.wait()
                last_end = -math.inf
                continue
            cpu0 = time.thread_time()
            prefill = self._schedule()
            batch = list(self.decoding)
            ctx = sum(self.running[eid].context for eid in batch)
            self._step_done.clear()
            dt = self.t0 + self.k * len(batch) + self.k_ctx * ctx + self.k_prefill * prefill
            self.cpu_s += time.thread_time() - cpu0
            t = loop.time()
            lag = t - last_end      # this loop's Python since the last step ended (0 in virtual time)
            delay = dt - lag if 1e-6 < lag < dt else dt
            last_end = t + delay
            await asyncio.sleep(delay)
            cpu0 = time.thread_time()
            self.busy_s += dt
            self.num_steps += 1
            self.tokens_prefilled += prefill
            logprob = -1.0 / (1 + self.num_loads)
            for eid in batch:
                r = self.running.get(eid)
                if r is None or eid not in self.decoding:   # aborted or preempted during the step
                    continue
                tok = r.script[r.generated] if r.script else self.rng.randrange(2, self.vocab_size)
                if not r.version_starts or r.version_starts[-1][0] != self.version:
                    r.version_starts.append((self.version, r.generated))
                r.generated += 1
                r.pending_ids.append(tok)
                r.pending_lps.append(logprob)
                reason = r.end_reason if r.generated >= r.target else None
                # delivered: the first token, every `interval` tokens, and the end (vLLM's stream_interval)
                if reason or r.generated == 1 or len(r.pending_ids) >= r.interval:
                    r.queue.put_nowait((r.pending_ids, r.pending_lps, reason, r.spans() if reason else None))
                    r.pending_ids, r.pending_lps = [], []
                if reason:
                    self._drop(eid)
            self._step_done.set()
            self.cpu_s += time.thread_time() - cpu0

    def _drop(self, eid: str) -> _FakeRequest | None:
        r = self.running.get(eid)
        if r is None:
            return None
        self._release(eid)
        if eid in self.decoding:
            self.decoding.remove(eid)
        else:
            self.waiting.remove(eid)
        return self.running.pop(eid)

    # --- backend calls (see vllm_engine.VLLMEngine)
    async def stream(self, request_id, prompt_token_ids, sampling, cache_salt=None):  # no prefix cache here
        if self.hang:
            await asyncio.Event().wait()        # never answers
        script = self.respond(list(prompt_token_ids)) if self.respond else None
        if script is not None:
            want = max(1, len(script))
        elif sampling.ignore_eos:
            want = sampling.max_tokens + 1      # never draws EOS
        elif self.length_of_prompt is not None:
            want = self.length_of_prompt(prompt_token_ids, self.rng)
        else:
            want = self.length_sampler(self.rng)
        target = min(want, sampling.max_tokens)
        r = _FakeRequest(len(prompt_token_ids), target, "stop" if want <= sampling.max_tokens else "length",
                         script, interval=sampling.stream_interval)
        self.running[request_id] = r
        self.waiting.append(request_id)
        self._ensure_loop()
        self._wake.set()
        try:
            while True:
                item = await r.queue.get()
                yield item
                if item[2] is not None:
                    return
        finally:  # a cancelled or closed stream must not keep taking decode steps
            self._drop(request_id)

    async def abort(self, request_ids):
        for eid in request_ids:
            r = self._drop(eid)
            if r is not None:       # tokens generated and not yet delivered come with the abort, as in vLLM
                r.queue.put_nowait((r.pending_ids, r.pending_lps, "abort", r.spans()))

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

    async def sleep(self):                      # colocated mode: memory released (paused, nothing kept)
        await self.pause("abort")
        self.asleep = True

    async def wake(self):
        self.asleep = False

    async def receive_weights(self, spec, first_rank: int, layout):
        """The weight sync, modelled: load_s seconds (transfer + load); no group is joined (the real
        engine: weight_sync.WeightSyncWorker)."""
        if self.asleep:
            raise RuntimeError("fake engine: receive_weights while asleep (vLLM needs wake_up first)")
        await asyncio.sleep(self.load_s)
        self.num_loads += 1

    async def set_version(self, version: int):
        self.version = version

    async def score(self, token_ids):
        return [-1.0 / (1 + self.num_loads)] * (len(token_ids) - 1)

    def shutdown(self):
        if self._loop_task is not None:
            self._loop_task.cancel()
