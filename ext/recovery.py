"""ext/recovery.py: self-healing engines (on by default). An engine that dies or hangs under a rollout rank is
replaced by a fresh one, and the run goes on; a broadcast an engine died under is sent again over a new group.

    EngineRecovery(restart_engine)     # a rollout rank's (EnvManager.recovery); restart_engine() -> a backend
    SyncRecovery()                     # trainer rank 0's (AsyncController.recovery)

The rollout side: a trajectory that sees the engine fail (proxy.EngineError: its process died, or it
produced nothing for the proxy's timeout) hands its task here; the control loop then cancels every
trajectory in flight, reports each lost sample as given up (the controller re-admits those prompts: not
their fault), starts a new engine, and resumes it before the first weight sync (it holds the model dir's
weights, the current ones); after one, the new engine waits suspended for weights (ack REPLACED). A
broadcast that fails: this engine died (a new one, acked REPLACED) or another member did (the group broke:
this engine lives on); either way it holds part of the weights at most, acks SYNCED with needs_weights
and waits suspended.
The controller's side: REPLACED acks move the weight-sync group to a new generation (a replaced engine cannot
enter its predecessor's group; an engine never joins a generation older than its own start, may_join), and a
replaced engine is synced again to the current version while the controller collects (every engine reloads it:
engines are rarely replaced), probed as the last sync was; a broadcast that fails is sent once more over a new
group, once every rank acked that its engine waits for weights.
Without this extension an engine failure ends the rank, and a failed broadcast the run.
"""

import asyncio
import contextlib

from buffer import Ack, Phase
from config import Extension, extension
from buffer import now
from proxy import EngineError, Status


def replace_engine(proxy, engine):
    """After an engine failure: the proxy carries on with a new backend. The old one is shut down and its
    requests are gone (the proxy forgets their engine ids and the failure its watchdog reported); version
    and counters are kept. The proxy is left suspended, as suspend() leaves it: the caller loads the current
    weights (update_weights), then resume()s."""
    old, proxy.engine = proxy.engine, engine
    with contextlib.suppress(Exception):         # it is dead already; shutting it down is best effort
        old.shutdown()
    proxy._failure = None
    proxy._engine_ids.clear()
    proxy._resumed.clear()
    proxy.status = Status.SUSPENDED
    proxy._account()


class EngineRecovery:
    """A rollout rank's side (EnvManager.recovery)."""

    def __init__(self, restart_engine):
        self.restart_engine = restart_engine    # async () -> a new engine backend
        self.failure: EngineError | None = None  # set by a trajectory that saw the engine fail
        self.lost: list = []                    # tasks whose work died with the engine
        self.busy = False                       # replacing the engine (the loop starts no task)
        self.gen_seen = -1                      # the newest weight-sync group generation a SYNC named
        self.min_gen = 0                        # the oldest this engine may join (a replaced one: newer)

    def lose(self, task, failure: EngineError):
        self.lost.append(task)
        self.failure = self.failure or failure

    def may_join(self, gen: int) -> bool:
        """May this engine join generation gen? Not one formed with the engine it replaced."""
        self.gen_seen = max(self.gen_seen, gen)
        return gen >= self.min_gen

    async def recover_pending(self, mgr):
        if self.failure is not None:
            await self.recover(mgr, self.failure)

    async def sync_failed(self, mgr, e: EngineError, version: int, t0: float, t1: float):
        """The broadcast failed (module docstring): ack SYNCED with needs_weights; REPLACED: a new engine."""
        mgr.synced = True      # (whatever it loaded, the model dir's weights are not version v)
        t2 = now()
        group_broke = "weight-sync" in str(e) and not getattr(mgr.proxy.engine, "dead", False)
        if not group_broke:
            await self.recover(mgr, e, report=False)
        await mgr._ack_synced(version, {"receive_s": t2 - t1, "load_s": now() - t0}, needs_weights=True)
        if not group_broke:
            await mgr.buffer.put_ack(Ack(mgr.rank, Phase.REPLACED, mgr.proxy.version))

    async def recover(self, mgr, failure: EngineError, report: bool = True):
        """The engine died or hung (failure): every trajectory in flight is lost. Report each lost sample as
        given up (its group is lost; the controller re-admits the prompt) and start a new engine. Before the
        first sync the model dir's weights are the current ones: resume. After it, the new engine waits
        suspended for weights: ack REPLACED (when `report`), and the controller's next SYNC loads them."""
        self.busy = True     # (a sync's recovery: the loop, running beside it, starts no task)
        try:
            jobs = list(mgr.jobs.values())
            for t, job in jobs:
                job.cancel()
            await asyncio.wait([j for _, j in jobs], timeout=mgr.cfg.stop_timeout_s) if jobs else None
            for t in self.lost + [t for t, _ in jobs]:
                mgr.counters["samples_lost_to_engine"] += t.num_samples
                mgr._give_up(t, f"engine lost: {failure}", engine_lost=True)
            self.lost, self.failure = [], None
            await mgr._flush()
            print(f"{failure}; starting a new engine", flush=True)    # (it names the rank and the why)
            replace_engine(mgr.proxy, await self.restart_engine())
        finally:
            self.busy = False
        self.min_gen = self.gen_seen + 1        # its workers may only join a group formed after this
        mgr.counters["engine_restarts"] += 1
        if not mgr.synced:
            await mgr.proxy.resume()
        elif report:
            await mgr.buffer.put_ack(Ack(mgr.rank, Phase.REPLACED, mgr.proxy.version))


