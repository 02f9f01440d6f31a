"""ranks.py: the ranks of one torchrun job. Who is who (init_distributed, from torchrun's environment only),
what a layout cannot run (layout_errors, before any group forms), where each engine runs; `collective`, the
one wrapper of a torch.distributed call that names the rank and phase when it fails or times out; and the
trainer ranks in lockstep under rank 0 (TrainerRanks).

    rank, world, device, engine_core, trainer_group, store = init_distributed(cfg)
    ranks = TrainerRanks(trainer, num_ranks, trainer_group, out_dir, model_dir, probe_ids, store=store)
    if rank != 0: ranks.follow()                           # the followers: run rank 0's ops until "stop"
    metrics, probe = await ranks.train(samples, advantages, version)   # rank 0: every rank its shard

Ranks [0, train_gpus) train; each other rank runs one engine. Each trainer op ("train", "send", "probe",
"save", "stop"; OPS, which extensions extend) is decided by rank 0 and run by every rank, because FSDP's
collectives need all of them (trainer.py holds what each rank runs).
Design notes: DESIGN.md#roles-and-process-groups
"""

import itertools
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from buffer import PROBE_TEXT
from trainer import Trainer
from weight_sync import TRANSPORTS, gpus_shared


def collective(phase: str, fn, *args, **kwargs):
    """Run a torch.distributed call; a timeout or a dead peer fails naming this rank and the phase
    (the groups carry the timeout: --timeout-s, longer for the default group's start-up)."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise RuntimeError(f"rank {os.environ.get('RANK', '?')}: {phase} failed or timed out: {e}") from None


class TrainerRanks:
    """The trainer ranks in lockstep. Rank 0 decides each op ("train", "send", "probe", "save", "stop", and
    what ext/ adds to OPS) and broadcasts it over the trainer group; then every rank runs it, because FSDP's
    collectives need all of them. Ranks > 0 just follow().

    Between two ops a follower waits as long as rank 0 collects a batch or evaluates, which may outlast
    --timeout-s, the group's timeout. So a follower does not wait in the op's broadcast: rank 0 first
    posts "op" to every follower's mailbox on `store`, and from a daemon thread "beat" every
    timeout_s / 4 (keys msg<n>/rank<r>: ops and heartbeats in one numbered sequence); a follower enters
    the broadcast once its mailbox says "op", and fails when nothing, not even a heartbeat, came for
    timeout_s: --timeout-s bounds a dead rank 0, not a long step. (The heartbeat shows that rank 0's
    process lives, not that it makes progress: rank 0's own waits carry their own timeouts, and when
    one fails it still tells the followers 'stop'.)"""

    def __init__(self, trainer: Trainer, num_ranks: int, trainer_group, out_dir: str, model_dir: str,
                 probe_ids: list[int], store=None, timeout_s: float = 1800.0):
        self.trainer, self.num_ranks, self.trainer_group = trainer, num_ranks, trainer_group
        self.out_dir, self.model_dir, self.probe_ids = out_dir, model_dir, probe_ids
        # this rank's sender (weight_sync.TRANSPORTS' sender: rank 0's, or every rank's), set by train.py
        self.sender = None
        self.every_rank_sends = False      # the transport's every_rank: each rank sends, tells rank 0 how
        self.after_train: list = []        # (trainer) -> None after each batch, every rank (the extensions')
        self.probe_due = lambda version: False    # (version) -> probe the weights after this sync? (train.py)
        self.store, self.timeout_s = store, timeout_s     # the mailboxes; a follower's longest wait
        if num_ranks > 1 and store is None:
            raise ValueError("TrainerRanks: more than one trainer rank needs a store (for the mailboxes)")
        self.posted = 0                  # rank 0: messages posted to each mailbox so far
        self.lock = threading.Lock()     # the heartbeat thread posts too: one sequence, in order
        self.quit = threading.Event()
        self.heartbeat = None
        if num_ranks > 1 and trainer.rank == 0:
            self.heartbeat = threading.Thread(target=self._beat, name="trainer rank 0 heartbeat", daemon=True)
            self.heartbeat.start()

    async def train(self, batch, advantages: list[float], version: int):
        """controller.WholeBatch's train: one batch on every rank (rank r trains batch[r::n]) at policy
        `version`; returns rank 0's metrics and, when a probe is due at version + 1 (probe_due), the
        trainer's probe logprobs under the new weights. It runs on rank 0's event loop, which has nothing
        else to do meanwhile (the rollout ranks go on in their own processes).
        From controller.rl_step to the optimizer, each hop for one reason: rl_step -> the TrainBackend's
        finish (the seam that decides when groups train: whole or streamed) -> this (every rank gets its
        shard) -> run (rank 0 tells the followers the op: FSDP's collectives need them all in it) -> OPS
        (the op's body, the same on every rank: train_step, the probe, the extensions' after_train) ->
        Trainer.train_step."""
        n, probe = self.num_ranks, self.probe_due(version + 1)
        return self.run({"op": "train", "samples": [batch[r::n] for r in range(n)], "version": version,
                         "advantages": [advantages[r::n] for r in range(n)], "probe": probe})

    def save(self, state: dict):
        self.run({"op": "save", "state": state})

    def send_weights(self, spec, layout):
        """The weights into every engine as `spec` says (weight_sync.GroupSpec): each trainer rank
        gathers them weight by weight (FSDP), rank 0 broadcasts them bucket by bucket (self.sender).
        Runs in the controller's thread while rank 0's event loop waits."""
        self.run({"op": "send", "spec": spec, "layout": layout})

    def _send(self, spec, layout):
        """This rank's part of a sync: its sender (rank 0's broadcast; a transport whose every rank sends:
        its own engine's) sends what every rank gathers. Every rank sending, over several ranks: every
        rank's outcome goes to rank 0, which raises for any (the controller then syncs again); the others
        go on."""
        tr, each, error = self.trainer, self.every_rank_sends and self.num_ranks > 1, None
        named = tr.iter_full_state([getattr(torch, dtype) for _, _, dtype in layout])  # in the engine's dtype
        if self.sender is None:
            for _ in named:                            # this rank's part of the gathers, nothing sent
                pass
        else:
            try:
                self.sender.send(spec, named, layout)
            except Exception as e:
                if not each:
                    raise
                error = str(e)
        if each:
            errors = [None] * self.num_ranks
            collective("gathering the trainer ranks' sends", dist.all_gather_object, errors, error,
                       group=self.trainer_group)
            if tr.rank == 0 and any(errors):
                raise RuntimeError("; ".join(e for e in errors if e))

    def probe(self) -> list[float]:
        """The trainer's logprobs of the probe sequence (a forward pass on every rank under FSDP)."""
        return self.run({"op": "probe"})

    def stop(self):
        if self.heartbeat:        # no heartbeat after 'stop': the followers read no further
            self.quit.set()
            self.heartbeat.join(self.timeout_s)
        self._tell({"op": "stop"})

    def follow(self):
        for n in itertools.count():
            if self._next_message(n) == "beat":
                continue
            box = [None]       # rank 0 posted "op" just before its broadcast: this wait is short
            collective("receiving trainer rank 0's next op", dist.broadcast_object_list, box, src=0,
                       group=self.trainer_group)
            if box[0]["op"] == "stop":
                return
            self._do(box[0])

    def _next_message(self, n: int) -> str:
        """Follower: rank 0's message n ("op" or "beat"), within timeout_s."""
        me, t = self.trainer.rank, time.monotonic()
        key = f"msg{n}/rank{me}"
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
            kind = self.store.get(key).decode()
            self.store.delete_key(key)            # read once: the store does not grow with the run
            return kind
        except dist.DistStoreError:              # the wait timed out
            raise RuntimeError(f"trainer rank {me}: trainer rank 0 silent for {time.monotonic() - t:.1f} s "
                               f"(no op, no heartbeat) while waiting for its next op") from None
        except RuntimeError as e:                # the store's host is gone (without torchrun's agent: rank 0)
            raise RuntimeError(f"trainer rank {me}: lost the store while waiting for trainer rank 0's next "
                               f"op (is trainer rank 0 dead?): {e}") from None

    def _post(self, kind: str):
        """Rank 0: message `kind` into every follower's mailbox."""
        with self.lock:
            for r in range(1, self.num_ranks):
                self.store.set(f"msg{self.posted}/rank{r}", kind)
            self.posted += 1

    def _beat(self):
        """Rank 0's heartbeat thread, until stop()."""
        while not self.quit.wait(self.timeout_s / 4):
            try:
                self._post("beat")
            except RuntimeError as e:     # the store is gone: the followers and this rank's next op will say
                print(f"trainer rank 0: heartbeat stopped: {e}", file=sys.stderr, flush=True)
                return

    def run(self, op: dict):
        """Rank 0: op on every rank (each in _do); returns rank 0's result."""
        self._tell(op)
        return self._do(op)

    def _tell(self, op: dict):
        if self.num_ranks > 1:
            collective(f"posting '{op['op']}' to the trainer ranks' mailboxes", self._post, "op")
            collective(f"sending '{op['op']}' to the trainer ranks", dist.broadcast_object_list, [op], src=0,
                       group=self.trainer_group)

    def _do(self, op: dict):
        if self.num_ranks > 1:    # FSDP: the op's collectives (batch plan, forward/backward, gathers) name it
            return collective(f"the trainer ranks' '{op['op']}'", OPS[op["op"]], self, op)
        return OPS[op["op"]](self, op)


def trainer_ranks(cfg, exts, rank: int, device: str, trainer_group, model_dir: str, state,
                  base_dir: str, tokenizer, mailbox=None, **where) -> TrainerRanks:
    """This trainer rank's Trainer in lockstep with the others (TrainerRanks: mailbox, the store their ops are
    posted on), with its weight sender (the transport's; where: the sender's host, port, store, prefix)."""
    timeout, transport = cfg.controller.timeout_s, TRANSPORTS[cfg.weight_transport]
    trainer = Trainer(model_dir, cfg.train, trainer_group if cfg.train_gpus > 1 else None, device,
                      weights=exts.first("trainer_weights"), ref_dir=base_dir,   # (--kl-coef's reference)
                      temperature=cfg.rollout.temperature)              # log-probs of what the engines sample
    if state:
        trainer.load_optimizer(Path(cfg.out_dir) / "checkpoint")
        trainer.num_steps = state["step"]
    if getattr(transport, "engines_after_trainers", False):   # (ipc: the engines start once the trainers
        collective("the trainer ranks' models built, before the engines start", dist.barrier)   # hold theirs)
    # followers wait for rank 0's next op on the store, not in a collective: a step may outlast --timeout-s
    ranks = TrainerRanks(trainer, cfg.train_gpus, trainer_group, cfg.out_dir, model_dir,
                         tokenizer.encode(PROBE_TEXT), store=mailbox, timeout_s=timeout)
    ranks.after_train = [e.after_train for e in exts if hasattr(e, "after_train")]
    ranks.probe_due = lambda v: cfg.check_sync_every > 0 and v % cfg.check_sync_every == 0
    # the weights go to the engines by the transport's senders (rank 0's, or every rank's); engines receive
    # in their own dtype
    ranks.sender = transport.sender(rank, "nccl" if device.startswith("cuda") else "gloo", device=device,
                                    timeout_s=timeout, bucket_bytes=cfg.bucket_mb << 20, **where)
    ranks.every_rank_sends = transport.every_rank
    return ranks


def _train(ranks: TrainerRanks, op: dict):
    tr = ranks.trainer
    metrics = tr.train_step(op["samples"][tr.rank], op["advantages"][tr.rank], op["version"])
    probe = tr.probe_logprobs(ranks.probe_ids) if op["probe"] else None
    for hook in ranks.after_train:
        hook(tr)
    return metrics, probe


# op name -> what every trainer rank runs for it (ext/stream_trainer.py adds its own)
OPS = {"train": _train,
       "send": lambda ranks, op: ranks._send(op["spec"], op["layout"]),    # gathers: collective under FSDP
       "probe": lambda ranks, op: ranks.trainer.probe_logprobs(ranks.probe_ids),
       "save": lambda ranks, op: ranks.trainer.save_checkpoint(ranks.out_dir, op["state"], ranks.model_dir)}


# ---------------------------------------------------------------------------------------------
# who is who: torchrun's environment, the layout check, where each engine runs


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


def pin_engine_gpu(device: str):
    """GPU: this rollout rank's engine processes see only its GPU (CUDA_VISIBLE_DEVICES, engine_gpu)."""
    if device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu(int(os.environ.get("LOCAL_RANK", 0)),
                                                        os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                        torch.cuda.device_count())


def rank_places(world: int, local_world: int, visible: str | None, count: int) -> list[tuple[int, str]]:
    """(node, GPU) of every global rank from torchrun's environment alone: rank r is local rank
    r % local_world on node r // local_world (torchrun starts as many ranks on every node) and takes
    the GPU init_distributed and run_rollout give that local rank (vllm_engine.engine_gpu)."""
    return [(r // local_world, engine_gpu(r % local_world, visible, count)) for r in range(world)]


def layout_errors(places: list[tuple[int, str]], train: int, transport: str, cuda: bool) -> list[str]:
    """What is wrong with this layout, before any group forms: an NCCL trainer group (GPU) holding two ranks
    of one GPU, which NCCL refuses; and what the weight transport cannot run on (its layout_errors: the
    group's weight-sync group likewise, an ipc pair not on one GPU)."""
    def name(r: int) -> str:
        return f"trainer rank {r}" if r < train else f"rollout rank {r - train} (global rank {r})"

    def where(r: int) -> str:
        return f"node {places[r][0]}'s GPU {places[r][1]}" if cuda else f"node {places[r][0]}"
    return (gpus_shared("the trainer group (FSDP)", range(train), places, cuda, name, where)
            + TRANSPORTS[transport].layout_errors(places, train, cuda, name, where))


def init_distributed(cfg, extra: int = 0):
    """This rank in torchrun's job (train.py's Config; extra: the ranks extensions add after the rollout
    ranks, each running an engine: a teacher's, a judge's): the checks, the default group (gloo) and the
    trainer group (NCCL on GPU), its device and CPU cores. -> (rank, world, device, engine core (a rollout
    rank's on CPU, else ""), trainer group, store)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        sys.exit(f"train.py: {', '.join(missing)} not set: launch with torchrun, e.g.\n"
                 f"  torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.rollout_gpus + cfg.train_gpus + extra != world:
        sys.exit(f"train.py: --rollout-gpus {cfg.rollout_gpus} + --train-gpus {cfg.train_gpus}"
                 + (f" + {extra} of the extensions' ranks" if extra else "")
                 + f" = {cfg.rollout_gpus + cfg.train_gpus + extra}, but torchrun started {world} ranks "
                 f"(WORLD_SIZE; train.py --print-world-size counts them)")
    cuda = torch.cuda.is_available()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    errors = layout_errors(rank_places(world, local_world, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                       torch.cuda.device_count() if cuda else 1),
                           cfg.train_gpus, cfg.weight_transport, cuda)
    if errors:
        sys.exit("train.py: this layout cannot run (torchrun's ranks on their GPUs, before any group "
                 "forms):\n  " + "\n  ".join(errors))
    if cuda:      # this rank's GPU; under --colocate a trainer rank and a rollout rank share one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    # long: start-up collectives wait for rank 0 to build the tiny model, or (ipc) the trainers' models
    long = timedelta(seconds=max(cfg.controller.timeout_s, cfg.controller.startup_timeout_s))
    # The default group's store, under a prefix per torchrun restart: torchrun's static rendezvous keeps
    # one store for every restart, and a restarted rank would read the address its killed predecessor left.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"     # torchrun's agent hosts the store
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=not agent and rank == 0,
        timeout=long))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=long)
    trainer_group = dist.new_group(list(range(cfg.train_gpus)), backend="nccl" if cuda else "gloo",
                                   timeout=timedelta(seconds=cfg.controller.timeout_s))
    # explicit: worker threads default to cuda:0
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    engine_core = ""
    if not cuda:   # CPU: trainer rank t on host core t (one thread); the other ranks share the host cores,
        # and a rollout rank's engine gets an engine core (an extension's rank places its own: ext/served.py)
        host, engines = cpu_layout(sorted(os.sched_getaffinity(0)), cfg.rollout_gpus)
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {host[rank % len(host)]} if rank < cfg.train_gpus else set(host))
        if cfg.train_gpus <= rank < cfg.train_gpus + cfg.rollout_gpus:
            engine_core = str(engines[(rank - cfg.train_gpus) % len(engines)])
    # the default group's TCPStore: the weight-sync group meets there, and the trainer ranks' mailboxes
    return rank, world, device, engine_core, trainer_group, store.underlying_store
