"""weight_sync.py: the weights, from trainer rank 0 straight into every vLLM worker.

    sender = Sender(host, port, store=store, backend="nccl")     # trainer rank 0 (train.py)
    layout = weight_layout(trainer.named_weights(), dtype)          # names, shapes, dtypes: rides on Cmd.SYNC
    sender.send(sender.spec(gen, num_engines), trainer.iter_full_state(), layout)
    await proxy.update_weights(layout, version, spec)   # each rollout rank, engine suspended: its workers'
                                                      # WeightSyncWorker.receive_weights (collective_rpc)

What lives here: the one weight-sync group (rank 0 the sender, ranks 1.. every engine's workers,
built with vLLM's stateless helpers on the run's key-value store; gloo on CPU, NCCL on GPU, the same
code), the bucket plan (plan_buckets over weight_layout, computed alike on both sides), Sender (gather,
flatten and broadcast bucket by bucket) and WeightSyncWorker (the vLLM worker extension that
receives each bucket and loads it as it arrives). A replaced engine means a new group generation.
The seam: TRANSPORTS, --weight-transport's registry. A transport (GroupTransport here; ext/colocate.py's
ipc) says what layout it cannot run on, makes the trainer ranks' senders, and names its worker-side
receive in the sync's spec (GroupSpec.receiver); what the workers do with the tensors is the engine's
`load` (None: vLLM's reload of the model's weights; ext/lora.py: its adapter).
Every wait raises within the group's timeout and a failed one aborts that group (NCCL: the group is
built with blocking waits and no watchdog, nccl_group_env, so a dead engine ends no process).

Deviations, on purpose: the group is formed at the first sync, not at engine start (on NCCL the
communicator's start-up lands in the first sync); weights travel in the engine's dtype; vLLM's own
weight_transfer package is CUDA-only, and the point here is one code path for CPU and GPU.

Design notes: DESIGN.md#weight_syncpy
"""

import contextlib
import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch

Layout = list[tuple[str, list[int], str]]     # (name, shape, dtype) per tensor, in send order


def weight_layout(named, dtype: str | None = None) -> Layout:
    """(name, shape, dtype) of (name, tensor) pairs; dtype: the one they travel in (default: their own)."""
    return [(n, list(t.shape), dtype or str(t.dtype).removeprefix("torch.")) for n, t in named]


def plan_buckets(layout: Layout, bucket_bytes: int) -> list[list[int]]:
    """Indices of `layout` grouped into buckets of one dtype and about bucket_bytes each."""
    buckets, size = [], 0                       # size: the last bucket's bytes
    for i, (_, shape, dtype) in enumerate(layout):
        nbytes = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
        if buckets and size + nbytes <= bucket_bytes and dtype == layout[buckets[-1][0]][2]:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


