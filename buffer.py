"""buffer.py: the SampleBuffer. Shared task and sample queues, per-sample versions, freshness.

    controller (trainer rank 0)                      rollout ranks (env_manager.py)
      put_tasks([RolloutTask])  -- task queue ---->   exchange(rank, samples, ...): a control-loop tick's
      get_sample()           <--- sample queue ----     traffic in one round trip; poll_tasks(n)
      send_command(rank, Command) -- command queues ->  (commands: weight sync, aborts, stop)
      get_ack()              <--- ack queue -------    put_ack(Ack)

What lives here:
- the control protocol's messages, in one place: Command and Ack, their kinds and phases named by
  the Cmd and Phase enums (who sends what, and which timeout bounds it: DESIGN.md#controllerpy);
- the transport: LocalQueues (asyncio, one process: tests, tools/sim.py) or ManagerQueues (served
  over TCP by trainer rank 0 with an authkey: train.py), a list of items per round trip, wrapped by
  SampleBuffer, whose methods are async and all take a timeout;
- Freshness, the freshness rule (the paper's async ratio), the one place it lives;
- GroupAssembler: GRPO groups by group_id, with the freshness rule and dynamic filtering.

Design notes: DESIGN.md#bufferpy
"""

import asyncio
import collections
import contextlib
import enum
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.managers import BaseManager

from task import Problem


@dataclass
class RolloutTask:
    """One unit of rollout work on the task queue."""
    task_id: str              # unique
    group_id: str             # the prompt: a GRPO group is all samples of one group_id
    problem: Problem
    num_samples: int = 1      # 1 with prompt replication; group_size for the batch baseline
    admit_version: int = 0    # policy version when the controller admitted it
    env: str = ""             # "" = single-turn RLVR; else an environment name (rollout.ENVS)
    eval_temperature: float | None = None   # an evaluation task: sampled at this temperature (0 = greedy),
                                            # never trained on, never aborted as stale


@dataclass
class Sample:
    """One finished trajectory, ready for training."""
    task_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]           # model tokens, and for multi-turn also observation tokens
    logprobs: list[float]             # behaviour logprob per response token (0 on observations)
    loss_mask: list[int]              # 1 on model tokens, 0 on observation tokens
    versions: list[int]               # policy version per model token
    reward: float
    finish_reason: str = "stop"
    rank: int = -1                    # rollout rank that produced it
    num_turns: int = 1
    admit_version: int = 0
    failed: bool = False              # env raised or timed out: recorded, never trained on
    meta: dict = field(default_factory=dict)
    # more per-token values by name, one per model token like `versions` (an ext/ file's: the teacher's
    # log-probs); each reaches the loss as losses.Terms.fields[name], on the loss mask's columns
    token_fields: dict[str, list[float]] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        """The policy version of its oldest token (none: the version it was admitted under), as
        rollout.Trajectory's: what the freshness rule judges."""
        return min(self.versions) if self.versions else self.admit_version

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def notice(self) -> bool:
        """A rank's notice that this sample will never come (its own abort, its engine lost): no failure."""
        return self.failed and ("aborted" in self.meta or "engine_lost" in self.meta)


class Freshness:
    """The freshness rule, the paper's async ratio: a sample may train the update that makes version + 1
    (the trainer at `version`) only if its oldest token came from a policy no older than version - max_lag.
    The controller holds one: its GroupAssembler asks it of every sample, admission sizes its capacity by
    max_lag, and every SYNC carries it to the rollout ranks, which abort the running work that can no longer
    pass it. An Extension's `freshness` hook may give another: override fresh() (a bound per group, say)
    and end_step() (an adaptive bound that moves after each step); max_lag must stay the most any group may
    lag (admission and forgetting use it)."""

    def __init__(self, async_ratio: int):
        self.max_lag = async_ratio

    def fresh(self, oldest_version: int, version: int, group_id: str = "") -> bool:
        return oldest_version >= version - self.max_lag

    def end_step(self, ctrl, info: dict):
        """A step's batch is complete (info: its collect metrics); an adaptive rule updates itself here."""

    def __str__(self) -> str:
        return f"{type(self).__name__} (max lag {self.max_lag} versions; --async-ratio)"

    @staticmethod
    def of(rule: "Freshness | int") -> "Freshness":
        """A rule as given, or the async ratio's for an int."""
        return rule if isinstance(rule, Freshness) else Freshness(rule)


