"""Lab 6's reference: what proxy.LLMProxy._versions and proxy.LLMProxy.generate do, as two functions."""


def token_versions(spans, n: int, submitted: int) -> list[int]:
    versions = []
    for v, start, end in spans or []:
        versions += [submitted if v is None else v] * (end - start)
    if spans is None or len(versions) != n:
        raise ValueError(f"the engine's spans {spans!r} do not cover its {n} tokens")
    return versions


def resubmission(prompt_ids: list[int], token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    return prompt_ids + token_ids, max_tokens - len(token_ids)
