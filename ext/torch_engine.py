"""ext/torch_engine.py: TorchEngine, a generation backend (proxy.Engine) in plain torch: the one-process
teaching mode's engine (`python train.py` without torchrun: the controller, one env manager and the trainer in
one process and one event loop), and with --engine torch the torchrun rollout ranks' engine in vLLM's place.

    engine = TorchEngine.from_dir(model_dir, max_num_seqs=64, seed=0)    # float32, on CPU
    proxy = LLMProxy(engine, rank=0)                                     # the proxy's rules, unchanged
    await proxy.suspend("keep"); engine.load_state(trainer.iter_full_state())
    await proxy.update_weights(None, version); await proxy.resume()      # (receive_weights: spec None)

    torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1 --engine torch   # CPU ranks

Why: a whole run a student can step through in one debugger (no engine-core process, no workers, no
weight-sync group), and an install without vLLM: it needs torch, transformers and numpy, nothing else. Under
torchrun (--engine torch): an engine that starts in a second or two where vLLM's CPU engine takes 25-50 s,
for the tests whose subject is not vLLM (the controller, restarts, an agent, two nodes) and tiny models.

How it generates: concurrent stream() calls join one scheduler, an asyncio task on the caller's loop.
Each step admits waiting requests first come, first served up to max_num_seqs, runs ONE forward over
every running sequence (right-padded, with an attention mask and positions 0..n-1), samples each one's
next token at its own Sampling and hands the outputs to the streams; then `await asyncio.sleep(0)`, so
the env manager and the controller run between steps. The forward runs on the loop's thread, under
torch.no_grad, with torch's thread count as the caller set it. A token's logprob is vLLM's processed one
(vllm_engine.py: processed_logprobs): log softmax(logits / temperature) at it; temperature 0 is greedy
with temperature 1's logprob, as vLLM does. The trainer computes the same (model.token_logprobs).

Simplified on purpose, versus vLLM:
- No KV cache: each step recomputes every running sequence's whole context. The embedded model has 1M
  parameters and contexts of 10-40 tokens (128 at most), so that costs little, and it keeps the engine a
  page long: no cache to grow, reorder or merge as requests join and leave a batch. The forward is the
  trainer's (model.PolicyNet: the model's body, then its head at the wanted positions), so engine and
  trainer logprobs agree to float32 rounding. Hence also no prefix cache (cache_salt is ignored), no
  preemption (a request waits for a seat, then keeps it), no chunked prefill. For real models use vLLM.
- top_p < 1 is refused with an error (the logprobs would be of the truncated distribution).
- Weights: in one process there is no weight-sync group: receive_weights takes the inprocess transport's
  hand-over (or spec None: the runner copies the trainer's weights in with load_state()). Under torchrun a
  sync arrives as it does in a vLLM worker: weight_sync.WeightSyncWorker's receive (the group's broadcast,
  or ext/colocate.py's ipc buckets) runs in a thread while the engine is paused, its `load` handing the
  tensors to load_state (_SyncWorker). sleep() and wake() do nothing: on a CPU there is no accelerator
  memory to give back to the trainer.
- Under torchrun (--engine torch): CPU only, no LoRA adapters, no --colocate (each refused at parse time by
  name); the rollout rank's whole process runs on its engine core (vLLM's engine processes would); the
  extensions' own engines (a teacher's, a judge's) stay vLLM's.
"""

import asyncio
import contextlib
import os
import queue
import time
import types
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from config import Extension, check, extension, opt
from weight_sync import TRANSPORTS, GroupSpec, WeightSyncWorker

GREEDY_BELOW = 1e-5     # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)


def _ids(x) -> set[int]:
    """A config's EOS field (None, an id or a list of ids) as a set."""
    return set() if x is None else {x} if isinstance(x, int) else set(x)


@dataclass
class _Request:
    rid: str
    context: list[int]                   # prompt + the tokens generated so far
    sampling: object                     # a proxy.Sampling (read field by field, as vllm_engine.py does)
    generator: torch.Generator | None    # its own when Sampling.seed is set; None: the engine's
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)    # outputs for its stream
    generated: int = 0
    version_starts: list = field(default_factory=list)   # [(version label, index of its first token)]
    pending_ids: list[int] = field(default_factory=list)  # generated, not yet delivered
    pending_lps: list[float] = field(default_factory=list)

    def spans(self) -> list[tuple[int | None, int, int]]:
        """(version, start, end) over its tokens: what the last output carries."""
        ends = [start for _, start in self.version_starts[1:]] + [self.generated]
        return [(v, start, end) for (v, start), end in zip(self.version_starts, ends)]


