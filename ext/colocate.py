"""ext/colocate.py: the synchronous baseline on shared GPUs (--colocate) and the weights handed over, not
sent (--weight-transport ipc, --colocate's: trainer rank i -> engine i as IPC handles of buckets).

    torchrun --nproc-per-node 8 train.py --rollout-gpus 4 --train-gpus 4 --colocate --async-ratio 0
    sender = IpcSender(host, port, store=store, engine=i, device=device)   # trainer rank i (ipc transport)
    sender.send(sender.spec().with_gen(gen, seq), trainer.iter_full_state(), layout)
    IpcReceiver(store, spec, i, layout, device, slots, who).stream()   # engine i's worker, meanwhile

--colocate: rollout rank i runs on trainer rank i's GPU; before each batch trains the engines sleep
(vLLM's sleep mode frees their memory: Extension.before_train), and the next sync wakes them; each engine
takes what is free at its start less what its trainer rank adds while the engine is awake
(ext/memplan.py's colocated_headroom). NCCL refuses a group holding two ranks of one GPU, so colocated
weights go by CUDA IPC.

The ipc transport (weight_sync.TRANSPORTS["ipc"]): no process group. Trainer rank i fills a few flat
buckets (BUFFERS, reused) in the engine's dtype on its own device and posts each bucket's slot on the
run's TCPStore; the first post of a slot in a sync carries its handle (torch.multiprocessing's
reduce_tensor: CUDA IPC on a GPU; on CPU a shared-memory file of the file_system strategy, which an
unrelated process can open: the CPU twin is the same code). Engine i's worker rebuilds the slot, copies
the bucket into memory of its own (vLLM's layer-wise reload keeps the tensors it gets until their layer
is complete), acks, and loads it while the trainer fills the next one; a slot is refilled once its last
bucket is acked. Waits: each one blocks on one key, bounded by the spec's timeout, and names the rank,
the bucket and the phase. A side that fails posts its error in every key the other may be waiting on
(the rollout rank does it for an engine that died), so a failure ends the sync at once on both sides.
Clean-up: CUDA memory goes with its process. The shared-memory files are reference counted by torch:
unlinked when the last process that maps one closes it, and torch_shm_manager unlinks those of processes
that were killed (checked: tests/test_weight_ipc.py).
"""

import contextlib
import dataclasses
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from buffer import Cmd, Command, Phase
from config import Extension, extension, opt
from ext import memplan
from ext.memplan import BUFFERS       # bucket buffers per sender (there: the memory plan counts them)
from weight_sync import TRANSPORTS, GroupSpec, Layout, layout_bytes, pack, plan_buckets


def keys(store, spec: GroupSpec, engine: int):
    """Engine `engine`'s keys for the sync spec names (a generation and a sequence number: never reused)."""
    from torch.distributed import PrefixStore
    return PrefixStore(f"{spec.prefix}/weight-ipc/gen{spec.gen}/engine{engine}/sync{spec.seq}", store)


def connect(spec: GroupSpec):
    from torch.distributed import TCPStore
    return TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))


class PeerFailed(RuntimeError):
    """The other side of the sync failed and said so (it needs no telling back)."""


def take(store, key: str, timeout_s: float, who: str, what: str):
    """Wait for `key` (at most timeout_s), read it and delete it; a failure the peer posted there raises."""
    from torch.distributed import DistStoreError
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        value = pickle.loads(store.get(key))
        store.delete_key(key)
    except DistStoreError:
        raise TimeoutError(f"{who}: {what}: nothing came within {timeout_s:.0f}s") from None
    except RuntimeError as e:        # the store's host is gone
        raise RuntimeError(f"{who}: {what}: lost the store: {e}") from None
    if isinstance(value, dict) and "failed" in value:
        raise PeerFailed(f"{who}: {what}: the other side failed: {value['failed']}")
    return value


def post_failure(store, names: list[str], reason: str):
    """Wake whoever waits on one of `names` with `reason` (best effort: the store may be gone)."""
    with contextlib.suppress(Exception):
        for name in names:
            store.set(name, pickle.dumps({"failed": reason}))


def tell_sender(spec: GroupSpec, engine: int, layout: Layout, reason: str):
    """From outside the worker (its rollout rank): wake engine `engine`'s sender, whichever ack it waits
    for, with `reason` (best effort, within seconds)."""
    from torch.distributed import TCPStore
    with contextlib.suppress(Exception):
        store = TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=10))
        n = len(plan_buckets(layout, spec.bucket_bytes))
        post_failure(keys(store, spec, engine), [f"ack{k}" for k in range(n)], reason)