class SyncRecovery:
    """Trainer rank 0's side (AsyncController.recovery)."""

    def __init__(self):
        self.resyncs = 0                        # syncs done again for replaced engines, or retried

    @staticmethod
    def take_replaced(ctrl) -> int:
        """Drop the REPLACED acks received so far; returns how many there were."""
        ctrl.acks += ctrl.buffer.transport.get_many_nowait("acks", ctrl.buffer.MAX_BATCH)
        n = sum(a.phase == Phase.REPLACED for a in ctrl.acks)
        ctrl.acks = [a for a in ctrl.acks if a.phase != Phase.REPLACED]
        return n

    def before_send(self, ctrl):
        """A replaced engine cannot enter the group its predecessor was in: every member forms a new one."""
        if self.take_replaced(ctrl):
            ctrl.gen += 1

    async def send_failed(self, ctrl, error: Exception, version: int, attempt: int) -> bool:
        """A broadcast that failed (an engine died under it: every member's receive fails) is sent once more
        over a new group, once every rank acked that its engine waits for weights (True: send again)."""
        if attempt > 1:
            return False
        acks = await ctrl._wait_acks(Phase.SYNCED, version)
        if not any(a.needs_weights for a in acks):
            return False                                 # the trainer's side failed, not an engine
        if ctrl.log:
            ctrl.log(f"weight sync to version {version}: the broadcast failed ({error}); sending again over "
                     f"a new group")
        self.take_replaced(ctrl)
        ctrl.gen += 1
        self.resyncs += 1
        return True

    async def serve(self, ctrl):
        """An engine replaced after the first sync waits, suspended, for the current weights: sync the current
        version again over a new group, probed when the last sync was. Its acks are awaited here; the sync in
        flight, if any, is finished first, and the next report carries the resync's probe."""
        from runlog import probe_diff
        ctrl.acks += ctrl.buffer.transport.get_many_nowait("acks", ctrl.buffer.MAX_BATCH)
        if ctrl.send_fn is None or not any(a.phase == Phase.REPLACED for a in ctrl.acks):
            return
        if ctrl.in_flight is not None:
            ctrl.unreported = await ctrl.finish_sync()
        if ctrl.log:
            ctrl.log(f"a rollout engine was replaced: syncing version {ctrl.version} again over a new group")
        self.resyncs += 1
        await ctrl._send_weights(ctrl.version, probe=ctrl.probe_ref is not None)
        acks = await ctrl._wait_acks(Phase.SYNCED, ctrl.version)
        if ctrl.probe_ref is not None:
            ctrl.unreported["sync_probe_max_diff"] = probe_diff(acks, ctrl.probe_ref)


@extension
class Recovery(Extension):
    name = "recovery"

    def engine_recovery(self, restart_engine):
        return EngineRecovery(restart_engine)

    def sync_recovery(self):
        return SyncRecovery()
