"""proxy.py: the LLM proxy. One per rollout rank, in front of one engine.

Owns per-sample control of generation (the paper's LLMProxy): every request lives and dies on its
own, the caller gets it back the moment it ends, and weights can change under running requests. A
Completion carries the token ids, the behaviour logprob and the policy version of every token.

    proxy = await LLMProxy.start_vllm(model_dir, rank=r)   # real vLLM AsyncLLM (engine-core subprocess)
    proxy = LLMProxy(FakeTimedEngine(...), rank=r)          # timed fake, for unit tests and tools/sim.py
    c = await proxy.generate(prompt_ids, Sampling(max_tokens=16))   # -> Completion
    await proxy.suspend("keep"); await proxy.update_weights(layout, 3, spec); await proxy.resume()

Suspend "keep": in-flight requests stay in the engine and continue under the new weights; "abort":
they end, and are resubmitted after resume as prompt + tokens so far (partial rollout). VLLMEngine
(vllm_engine.py) and FakeTimedEngine (tools/fake_engine.py) implement one backend interface (Engine), so
every rule here is the same code in tests, in the simulator and on a GPU cluster. A dead engine can be
swapped for a new one under a proxy (ext/recovery.replace_engine).

A token's version is the one the engine labelled it with when it sampled it (update_weights labels
each load: set_version; a request's last output carries its tokens' spans per version), never the
proxy's version when the output reaches it: outputs can arrive late (vLLM's output handler is an
asyncio task behind the engine core), after the version changed.
Simplification: "utilisation" is busy, unpaused wall time, not FLOPs.

Design notes: DESIGN.md#proxypy
"""

import asyncio
import contextlib
import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable

from buffer import now


class EngineError(RuntimeError):
    """The engine died or stopped answering; the message names the rank and the phase."""


class Status(enum.Enum):
    RUNNING = "running"
    SUSPENDED = "suspended"
    STOPPED = "stopped"


@dataclass
class Sampling:
    max_tokens: int = 16          # response budget, tokens
    temperature: float = 1.0      # the logprobs are of softmax(logits / temperature) (vllm_engine: processed)
    top_p: float = 1.0            # < 1: the logprobs are of the truncated distribution, the trainer's are not
    ignore_eos: bool = False      # True: generate exactly max_tokens (benchmarks' drawn lengths)
    seed: int | None = None
    # the engine delivers a request's tokens in outputs of this many (its first token and its end at
    # once): the proxy pays Python per output, so per token at 1 (vLLM's default; the rollout ranks ask
    # for RolloutConfig.stream_interval); versions stay exact either way (they come from the engine's spans)
    stream_interval: int = 1

    def __post_init__(self):
        for name, least in (("max_tokens", 1), ("stream_interval", 1), ("temperature", 0)):   # (0: greedy)
            if getattr(self, name) < least:
                raise ValueError(f"Sampling.{name} must be >= {least}, got {getattr(self, name)}")


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)    # behaviour logprob per token
    versions: list[int] = field(default_factory=list)      # policy version per token
    finish_reason: str = ""                                # "stop" | "length" | "abort"
    submit_version: int = 0                                # proxy version when the request arrived
    latency_s: float = 0.0
    num_resubmits: int = 0                                 # "abort"-mode partial-rollout resubmissions


# ---------------------------------------------------------------------------------------------
# the engine interface: what the proxy drives


class Engine:
    """A generation backend behind the proxy: vllm_engine.VLLMEngine (real vLLM, the default) and
    tools/fake_engine.FakeTimedEngine (timed, for the unit tests and the simulator) implement it, and a new
    backend is one class with these methods (tests/test_proxy.py checks every backend against this list: the
    names, the parameters' names, which are async):

        def stream(self, request_id, prompt_token_ids, sampling, cache_salt=None)     (an async generator)
            Generate prompt_token_ids' continuation under `sampling` (Sampling): per output (new token ids,
            their logprobs, None, None); the last output carries the finish reason ("stop", "length",
            "abort") and the spans [(version, start, end)] of the request's tokens by the version that
            sampled them (None: weights never labelled). Closing it early aborts the request. Requests of the
            same cache_salt may share prefix-cache blocks, others never.
        async def abort(self, request_ids)
            End these requests: their streams end with finish reason "abort".
        async def pause(self, mode)
            Schedule nothing until resume(): "keep" holds the running requests (they go on after it),
            "abort" ends them.
        async def resume(self)
            Schedule again after pause().
        async def sleep(self)
            Release the engine's memory for training on the same GPU (--colocate); wake() brings it back.
        async def wake(self)
            Take the memory back after sleep().
        async def set_version(self, version)
            Label the tokens sampled from now on with this policy version (the spans of stream()).
        async def receive_weights(self, spec, first_rank, layout)
            Receive new weights the way spec names (weight_sync.GroupSpec; None: none to receive), as ranks
            first_rank.. of its group, and load them; layout: their (name, shape, dtype). Returns each
            worker's timings ({"total_s", "wait_s"}) or None.
        async def score(self, token_ids)
            The logprob of each token after the first given the ones before it, at temperature 1 (the probe
            that checks the weights arrived).
        def shutdown(self)
            Stop the engine and its processes; idempotent.

    Optionally a `dead` property: True once the engine's process is gone (the proxy's watchdog asks it every
    second; without it only silence is noticed)."""