# ---------------------------------------------------------------------------------------------
# the control protocol: controller -> rollout rank commands, rollout rank -> controller acks


class Cmd(enum.StrEnum):
    SYNC = "sync"                  # load weights `version`: suspend, receive into the engine, resume, ack
    ABORT_GROUPS = "abort_groups"  # the controller no longer wants these groups: abort their work
    SLEEP = "sleep"                # --colocate: end all work, free the engine's memory for training
                                   # (ack SLEPT)
    STOP = "stop"                  # end the rollout loop (ack STOPPED)


class Phase(enum.StrEnum):
    READY = "ready"                # the rank's engine is up and its rollout loop runs; carries the probe
    SYNCED = "synced"              # SYNC: received, loaded, resumed, stale work aborted; engine stats, probe
    REPLACED = "replaced"          # the rank's engine was replaced after the first sync: it waits for a SYNC
    SLEPT = "slept"                # SLEEP: the engine is asleep; the next SYNC wakes it
    STOPPED = "stopped"            # STOP: every trajectory ended; carries the rank's counters


@dataclass
class Command:
    kind: Cmd
    version: int | None = None             # SYNC: the version being loaded
    layout: list | None = None             # SYNC: (name, shape, dtype) per weight, the receiver's bucket plan
    spec: object = None                    # SYNC: the weight-sync group to receive over
                                           # (weight_sync.GroupSpec)
    probe: bool = False                    # SYNC: score the probe sequence after loading (ack.probe)
    freshness: Freshness | None = None     # SYNC: the controller's freshness rule (running work that fails
                                           # it is aborted); None: the rank keeps its own
    group_ids: list[str] = field(default_factory=list)   # ABORT_GROUPS


@dataclass
class Ack:
    rank: int                              # rollout rank index (its command queue)
    phase: Phase
    version: int | None = None             # SYNCED: the version of the SYNC being acked
    engine: dict | None = None             # READY, SYNCED: proxy.stats() (busy/idle seconds...)
    probe: list[float] | None = None       # READY, and SYNCED with Command.probe:
                                           # engine logprobs of the probe
    timings: dict | None = None            # SYNCED: receive_s (transfer into the engine),
                                           # load_s (suspend + that + resume), vllm_load_s
    needs_weights: bool = False            # SYNCED: the broadcast failed;
                                           # the engine waits, suspended, for a new SYNC
    stats: dict | None = None              # STOPPED: the env manager's counters
    events: list[dict] | None = None       # SYNCED, STOPPED: the rank's timeline events
                                           # since its last ack (timeline.py)


# ---------------------------------------------------------------------------------------------
# transports


def die_with_parent(sig: int = signal.SIGKILL, watch: bool = False):
    """Make this process end when its parent dies, even when the parent is SIGKILLed.
    watch=False: the kernel sends `sig` (Linux prctl PR_SET_PDEATHSIG). It fires when the parent
    *thread* that started this process ends, so use it only for processes started from a parent's
    main thread (the queue server, torchrun's ranks).
    watch=True: a daemon thread polls the parent every second and exits this process when it is
    gone (any thread may have started it: vLLM's engine processes)."""
    ppid = os.getppid()
    if watch:
        def watcher():
            while os.getppid() == ppid:
                time.sleep(1.0)
            os._exit(1)
        import threading
        threading.Thread(target=watcher, name="die-with-parent", daemon=True).start()
        return
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))    # 1 = PR_SET_PDEATHSIG
    if os.getppid() != ppid:                                 # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def now() -> float:
    """The one clock every timeout and duration of the loop reads: the running event loop's time (outside a
    loop, time.monotonic()). Real time in a run, virtual under a fast-forwarded loop (looptime: the unit
    tests and tools/sim.py), so the same code's waits and timings hold in both."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


QUEUE_NAMES = ("tasks", "samples", "acks")
PROBE_TEXT = "123+456=579"   # the weight-sync probe (READY, SYNCED): any text the model's vocab covers


class ServedQueue:
    """A FIFO queue whose every call moves a whole list of items: one TCP round trip each where it lives in
    the manager's server process (ManagerQueues), at once in-process (LocalQueues). deque append/popleft are
    atomic: the server's per-connection threads need no lock."""

    def __init__(self):
        self.items = collections.deque()

    def put_many(self, items: list):
        self.items.extend(items)

    def put_front(self, items: list):
        """Back to the front, in their order (one call: no other client's items come between)."""
        self.items.extendleft(reversed(items))

    def get_many(self, max_items: int) -> list:
        out = []
        while len(out) < max_items:
            try:
                out.append(self.items.popleft())
            except IndexError:
                break
        return out

    def qsize(self) -> int:
        return len(self.items)


