"""ext/timeline.py: the events tools/plot.py's timeline is drawn from, recorded while a run runs
(--max-events; on by default).

    events = RankEvents(rank)           # a rollout rank: proxy.LLMProxy.events (Extension.on_proxy)
    ack.events = events.take()          # ... sent to rank 0 in the acks it already sends (env_manager.py)
    log = EventLog(path, cap, fresh)    # trainer rank 0: controller.AsyncController.events (on_controller)
    log.add(e); log.extend(es)          # in memory, on the controller's path
    log.flush()                         # to events.jsonl, after each step and at the end

The core's seam: proxy.LLMProxy.events and controller.AsyncController.events, None until an extension
sets them (then the proxy records requests and weight-update phases, the controller each step's spans
and the events the ranks' acks carry, buffer.Ack.events).

events.jsonl: one JSON object per line, "ev" one of start, ready, step, phase, req, dropped, end;
times are time.time() seconds, one clock for every process (the ranks of a run share a node, or
NTP-synchronised clocks across nodes). The ranks' events ride in the acks they already send
(SYNCED, STOPPED), so the protocol and its timing are unchanged.

Size bound: a rank keeps at most 20,000 events between two acks (the oldest go first, counted in
a "dropped" event); rank 0 writes at most --max-events request events per session (later ones are
only counted in "end"); steps and phases are always written. Every event's fields: the end of this file.
"""

import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from config import Extension, extension, opt


def _round(x):
    """Times to 0.1 ms: smaller lines, and far finer than anything tools/plot.py draws."""
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


class RankEvents:
    """A rollout rank's events between two acks (proxy.LLMProxy.events points here). At most `cap`
    are kept (a weight sync every few seconds sees a few hundred); past it, the oldest are dropped and
    counted, so a rank whose acks stop coming holds bounded memory."""

    def __init__(self, rank: int, cap: int = 20_000):
        self.rank = rank
        self.cap = cap
        self.items: deque[dict] = deque(maxlen=cap)
        self.dropped = 0

    def add(self, e: dict):
        if len(self.items) == self.cap:
            self.dropped += 1
        self.items.append(e)

    def request(self, t0: float, t1: float, c):
        """One finished engine request (a proxy.Completion) that ran from t0 to t1."""
        first = c.versions[0] if c.versions else c.submit_version
        self.add({"ev": "req", "rank": self.rank, "t": [t0, t1],
                  "v": [first, c.versions[-1] if c.versions else first],
                  "n": len(c.token_ids), "finish": c.finish_reason or "error"})

    def phase(self, name: str, t0: float, t1: float, version: int):
        self.add({"ev": "phase", "rank": self.rank, "name": name, "version": version, "t": [t0, t1]})

    def take(self) -> list[dict]:
        """Everything since the last take, for the next ack."""
        out = list(self.items)
        if self.dropped:
            out.append({"ev": "dropped", "rank": self.rank, "n": self.dropped})
        self.items.clear()
        self.dropped = 0
        return out


class EventLog:
    """Rank 0's events.jsonl. add()/extend() only append in memory (the controller calls them on its
    own path); flush() writes, after each step and at the end."""

    def __init__(self, path: Path, max_requests: int, fresh: bool):
        self.path = path
        self.max_requests = max_requests
        self.pending: list[dict] = []
        self.requests_written = 0
        self.requests_not_written = 0
        self.requests_dropped_by_ranks = 0
        if fresh:
            path.unlink(missing_ok=True)

    def add(self, e: dict):
        self.pending.append(e)

    def extend(self, events):
        self.pending.extend(events)

    def flush(self):
        lines = []
        for e in self.pending:
            if e["ev"] == "req":
                if self.requests_written >= self.max_requests:
                    self.requests_not_written += 1
                    continue
                self.requests_written += 1
            elif e["ev"] == "dropped":
                self.requests_dropped_by_ranks += e["n"]
            lines.append(json.dumps({k: _round(v) for k, v in e.items()}) + "\n")
        self.pending = []
        if lines:
            with open(self.path, "a") as f:
                f.writelines(lines)


@dataclass
class TimelineConfig:
    max_events: int = opt(100_000, "request events kept in out_dir/events.jsonl for tools/plot.py's "
                                   "timeline; 0 = no events file")

    def __post_init__(self):
        if self.max_events < 0:
            raise ValueError(f"--max-events must be >= 0, got {self.max_events}")


@extension
class Timeline(Extension):
    name, Config = "timeline", TimelineConfig

    log: EventLog | None = None

    def on_controller(self, ctrl, state):
        fresh, out = state is None, Path(self.cfg.out_dir) / "events.jsonl"
        if not self.part.max_events:
            if fresh:             # --max-events 0: no timeline, not an old run's either
                out.unlink(missing_ok=True)
            return
        from runlog import process_start
        self.log = ctrl.events = EventLog(out, self.part.max_events, fresh)
        self.log.add({"ev": "start", "t": process_start(), "rollout_ranks": self.cfg.rollout_gpus,
                      "async_ratio": self.cfg.controller.async_ratio, "step": state["step"] if state else 0,
                      "steps": self.cfg.steps})

    def on_proxy(self, proxy, index: int, t_start: float):
        if self.part.max_events:
            proxy.events = RankEvents(index)
            proxy.events.phase("engine_start", t_start, time.time(), proxy.version)

    def on_ready(self, t: float):
        if self.log is not None:
            self.log.add({"ev": "ready", "t": t})

    def on_row(self, row: dict):
        if self.log is not None:
            self.log.flush()

    def run_files(self):
        return [str(self.log.path)] if self.log is not None else None

    def summary_lines(self, runlog):
        if self.log is None or not (self.log.requests_not_written or self.log.requests_dropped_by_ranks):
            return None
        n = self.log.requests_not_written + self.log.requests_dropped_by_ranks
        return [f"  timeline   {n} request events not written (over --max-events {self.part.max_events} "
                f"or a rank's cap)"]

    def on_finish(self):
        if self.log is not None:
            self.log.add({"ev": "end", "t": time.time(),
                          "requests_not_written": self.log.requests_not_written})

    def close(self):
        if self.log is not None:
            self.log.flush()


# events.jsonl's events (times: time.time() seconds; versions: policy versions):
#   start  {t, rollout_ranks, async_ratio, step, steps}       rank 0, once per session
#   ready  {t}                                                 the engines' READY
#   step   {version, collect: [t0, t1], train, wait_sync, broadcast}   the controller, per step
#   phase  {rank, name, version, t: [t0, t1]}                  engine_start, suspend, load, resume
#   req    {rank, t: [t0, t1], v: [first, last], n, finish}    one engine request
#   dropped {rank, n}                                          a rank's events over its cap
#   end    {t, requests_not_written}                           rank 0, at the end