class TorchEngine:
    """proxy.Engine over an HF causal LM in this process (see the module docstring)."""

    def __init__(self, model, max_num_seqs: int = 64, seed: int = 0, eos_token_ids=None,
                 max_model_len: int | None = None):
        """model: an HF causal LM (the trainer's model class; a PEFT model's base is what runs), used in the
        mode and device it is in. eos_token_ids: None = the model's generation config's (from_dir adds the
        tokenizer's). max_model_len: prompt + generated tokens at most (None: max_position_embeddings)."""
        self.model = model
        self.lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        limit = self.lm.config.max_position_embeddings
        self.max_model_len = max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"TorchEngine: max_model_len {max_model_len} > the model's "
                             f"max_position_embeddings {limit}")
        if eos_token_ids is None:
            gen = getattr(self.lm, "generation_config", None)
            eos_token_ids = _ids(getattr(gen, "eos_token_id", None)) or _ids(self.lm.config.eos_token_id)
        self.eos_ids = set(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.device = next(self.lm.parameters()).device
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.version: int | None = None     # the weights' label (set_version); None: never labelled
        self.paused = False
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.num_steps = 0                  # generation forwards: one a step, over every running sequence
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._sync_worker: _SyncWorker | None = None    # torchrun: its side of the weight-sync group, kept

    @classmethod
    def from_dir(cls, model_dir, dtype: str = "float32", **kwargs) -> "TorchEngine":
        """The model of an HF model dir, on CPU in `dtype` (--dtype: float32 keeps engine and trainer logprobs
        equal), in eval mode; EOS: the tokenizer's and the generation config's (vllm_engine.py stops on both).
        kwargs: __init__'s."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        eos = _ids(AutoTokenizer.from_pretrained(model_dir).eos_token_id)
        kwargs.setdefault("eos_token_ids", eos | _ids(model.generation_config.eos_token_id))
        return cls(model, **kwargs)

    @property
    def dead(self) -> bool:
        """The scheduler failed (its error is raised in every stream): the proxy's watchdog asks."""
        return self._error is not None

    # --- the scheduler

    def _kick(self):
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()        # (bound to the running loop)
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    async def _loop(self):
        while True:
            if self.paused or not (self.running or self.waiting):
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                self._step()
            except Exception as e:        # every stream raises it; the engine is dead from here
                self._error = e
                for r in [*self.running, *self.waiting]:
                    r.queue.put_nowait(e)
                self.running.clear()
                self.waiting.clear()
                return
            await asyncio.sleep(0)        # the env manager, the controller, aborts and pauses run here

    @torch.no_grad()
    def _step(self):
        """One forward over every running sequence; each gets one token."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.popleft())
        batch = list(self.running)
        logits = self._last_logits([r.context for r in batch])                  # [B, V] float32
        greedy = torch.tensor([r.sampling.temperature < GREEDY_BELOW for r in batch], device=logits.device)
        temps = torch.tensor([r.sampling.temperature for r in batch], device=logits.device)
        logp = torch.log_softmax(logits / temps.masked_fill(greedy, 1.0)[:, None], dim=-1)   # (/ 1.0: exact)
        drawn = torch.multinomial(logp.exp(), 1, generator=self.generator)[:, 0]    # one draw a row
        for i, r in enumerate(batch):           # Sampling.seed: a draw from the request's own generator
            if r.generator is not None:
                drawn[i] = torch.multinomial(logp[i].exp(), 1, generator=r.generator)[0]
        tokens = torch.where(greedy, logp.argmax(-1), drawn)
        logprobs = logp.gather(-1, tokens[:, None])[:, 0].tolist()
        self.num_steps += 1
        for r, tok, lp in zip(batch, tokens.tolist(), logprobs):
            s = r.sampling
            if not r.version_starts or r.version_starts[-1][0] != self.version:
                r.version_starts.append((self.version, r.generated))
            r.context.append(tok)
            r.generated += 1
            r.pending_ids.append(tok)
            r.pending_lps.append(lp)
            if tok in self.eos_ids and not s.ignore_eos:
                self._finish(r, "stop")
            elif r.generated >= s.max_tokens:
                self._finish(r, "length")
            elif r.generated == 1 or len(r.pending_ids) >= s.stream_interval:    # vLLM's stream_interval
                r.queue.put_nowait((r.pending_ids, r.pending_lps, None, None))
                r.pending_ids, r.pending_lps = [], []

    def _last_logits(self, contexts: list[list[int]]) -> torch.Tensor:
        """Logits [B, V] (float32) at each context's last token: the body over the right-padded batch,
        then the head at those positions only (as model.PolicyNet: never [B, T, V])."""
        B, T = len(contexts), max(map(len, contexts))
        ids = torch.zeros(B, T, dtype=torch.long)
        attn = torch.zeros(B, T, dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, :len(c)] = torch.tensor(c)
            attn[i, :len(c)] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        positions = torch.arange(T, device=self.device).expand(B, T)    # right-padded: 0..n-1 in every row
        hidden = self.lm.model(input_ids=ids, attention_mask=attn, position_ids=positions,
                               use_cache=False).last_hidden_state                    # [B, T, H]
        last = hidden[torch.arange(B, device=self.device), attn.sum(1) - 1]         # [B, H]
        return self.lm.lm_head(last).float()

    def _finish(self, r: _Request, reason: str):
        """Its last output: what it has not delivered yet, the reason and its spans; it leaves the engine."""
        r.queue.put_nowait((r.pending_ids, r.pending_lps, reason, r.spans()))
        r.pending_ids, r.pending_lps = [], []
        self._drop(r)

    def _drop(self, r: _Request):
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)

    # --- the backend calls (proxy.Engine)

    async def stream(self, request_id: str, prompt_token_ids: list[int], sampling,
                     cache_salt: str | None = None):
        """(new token ids, their logprobs, None, None) per output: the first token, then every
        Sampling.stream_interval; the last one carries the finish reason and the spans. Closing the stream
        early drops the request. cache_salt: ignored (no cache here)."""
        if self._error is not None:
            raise RuntimeError(f"TorchEngine: dead since its scheduler failed: {self._error!r}")
        if self._stopped:
            raise RuntimeError("TorchEngine: stream after shutdown")
        if sampling.top_p < 1:
            raise ValueError(f"TorchEngine: request {request_id}: top_p {sampling.top_p} < 1 is not "
                             f"supported (sample at top_p 1, or use vLLM)")
        n = len(prompt_token_ids)
        if n == 0 or n + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"TorchEngine: request {request_id}: a prompt of {n} tokens + max_tokens "
                             f"{sampling.max_tokens} does not fit the model's context of "
                             f"{self.max_model_len}")
        if any(r.rid == request_id for r in [*self.running, *self.waiting]):
            raise ValueError(f"TorchEngine: request {request_id} is already running")
        gen = None if sampling.seed is None else torch.Generator(self.device).manual_seed(sampling.seed)
        r = _Request(request_id, list(prompt_token_ids), sampling, gen)
        self.waiting.append(r)
        self._kick()
        try:
            while True:
                out = await r.queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError(f"TorchEngine: request {request_id}: the scheduler failed") from out
                yield out
                if out[2] is not None:
                    return
        finally:              # closed or cancelled early: it must not take more steps
            self._drop(r)

    async def abort(self, request_ids: list[str]) -> None:
        """Their streams end with "abort" and the tokens not delivered yet."""
        wanted = set(request_ids)
        for r in [r for r in [*self.running, *self.waiting] if r.rid in wanted]:
            self._finish(r, "abort")

    async def pause(self, mode: str) -> None:
        """No step runs until resume(). The steps run on this thread, so none is in flight now: "keep" holds
        every request where it is, "abort" ends them all."""
        if mode not in ("keep", "abort"):
            raise ValueError(f"TorchEngine.pause: mode must be 'keep' or 'abort', got {mode!r}")
        self.paused = True
        if mode == "abort":
            for r in [*self.running, *self.waiting]:
                self._finish(r, "abort")

    async def resume(self) -> None:
        self.paused = False
        if self.running or self.waiting:
            self._kick()

    async def sleep(self) -> None:
        """Nothing to release: the engine's memory is host memory, as the trainer's."""

    async def wake(self) -> None:
        """Nothing to take back (sleep)."""

    async def set_version(self, version: int) -> None:
        self.version = version

    async def receive_weights(self, spec, first_rank: int, layout) -> list[dict] | None:
        """The trainer's weights, loaded while the engine is paused; returns the timings ([one worker's]).
        spec None: none to receive (the caller loads them with load_state). The inprocess transport (one
        process): the tensors the trainer's sender handed over (HANDOFF, from its sync thread). Any other
        (torchrun: the group's broadcast, ext/colocate.py's ipc): weight_sync.WeightSyncWorker's receive as a
        vLLM worker runs it, as weight-sync rank first_rank, in a thread (the broadcast blocks); a receive
        that fails tells the transport, as vllm_engine.VLLMEngine.receive_weights does."""
        if spec is None:
            return None
        if spec.transport != "inprocess":
            if self._sync_worker is None:
                self._sync_worker = _SyncWorker(self)
            try:
                return [await asyncio.to_thread(self._sync_worker.receive_weights, asdict(spec), first_rank,
                                                layout)]
            except BaseException as e:
                TRANSPORTS[spec.transport].receive_failed(spec, first_rank, layout, e)
                raise
        t0 = time.monotonic()
        try:
            seq, named = await asyncio.to_thread(HANDOFF.get, True, spec.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"TorchEngine: no weights from the trainer within {spec.timeout_s:.0f}s "
                               f"(sync {spec.seq})") from None
        if seq != spec.seq:
            raise RuntimeError(f"TorchEngine: the trainer sent sync {seq}'s weights, sync {spec.seq} waits")
        t1 = time.monotonic()
        self.load_state(named)
        return [{"total_s": time.monotonic() - t0, "wait_s": t1 - t0}]

    @torch.no_grad()
    def load_state(self, named_tensors, strict: bool = True) -> int:
        """Copy (HF name, tensor) pairs into the model: Trainer.iter_full_state's or named_weights' (a
        tied lm_head is left out there: it is the embedding, which is copied). Call it paused (or idle).
        strict: every weight of the model must come. Returns how many tensors were copied."""
        if not self.paused and (self.running or self.waiting):
            raise RuntimeError("TorchEngine.load_state: pause first (proxy.suspend): requests are running")
        own = self.model.state_dict()          # name -> a tensor sharing the parameter's storage
        seen = set()
        for name, t in named_tensors:
            if name not in own or own[name].shape != t.shape:
                raise ValueError(f"TorchEngine.load_state: {name} {tuple(t.shape)} is not a weight of this "
                                 f"model" + (f" (it is {tuple(own[name].shape)})" if name in own else ""))
            own[name].copy_(t)
            seen.add(name)
        tied = getattr(self.lm.config, "tie_word_embeddings", False)
        missing = set(own) - seen - ({"lm_head.weight"} if tied else set())
        if strict and missing:
            raise ValueError(f"TorchEngine.load_state: {len(missing)} weights missing, e.g. "
                             f"{sorted(missing)[:3]}")
        return len(seen)

    async def score(self, token_ids: list[int]) -> list[float]:
        """The logprob of each token after the first given the ones before it, at temperature 1 (the probe:
        as Trainer.probe_logprobs computes it)."""
        ids = torch.tensor([token_ids], device=self.device)
        with torch.no_grad():       # (not as a decorator: that would not cover a coroutine's body)
            hidden = self.lm.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   use_cache=False).last_hidden_state[0, :-1]        # [T-1, H]
            logp = torch.log_softmax(self.lm.lm_head(hidden).float(), dim=-1)
        return logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()

    def shutdown(self) -> None:
        """Every open stream ends with "abort"; the scheduler stops. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(RuntimeError):         # (its event loop may be closed already)
            for r in [*self.running, *self.waiting]:
                self._finish(r, "abort")
            if self._task is not None:
                self._task.cancel()


