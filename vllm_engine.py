"""vllm_engine.py: the real engine backend of an LLMProxy (proxy.py): one vLLM AsyncLLM, public API only.

    engine = VLLMEngine.start(model_dir, max_num_seqs=64, cpu_cores="1")   # its engine-core process(es)
    proxy = LLMProxy(engine, rank=r)              # or: await LLMProxy.start_vllm(model_dir, rank=r)

The backend calls (stream, abort, pause, resume, set_version, receive_weights, score, sleep, wake,
shutdown) are the ones tools/fake_engine.FakeTimedEngine speaks too, so every rule of the proxy is the
same code over either. Also here: where each engine runs (cpu_layout: a CPU core of its own;
engine_gpu: its rank's GPU). Design notes: DESIGN.md#proxypy
"""

import asyncio
import concurrent.futures
import os
import shutil
import threading
import time
from typing import AsyncIterator

import torch

from proxy import Sampling


USER_OMP_BIND = "VLLM_CPU_OMP_THREADS_BIND" in os.environ    # the user's own engine core binding


def cpu_layout(cores: list[int], num_rollout: int) -> tuple[list[int], list[int]]:
    """CPU runs, one node: (host cores, engine cores). Each vLLM engine (its engine-core and worker
    processes) gets a core of its own, from the top; the ranks' own Python (trainers, controller, the
    rollout ranks' front ends) shares the rest; with no core to spare, everything shares
    (measured: DESIGN.md#proxypy)."""
    if len(cores) > num_rollout:
        return cores[:len(cores) - num_rollout], cores[len(cores) - num_rollout:]
    return cores, cores


def engine_gpu(local_rank: int, visible: str | None, count: int) -> str:
    """CUDA_VISIBLE_DEVICES for a rollout rank's engine processes: this rank's own GPU (LOCAL_RANK
    round robin over the node's GPUs; under --colocate two ranks share one), named as the parent sees
    it (a user's CUDA_VISIBLE_DEVICES list is honoured). vLLM's engine otherwise takes device 0."""
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    return ids[local_rank % len(ids)]