class Queues:
    """What the transports share: the queues by name, each a ServedQueue (or a manager's proxy of one) that
    queue(name) gives; rollout rank r's commands are "commands<r>"."""

    def q(self, name: str, rank: int | None = None):
        return self.queue(f"commands{rank}" if name == "commands" else name)

    def put_many_nowait(self, name, items, rank=None):
        self.q(name, rank).put_many(items)

    def get_many_nowait(self, name, max_items: int, rank=None) -> list:
        return self.q(name, rank).get_many(max_items)

    def qsize(self, name, rank=None) -> int:
        return self.q(name, rank).qsize()

    def exchange(self, rank: int, samples: list, want_command: bool, max_tasks: int):
        """A rollout rank's control-loop tick as one call (one round trip over TCP: ManagerQueues runs it in
        the server): put its finished samples, take its next command (if want_command), and take up to
        max_tasks tasks. -> (Command or None, [RolloutTask], tasks queued before the take)."""
        if samples:
            self.put_many_nowait("samples", samples)
        got = self.get_many_nowait("commands", 1, rank) if want_command else []
        queued = self.qsize("tasks")
        return (got[0] if got else None), self.get_many_nowait("tasks", min(max_tasks, queued)), queued


class LocalQueues(Queues):
    """In-process queues (tests, simulator), num_ranks rollout ranks' command queues among them. An
    extension's own queue is one more by name (named: put_many, get_many, qsize)."""

    round_trips = False       # every call answers at once: no thread (virtual time stays exact)

    def __init__(self, num_ranks: int):
        self.num_ranks, self.queues = num_ranks, {}
        self.arrived = asyncio.Event()     # set by every put: get_many's waiter looks again

    def queue(self, name: str) -> ServedQueue:
        return self.queues.setdefault(name, ServedQueue())

    named = queue

    def put_many_nowait(self, name, items, rank=None):
        super().put_many_nowait(name, items, rank)
        self.arrived.set()

    async def put_many(self, name, items, rank=None):
        self.put_many_nowait(name, items, rank)

    async def put_front(self, name, items):
        self.q(name).put_front(list(items))
        self.arrived.set()

    async def get_many(self, name, max_items: int, rank=None) -> list:
        """Wait for at least one item; return up to max_items."""
        while not (items := self.get_many_nowait(name, max_items, rank)):
            self.arrived.clear()
            await self.arrived.wait()
        return items


class _QueueManager(BaseManager):
    pass


_SERVED: dict[str, ServedQueue] = {}


def _served(name: str) -> ServedQueue:
    return _SERVED.setdefault(name, ServedQueue())


class ServedQueues(Queues):
    """The server's own view of all its queues: calls that touch several in one round trip (exchange)."""
    queue = staticmethod(_served)


_QueueManager.register("get_queue", callable=_served)
_QueueManager.register("get_queues", callable=ServedQueues)


def queue_bind() -> str | None:
    """Where trainer rank 0's queue server listens: on one node, MASTER_ADDR (loopback stays loopback);
    across nodes every interface, because under torchrun's c10d rendezvous MASTER_ADDR is node 0's
    name, which node 0 itself may resolve to a loopback address (127.0.1.1 on many Ubuntu hosts and
    containers) that the other nodes cannot reach. The clients connect to MASTER_ADDR either way."""
    world = int(os.environ["WORLD_SIZE"])
    return "" if int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world else None


