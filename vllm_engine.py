"""vllm_engine.py: the real engine backend of an LLMProxy (proxy.py): one vLLM AsyncLLM, public API only.

    engine = VLLMEngine.start(model_dir, max_num_seqs=64, cpu_cores="1")   # its engine-core process(es)
    proxy = LLMProxy(engine, rank=r)              # or: await LLMProxy.start_vllm(model_dir, rank=r)

The backend calls (stream, abort, pause, resume, set_version, receive_weights, score, sleep, wake,
shutdown) are the ones tools/fake_engine.FakeTimedEngine speaks too, so every rule of the proxy is the
same code over either. An extension adapts an engine (on_engine): what its workers do with received
tensors (`load`, weight_sync.WeightSyncWorker.load), keywords every request carries (request_kwargs),
what follows a receive (after_receive): ext/lora.py's adapter. Design notes: DESIGN.md#the-proxy
"""

import asyncio
import concurrent.futures
import contextlib
import itertools
import math
import os
import shutil
import threading
import time
from typing import AsyncIterator

import torch


USER_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND" in os.environ    # the user's own engine core binding


def export_startup_timeout(seconds: float):
    """vLLM's own wait for its engine core (VLLM_ENGINE_READY_TIMEOUT_S, default 600 s, read once when
    vLLM's engine client is imported: so before any vLLM import) follows --startup-timeout-s, a minute
    longer: the rank's own wait fires first and names the flag."""
    os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(math.ceil(seconds) + 60)