class _SyncWorker(WeightSyncWorker):
    """A TorchEngine's side of the weight sync under torchrun: weight_sync.WeightSyncWorker's receive, as a
    vLLM worker runs it (it joins the group once a generation and keeps it, or hands over to the transport's
    receiver, ext/colocate.py's ipc), with one worker: weight-sync rank first_rank; its `load` copies the
    tensors into the engine's model as they arrive (TorchEngine.load_state, the engine paused)."""
    rank = 0

    def __init__(self, engine: TorchEngine):
        self.engine = engine
        self.model_runner = types.SimpleNamespace(device=engine.device)   # (where the buckets are received)

    def load(self, stream, load: tuple | None = None):
        try:
            if load is not None:     # (an adapter's load: ext/lora.py's, which --engine torch refuses)
                raise ValueError(f"TorchEngine: cannot load weights through {load[0]} (vLLM's workers can)")
            self.engine.load_state(stream)
        finally:                     # (a load that stopped early: the sender still needs every bucket taken)
            for _ in stream:
                pass


# ---------------------------------------------------------------------------------------------
# the one-process run's weight transport (ext/one_process.py)

HANDOFF: queue.Queue = queue.Queue()    # trainer sender -> engine, in one process: (sync number, weights)


class InProcessSender:
    """The trainer's side: it hands a copy of every weight over (the trainer's own tensors change at its next
    step, maybe before the engine has loaded them)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def spec(self, gen: int, num_engines: int, workers_per_engine: int = 1) -> GroupSpec:
        return GroupSpec("", 0, "inprocess", gen, 1 + num_engines, workers_per_engine,
                         timeout_s=self.timeout_s, transport="inprocess")

    def send(self, spec: GroupSpec, named, layout):
        HANDOFF.put((spec.seq, [(name, t.detach().clone()) for name, t in named]))


class InProcessTransport:
    """--weight-transport inprocess, the one-process run's (train.py sets it): no group, no wire; the
    tensors pass from the trainer's sender to the engine through HANDOFF."""
    every_rank = False

    def layout_errors(self, places: list, train: int, cuda: bool, name, where) -> list[str]:
        return ["--weight-transport inprocess is the one-process run's (python train.py without torchrun)"]

    def sender(self, rank: int, backend: str, timeout_s: float = 600.0, **where):
        return InProcessSender(timeout_s) if rank == 0 else None

    def receive_failed(self, spec, first_rank: int, layout, error: BaseException):
        """Nothing to tell: the trainer's send has handed its weights over already."""


