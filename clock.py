"""clock.py: the one clock every timeout and duration of the loop reads.

    t0 = now(); ...; elapsed = now() - t0

Event-loop time: real time in a run, virtual time under a fast-forwarded loop (looptime: the unit tests
and tools/sim.py), so the same code's waits and timings hold in both.
"""

import asyncio
import time


def now() -> float:
    """The running event loop's time; outside a loop, time.monotonic()."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
