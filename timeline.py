"""timeline.py: the events tools/plot.py's timeline is drawn from, recorded while a run runs.

    events = RankEvents(rank)           # a rollout rank: proxy.LLMProxy.events; train.py adds engine_start
    ack.events = events.take()          # ... sent to rank 0 in the acks it already sends (env_manager.py)
    log = EventLog(path, cap, fresh)    # trainer rank 0: controller.AsyncController.events, runlog.RunLog
    log.add(e); log.extend(es)          # in memory, on the controller's path
    log.flush()                         # to events.jsonl, after each step and at the end

events.jsonl: one JSON object per line, "ev" one of start, ready, step, phase, req, dropped, end;
times are time.time() seconds, one clock for every process (the ranks of a run share a node, or
NTP-synchronised clocks across nodes). The ranks' events ride in the acks they already send
(buffer.Ack.events: SYNCED, STOPPED), so the protocol and its timing are unchanged.

Size bound: a rank keeps at most 20,000 events between two acks (the oldest go first, counted in
a "dropped" event); rank 0 writes at most --max-events request events per session (later ones are
only counted in "end"); steps and phases are always written.

Design notes (every event's fields, sizes): DESIGN.md#timelinepy
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