class ManagerQueues(Queues):
    """Queues served over TCP by a multiprocessing manager (train.py). The server side (trainer
    rank 0) calls serve(); every other rank connect()s with the same address and authkey."""

    POLL_S = (0.002, 0.008)   # an empty queue is polled after 2 ms, then ever less often, up to every 8 ms
    round_trips = True        # every call waits for the server: SampleBuffer runs them off the event loop

    def __init__(self, manager: BaseManager, num_ranks: int):
        self.manager, self.num_ranks = manager, num_ranks
        names = (*QUEUE_NAMES, *(f"commands{r}" for r in range(num_ranks)))
        self.queues = {name: manager.get_queue(name) for name in names}     # their proxies
        self.served = manager.get_queues()

    def queue(self, name: str):
        return self.queues[name]

    def named(self, name: str):
        """A queue of an extension's own on the same server, by name (put_many, get_many, qsize: each call
        a round trip, to run off the event loop): how an extension's ranks meet the rollout ranks."""
        return self.manager.get_queue(name)

    @classmethod
    def serve(cls, host: str, port: int, authkey: bytes, num_ranks: int,
              bind: str | None = None) -> "ManagerQueues":
        """Listen on (bind, port); bind None: host, the address the clients connect() to. bind "": every
        interface (a multi-node job: train.py), since node 0 may resolve its own name to a loopback
        address that no other node reaches (Ubuntu's 127.0.1.1 for the hostname)."""
        bind = host if bind is None else bind
        where = f"{bind or '*'}:{port}"
        with socket.socket() as probe:     # a port in use: say so (the manager would fail later, obscurely)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the manager's own listener
            try:
                probe.bind((bind, port))
            except OSError as e:
                raise OSError(f"buffer: the queue server's port {where} is in use ({e.strerror}): "
                              f"another run on this MASTER_PORT (the queue server takes MASTER_PORT + 1)? "
                              f"Pick another --master-port") from None
        m = _QueueManager(address=(bind, port), authkey=authkey)
        m.start(initializer=die_with_parent)    # the server process ends with trainer rank 0, even on SIGKILL
        return cls(m, num_ranks)

    @classmethod
    def connect(cls, host: str, port: int, authkey: bytes, num_ranks: int,
                timeout_s: float = 120, who: str = "buffer") -> "ManagerQueues":
        deadline = time.monotonic() + timeout_s
        while True:  # the server may not be up yet: retry until the deadline
            try:
                m = _QueueManager(address=(host, port), authkey=authkey)
                m.connect()
                return cls(m, num_ranks)
            except (ConnectionRefusedError, OSError) as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{who}: could not reach the queue server at {host}:{port} "
                                       f"within {timeout_s:.0f}s (--startup-timeout-s): {e}") from None
                time.sleep(0.5)

    async def put_many(self, name, items, rank=None):
        # in a thread: the caller's event loop goes on during the round trip (the proxy per thread is
        # multiprocessing's own: each thread gets its connection)
        await asyncio.to_thread(self.q(name, rank).put_many, list(items))

    async def put_front(self, name, items):
        await asyncio.to_thread(self.q(name).put_front, list(items))

    async def get_many(self, name, max_items: int, rank=None) -> list:
        wait, longest = self.POLL_S
        while not (items := self.get_many_nowait(name, max_items, rank)):
            await asyncio.sleep(wait)    # each poll is a round trip that the server's core pays for too
            wait = min(2 * wait, longest)
        return items

    def exchange(self, *args):
        return self.served.exchange(*args)

    def shutdown(self):
        """Stop the queue server (server side only; a connected client has nothing to stop)."""
        if hasattr(self.manager, "shutdown"):
            with contextlib.suppress(Exception):   # already gone: shutting down twice is not an error
                self.manager.shutdown()


# ---------------------------------------------------------------------------------------------
# the buffer: named operations with timeouts over either transport


