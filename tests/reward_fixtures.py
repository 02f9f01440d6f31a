"""Verifiers for tests (--reward tests.reward_fixtures... is loaded by module:function)."""


def slow_or_exact(problem, response):
    if response == "hang":            # a pathological verifier: it never returns
        while True:
            pass
    if response == "raise":
        raise ValueError("a verifier bug")
    return 1.0 if response == problem.answer else 0.0