class VLLMEngine:
    """The backend calls over a vLLM AsyncLLM engine (public API only)."""

    def __init__(self, llm, ipc_dir: str | None = None):
        self.llm = llm
        # the tokenizer's EOS, which the engine (started without a tokenizer: start()) cannot know; it
        # stops on the generation config's EOS ids by itself
        self.stop_token_ids: list[int] = []
        self.ipc_dir = ipc_dir    # this engine's ZMQ IPC sockets (VLLM_RPC_BASE_PATH), removed at shutdown
        self.adapter_config: dict | None = None    # LoRA: the adapter's adapter_config.json content
        self.lora_request = None  # LoRA: the adapter every request names, once the engine holds one

    @classmethod
    def start(cls, model_dir: str, max_model_len: int | None = None, max_num_seqs: int = 64,
              kv_cache_gib: float = 1, gpu_memory_utilization: float = 0.85, dtype: str = "float32",
              seed: int = 0, cpu_cores: str = "", sleep_mode: bool = False, lora=None, adapter_dir: str = "",
              enforce_eager: bool | None = None, **engine_kwargs) -> "VLLMEngine":
        """max_model_len None: the model's own (max_position_embeddings). dtype float32 on CPU keeps
        engine and trainer logprobs equal to ~1e-6; GPUs run bfloat16. KV cache: kv_cache_gib on CPU
        (VLLM_CPU_KVCACHE_SPACE; vLLM's default takes most of the machine), gpu_memory_utilization on GPU.
        lora (lora.LoraConfig, rank > 0): serve model_dir plus one LoRA adapter, the one in adapter_dir
        (a --resume) or else none (the base model) until a weight sync sends one. enforce_eager None: eager
        on CPU (vLLM's CPU build compiles nothing), CUDA graphs on GPU (vLLM's default)."""
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
        lora = lora if lora is not None and lora.lora_rank else None
        if lora:
            from lora import engine_rank
            engine_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=engine_rank(lora.lora_rank))
        if torch.cuda.is_available():
            engine_kwargs.setdefault("gpu_memory_utilization", gpu_memory_utilization)
            engine_kwargs.setdefault("enable_sleep_mode", sleep_mode)     # --colocate
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
            # raw in either mode
            logprobs_mode="processed_logprobs",
            **engine_kwargs)
        affinity = os.sched_getaffinity(0)      # this thread's, given back once the engine's processes run
        if cpu_cores and not torch.cuda.is_available():   # the engine's processes inherit this thread's cores
            os.sched_setaffinity(0, {c for part in cpu_cores.split(",") for c in
                                     range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)})
        try:
            engine = cls._start(args)
        finally:   # (a pool thread, in the tools: later work must not stay on the engine's core)
            os.sched_setaffinity(0, affinity)
        if lora:
            engine.use_adapter(lora.adapter_config(model_dir), adapter_dir)
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
                try:
                    done.set_exception(e)
                except concurrent.futures.InvalidStateError:   # abandoned: nobody to tell
                    pass
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

    def use_adapter(self, config: dict, adapter_dir: str = ""):
        """LoRA: requests name the engine's adapter (lora.ADAPTER_ID): the one in adapter_dir, loaded
        at the first request; without a dir, none (the base model) until the first weight sync."""
        self.adapter_config = config
        if adapter_dir:
            self.lora_request = self._adapter_request(adapter_dir)

    @staticmethod
    def _adapter_request(path: str):
        from vllm.lora.request import LoRARequest

        import lora
        return LoRARequest(lora.ADAPTER_NAME, lora.ADAPTER_ID, path)

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

    async def stream(self, request_id: str, prompt_token_ids: list[int], sampling: Sampling,
                     cache_salt: str | None = None
                     ) -> AsyncIterator[tuple[list[int], list[float], str | None, list | None]]:
        """(token ids, logprobs, finish reason or None, spans or None) per output; the last output's
        spans are [(version, start, end)] over the request's tokens: the version set_version gave the
        weights that sampled them (None: the engine's initial weights, never labelled). The stream ends
        after the last output: closed earlier, vLLM aborts the request."""
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
        async for out in self.llm.generate(prompt, params, request_id, lora_request=self.lora_request):
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

    async def receive_weights(self, spec, first_rank: int, meta):
        """Every worker joins spec's weight-sync group and loads what its rank 0 broadcasts
        (weight_sync.WeightSyncWorker); collective_rpc carries only the spec and the meta. Returns
        each worker's timings."""
        from dataclasses import asdict

        from lora import is_adapter_tensor
        adapter = self.adapter_config if meta and all(is_adapter_tensor(m[0]) for m in meta) else None
        if spec.transport == "ipc":        # weight_ipc.py: trainer rank e hands engine e its buckets
            out = await self._receive_ipc(spec, (first_rank - 1) // spec.workers_per_engine, meta, adapter)
        else:
            out = await self.llm.collective_rpc("receive_weights",
                                                args=(asdict(spec), first_rank, meta, adapter))
        if adapter is not None and self.lora_request is None:      # every worker holds it now
            # (vLLM wants a path even for an adapter its workers hold; this one says where it came from)
            self.lora_request = self._adapter_request("(weight sync)")
        return out
        # (prefix-cache KV computed with the old weights is never reused: requests carry the policy
        # version as their cache salt, see LLMProxy._consume; vLLM refuses reset_prefix_cache while
        # kept requests hold blocks, so a reset here would not do it)

    async def _receive_ipc(self, spec, engine: int, meta, adapter):
        """The worker takes its buckets from the store (WeightSyncWorker.receive_weights_ipc). If the
        call ends otherwise than by the worker's own answer (the engine died: the proxy cancels it),
        the trainer rank waiting for its acks is told at once, not at its timeout."""
        from dataclasses import asdict

        import weight_ipc
        try:
            return await self.llm.collective_rpc("receive_weights_ipc",
                                                 args=(asdict(spec), engine, meta, adapter))
        except BaseException as e:
            weight_ipc.tell_sender(spec, engine, meta, f"engine {engine}: its receive ended: {e!r}")
            raise

    async def score(self, token_ids: list[int]) -> list[float]:
        """Logprob of each token of `token_ids` given the ones before it (first token: none), at temperature 1
        (prompt logprobs: vLLM takes them from the raw logits)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        final = None
        async for out in self.llm.generate({"prompt_token_ids": token_ids}, params,
                                           f"score-{time.monotonic_ns()}", lora_request=self.lora_request):
            final = out
        return [lp[t].logprob for t, lp in zip(token_ids[1:], final.prompt_logprobs[1:])]

    def shutdown(self):
        if self.llm is not None:
            self.llm.shutdown()
            # drop it now: AsyncLLM.__del__ at interpreter exit would shut down again, noisily
            self.llm = None
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