# ---------------------------------------------------------------------------------------------
# the proxy


class LLMProxy:
    def __init__(self, engine: Engine, rank: int = 0, timeout_s: float = 60.0):
        self.engine, self.rank, self.status, self.version = engine, rank, Status.RUNNING, 0
        self.timeout_s = timeout_s          # an engine silent this long while running = dead
        self.asleep = False                   # sleep()ing: colocated mode, memory given to the trainer
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._ids = itertools.count()
        self._engine_ids: dict[str, str] = {}   # caller's request id -> current engine request id
        self._live: dict[str, Completion] = {}    # caller's request id -> its completion so far
        self._user_aborted: set[str] = set()
        self._consumers: set[asyncio.Task] = set()    # tasks inside generate(), for the watchdog
        self._watchdog_task: asyncio.Task | None = None
        self._last_progress = 0.0                      # loop time of the last token received
        self._failure: EngineError | None = None
        self.num_in_flight = self.num_completed = self.num_tokens = self.num_resubmits = 0      # counters
        self.latencies_s: deque[float] = deque(maxlen=4096)
        self._t_start: float | None = None   # set on first use, in loop time
        self._busy_s = 0.0
        self._busy_since: float | None = None
        # optional ext.timeline.RankEvents: wall-clock (time.time()) records of requests and of the weight
        # update's phases, for tools/plot.py's timeline; train.py turns it on, None records nothing
        self.events = None

    def take_events(self) -> list[dict] | None:
        """The events recorded since the last call (they ride on the next ack); None when off."""
        return self.events.take() if self.events is not None else None

    def _phase(self, name: str, wall0: float):
        if self.events is not None:
            self.events.phase(name, wall0, time.time(), self.version)

    @classmethod
    async def start_vllm(cls, model_dir: str, rank: int = 0, timeout_s: float = 60.0,
                         startup_timeout_s: float | None = None, **engine_kwargs) -> "LLMProxy":
        """The engine's start waits at most startup_timeout_s (None: max(timeout_s, 300))."""
        from vllm_engine import VLLMEngine     # (here: torch and vLLM only where an engine starts)
        engine = await VLLMEngine.start_async(model_dir, startup_timeout_s or max(timeout_s, 300),
                                              f"rollout rank {rank}", **engine_kwargs)
        return cls(engine, rank=rank, timeout_s=timeout_s)

    # --- utilisation bookkeeping: busy = has requests and not paused
    def _account(self):
        t = now()
        self._t_start = t if self._t_start is None else self._t_start
        self._busy_s += t - self._busy_since if self._busy_since is not None else 0.0     # (busy until now)
        self._busy_since = t if self.num_in_flight > 0 and self.status == Status.RUNNING else None

    def stats(self) -> dict:
        self._account()
        elapsed = now() - self._t_start
        lat = sorted(self.latencies_s)
        return {"rank": self.rank, "version": self.version, "in_flight": self.num_in_flight,
                "completed": self.num_completed, "tokens": self.num_tokens, "resubmits": self.num_resubmits,
                "busy_s": self._busy_s, "idle_s": elapsed - self._busy_s,
                "utilisation": self._busy_s / elapsed if elapsed > 0 else 0.0,
                "latency_p50_s": lat[len(lat) // 2] if lat else 0.0, "latency_max_s": lat[-1] if lat else 0.0}

    def _check_running(self, phase: str):
        if self.status == Status.STOPPED:
            raise EngineError(f"rollout rank {self.rank}: {phase} called after shutdown")

    async def _call(self, phase: str, coro, timeout: float | None = None):
        """An engine call under a timeout; any failure of the engine becomes EngineError. A backend
        that can tell it is dead is asked every second meanwhile: vLLM's utility calls (pause, load)
        wait forever for an answer from an engine core that was killed."""
        timeout = timeout or self.timeout_s
        task = asyncio.ensure_future(coro)
        deadline = now() + timeout
        tick = 1.0 if hasattr(self.engine, "dead") else float("inf")      # seconds between its answers
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=max(0.0, min(tick, deadline - now())))
                if not task.done() and getattr(self.engine, "dead", False):
                    raise EngineError(f"rollout rank {self.rank}: the engine process died during {phase}")
                if not task.done() and now() >= deadline:
                    raise EngineError(f"rollout rank {self.rank}: engine did not answer "
                                      f"within {timeout:.0f}s during {phase}")
            return task.result()
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as e:    # vLLM's EngineDeadError and friends: the engine process is gone
            raise EngineError(f"rollout rank {self.rank}: engine failed during {phase}: {e!r}") from e
        finally:
            task.cancel()         # (a no-op when it finished)

    # --- generation
    async def generate(self, prompt_token_ids: list[int], sampling: Sampling,
                       request_id: str | None = None) -> Completion:
        self._check_running("generate")
        if self._failure is not None:
            raise self._failure
        rid = request_id or f"r{self.rank}-{next(self._ids)}"
        c = Completion(rid, list(prompt_token_ids), submit_version=self.version)
        t0, wall0 = now(), time.time()
        if self.num_in_flight == 0:
            self._last_progress = t0          # idle time is not silence
        if self._watchdog_task is None or self._watchdog_task.done():   # (it ends after reporting a failure)
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog())
        me = asyncio.current_task()
        self._consumers.add(me)
        self._live[rid] = c
        self.num_in_flight += 1
        self._account()
        try:
            while True:
                await self._resumed.wait()          # no new submissions while suspended
                eid = self._engine_ids[rid] = f"{rid}.{c.num_resubmits}"
                left = sampling.max_tokens - len(c.token_ids)         # a resubmission asks for what is left
                sp = replace(sampling, max_tokens=left) if c.token_ids else sampling    # (the first: no copy)
                reason = await self._consume(eid, c.prompt_token_ids + c.token_ids, sp, c)
                if (reason == "abort" and rid not in self._user_aborted
                        and len(c.token_ids) < sampling.max_tokens):
                    c.num_resubmits += 1            # ended by an "abort"-mode suspend: partial rollout
                    self.num_resubmits += 1
                    continue
                c.finish_reason = reason
                return c
        except asyncio.CancelledError:
            if self._failure is not None:     # cancelled by the watchdog, not by the caller
                raise self._failure from None
            raise
        finally:
            self._consumers.discard(me)
            self._engine_ids.pop(rid, None)
            self._live.pop(rid, None)
            self._user_aborted.discard(rid)
            self.num_in_flight -= 1
            self.num_completed += 1
            c.latency_s = now() - t0
            self.latencies_s.append(c.latency_s)
            self._account()
            if self.events is not None:
                self.events.request(wall0, time.time(), c)

    async def _consume(self, eid: str, prompt: list[int], sampling: Sampling, c: Completion) -> str:
        """Read one engine request's stream into `c`; returns its finish reason. The versions of its
        tokens come with its last output, as the engine's spans (module docstring). No per-token
        timer: the proxy's watchdog notices an engine that stops producing (see _watchdog)."""
        submitted, first = self.version, len(c.token_ids)
        # the version as cache salt: a new request never reuses prompt KV computed with older weights
        stream = self.engine.stream(eid, prompt, sampling, cache_salt=f"v{self.version}")
        reason = spans = None
        ended = False        # read to its end: a stream closed after its last output still aborts in vLLM
        try:
            async for token_ids, logprobs, reason_now, spans_now in stream:
                if reason is not None:
                    raise EngineError(f"rollout rank {self.rank}: engine stream for {eid} went on after its "
                                      f"finish reason {reason!r}")
                reason, spans = reason_now, spans_now
                self._last_progress = now()
                c.token_ids += token_ids
                c.logprobs += logprobs
                self.num_tokens += len(token_ids)
            ended = True
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as e:    # vLLM's EngineDeadError and friends: the engine process is gone
            raise EngineError(f"rollout rank {self.rank}: engine failed during generate: {e!r}") from e
        finally:
            if not ended:    # cancelled or failed: closing the stream aborts the request (bounded: the
                with contextlib.suppress(TimeoutError, RuntimeError):     # engine may be gone)
                    async with asyncio.timeout(5.0):
                        await stream.aclose()
        if reason is None:
            raise EngineError(f"rollout rank {self.rank}: engine stream for {eid} ended without a finish "
                              f"reason")
        c.versions += self._versions(eid, spans, len(c.token_ids) - first, submitted)
        return reason

    def _versions(self, eid: str, spans, n: int, submitted: int) -> list[int]:
        """The version of each of an engine request's n tokens, from the engine's spans. Version None
        (an engine whose weights were never labelled: the ones it started with) is the version the
        request was submitted under: every load is labelled, so that is before its first load."""
        versions = []
        for v, start, end in spans or []:        # a few spans: no per-token Python work
            versions += [submitted if v is None else v] * (end - start)
        if spans is None or len(versions) != n:
            raise RuntimeError(f"rollout rank {self.rank}: the engine's weight-version spans for {eid} "
                               f"({spans!r}) do not cover its {n} tokens")
        return versions

    async def _watchdog(self):
        """While requests are in flight: an engine whose process is gone (the backend says it is dead)
        fails at the next tick; one that produces no token for timeout_s while not suspended is
        stuck. Either way every waiting generate() then fails with EngineError. (vLLM does not
        always wake a request's stream when its engine core dies: seen with a SIGKILLed core.)"""
        while self.status != Status.STOPPED:
            # (a backend that can tell it is dead is asked every second; others are only timed)
            await asyncio.sleep(min(self.timeout_s / 8, 1.0) if hasattr(self.engine, "dead")
                                else self.timeout_s / 8)
            silent = now() - self._last_progress
            dead = self.num_in_flight > 0 and getattr(self.engine, "dead", False)
            if dead or (self.status == Status.RUNNING and self.num_in_flight > 0 and silent > self.timeout_s):
                why = ("the engine process died" if dead
                       else f"engine produced nothing for {silent:.0f}s during generate")
                waiting = f"{self.num_in_flight} requests waiting"
                self._failure = EngineError(f"rollout rank {self.rank}: {why} ({waiting})")
                for t in list(self._consumers):
                    t.cancel()
                return

    def tokens_so_far(self, request_id: str) -> int:
        """Tokens a request in flight has received so far (0 when it is not in flight)."""
        c = self._live.get(request_id)
        return len(c.token_ids) if c is not None else 0

    async def abort(self, request_ids: Iterable[str]):
        """End these requests; their generate() returns what was generated with finish_reason "abort"."""
        self._check_running("abort")
        rids = [r for r in request_ids if r in self._engine_ids]
        self._user_aborted.update(rids)
        if rids:
            await self._call("abort", self.engine.abort([self._engine_ids[r] for r in rids]))

    # --- weight updates: suspend -> update_weights -> resume
    async def suspend(self, mode: str = "keep"):
        if mode not in ("keep", "abort"):
            raise ValueError(f"suspend mode must be 'keep' or 'abort', got {mode!r}")
        self._check_running("suspend")
        if self.status == Status.SUSPENDED:
            return
        self._resumed.clear()
        self.status = Status.SUSPENDED
        self._account()
        wall0 = time.time()
        await self._call(f"suspend({mode})", self.engine.pause(mode))
        self._phase("suspend", wall0)

    async def sleep(self):
        """Colocated mode: suspend (ending every request) and let the engine release its memory
        while the trainer trains on the same GPU. The next update_weights (or resume) wakes it."""
        await self.suspend("abort")
        await self._call("sleep", self.engine.sleep(), timeout=max(self.timeout_s, 300))
        self.asleep = True

    async def _wake(self):
        if self.asleep:
            await self._call("wake", self.engine.wake(), timeout=max(self.timeout_s, 300))
            self.asleep = False

    async def update_weights(self, layout, version: int, spec=None, first_rank: int = 1):
        """The engine's workers receive new weights (layout: weight_sync.Layout, HF names) over spec's
        weight-sync group, as ranks first_rank.., from its rank 0, which sends at the same time;
        tokens sampled after resume carry `version`. (spec None: the fake engine, which has no group.)
        Returns what the backend reports: per worker, seconds in all and waiting in the broadcast."""
        if self.status != Status.SUSPENDED:
            raise RuntimeError(f"rollout rank {self.rank}: update_weights needs a suspended proxy "
                               f"(call suspend first), status is {self.status.value}")

        async def load():
            out = await self.engine.receive_weights(spec, first_rank, layout)
            await self.engine.set_version(version)     # the engine labels the tokens it samples next
            return out
        await self._wake()
        wall0 = time.time()
        timeout = max(self.timeout_s, 300) if spec is None else max(self.timeout_s, spec.timeout_s + 5)
        workers = await self._call("update_weights", load(), timeout=timeout)
        self.version = version
        self._phase("load", wall0)
        return workers

    async def resume(self):
        self._check_running("resume")
        if self.status != Status.SUSPENDED:
            return
        await self._wake()
        wall0 = time.time()
        await self._call("resume", self.engine.resume())
        self._phase("resume", wall0)
        self._last_progress = now()                   # suspended time is not silence
        self.status = Status.RUNNING
        self._resumed.set()
        self._account()

    async def score(self, token_ids: list[int]) -> list[float]:
        """The engine's logprobs of a fixed probe sequence (to check that weights arrived)."""
        self._check_running("score")
        return await self._call("score", self.engine.score(list(token_ids)))

    def shutdown(self):
        if self.status != Status.STOPPED:
            self.status = Status.STOPPED
            if self._watchdog_task is not None:
                self._watchdog_task.cancel()
            self.engine.shutdown()
