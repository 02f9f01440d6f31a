"""trainer.py: the training side (filled in by the training-system issue)."""

import torch


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logprob of every token given the tokens before it, under `model`.

    input_ids, attention_mask: [B, T], right-padded. Returns [B, T] float32; column 0 (no context)
    and padded positions are 0. Matches what the engine reports for the same tokens (float32)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1)                                    # [B, T-1, V]
    taken = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)                         # [B, T-1]
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    out[:, 1:] = taken * attention_mask[:, 1:]
    return out
