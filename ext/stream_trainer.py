"""ext/stream_trainer.py: the streaming trainer (--stream-trainer, RollPacker's stream trainer without its
elastic GPUs), a controller.TrainBackend that streams: each complete group is trained on as it arrives,
gradients accumulate, and one optimizer step follows once the batch is complete. The weights do not move
before that step, so it is exact.

    stream = TrainStream(group_size, backend, timeout_s, "grpo")  # rl_step's side: groups in, a worker trains
    step = await rl_step(ctrl, stream, send, layout, spec)            # collect(stream.add) as groups complete
    grad = GradStream(trainer); grad.begin(v); grad.micro(samples, adv); grad.step()   # every trainer rank
    dealer = Dealer(world, micro_batch, max_tokens)          # rank 0: arrivals -> micro-batches per rank

Advantages (--adv-estimator) are per group, so a complete group's are known at once. A token-mean
loss's normaliser (the batch's tokens) is known only at the end, but a gradient is linear in the loss's
weights: each micro-batch's loss is backpropagated times its own token count (seq-mean-token-mean:
its sequence count), and the sum is scaled once, before clipping and the step, by 1 / the total. Under
FSDP every rank runs every forward/backward (a collective): rank 0 deals each micro-batch over the
ranks, a rank with no share runs an empty one (weight 0); the total is all-reduced, so the step
normalises by the batch's tokens over all ranks, as train_step does. The trainer ranks' ops for it are
registered in ranks.OPS. Where it cannot apply (several optimizer steps per batch, --colocate) whole
batches train, and the run says why (fallback).
"""


import asyncio
from dataclasses import dataclass

import torch
import torch.distributed as dist

from config import Extension, extension, opt
from losses import agg_count, estimate_advantages
from model import pack_by_tokens
from buffer import now
from ranks import OPS, TrainerRanks
from runlog import print0


class GradStream:
    """One rank's streamed step over a trainer.Trainer: begin, micro-batches, step."""

    def __init__(self, trainer):
        self.tr = trainer

    def begin(self, version: int | None):
        tr = self.tr
        tr.model.train()
        tr.opt.zero_grad(set_to_none=True)
        self.lr, self.version = tr.set_lr(), version
        self.sums: dict[str, float] = {"loss": 0.0}
        self.den = 0.0                           # the normaliser so far: tokens (or samples) on this rank
        self.gap = {"all": [0.0, 0.0], "on_policy": [0.0, 0.0]}

    def micro(self, samples, advantages: list[float]):
        """One forward/backward; no samples: an empty one (FSDP: every rank runs every pass)."""
        mb = self.tr.micro(samples, advantages, self.version)
        self.tr.prepare(mb)
        num = agg_count(mb["mask"], self.tr.cfg.agg)          # its tokens (or sequences); 0 for an empty one
        self.tr.forward_backward(mb, float(num), self.sums, self.gap)    # unnormalised
        self.den += num

    def step(self) -> dict:
        """Scale the accumulated gradient by 1 / the batch's normaliser, clip, step; the step's metrics."""
        tr = self.tr
        # on the trainer's device: an NCCL group takes only tensors on its GPU
        den = torch.tensor([self.den], dtype=torch.float64, device=tr.device)
        if tr.fsdp:       # FSDP averaged the ranks' gradients: times world / the ranks' total
            dist.all_reduce(den, group=tr.trainer_group)
        scale = tr.world / den.item() if den.item() > 0 else 0.0
        for p in tr.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        local = max(self.den, 1.0)
        means = {k: v / local for k, v in self.sums.items()}     # (this rank's, as train_step reports)
        tr.update_metrics = [{**means, "grad_norm": tr.clip_and_step()}]
        tr.num_steps += 1
        return tr.step_metrics(self.lr, self.gap)


