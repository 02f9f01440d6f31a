"""trainer_ranks.py: the trainer ranks in lockstep under rank 0 (TrainerRanks), and `collective`, the
one wrapper of a torch.distributed call that names the rank and phase when it fails or times out.

    ranks = TrainerRanks(trainer, num_ranks, group, out_dir, model_dir, probe_ids, store=store)
    if rank != 0: ranks.follow()                           # the followers: run rank 0's ops until "stop"
    metrics = ranks.train(samples, advantages, version)    # rank 0: every rank trains its shard

Each op ("train", "stream_*", "send", "probe", "save", "stop") is decided by rank 0 and run by every
rank, because FSDP's collectives need all of them (trainer.py holds what each rank runs).
Design notes: DESIGN.md#trainerpy
"""

import itertools
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from stream import Dealer, GradStream
from trainer import Trainer


PROBE_TEXT = "123+456=579"   # the weight-sync probe: any token sequence the model's vocab covers


def collective(phase: str, fn, *args, **kwargs):
    """Run a torch.distributed call; a timeout or a dead peer fails naming this rank and the phase
    (the groups carry the timeout: --timeout-s, longer for the default group's start-up)."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise RuntimeError(f"rank {os.environ.get('RANK', '?')}: {phase} failed or timed out: {e}") from None


class TrainerRanks:
    """The trainer ranks in lockstep. Rank 0 decides each op ("train", "stream_*", "send", "probe", "save",
    "stop") and broadcasts it over the trainer group; then every rank runs it, because FSDP's collectives
    need all of them. Ranks > 0 just follow().

    Between two ops a follower waits as long as rank 0 collects a batch or evaluates, which may outlast
    --timeout-s, the group's timeout. So a follower does not wait in the op's broadcast: rank 0 first
    posts "op" to every follower's mailbox on `store`, and from a daemon thread "beat" every
    timeout_s / 4 (keys msg<n>/rank<r>: ops and heartbeats in one numbered sequence); a follower enters
    the broadcast once its mailbox says "op", and fails when nothing, not even a heartbeat, came for
    timeout_s: --timeout-s bounds a dead rank 0, not a long step. (The heartbeat shows that rank 0's
    process lives, not that it makes progress: rank 0's own waits carry their own timeouts, and when
    one fails it still tells the followers 'stop'.)"""

    def __init__(self, trainer: Trainer, num_ranks: int, group, out_dir: str, model_dir: str,
                 probe_ids: list[int], store=None, timeout_s: float = 1800.0):
        self.trainer, self.num_ranks, self.group = trainer, num_ranks, group
        self.out_dir, self.model_dir, self.probe_ids = out_dir, model_dir, probe_ids
        # rank 0: weight_sync.Sender; ipc transport: every rank's weight_ipc.IpcSender (set by train.py)
        self.sender = None
        self.release_after_train = False   # --colocate: the GPU's cached blocks go back after each step
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

    def train(self, batch, advantages: list[float], version: int, probe: bool):
        """One batch on every rank (rank r gets batch[r::n]) at policy `version`; returns rank 0's
        metrics and, if `probe`, the trainer's probe logprobs under the new weights."""
        n = self.num_ranks
        return self._run({"op": "train", "samples": [batch[r::n] for r in range(n)], "version": version,
                          "advantages": [advantages[r::n] for r in range(n)], "probe": probe})

    def save(self, state: dict):
        self._run({"op": "save", "state": state})

    # the streaming trainer (stream.py): rank 0 deals micro-batches; each is one op on every rank
    def stream_begin(self, version: int):
        cfg = self.trainer.cfg
        self.dealer = Dealer(self.num_ranks, cfg.micro_batch, cfg.max_tokens_per_micro)
        self._run({"op": "stream_begin", "version": version})

    def stream_add(self, samples, advantages: list[float]):
        """Complete groups join the batch: a forward/backward for each micro-batch they fill."""
        for parts in self.dealer.add(samples, advantages):
            self._run({"op": "stream_micro", "parts": parts})

    def stream_step(self, probe: bool):
        """The rest of the batch, then the optimizer step; returns train()'s (metrics, probe logprobs)."""
        for parts in self.dealer.flush():
            self._run({"op": "stream_micro", "parts": parts})
        return self._run({"op": "stream_step", "probe": probe})

    def send_weights(self, group, meta):
        """The weights into every engine over `group` (weight_sync.GroupSpec): each trainer rank
        gathers them weight by weight (FSDP), rank 0 broadcasts them bucket by bucket (self.sender).
        Runs in the controller's thread while rank 0's event loop waits."""
        self._run({"op": "send", "group": group, "meta": meta})

    def _send(self, group, meta):
        """This rank's part of a sync: its sender (rank 0's broadcast; under the ipc transport every
        rank's own engine) sends what every rank gathers. ipc over several ranks: every rank's outcome
        goes to rank 0, which raises for any (the controller then syncs again); the others go on."""
        tr, ipc = self.trainer, getattr(group, "transport", "group") == "ipc"
        dtypes = [getattr(torch, dtype) for _, _, dtype in meta]    # gathered in the engine's dtype
        if self.sender is None:
            for _ in tr.iter_full_state(dtypes):
                pass
            error = None
        elif not ipc or self.num_ranks == 1:
            return self.sender.send(group, tr.iter_full_state(dtypes), meta)
        else:
            try:
                self.sender.send(group, tr.iter_full_state(dtypes), meta)
                error = None
            except Exception as e:
                error = str(e)
        if ipc and self.num_ranks > 1:
            errors = [None] * self.num_ranks
            collective("gathering the trainer ranks' ipc sends", dist.all_gather_object, errors, error,
                       group=self.group)
            if tr.rank == 0 and any(errors):
                raise RuntimeError("; ".join(e for e in errors if e))

    def probe(self) -> list[float]:
        """The trainer's logprobs of the probe sequence (a forward pass on every rank under FSDP)."""
        return self._run({"op": "probe"})

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
                       group=self.group)
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

    def _run(self, op: dict):
        self._tell(op)
        return self._do(op)

    def _tell(self, op: dict):
        if self.num_ranks > 1:
            collective(f"posting '{op['op']}' to the trainer ranks' mailboxes", self._post, "op")
            collective(f"sending '{op['op']}' to the trainer ranks", dist.broadcast_object_list, [op], src=0,
                       group=self.group)

    def _do(self, op: dict):
        if self.num_ranks > 1:    # FSDP: the op's collectives (batch plan, forward/backward, gathers) name it
            return collective(f"the trainer ranks' '{op['op']}'", self._op, op)
        return self._op(op)

    def _op(self, op: dict):
        tr = self.trainer
        if op["op"] == "train":
            metrics = tr.train_step(op["samples"][tr.rank], op["advantages"][tr.rank], op["version"])
            probe = tr.probe_logprobs(self.probe_ids) if op["probe"] else None
            if self.release_after_train and tr.device.type == "cuda":
                torch.cuda.empty_cache()    # --colocate: the engine on this GPU wakes for the sync next
            return metrics, probe
        if op["op"] == "send":                                         # gathers: collective under FSDP
            return self._send(op["group"], op["meta"])
        if op["op"] == "stream_begin":
            self.grad = GradStream(tr)
            self.grad.begin(op["version"])
        if op["op"] == "stream_micro":
            self.grad.micro(*op["parts"][tr.rank])
        if op["op"] == "stream_step":
            metrics = self.grad.step()
            return metrics, (tr.probe_logprobs(self.probe_ids) if op["probe"] else None)
        if op["op"] == "probe":
            return tr.probe_logprobs(self.probe_ids)
        if op["op"] == "save":
            tr.save_checkpoint(self.out_dir, op["state"], self.model_dir)
