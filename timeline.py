"""timeline.py: the events tools/plot.py's timeline is drawn from, recorded while a run runs.

    events = RankEvents(rank)           # a rollout rank: proxy.LLMProxy.events; train.py adds engine_start
    ack.events = events.take()          # ... sent to rank 0 in the acks it already sends (env_manager.py)
    log = EventLog(path, cap, fresh)    # trainer rank 0: controller.AsyncController.events, runlog.RunLog
    log.add(e); log.extend(es)          # in memory, on the controller's path
    log.flush()                         # to events.jsonl, after each step and at the end

events.jsonl, one JSON object per line; times are time.time() seconds. One clock for every process:
this assumes the ranks of a run share a node (or NTP-synchronised clocks across nodes; tools/plot.py
draws whatever it is given). "ev" says what it is:
    start      t, rollout_ranks, async_ratio, step (where this session starts), steps  (every session;
               a resumed run appends, and tools/plot.py draws the last session)
    ready      t: the engines acked READY (start-up ends)
    step       version, collect / train / wait_sync / broadcast: [start, end] each: the trainer's step
               as the controller sees it (train = from the batch to the sync: advantages + optimizer
               step + gathering the weights; wait_sync = the previous sync's acks)
    phase      rank, name (engine_start | suspend | load | resume; receive in runs recorded before
               weight_sync.py), version, t: [start, end]
    req        rank, t: [start, end], v: [version of its first token, of its last], n: tokens,
               finish: stop | length | abort   (one engine request: a turn of a trajectory)
    dropped    rank, n: request events a rank dropped (more than its cap between two acks)
    end        t, requests_not_written
Where they come from: the proxy records each request and its engine's suspend, load and resume; the
rollout rank (train.py) the engine's start; the controller each step's spans. The
ranks' events travel to rank 0 in the acks they already send (buffer.Ack.events: SYNCED after
every weight sync, STOPPED at the end); the protocol and its timing are unchanged (an ack then
carries a few hundred events, about 30 KB: a few ms of pickling, off the trainer's path, since the
controller reads a SYNCED ack only at the next sync).

Size bound: a rank keeps at most 20,000 events between two acks (the oldest go first, counted in a
"dropped" event), and rank 0 writes at most --max-events request events per session (the first
ones; later ones are only counted in "end"); steps and phases, a few per step, are always written.
A request event is about 100 bytes: the default cap of 100,000 is about 10 MB.
"""

import json
from collections import deque
from pathlib import Path


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
        self.add({"ev": "req", "rank": self.rank, "t": [t0, t1], "v": [first, c.versions[-1] if c.versions else first],
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