class SampleBuffer:
    MAX_BATCH = 4096       # items moved per transport call at most

    def __init__(self, transport, who: str = "?", timeout_s: float = 600.0):
        # who: e.g. "trainer rank 0", "rollout rank 2": named in timeout errors
        self.transport, self.who, self.timeout_s = transport, who, timeout_s
        self.inbox: collections.deque[Sample] = collections.deque()   # samples fetched, not yet handed out

    async def _get_many(self, name: str, phase: str, rank=None, timeout: float | None = None,
                        max_items: int = MAX_BATCH) -> list:
        timeout = self.timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):      # (not wait_for: in 3.11 it can swallow a cancel)
                return await self.transport.get_many(name, max_items, rank)
        except TimeoutError:
            raise TimeoutError(f"{self.who}: nothing on the {name} queue for {timeout:.0f}s "
                               f"during {phase}") from None

    # controller side
    async def _bounded(self, coro, phase: str):
        """A transport call under the buffer's timeout (a ManagerQueues round trip waits for the server;
        in-process queues answer at once, and awaited directly they add no scheduling step)."""
        if not self.transport.round_trips:
            return await coro
        try:
            async with asyncio.timeout(self.timeout_s):
                return await coro
        except TimeoutError:
            raise TimeoutError(f"{self.who}: the queue server did not answer within {self.timeout_s:.0f}s "
                               f"during {phase}") from None

    async def put_tasks(self, tasks: list[RolloutTask]):
        await self._bounded(self.transport.put_many("tasks", tasks), "put tasks")

    async def return_tasks(self, tasks: list[RolloutTask]):
        """Tasks a rollout rank took and passed over go back to the task queue's front, in their order, so
        that they start before the tasks queued after them (a group's samples start close together)."""
        await self._bounded(self.transport.put_front("tasks", tasks), "return tasks")

    async def get_sample(self, timeout: float | None = None) -> Sample:
        if not self.inbox:          # one round trip fetches every sample waiting
            self.inbox.extend(await self._get_many("samples", "collect samples", timeout=timeout))
        return self.inbox.popleft()

    def get_sample_nowait(self) -> Sample | None:
        if not self.inbox:
            self.inbox.extend(self.transport.get_many_nowait("samples", self.MAX_BATCH))
        return self.inbox.popleft() if self.inbox else None

    async def send_command(self, rank: int, cmd: Command):
        await self._bounded(self.transport.put_many("commands", [cmd], rank),
                            f"send a command to rank {rank}")

    async def get_ack(self, phase: str, timeout: float | None = None) -> Ack:
        return (await self._get_many("acks", phase, timeout=timeout, max_items=1))[0]

    def num_queued_tasks(self) -> int:
        return self.transport.qsize("tasks")

    # rollout side: polls from the rank's event loop, which must not stand still in a round trip to the
    # trainer's queue server while the engine's outputs wait (tools/bench_rollout.py measured 29-34%)
    async def _polled(self, phase: str, fn, *args):
        if not self.transport.round_trips:
            return fn(*args)
        return await self._bounded(asyncio.to_thread(fn, *args), phase)

    async def exchange(self, rank: int, samples: list[Sample], want_command: bool,
                       max_tasks: int) -> tuple[Command | None, list[RolloutTask], int]:
        """A control-loop tick's queue work in one round trip (Queues.exchange)."""
        return await self._polled("send samples, poll commands and tasks", self.transport.exchange, rank,
                                  samples, want_command, max_tasks)

    async def poll_tasks(self, max_items: int) -> list[RolloutTask]:
        return await self._polled("poll tasks", self.transport.get_many_nowait, "tasks", max_items)

    async def put_samples(self, samples: list[Sample]):
        if samples:
            await self._bounded(self.transport.put_many("samples", samples), "put samples")

    async def put_ack(self, ack: Ack):
        await self._bounded(self.transport.put_many("acks", [ack]), f"put a {ack.phase} ack")

    def close(self):
        if hasattr(self.transport, "shutdown"):
            self.transport.shutdown()


# ---------------------------------------------------------------------------------------------
# group assembly (GRPO) with the freshness rule and dynamic filtering


ORDERS = ("oldest", "freshest")     # GroupAssembler.take: which complete groups go to the trainer first


