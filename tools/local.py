"""tools/local.py: a run in one process, for the tools (the simulator, the benchmarks, the study) and the
tests: the rollout ranks' EnvManagers as tasks beside the trainer's loop, over in-process queues; and a
weight sync from this process into its engines.

    result = await run_local(ctrl, managers, driver(), timeout_s)
    await push(proxies, sender, named, version)       # the weights into every (suspended) proxy's engine
"""

import asyncio
import itertools

from weight_sync import weight_layout

from buffer import now


async def run_local(ctrl, managers: list, driver, timeout_s: float):
    """The rollout ranks as tasks of this event loop beside `driver` (a coroutine: the trainer's loop),
    for the in-process runners. A manager that crashes ends the run with its error; when the driver
    returns, the controller stops the managers. The whole run is bounded by timeout_s (event-loop
    seconds). Returns the driver's result."""
    runs = [asyncio.ensure_future(m.run()) for m in managers]
    main = asyncio.ensure_future(driver)
    pending, deadline = {main, *runs}, now() + timeout_s
    while not main.done():
        done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - now()),
                                           return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in done if t.exception() is not None]
        if failed or not done:
            for t in [main, *runs]:
                t.cancel()
            await asyncio.gather(main, *runs, return_exceptions=True)
            if failed:
                raise failed[0].exception()
            raise TimeoutError(f"run_local: the trainer's loop did not end within {timeout_s:.0f}s")
    await ctrl.stop()
    async with asyncio.timeout(max(0.0, deadline - now())):
        await asyncio.gather(*runs)
    return main.result()


PUSHES = itertools.count(1)      # push()'s syncs, numbered as the controller numbers a run's


async def push(proxies, sender, named, version: int, gen: int = 0):
    """One process holding the weights and the proxies (benchmarks, tests): `named` into every
    (suspended) proxy's engine, generation `gen`. sender: a Sender (a broadcast over its group) or a
    list of ext/colocate.IpcSender, one per proxy, on one store (ipc: each hands its engine the buckets)."""
    named = list(named)
    layout = weight_layout(named)
    senders = sender if isinstance(sender, list) else [sender]
    spec = senders[0].spec(gen, len(proxies)).with_gen(gen, next(PUSHES))
    await asyncio.gather(*[asyncio.to_thread(s.send, spec, named, layout) for s in senders],
                         *[p.update_weights(layout, version, spec, first_rank=1 + i)
                           for i, p in enumerate(proxies)])