class Dealer:
    """Rank 0: samples in arrival order dealt round-robin over `world` ranks into micro-batches of at most
    micro_batch samples per rank, or (max_tokens > 0) of at most max_tokens padded token slots per rank.
    add() returns the micro-batches that are full; flush() the rest. Each is a list of (samples,
    advantages) per rank."""

    def __init__(self, world: int, micro_batch: int, max_tokens: int = 0):
        self.world, self.micro_batch, self.max_tokens = world, micro_batch, max_tokens
        self.buf: list[tuple] = []           # (sample, advantage)

    def _fits(self, n: int) -> bool:
        """Do the first n buffered samples, dealt round-robin, fit one micro-batch on every rank?"""
        if not self.max_tokens:
            return n <= self.world * self.micro_batch
        for r in range(self.world):
            share = [s.num_tokens for s, _ in self.buf[r:n:self.world]]
            if len(share) > 1 and len(share) * max(share) > self.max_tokens:
                return False
        return True

    def _take(self, n: int) -> list[tuple[list, list]]:
        part, self.buf = self.buf[:n], self.buf[n:]
        return [([s for s, _ in part[r::self.world]], [a for _, a in part[r::self.world]])
                for r in range(self.world)]

    def _prefix(self) -> int:
        """The most buffered samples (at least one) that fit one micro-batch."""
        n = 1
        while n < len(self.buf) and self._fits(n + 1):
            n += 1
        return n

    def add(self, samples, advantages) -> list:
        self.buf += list(zip(samples, advantages))
        out = []
        while self.buf:
            n = self._prefix()
            full = not self.max_tokens and n == self.world * self.micro_batch
            if n == len(self.buf) and not full:    # more may still fit: wait for the next arrivals
                break
            out.append(self._take(n))
        return out

    def flush(self) -> list:
        out = []
        if self.max_tokens and self.world == 1:     # one rank: the rest packed by tokens, longest first
            parts = pack_by_tokens([s.num_tokens for s, _ in self.buf], self.max_tokens)
            out = [[([self.buf[i][0] for i in p], [self.buf[i][1] for i in p])] for p in parts]
            self.buf = []
        while self.buf:
            out.append(self._take(self._prefix()))
        return out


class TrainStream:
    """rl_step's side of the streaming trainer: a controller.TrainBackend that streams. backend: async
    begin(version); async add(samples, advantages) (forward/backward as micro-batches fill); async
    step(version) -> (metrics, probe_ref). A worker task runs them one at a time, in order, while the
    controller goes on collecting. busy_s: the worker's time in them this step (the trainer's busy time)."""
    streams = True

    def __init__(self, group_size: int, backend, timeout_s: float = 600.0, estimator: str = "grpo"):
        self.G, self.backend, self.timeout_s = group_size, backend, timeout_s
        self.estimator = estimator                      # --adv-estimator (losses.ADV_ESTIMATORS)
        self.queue: asyncio.Queue | None = None
        self.worker: asyncio.Task | None = None

    def begin(self, version: int):
        self.version, self.busy_s = version, 0.0
        self.queue = asyncio.Queue()
        self.worker = asyncio.get_running_loop().create_task(self._work(), name="streaming trainer")
        self.queue.put_nowait(("begin",))

    def add(self, group: list):
        """A complete group joins the batch (controller.collect's on_group)."""
        if self.worker.done():          # the trainer failed: say so now, not at the end of the step
            self.worker.result()
        adv = estimate_advantages(torch.tensor([s.reward for s in group]), self.G, self.estimator).tolist()
        self.queue.put_nowait(("add", group, adv))

    async def _work(self):
        while True:
            item = await self.queue.get()
            t = now()
            if item[0] == "begin":
                await self.backend.begin(self.version)
            elif item[0] == "add":
                await self.backend.add(item[1], item[2])
            else:
                out = await self.backend.step(self.version)
                self.busy_s += now() - t
                return out
            self.busy_s += now() - t

    async def finish(self) -> tuple[dict, list | None]:
        """The micro-batches still queued, then the optimizer step: (metrics, probe_ref)."""
        self.queue.put_nowait(("step",))
        try:
            async with asyncio.timeout(self.timeout_s):
                metrics, probe_ref = await self.worker
        except TimeoutError:
            raise TimeoutError(f"trainer rank 0: the streaming trainer's micro-batches and step did not end "
                               f"within {self.timeout_s:.0f}s of the batch's last group") from None
        return {**metrics, "time_trainer_busy": self.busy_s}, probe_ref


