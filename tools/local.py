"""tools/local.py: a whole run in one event loop, for the tools (the simulator, the benchmarks, the study)
and the tests: the rollout ranks' EnvManagers as tasks beside the trainer's loop, over in-process queues.

    result = await run_local(ctrl, managers, driver(), timeout_s)
"""

import asyncio

from proxy import now


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