@contextlib.contextmanager
def file_system_sharing():
    """torch.multiprocessing's file_system strategy, here only: a file in /dev/shm that any process can
    open by name (the default strategy passes a file descriptor, which only a child can receive)."""
    import torch.multiprocessing as mp
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def handle_of(t: torch.Tensor) -> bytes:
    """A handle another process can rebuild `t` from: reduce_tensor's, pickled as torch pickles it for
    a queue, with the GPU's UUID (a device index means another GPU in a process with its own
    CUDA_VISIBLE_DEVICES)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor
    with file_system_sharing():
        payload = bytes(ForkingPickler.dumps(reduce_tensor(t)))
    uuid = str(torch.cuda.get_device_properties(t.device).uuid) if t.is_cuda else ""
    return pickle.dumps((uuid, payload))


def rebuild(handle: bytes, device: torch.device, who: str) -> torch.Tensor:
    """The tensor handle_of() described, in this process (CUDA: on `device`, which must be its GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    uuid, payload = pickle.loads(handle)
    fn, args = pickle.loads(payload)
    if fn is rebuild_cuda_tensor:
        mine = str(torch.cuda.get_device_properties(device).uuid)
        if mine != uuid:
            raise RuntimeError(f"{who}: the trainer's buckets are on GPU {uuid}, this worker's device is GPU "
                               f"{mine}: CUDA IPC hands over memory of one GPU (--colocate pairs them)")
        args = list(args)
        args[6] = device.index        # its storage_device: this process's index of the same GPU
    return fn(*args)


class IpcSender:
    """Trainer rank `rank`'s side, for engine `engine`: BUFFERS bucket buffers on `device`, reused (fresh
    ones only when a bucket outgrows them). `store`: a TCPStore that engine's worker reaches at (host,
    port), the run's; None: host one here on a free port (one process as the trainer: tests, tools)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, store=None, prefix: str = "run",
                 engine: int = 0, device: str = "cpu", timeout_s: float = 600.0, bucket_bytes: int = 64 << 20,
                 rank: int | None = None):
        if store is None:
            from torch.distributed import TCPStore
            store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s))
            port = store.port
        self.store, self.engine, self.device = store, engine, torch.device(device)
        self.spec0 = GroupSpec(host, port, prefix, 0, 2, 1, "none", timeout_s, bucket_bytes, transport="ipc",
                               receiver="ext.colocate:receive")
        self.who = f"trainer rank {engine if rank is None else rank}"
        self.bufs: list[torch.Tensor] = []

    def spec(self, gen: int = 0, num_engines: int = 1, workers_per_engine: int = 1) -> GroupSpec:
        """What a sync rides on (Cmd.SYNC, collective_rpc): the store's address and the keys' prefix; the
        controller numbers the syncs (with_gen). As Sender.spec; the ipc path has no group to size."""
        return self.spec0.with_gen(gen)

    def _buffers(self, nbytes: int):
        if self.bufs and self.bufs[0].numel() >= nbytes:
            return
        self.bufs = []                   # (the old ones: freed; their files go with their last mapping)
        for _ in range(BUFFERS):
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            if buf.device.type == "cpu":
                with file_system_sharing():
                    buf.share_memory_()
            self.bufs.append(buf)

    def send(self, spec: GroupSpec, named, layout: Layout):
        """Hand `named` ((name, tensor) in layout's order, consumed once, bucket by bucket) to engine
        self.engine's worker, which receives at the same time. Returns once the worker has copied
        every bucket. On a failure the iterator is still drained (FSDP's gathers are collectives)."""
        named = iter(named)
        store = keys(self.store, spec, self.engine)
        who = f"{self.who} -> engine {self.engine} (weight-sync ipc, gen {spec.gen}, sync {spec.seq})"
        plan = plan_buckets(layout, spec.bucket_bytes)
        b = 0
        try:
            nbytes = [layout_bytes([layout[i] for i in idx]) for idx in plan]
            self._buffers(max(nbytes, default=0))
            announced = set()
            for b, idx in enumerate(plan):
                slot = b % BUFFERS
                if b >= BUFFERS:
                    take(store, f"ack{b - BUFFERS}", spec.timeout_s, who,
                         f"bucket {b - BUFFERS}: waiting for the worker's ack to reuse its buffer")
                flat = self.bufs[slot][:nbytes[b]].view(getattr(torch, layout[idx[0]][2]))
                pack(named, layout, idx, flat, who)
                if flat.is_cuda:         # written before the worker reads (reduce_tensor's event: only once)
                    torch.cuda.current_stream(flat.device).synchronize()
                handle = b"" if slot in announced else handle_of(self.bufs[slot])
                announced.add(slot)
                store.set(f"b{b}", pickle.dumps((slot, nbytes[b], handle)))
            for k in range(max(0, len(plan) - BUFFERS), len(plan)):
                b = k
                take(store, f"ack{k}", spec.timeout_s, who, f"bucket {k}: waiting for the worker's ack")
        except BaseException as e:
            if not isinstance(e, PeerFailed):
                post_failure(store, [f"b{k}" for k in range(b, len(plan))], f"{who}: bucket {b}: {e}")
            for _ in named:
                pass
            raise


class IpcReceiver:
    """Engine `engine`'s worker side of one sync. stream(): (name, tensor) of every weight, bucket by
    bucket, in memory of its own on `device`; slots: slot -> the sender's buffer, rebuilt (kept across
    syncs: a handle is opened once); waited: seconds spent waiting for buckets. fail(reason): tell
    the sender (whatever failed: the stream, or vLLM's load of what it yielded)."""

    def __init__(self, store, spec: GroupSpec, engine: int, layout: Layout, device: torch.device, slots: dict,
                 who: str):
        self.store, self.spec, self.layout = keys(store, spec, engine), spec, layout
        self.device, self.slots = device, slots
        self.who, self.plan = who, plan_buckets(layout, spec.bucket_bytes)
        self.acked, self.waited = 0, 0.0        # buckets acked so far; seconds waiting for buckets

    def stream(self):
        layout, plan = self.layout, self.plan
        for b, idx in enumerate(plan):
            t = time.monotonic()
            slot, nbytes, handle = take(self.store, f"b{b}", self.spec.timeout_s, self.who,
                                        f"bucket {b}: waiting for it")
            self.waited += time.monotonic() - t
            if nbytes != layout_bytes([layout[i] for i in idx]):
                raise RuntimeError(f"{self.who}: bucket {b} has {nbytes} bytes, this worker's plan "
                                   f"{layout_bytes([layout[i] for i in idx])}: the two sides' layout differ")
            if handle:
                self.slots[slot] = rebuild(handle, self.device, self.who)
            flat = self.slots[slot][:nbytes].view(getattr(torch, layout[idx[0]][2])).clone()
            if flat.is_cuda:             # copied before the sender refills the slot
                torch.cuda.current_stream(flat.device).synchronize()
            self.store.set(f"ack{b}", pickle.dumps(None))
            self.acked = b + 1
            for i, chunk in zip(idx, torch.split(flat, [torch.Size(layout[i][1]).numel() for i in idx])):
                yield layout[i][0], chunk.view(layout[i][1])

    def fail(self, reason: str):
        """Wake the sender, waiting for an ack, with `reason`."""
        post_failure(self.store, [f"ack{k}" for k in range(self.acked, len(self.plan))], reason)


def receive(worker, spec: GroupSpec, first_rank: int, layout: Layout, load) -> dict:
    """The worker side (GroupSpec.receiver): engine `engine`'s buckets, handed over by trainer rank `engine`
    through the run's store, loaded as they arrive (weight_sync.WeightSyncWorker.load)."""
    t0 = time.monotonic()
    engine = (first_rank - 1) // spec.workers_per_engine
    who = f"engine {engine}'s worker (weight-sync ipc, gen {spec.gen}, sync {spec.seq})"
    if getattr(worker, "rank", 0) != 0:
        raise RuntimeError(f"{who}: the ipc transport hands each engine's buckets to one worker; "
                           f"this engine has more (worker {worker.rank})")
    if getattr(worker, "_ipc_at", None) != (spec.host, spec.port):
        worker._ipc_store, worker._ipc_at = connect(spec), (spec.host, spec.port)
        worker._ipc_slots = {}
    rx = IpcReceiver(worker._ipc_store, spec, engine, layout, worker.model_runner.device, worker._ipc_slots,
                     who)
    try:
        worker.load(rx.stream(), load)
    except BaseException as e:
        if not isinstance(e, PeerFailed):
            rx.fail(f"{who}: {e}")
        raise
    return {"tensors": len(layout), "wait_s": rx.waited, "total_s": time.monotonic() - t0}


class IpcTransport:
    """--weight-transport ipc: trainer rank i hands engine i its buckets (every trainer rank sends)."""
    every_rank = True
    engines_after_trainers = True   # an engine starts once its trainer rank holds its model (--colocate)

    def layout_errors(self, places: list, train: int, cuda: bool, name, where) -> list[str]:
        """Trainer rank i and rollout rank i on one GPU (CUDA IPC), on CPU one node (shared memory)."""
        return [f"the ipc transport pairs {name(i)} ({where(i)}) with {name(j)} ({where(j)}): "
                + ("CUDA IPC needs both on one GPU (--colocate)" if cuda
                   else "shared memory needs both on one node")
                for i, j in zip(range(train), range(train, len(places)))
                if (places[i] if cuda else places[i][0]) != (places[j] if cuda else places[j][0])]

    def configure(self, cfg):
        if cfg.rollout_gpus != cfg.train_gpus:
            raise ValueError(f"--weight-transport ipc: trainer rank i hands engine i its weights, so it "
                             f"needs --rollout-gpus == --train-gpus (got {cfg.rollout_gpus} and "
                             f"{cfg.train_gpus})")

    def sender(self, rank: int, backend: str, **where):
        return IpcSender(**where, engine=rank, rank=rank)

    def receive_failed(self, spec: GroupSpec, first_rank: int, layout: Layout, error: BaseException):
        """The engine's receive ended otherwise than by its worker's answer (it died): tell the trainer rank
        waiting for its acks at once, not at its timeout."""
        engine = (first_rank - 1) // spec.workers_per_engine
        tell_sender(spec, engine, layout, f"engine {engine}: its receive ended: {error!r}")


TRANSPORTS["ipc"] = IpcTransport()


# ---------------------------------------------------------------------------------------------
# --colocate


@dataclass
class ColocateConfig:
    colocate: bool = opt(False, "GPU: the synchronous baseline on shared GPUs: rollout rank i on trainer "
                                "rank i's GPU; engines sleep (free their memory) while the trainer trains; "
                                "needs --async-ratio 0 and --rollout-gpus == --train-gpus")


def engine_memory_share(cfg, model_dir: str, who: str) -> float:
    """The engine's --gpu-memory-utilization under --colocate: what is free now (the trainer rank on this GPU
    holds its model) less what that rank adds while the engine is awake (ext/memplan.colocated_headroom),
    as a share of the GPU."""
    from transformers import AutoConfig

    free, total = torch.cuda.mem_get_info()
    fixed = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.85))
    plan = memplan.make_plan(AutoConfig.from_pretrained(model_dir), fixed, gpu=True, gpu_gib=total / 2**30)
    try:
        headroom = memplan.colocated_headroom(plan.trainer, cfg.bucket_mb << 20)
        share = memplan.colocated_share(total, free, headroom, plan.engine["weights"])
    except ValueError as e:
        raise SystemExit(f"train.py: {who}: {e}") from None
    print(f"{who}: --colocate: the engine takes {share:.3f} of the GPU ({free / 2**30:.1f} of "
          f"{total / 2**30:.1f} GiB free at its start)", flush=True)
    return share


async def sleep_engines(ctrl):
    """Every engine ends its work and frees its GPU memory for the trainer on the same GPU (SLEEP, ack
    SLEPT); the next sync_weights wakes them (the load needs them awake). The previous SYNC's acks are
    awaited first (reported by the next sync)."""
    ctrl.unreported = await ctrl.finish_sync()
    for r in range(ctrl.num_ranks):
        await ctrl.buffer.send_command(r, Command(Cmd.SLEEP))
    await ctrl._wait_acks(Phase.SLEPT, None)


@extension
class Colocate(Extension):
    name, Config = "colocate", ColocateConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return part.colocate

    @classmethod
    def configure(cls, cfg, part):
        if not part.colocate:
            return
        if cfg.controller.async_ratio != 0 or cfg.rollout_gpus != cfg.train_gpus:
            raise ValueError("--colocate: the same GPUs generate then train, so it needs --async-ratio 0 and "
                             "--rollout-gpus == --train-gpus")
        if cfg.weight_transport == "group":
            raise ValueError("--colocate --weight-transport group: NCCL refuses a group holding two ranks of "
                             "one GPU; colocated weights go by CUDA IPC (--weight-transport ipc or auto)")
        if cfg.weight_transport == "auto":
            cfg.weight_transport = "ipc"

    def before_launch(self):
        if not torch.cuda.is_available():
            raise SystemExit("train.py: --colocate needs GPUs: vLLM's sleep mode, which frees an engine's "
                             "memory while the trainer trains on the same GPU, is CUDA-only")

    def engine_args(self, model_dir: str, device: str, who: str):
        args = {"enable_sleep_mode": True}
        if not self.cfg.rollout.gpu_memory_utilization:
            args["gpu_memory_utilization"] = engine_memory_share(self.cfg, model_dir, who)
        return args

    async def before_train(self, ctrl):
        await sleep_engines(ctrl)                  # their GPUs' memory, for training

    def after_train(self, trainer):
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()               # the engine on this GPU wakes for the sync next
