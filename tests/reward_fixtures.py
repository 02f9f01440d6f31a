"""Verifiers for tests (--reward tests.reward_fixtures... is loaded by module:function)."""


def slow_or_exact(problem, response):
    if response == "hang":            # a pathological verifier: it never returns
        while True:
            pass
    if response == "raise":
        raise ValueError("a verifier bug")
    return 1.0 if response == problem.answer else 0.0


def sleep_then(problem, response):
    """response "SECONDS|VALUE": sleep that long, then score VALUE (a value names its own call)."""
    import time
    seconds, value = response.split("|")
    time.sleep(float(seconds))
    return float(value)


def always_raises(problem, response):
    """A verifier with a bug every answer meets (issue 61: such a run must stop, not spin)."""
    raise ValueError("a verifier that always raises")