TRANSPORTS["inprocess"] = InProcessTransport()


# ---------------------------------------------------------------------------------------------
# --engine torch: the torchrun rollout ranks' engine


@dataclass
class TorchEngineConfig:
    engine: str = opt("vllm", "the rollout ranks' engine under torchrun: vllm | torch (ext/torch_engine.py: "
                              "plain torch on the CPU, no KV cache, starts in seconds; for tiny models and "
                              "the tests whose subject is not vLLM). python train.py without torchrun runs "
                              "torch")

    def __post_init__(self):
        check(self, one_of=dict(engine=("vllm", "torch")))


def refusals(cfg) -> list[str]:
    """What --engine torch cannot run among cfg's flags, each named."""
    out = []
    if getattr(cfg.ext.get("lora"), "lora_rank", 0):
        out.append("--lora-rank (it serves no adapters: vLLM's LoRA does)")
    if getattr(cfg.ext.get("colocate"), "colocate", False):
        out.append("--colocate (vLLM's sleep mode)")
    if torch.cuda.is_available():
        out.append("GPUs (it runs on the CPU: its forward has no KV cache)")
    return out


async def start_engine(model_dir: str, who: str, engine: dict) -> TorchEngine:
    """A rollout rank's TorchEngine with the settings vLLM's would get (engine: VLLMEngine.start's keywords;
    the ones for vLLM alone, a KV cache's size, are not used). The rank's process runs on its engine core
    (cpu_cores), where vLLM's engine processes would, with one torch thread a core."""
    cores = engine.get("cpu_cores") or ""
    if cores:        # this thread (the event loop's: the forward runs here) and the threads it starts
        own = {c for part in cores.split(",")
               for c in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
        os.sched_setaffinity(0, own)
        torch.set_num_threads(len(own))
    return await asyncio.to_thread(TorchEngine.from_dir, model_dir, dtype=engine.get("dtype") or "float32",
                                   max_num_seqs=engine["max_num_seqs"], seed=engine["seed"],
                                   max_model_len=engine.get("max_model_len"))


@extension
class TorchRolloutEngine(Extension):
    """--engine torch: the rollout ranks run TorchEngine (rollout_engine), weights by the run's transport."""
    name, Config = "torch_engine", TorchEngineConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return part.engine == "torch"

    @classmethod
    def configure(cls, cfg, part):
        if no := refusals(cfg):
            raise ValueError(f"--engine torch cannot run with {'; '.join(no)}: use --engine vllm")

    def rollout_engine(self, model_dir: str, who: str, engine: dict):
        return start_engine(model_dir, who, engine)
