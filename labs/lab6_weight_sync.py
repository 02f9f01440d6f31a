"""Lab 6: a request that crosses a weight sync: which weights sampled each token, what "keep" and "abort" do.

A request of 20 tokens is generating when the trainer's new weights arrive: 9 tokens were sampled by the
policy of version 0 when the rollout rank suspends the engine (`proxy.LLMProxy.suspend`), loads version 1
(`proxy.LLMProxy.update_weights`) and resumes (`proxy.LLMProxy.resume`); the other 11 are sampled by
version 1. The trainer must know which is which: a token's behaviour log-prob is of the policy that
sampled it, PPO's ratio pi / mu is taken against it, and the freshness rule judges a sample by its oldest
token (lab 1). So the sample carries one version per token: [0] * 9 + [1] * 11.

The suspend mode decides what happens to the running request (`--suspend-mode`):
- keep (the default): the engine pauses it where it is, and it goes on under the new weights: one engine
  request, whose tokens change version mid-way.
- abort: the engine ends it (finish reason "abort"), and after the resume the proxy submits a new engine
  request: the prompt plus the 9 tokens so far as its prompt, the 11 tokens left of the budget as its
  max_tokens (partial rollout). The caller of `proxy.LLMProxy.generate` sees one Completion of 20 tokens
  either way.

Where the versions come from: the engine labels the tokens it samples with the version of its weights
(`proxy.LLMProxy.update_weights` calls the engine's set_version), and an engine request's last output
carries its tokens' spans per version, [(version, start, end), ...] over its tokens 0..n-1; version None
means weights never labelled (the ones the engine started with), which the proxy counts as the version
the request was submitted under. Why not simply the proxy's version when a token reaches it? Outputs can
arrive late (vLLM's output handler is a task behind the engine core): a token sampled by version 0 may
reach the proxy after version 1 was loaded.

Implement both functions below; the grader plugs them into the real `proxy.LLMProxy` in place of its own
(`LLMProxy._versions` and the resubmission in `LLMProxy.generate`) and runs it over a fake engine whose
outputs arrive late, in both modes, and over the plain-torch engine with the embedded model. Read for
inspiration: `proxy.LLMProxy.generate`, `proxy.LLMProxy._consume`, `ext/torch_engine.py` (`_Request.spans`)
and `env_manager.EnvManager._sync` (the sync on a rollout rank, and the abort of what can no longer be
fresh); docs/tour.md's step 6.

To think about: with vLLM and "keep", the request keeps its KV cache, computed by version 0's weights, and
its tokens 10..20 attend to it under version 1's. Which policy sampled token 10, and is the behaviour
log-prob recorded for it still the right mu for PPO's ratio? What does "abort" cost instead, and why does
the proxy salt vLLM's prefix cache with the version (`proxy.LLMProxy._consume`)?

    .venv/bin/python -m pytest labs/lab6_weight_sync_test.py
"""


def token_versions(spans: list[tuple[int | None, int, int]] | None, n: int, submitted: int) -> list[int]:
    """The policy version of each of an engine request's n tokens, from the spans its last output carried:
    [(version, start, end)] in order, covering tokens start..end-1; version None: the weights the engine
    started with, i.e. `submitted` (the proxy's version when this engine request was submitted). Spans
    that do not cover exactly n tokens (or None) are the engine's error: raise ValueError saying so."""
    raise NotImplementedError("lab 6: token_versions()")


def resubmission(prompt_ids: list[int], token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    """An "abort"-mode suspend ended a request after it had generated token_ids (of a budget of max_tokens
    response tokens). What the proxy submits to the engine after the resume: (the new engine request's
    prompt token ids, its max_tokens)."""
    raise NotImplementedError("lab 6: resubmission()")