class VLLMEngine:
    """The backend calls over a vLLM AsyncLLM engine (public API only)."""

    def __init__(self, llm, ipc_dir: str | None = None):
        self.llm = llm
        # the tokenizer's EOS, which the engine (started without a tokenizer: start()) cannot know; it
        # stops on the generation config's EOS ids by itself
        self.stop_token_ids: list[int] = []
        self.ipc_dir = ipc_dir    # this engine's ZMQ IPC sockets (VLLM_RPC_BASE_PATH), removed at shutdown
        self.load: tuple | None = None        # ("module:function", arg): the workers' load (None: reload)
        self.request_kwargs: dict = {}        # every generate call's keywords (ext/lora.py: lora_request)
        self.after_receive: list = []         # called after each receive_weights
        self.scores = itertools.count()       # score()'s request ids: unique, however many run at once

    @classmethod
    def start(cls, model_dir: str, max_model_len: int | None = None, max_num_seqs: int = 64,
              kv_cache_gib: float = 1, gpu_memory_utilization: float = 0.85, dtype: str = "float32",
              seed: int = 0, cpu_cores: str = "", enforce_eager: bool | None = None, on_engine=None,
              **engine_kwargs) -> "VLLMEngine":
        """max_model_len None: the model's own (max_position_embeddings). dtype float32 on CPU keeps
        engine and trainer logprobs equal to ~1e-6; GPUs run bfloat16. KV cache: kv_cache_gib on CPU
        (VLLM_CPU_KVCACHE_SPACE; vLLM's default takes most of the machine), gpu_memory_utilization on GPU.
        enforce_eager None: eager on CPU (vLLM's CPU build compiles nothing), CUDA graphs on GPU (vLLM's
        default). on_engine(engine): called once it runs (the extensions' on_engine). engine_kwargs:
        AsyncEngineArgs' own (the extensions' engine_args: enable_lora, enable_sleep_mode, ...)."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        # On CPU, each engine binds its OpenMP threads; left on "auto", every engine on a node picks
        # the same core (verified: two engines both on core 0). cpu_cores="1" or "4-7" gives this
        # engine its own cores; an explicit VLLM_CPU_OMP_THREADS_BIND from the user wins (USER_OMP_BIND:
        # read at import, so that a second engine this process starts gets its own cores, not the first's).
        if cpu_cores and not USER_OMP_BIND:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
        # the engine's worker process imports weight_sync.WeightSyncWorker by name, from this directory
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        from vllm import AsyncEngineArgs

        # (vLLM's CPU platform always runs the model in a worker process separate from the engine
        # core, even for one worker; the two hand over through a shared-memory queue that spins with
        # sched_yield. Both inherit this rank's core, so the spinning yields to generation.)
        if torch.cuda.is_available():
            engine_kwargs.setdefault("gpu_memory_utilization", gpu_memory_utilization)
        # No tokenizer in the engine: prompts arrive as token ids and outputs leave as token ids
        # (detokenize=False), and with one the front end borrows it from its pool per request just to
        # read its EOS id (12.5% of the rollout rank's CPU in the default run, py-spy). _start reads the
        # EOS id once instead, and every request names it (stream: stop_token_ids).
        args = AsyncEngineArgs(
            model=str(model_dir), dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, seed=seed, skip_tokenizer_init=True,
            enforce_eager=not torch.cuda.is_available() if enforce_eager is None else enforce_eager,
            worker_extension_cls="weight_sync.WeightSyncWorker", disable_log_stats=True,
            # a sampled token's logprob under the distribution it was drawn from: after temperature (and any
            # top-p / top-k), where the default (raw_logprobs) reports the unscaled model's; the trainer
            # computes its own at the same temperature (Trainer's temperature). Prompt logprobs (score) are
            # raw in either mode; score() at another temperature than 1 asks for a whole vocabulary's (-1)
            logprobs_mode="processed_logprobs", max_logprobs=engine_kwargs.pop("max_logprobs", -1),
            **engine_kwargs)
        affinity = os.sched_getaffinity(0)      # this thread's, given back once the engine's processes run
        if cpu_cores and not torch.cuda.is_available():   # the engine's processes inherit this thread's cores
            os.sched_setaffinity(0, {c for part in cpu_cores.split(",") for c in
                                     range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)})
        try:
            engine = cls._start(args)
        finally:   # (a pool thread, in the tools: later work must not stay on the engine's core)
            os.sched_setaffinity(0, affinity)
        if on_engine is not None:
            on_engine(engine)
        return engine

    @classmethod
    async def start_async(cls, model_dir: str, timeout_s: float, who: str = "engine",
                          **kwargs) -> "VLLMEngine":
        """start() in a thread of its own, awaited at most timeout_s (--startup-timeout-s). A start cannot
        be interrupted: at the timeout this raises, naming who, and the thread is left to finish; an
        engine it still brings up is shut down there, never used. A daemon thread, not asyncio's pool:
        a rank that fails on the timeout exits without waiting for the start to end."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                engine = cls.start(model_dir, **kwargs)
            except BaseException as e:
                with contextlib.suppress(concurrent.futures.InvalidStateError):   # abandoned: nobody to tell
                    done.set_exception(e)
                return
            try:
                done.set_result(engine)
            except concurrent.futures.InvalidStateError:       # abandoned (cancelled) meanwhile
                engine.shutdown()

        threading.Thread(target=run, name=f"{who}: engine start", daemon=True).start()
        bound = asyncio.timeout(timeout_s)
        try:
            async with bound:
                return await asyncio.wrap_future(done)
        except BaseException:
            # nobody takes the engine now: cancelled, the thread shuts it down when it comes; if it
            # came just now, here (a start that failed by itself raises its own error)
            if not done.cancel() and done.exception() is None:
                done.result().shutdown()
            if bound.expired():
                raise TimeoutError(f"{who}: the vLLM engine did not start within {timeout_s:.0f}s "
                                   f"(--startup-timeout-s)") from None
            raise

    @classmethod
    def _start(cls, args) -> "VLLMEngine":
        import tempfile

        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM
        eos = AutoTokenizer.from_pretrained(args.tokenizer or args.model).eos_token_id   # (see start())
        # vLLM leaves its IPC sockets in the temp dir (thousands after a few runs): each engine gets a
        # dir of its own, removed at shutdown. Set only while the engine starts (its processes inherit
        # it), so that no later child (a torchrun rank) takes a removed dir for a user's setting.
        ipc_dir = None
        if not os.environ.get("VLLM_RPC_BASE_PATH"):      # (a user's own is theirs to clean)
            ipc_dir = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="vllm-ipc-")
        try:
            engine = cls(AsyncLLM.from_engine_args(args), ipc_dir)
        except BaseException:
            if ipc_dir:
                shutil.rmtree(ipc_dir, ignore_errors=True)
            raise
        finally:
            if ipc_dir:
                del os.environ["VLLM_RPC_BASE_PATH"]
        engine.stop_token_ids = [] if eos is None else [eos]
        return engine

    @property
    def dead(self) -> bool:
        """The engine core process is gone (vLLM saw it die) or its output loop has failed."""
        return self.llm is not None and self.llm.errored

    async def stream(self, request_id: str, prompt_token_ids: list[int], sampling,
                     cache_salt: str | None = None
                     ) -> AsyncIterator[tuple[list[int], list[float], str | None, list | None]]:
        """(token ids, logprobs, finish reason or None, spans or None) per output; the last output's
        spans are [(version, start, end)] over the request's tokens: the version set_version gave the
        weights that sampled them (None: the engine's initial weights, never labelled). The stream ends
        after the last output: closed earlier, vLLM aborts the request. sampling: a proxy.Sampling, read
        field by field and not imported (proxy.py imports this module: no circle), as the fake engine does."""
        # (imported from the submodules: `from vllm import X` costs an import_module per call)
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            ignore_eos=sampling.ignore_eos, seed=sampling.seed, logprobs=0,
            stop_token_ids=None if sampling.ignore_eos else self.stop_token_ids,
            stream_interval=sampling.stream_interval,
            output_kind=RequestOutputKind.DELTA, detokenize=False,   # ids only: the env decodes what it needs
            skip_clone=True)        # one request's own params: vLLM need not deep-copy them
        # already rendered (token ids): vLLM processes it on the loop, not in its thread pool. Prefix-cache
        # blocks are shared only between requests of the same salt
        prompt = tokens_input(prompt_token_ids, cache_salt=cache_salt or None)
        async for out in self.llm.generate(prompt, params, request_id, **self.request_kwargs):
            o = out.outputs[0]
            lps = [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs or [])]
            if not out.finished:
                yield list(o.token_ids), lps, None, None
                continue
            # vLLM labels every step's outputs in the engine core, where they are sampled
            spans = None if o.weight_versions is None else [
                (int(s.version) if s.version.isdigit() else None, s.start, s.end) for s in o.weight_versions]
            yield list(o.token_ids), lps, o.finish_reason, spans

    async def abort(self, request_ids: list[str]):
        await self.llm.abort(request_ids)

    async def pause(self, mode: str):
        await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self):
        await self.llm.resume_generation()

    async def sleep(self):
        """Colocated mode: free the GPU memory for the trainer (weights offloaded, KV cache dropped;
        needs enable_sleep_mode at start, CUDA only)."""
        await self.llm.pause_generation(mode="abort", clear_cache=True)
        await self.llm.sleep(level=1, mode="abort")

    async def wake(self):
        await self.llm.wake_up()

    async def set_version(self, version: int):
        """The weights just loaded are policy `version`: the engine core labels the tokens it samples
        from now on with it (vLLM's weight_version; "default" before the first label)."""
        await self.llm.update_weight_version(str(version))

    async def receive_weights(self, spec, first_rank: int, layout):
        """Every worker receives the weights the way spec's transport hands them over (weight_sync.py: it
        joins the weight-sync group and loads what its rank 0 broadcasts) and loads them (self.load);
        collective_rpc carries only the spec, the layout and the load. Returns each worker's timings. A
        receive that ends otherwise than by the workers' answer (the engine died) tells the transport."""
        from dataclasses import asdict

        from weight_sync import TRANSPORTS
        try:
            out = await self.llm.collective_rpc("receive_weights",
                                                args=(asdict(spec), first_rank, layout, self.load))
        except BaseException as e:
            TRANSPORTS[spec.transport].receive_failed(spec, first_rank, layout, e)
            raise
        for hook in self.after_receive:
            hook()
        return out
        # (prefix-cache KV computed with the old weights is never reused: requests carry the policy
        # version as their cache salt, see LLMProxy._consume; vLLM refuses reset_prefix_cache while
        # kept requests hold blocks, so a reset here would not do it)

    async def score(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Logprob of each token of `token_ids` given the ones before it (first token: none), of
        softmax(logits / temperature). vLLM takes prompt logprobs from the raw logits (temperature 1, in any
        logprobs_mode); at another temperature every token's is asked for at each position ([T-1, vocab]
        values: the engine's max_logprobs -1 allows it) and renormalised, log_softmax(logp / temperature),
        which is exact: logp is the logits less one constant a position."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0 if temperature == 1 else -1, temperature=1.0)
        final = None
        async for out in self.llm.generate({"prompt_token_ids": token_ids}, params,
                                           f"score-{next(self.scores)}", **self.request_kwargs):
            final = out
        rows = zip(token_ids[1:], final.prompt_logprobs[1:])          # per position: {token id: Logprob}
        if temperature == 1:
            return [lp[t].logprob for t, lp in rows]
        return [lp[t].logprob / temperature - torch.logsumexp(torch.tensor(      # log_softmax(logp / T)[t]
            [x.logprob for x in lp.values()], dtype=torch.float64) / temperature, 0).item() for t, lp in rows]

    def shutdown(self):
        if self.llm is not None:
            self.llm.shutdown()
            # drop it now: AsyncLLM.__del__ at interpreter exit would shut down again, noisily
            self.llm = None
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