class Lost(enum.StrEnum):
    """Why a group was given up on (GroupAssembler.lost); the value names its counters (samples_<value>,
    groups_<value>). With trained and filtered, these are every way an admitted group can end."""
    STALE = "dropped_stale"        # a sample too old for the async ratio (or aborted as such by a rank)
    FAILED = "failed"              # samples given up on (env failures, a dead engine) left < G to come
    DEFERRED = "deferred"          # tail batching gave up on it (defer): the prompt runs in a long round
    INTERRUPTED = "interrupted"    # its rank ended its work otherwise (--colocate's SLEEP): re-admitted
    # A rank that ends a task on its own, not at the controller's request, sends one notice per sample: a
    # failed Sample with meta["aborted"] = the Lost value, so the controller learns of every group's end.


class GroupAssembler:
    """Collects samples into GRPO groups of `group_size` by group_id.

    - A sample that is not fresh at the current version is dropped and counted; its whole group
      can no longer complete, so the rest of that group is dropped (and counted) as well.
    - A complete group whose rewards are all equal carries no GRPO signal: filtered (DAPO's dynamic
      sampling) and counted, when `filter_groups`.
    - take() re-checks freshness against the version it is given, so a group that completed under
      an older version and then went stale is never returned.
    - Redundant rollout runs more samples of a group than it needs (expect(group, n)): the first
      `group_size` to arrive make the group; later ones are surplus, dropped and counted.
    - A sample the rollout side gives up on (failed and not retrying, or a rank's abort notice naming
      its Lost reason) kills its group only once fewer than `group_size` of the group's samples can still
      arrive; the group is then lost for that sample's reason (Lost).
    - take() hands out complete groups oldest first (order="oldest": in the order they completed)
      or freshest first (order="freshest": by the version of their oldest token, newest first; ties
      in completion order), the paper's preference for fresher samples. Either way only fresh ones.
    - defer() gives up on a group that is not complete (tail batching: its prompt runs again in a long
      round).
    Every sample given to add() ends in exactly one place: returned by take(), pending, ready, or one of
    the counters (groups_filtered x group_size, samples_surplus, samples_<Lost>); a sample that arrives for a
    lost group is counted under that group's reason, a failed one or a notice under its own. Every group ends
    once: taken, filtered, or groups_<Lost>.
    The ids of resolved groups (closed or lost) are forgotten FORGET_AFTER versions past the freshness
    window, so a long run's memory stays flat; a straggler of a forgotten group then waits as a
    pending group of its own until it is stale, and is counted as dropped stale.
    """

    FORGET_AFTER = 8

    def __init__(self, group_size: int, freshness: Freshness | int, filter_groups: bool = True,
                 order: str = "oldest"):
        if order not in ORDERS:
            raise ValueError(f"--sample-order must be one of {', '.join(ORDERS)}, got {order!r}")
        self.group_size, self.filter_groups, self.order = group_size, filter_groups, order
        self.freshness = Freshness.of(freshness)    # (an int: the async ratio's rule)
        self.pending: dict[str, list[Sample]] = {}
        self.ready: list[list[Sample]] = []
        self.lost: dict[str, Lost] = {}   # groups that can no longer complete, and why
        self.closed: set[str] = set()     # groups completed (ready, taken or filtered)
        self.expected: dict[str, int] = {}   # unresolved groups running more than group_size samples
        self.given_up: dict[str, int] = {}   # unresolved groups' samples that will never arrive
        # (version, id) into closed/lost; id -> its latest such version
        self.resolved: collections.deque[tuple[int, str]] = collections.deque()
        self.resolved_at: dict[str, int] = {}
        # groups_completed: groups that reached group_size samples (kept or filtered)
        self.samples_surplus = self.groups_completed = self.groups_filtered = 0
        for why in Lost:
            setattr(self, f"samples_{why}", 0)
            setattr(self, f"groups_{why}", 0)
        # examples for error messages (controller's stall report)
        self.last_failed: Sample | None = None
        self.last_filtered: list[Sample] | None = None

    @property
    def dead(self):
        """The ids of the groups that can no longer complete (a view of lost's keys)."""
        return self.lost.keys()

    def _count(self, why: Lost, samples: int, groups: int = 0):
        setattr(self, f"samples_{why}", getattr(self, f"samples_{why}") + samples)
        setattr(self, f"groups_{why}", getattr(self, f"groups_{why}") + groups)

    def _fresh(self, s: Sample, version: int) -> bool:
        return self.freshness.fresh(s.oldest_version, version, s.group_id)

    def _resolve(self, group_id: str, version: int):
        self.resolved.append((version, group_id))
        self.resolved_at[group_id] = version
        self.expected.pop(group_id, None)
        self.given_up.pop(group_id, None)

    def _lose(self, group_id: str, why: Lost, version: int, samples: list[Sample] | None = None):
        """Give up on a group: its samples held (pending, or `samples`) are counted under `why`."""
        self._count(why, len(self.pending.pop(group_id, []) if samples is None else samples), groups=1)
        self.lost[group_id] = why
        self._resolve(group_id, version)

    def expect(self, group_id: str, num_samples: int):
        """The group runs num_samples samples (> group_size: redundancy); the first group_size make it."""
        self.expected[group_id] = num_samples

    def add(self, s: Sample, version: int):
        gid = s.group_id
        if s.failed:
            why = Lost(s.meta.get("aborted", Lost.FAILED))
            if why is Lost.FAILED:
                self.last_failed = s
            self._count(why, 1)
            if s.meta.get("retrying", True) or gid in self.closed or gid in self.lost:
                return             # another attempt follows, or the group is resolved already
            self.given_up[gid] = self.given_up.get(gid, 0) + 1
            if self.expected.get(gid, self.group_size) - self.given_up[gid] < self.group_size:
                self._lose(gid, why, version)    # too few samples can still arrive
            return
        if gid in self.lost:
            self._count(self.lost[gid], 1)
            return
        if gid in self.closed:
            self.samples_surplus += 1
            return
        group = self.pending.setdefault(gid, [])
        group.append(s)
        if not self._fresh(s, version):
            self._lose(gid, Lost.STALE, version)
            return
        if len(group) == self.group_size:
            del self.pending[gid]
            self.closed.add(gid)
            self.groups_completed += 1
            self._resolve(gid, version)
            if self.filter_groups and len({x.reward for x in group}) == 1:
                self.groups_filtered += 1
                self.last_filtered = group
            else:
                self.ready.append(group)

    def defer(self, group_id: str, version: int):
        """Give up on a group that is not complete (not ready, not resolved): its samples so far are
        counted as deferred, and so are any that arrive later."""
        if group_id in self.closed or group_id in self.lost:
            raise ValueError(f"defer: group {group_id} is already resolved")
        self._lose(group_id, Lost.DEFERRED, version)

    def evict_stale(self, version: int) -> list[str]:
        """Drop pending and ready groups holding a sample that is stale at `version`; returns
        the dropped group ids (the env managers abort their still-running samples)."""
        dropped = []
        for group in [*self.pending.values(), *self.ready]:
            if not all(self._fresh(s, version) for s in group):
                dropped.append(gid := group[0].group_id)
                self.pending.pop(gid, None)
                self._lose(gid, Lost.STALE, version, samples=group)
        self.ready = [g for g in self.ready if g[0].group_id not in self.lost]
        horizon = version - self.freshness.max_lag - self.FORGET_AFTER
        while self.resolved and self.resolved[0][0] < horizon:      # forget long-resolved groups
            v, gid = self.resolved.popleft()
            if self.resolved_at.get(gid) == v:                      # (not resolved again since)
                del self.resolved_at[gid]
                self.closed.discard(gid)
                self.lost.pop(gid, None)
        return dropped

    def take(self, num_groups: int, version: int, policy=None) -> list[list[Sample]]:
        """Up to num_groups complete, fresh groups, in the assembler's order; policy (controller.Admission):
        its eligible(ready) says which may be taken, in which order (a per-domain quota), default all."""
        self.evict_stale(version)
        if self.order == "freshest":     # stable: equally fresh groups stay in completion order
            self.ready.sort(key=lambda g: -min(s.oldest_version for s in g))
        out = (policy.eligible(self.ready) if policy else self.ready)[:num_groups]
        taken = {id(g) for g in out}                  # (by identity: two groups may hold equal samples)
        self.ready = [g for g in self.ready if id(g) not in taken]
        return out

    def num_ready(self) -> int:
        return len(self.ready)

    def is_ready(self, group_id: str) -> bool:
        return any(g[0].group_id == group_id for g in self.ready)