# ---------------------------------------------------------------------------------------------
# the trainer ranks' side: rank 0 deals micro-batches; each is one op on every rank (ranks.OPS)


def _begin(ranks: TrainerRanks, op: dict):
    ranks.grad = GradStream(ranks.trainer)
    ranks.grad.begin(op["version"])


def _micro(ranks: TrainerRanks, op: dict):
    ranks.grad.micro(*op["parts"][ranks.trainer.rank])


def _step(ranks: TrainerRanks, op: dict):
    metrics = ranks.grad.step()
    return metrics, (ranks.trainer.probe_logprobs(ranks.probe_ids) if op["probe"] else None)


OPS.update(stream_begin=_begin, stream_micro=_micro, stream_step=_step)


class RanksStream:
    """TrainStream's backend over the trainer ranks, from a worker thread (rank 0's event loop goes on
    collecting meanwhile): begin, a forward/backward per micro-batch the arrivals fill, the step (each also
    callable as it is, *_now, from the thread that drives the ranks)."""

    def __init__(self, ranks: TrainerRanks, probe_due):
        self.ranks, self.probe_due = ranks, probe_due

    def begin_now(self, version: int):
        cfg = self.ranks.trainer.cfg
        self.dealer = Dealer(self.ranks.num_ranks, cfg.micro_batch, cfg.max_tokens_per_micro)
        self.ranks.run({"op": "stream_begin", "version": version})

    def add_now(self, samples, advantages):
        for parts in self.dealer.add(samples, advantages):
            self.ranks.run({"op": "stream_micro", "parts": parts})

    def step_now(self, probe: bool):
        for parts in self.dealer.flush():
            self.ranks.run({"op": "stream_micro", "parts": parts})
        return self.ranks.run({"op": "stream_step", "probe": probe})

    async def begin(self, version: int):
        await asyncio.to_thread(self.begin_now, version)

    async def add(self, samples, advantages):
        await asyncio.to_thread(self.add_now, samples, advantages)

    async def step(self, version: int):
        return await asyncio.to_thread(self.step_now, self.probe_due(version + 1))


@dataclass
class StreamConfig:
    stream_trainer: bool = opt(False, "the streaming trainer (ext/stream_trainer.py): forward/backward "
                                      "on micro-batches of complete groups as they arrive, gradients "
                                      "accumulated, one optimizer step once the batch is complete (exact: "
                                      "the weights do not move before it). Falls back to whole batches, "
                                      "saying so, with "
                                      "--mini-batches > 1 or --ppo-epochs > 1 (each step needs the whole "
                                      "batch) and with --colocate (the engines' GPUs train)")


def fallback(cfg) -> str:
    """Why --stream-trainer cannot apply to this run ('' when it can)."""
    colocate = getattr(cfg.ext.get("colocate"), "colocate", False)
    why = [f"--{n.replace('_', '-')} {getattr(cfg.train, n)}" for n in ("mini_batches", "ppo_epochs")
           if getattr(cfg.train, n) > 1] + (["--colocate"] if colocate else [])
    return (f"--stream-trainer with {' and '.join(why)}: training whole batches (several optimizer steps "
            f"per batch, or the engines' GPUs, need the whole batch first)") if why else ""


@extension
class StreamTrainer(Extension):
    name, Config = "stream_trainer", StreamConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return part.stream_trainer

    def train_backend(self, ranks, probe_due):
        if why := fallback(self.cfg):
            print0(f"train.py: {why}")
            return None
        c = self.cfg
        return TrainStream(c.controller.group_size, RanksStream(ranks, probe_due), c.controller.timeout_s,
                           c.train.adv_estimator)

    def on_row(self, row: dict):
        self.busy = getattr(self, "busy", 0.0) + row.get("time_trainer_busy", 0.0)
        self.steps = getattr(self, "steps", 0.0) + row.get("time_step", 0.0)

    def summary_lines(self, runlog):
        busy = getattr(self, "busy", 0.0) / max(getattr(self, "steps", 0.0), 1e-9)
        return [f"  trainer    busy {busy:.0%} of the step time"]