def layout_bytes(layout: Layout) -> int:
    return sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, shape, dtype in layout)


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the members of one generation of the weight-sync group meet (picklable: it
    rides on the SYNC command and on collective_rpc)."""
    host: str                 # the key-value store's address (a TCPStore)
    port: int
    prefix: str               # this run's keys in that store
    gen: int                  # generation: a new group after an engine is replaced
    world_size: int           # 1 sender + every worker of every engine
    workers_per_engine: int = 1   # engine e's workers are ranks 1 + e * workers_per_engine ...
    backend: str = "gloo"     # "gloo" (CPU) | "nccl" (GPU)
    timeout_s: float = 600.0  # every collective of the group, and joining it
    bucket_bytes: int = 64 << 20
    transport: str = "group"  # TRANSPORTS' name: "group" (this module's broadcast), "ipc" (ext/colocate.py)
    seq: int = 0              # the sync's number (the controller counts them): the ipc path's keys
    receiver: str = ""        # "module:function" of another transport's worker-side receive ("": the group's)

    def with_gen(self, gen: int, seq: int = 0) -> "GroupSpec":
        return replace(self, gen=gen, seq=seq)


# The weight-sync group on NCCL: a wait must raise, not take the process down. Without blocking wait,
# an NCCL Work.wait() only orders streams, and the group's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING's
# default) ends the process on an error or timeout: one engine dying mid-sync would take down trainer rank
# 0 and every engine. ProcessGroupNCCL reads these in its constructor, once per group (torch's
# ProcessGroupNCCL.cpp): blocking wait makes wait() block in the caller's thread and, on an error or the
# timeout, abort that work's communicator and raise, and starts no watchdog thread; no error handling keeps
# an older torch's watchdog from ending the process. Set only while this group is built: every other group
# (the trainer group's FSDP waits must not block the CPU) keeps what the environment says.
NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_BLOCKING_WAIT": ("NCCL_BLOCKING_WAIT", "0"),          # (old name, torch's
                     "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING", "3")}   # default)


def pin_nccl_env():
    """Give NCCL_GROUP_ENV's names the values torch would read anyway (its older names, else its defaults)
    if they are unset: done at import, before this process has threads, so that nccl_group_env() later
    replaces values in place. (Adding or removing a variable moves the environment's entries under another
    thread's getenv, NCCL's or torch's; replacing one swaps a pointer.)"""
    for name, (old, default) in NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(name, os.environ.get(old, default))


pin_nccl_env()


@contextlib.contextmanager
def nccl_group_env():
    """NCCL_GROUP_ENV while an NCCL group is built; what was there before, after (replaced in place)."""
    pin_nccl_env()
    before = {k: os.environ[k] for k in NCCL_GROUP_ENV}
    os.environ.update(NCCL_GROUP_ENV)
    try:
        yield
    finally:
        os.environ.update(before)


def open_group(spec: GroupSpec, rank: int, store=None):
    """Join generation spec.gen as `rank`; a member that has no store connects to spec's. vLLM's
    stateless helpers make the group: nothing global in torch.distributed changes. NCCL: built with
    blocking waits and no watchdog (NCCL_GROUP_ENV), so its waits raise within their timeout."""
    from torch.distributed import PrefixStore, TCPStore
    from vllm.distributed.utils import init_gloo_process_group

    timeout = timedelta(seconds=spec.timeout_s)
    if store is None:
        store = TCPStore(spec.host, spec.port, is_master=False, timeout=timeout)
    prefixed = PrefixStore(f"{spec.prefix}/weight-sync/gen{spec.gen}", store)
    if spec.backend == "gloo":
        return init_gloo_process_group(prefixed, rank, spec.world_size, timeout)
    from vllm.platforms import current_platform
    with nccl_group_env():
        return current_platform.stateless_init_device_torch_dist_pg(spec.backend, prefixed, rank,
                                                                    spec.world_size, timeout)


def abort_group(pg):
    """A failed group's communicators ended in this process now, not at its destructor (NCCL: that group's
    only; the other members' waits fail at NCCL's error or their timeout). Best effort: it failed already."""
    if pg is not None:
        with contextlib.suppress(Exception):
            pg.abort()


def broadcast(pg, t: torch.Tensor, who: str, phase: str, timeout_s: float):
    """One broadcast from group rank 0, its wait bounded by timeout_s; a failure names who and what."""
    try:
        pg.broadcast(t, 0).wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:     # gloo/NCCL timeouts and dead peers surface as RuntimeError
        raise RuntimeError(f"{who}: {phase} failed or timed out: {e}") from None


def pack(named, layout: Layout, idx: list[int], flat: torch.Tensor, who: str):
    """The next len(idx) weights of `named` (an iterator, in layout's order) into `flat`, one bucket, each
    cast to its layout dtype."""
    parts = []
    for i in idx:
        name, t = next(named)
        if name != layout[i][0]:
            raise ValueError(f"{who}: weight {name} arrived where the plan has {layout[i][0]}")
        parts.append(t.detach().reshape(-1).to(flat.device, getattr(torch, layout[i][2])))
    torch.cat(parts, out=flat)


class Sender:
    """Group rank 0. `store`: a TCPStore every member can reach at (host, port); None: host one
    here on a free port (one process holding trainer and engines: benchmarks, tests)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, store=None, prefix: str = "run",
                 backend: str = "gloo", device: str = "cpu", timeout_s: float = 600.0,
                 bucket_bytes: int = 64 << 20):
        if store is None:
            from torch.distributed import TCPStore
            store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
            port = store.port
        self.store, self.device = store, device
        self.spec0 = GroupSpec(host, port, prefix, 0, 1, 1, backend, timeout_s, bucket_bytes)
        self.pg, self.gen = None, None
        self.buf = None           # the bucket being sent, bytes (kept: fresh memory costs page faults)

    def spec(self, gen: int, num_engines: int, workers_per_engine: int = 1) -> GroupSpec:
        return replace(self.spec0, gen=gen, world_size=1 + num_engines * workers_per_engine,
                       workers_per_engine=workers_per_engine)

    def send(self, spec: GroupSpec, named, layout: Layout, who: str = "trainer rank 0"):
        """Broadcast `named` ((name, tensor) in layout's order; an iterator is consumed once, bucket by
        bucket, so the sender's extra memory is one bucket) over spec's group. Collective with
        every worker's receive. On a failure the iterator is still drained before the error is
        raised: FSDP's gathers behind it are collectives of every trainer rank."""
        named = iter(named)
        try:
            if self.gen != spec.gen:      # a new generation: drop the old group (if any) before forming it
                self.pg = None
                self.pg, self.gen = open_group(spec, 0, self.store), spec.gen
            plan = plan_buckets(layout, spec.bucket_bytes)
            nbytes = [layout_bytes([layout[i] for i in idx]) for idx in plan]
            # one bucket, reused: no fresh pages
            if self.buf is None or self.buf.numel() < max(nbytes, default=0):
                self.buf = torch.empty(max(nbytes), dtype=torch.uint8, device=self.device)
            for b, idx in enumerate(plan):
                flat = self.buf[:nbytes[b]].view(getattr(torch, layout[idx[0]][2]))
                pack(named, layout, idx, flat, who)
                broadcast(self.pg, flat, who, f"weight broadcast bucket {b} (gen {spec.gen})", spec.timeout_s)
        except BaseException:
            abort_group(self.pg)               # a group that failed once is not used again
            self.pg, self.gen = None, None
            for _ in named:
                pass
            raise


def gpus_shared(group: str, members, places: list, cuda: bool, name, where) -> list[str]:
    """A group's members two of which are on one GPU, which NCCL refuses: an error for each (places[r]: rank
    r's (node, GPU); name(r), where(r): how to say rank r and where it runs)."""
    seen, errors = {}, []
    for r in members:
        if cuda and places[r] in seen:
            errors.append(f"{group} would hold {name(seen[places[r]])} and {name(r)}, both on {where(r)}: "
                          f"NCCL refuses two ranks of one GPU")
        seen.setdefault(places[r], r)
    return errors


class GroupTransport:
    """--weight-transport group, the default: trainer rank 0 broadcasts every bucket into every engine's
    workers over one process group. A transport of another kind is a class like this one in TRANSPORTS."""
    every_rank = False       # which trainer ranks send: rank 0 (the others only take part in the gathers)

    def layout_errors(self, places: list, train: int, cuda: bool, name, where) -> list[str]:
        """What this layout breaks for it, before any group forms: the weight-sync group holds trainer rank
        0 and every engine, and NCCL refuses two ranks of one GPU. places[r]: rank r's (node, GPU);
        name(r), where(r): how to say rank r and where it runs."""
        members = [0, *range(train, len(places))]
        return gpus_shared("the weight-sync group", members, places, cuda, name, where)

    def sender(self, rank: int, backend: str, **where):
        """Trainer rank `rank`'s sender (where: Sender's host, port, store, prefix, device, timeout_s,
        bucket_bytes), or None."""
        return Sender(**where, backend=backend) if rank == 0 else None

    def receive_failed(self, spec: GroupSpec, first_rank: int, layout: Layout, error: BaseException):
        """The engine's receive ended otherwise than by its workers' answer (it died): the group's members
        find out by themselves (their waits fail)."""


TRANSPORTS = {"group": GroupTransport()}


def named_function(path: str):
    """"module:function" -> the function (imported in the worker process: ext/ is on its path)."""
    import importlib
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class WeightSyncWorker:
    """Mixed into every vLLM worker (worker_extension_cls="weight_sync.WeightSyncWorker"); its
    methods run in the worker process, called by collective_rpc."""

    def receive_weights(self, spec: dict, first_rank: int, layout: Layout, load: tuple | None = None) -> dict:
        """Join spec's group (first time, or a new generation) as first_rank + this worker's rank,
        receive every bucket and load it as it arrives (spec.receiver: another transport's receive does
        this part). load ("module:function", its argument): what to do with the tensors instead of vLLM's
        reload of the model's weights (ext/lora.py: replace the engine's adapter). Returns the tensors
        loaded and seconds: in all (total_s), waiting for the buckets (wait_s; the rest: vLLM's own load)."""
        import time
        t0 = time.monotonic()
        spec = GroupSpec(**spec)
        if spec.receiver:
            return named_function(spec.receiver)(self, spec, first_rank, layout, load)
        rank = first_rank + getattr(self, "rank", 0)
        who = f"engine worker (weight-sync rank {rank}, gen {spec.gen})"
        if getattr(self, "_sync_gen", None) != (spec.host, spec.port, spec.prefix, spec.gen):
            self._sync_pg = None
            try:
                self._sync_pg = open_group(spec, rank)
            except Exception as e:
                raise RuntimeError(f"{who}: joining the weight-sync group at {spec.host}:{spec.port} "
                                   f"failed: {e}") from None
            self._sync_gen = (spec.host, spec.port, spec.prefix, spec.gen)
        wait = [0.0]              # seconds waiting for the buckets
        plan = plan_buckets(layout, spec.bucket_bytes)
        sizes = [[torch.Size(layout[i][1]).numel() for i in idx] for idx in plan]    # elements per tensor

        def post(b: int):         # start receiving bucket b (gloo/NCCL run it on their own thread/stream)
            flat = torch.empty(sum(sizes[b]), dtype=getattr(torch, layout[plan[b][0]][2]),
                               device=self.model_runner.device)
            return flat, self._sync_pg.broadcast(flat, 0)

        def tensors():            # bucket b + 1 arrives while reload_weights loads bucket b
            pending = post(0) if plan else None
            for b, idx in enumerate(plan):
                flat, work = pending
                t = time.monotonic()
                try:
                    work.wait(timedelta(seconds=spec.timeout_s))
                except RuntimeError as e:              # the group is broken: the next sync forms a new one
                    abort_group(self._sync_pg)
                    self._sync_pg, self._sync_gen = None, None
                    raise RuntimeError(f"{who}: weight broadcast bucket {b} failed or timed out: "
                                       f"{e}") from None
                wait[0] += time.monotonic() - t
                pending = post(b + 1) if b + 1 < len(plan) else None
                for i, chunk in zip(idx, torch.split(flat, sizes[b])):
                    yield layout[i][0], chunk.view(layout[i][1])

        self.load(tensors(), load)            # (every tensor: load drains what its loader leaves)
        return {"tensors": len(layout), "wait_s": wait[0], "total_s": time.monotonic() - t0}

    def load(self, stream, load: tuple | None = None):
        """Every (name, tensor) of `stream` into the model with vLLM's own reload (or load's function, given
        this worker, the tensors and its argument). On a GPU the buckets' memory then goes back to the
        device (outside vLLM's sleep-mode pool: a colocated trainer needs it while this engine sleeps)."""
        if load is not None:
            named_function(load[0])(self, dict(stream), load[1])
        else:
            self.model_runner.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
            # (a loader that stopped early: the sender still needs every bucket taken)
            for _ in stream:
                pass
            self._fix_tied_head()
        if torch.device(self.model_runner.device).type == "cuda":
            torch.cuda.empty_cache()

    def _fix_tied_head(self):
        # Tied embeddings: HF checkpoints have no lm_head.weight, so the reload never touches the
        # head. On CPU vLLM keeps its own copy of the head (a prepacked GEMM made after loading),
        # which then still holds the old embedding (verified). Copy and re-run the head's
        # post-load step. On GPU the head shares the embedding's tensor and this is a cheap copy.
        model = self.model_runner.get_model()
        if (getattr(getattr(model, "config", None), "tie_word_embeddings", False)
                and hasattr(model, "lm_head")):
            head, emb = model.lm_head, model.model.embed_tokens.weight
            if head.weight is not emb:
                head.weight.data.copy_(emb.data)
            if getattr(head, "quant_method", None) is not None:
                head.quant_method.process_weights_after_loading(head)
