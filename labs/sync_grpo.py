"""labs/sync_grpo.py: the synchronous loop first. GRPO on the embedded addition task, in one process and one
file: the loop that the rest of this repository makes asynchronous. docs/tour.md starts here and shows which
part of the real system each piece below becomes.

    .venv/bin/python labs/sync_grpo.py                       # 30 steps: the reward rises (~1 s a step on CPU)
    .venv/bin/python labs/sync_grpo.py --steps 60 --seed 1 --out /tmp/sync.jsonl

One step: B prompts -> G samples of each from the engine (the plain-torch one, ext/torch_engine.py, with a
copy of the weights of its own) -> each sample scored by the task's verifier; groups whose rewards are all
equal dropped and more prompts sampled until B groups differ (DAPO's dynamic sampling, as train.py's
assembler filters) -> GRPO's group advantages -> PPO's loss (losses.py) on the trainer's copy -> one
optimizer step -> the new weights into the engine. The settings are train.py's defaults. Nothing overlaps:
the trainer waits for the slowest sample of the step, the engine waits while the trainer trains, and every
sample is of the current weights (staleness 0: the async ratio's 0).
"""

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))      # (run as a script: the repository's)

import losses  # noqa: E402
import task  # noqa: E402
import tiny_model  # noqa: E402
from config import check, opt, parse_cli  # noqa: E402
from ext.torch_engine import TorchEngine  # noqa: E402
from model import token_logprobs  # noqa: E402
from proxy import Sampling  # noqa: E402


@dataclass
class SyncConfig:
    steps: int = opt(30, "training steps (one optimizer step and one weight update each)")
    batch_groups: int = opt(32, "B: prompts per step (train.py's --batch-groups)")
    group_size: int = opt(8, "G: samples per prompt (--group-size)")
    max_tokens: int = opt(8, "response tokens at most (--max-tokens for the embedded model)")
    max_concurrency: int = opt(64, "sequences the engine decodes at once (--max-concurrency)")
    lr: float = opt(3e-4, "AdamW learning rate, linear warm-up over --warmup-steps (train.py's --lr)")
    warmup_steps: int = opt(10, "linear learning-rate warm-up, steps (--warmup-steps)")
    seed: int = opt(0, "seeds the prompts, the engine's sampling and torch (--seed)")
    out: str = opt("", "a JSONL file: one row of metrics per step (empty: none)")

    def __post_init__(self):
        check(self, at_least=dict(steps=1, batch_groups=1, group_size=2, max_tokens=1, max_concurrency=1,
                                  warmup_steps=0), above=dict(lr=0))


async def rollout(engine: TorchEngine, prompts: list[list[int]], G: int, max_tokens: int, tag: int):
    """G samples of every prompt, all submitted at once (the engine batches them: continuous batching); the
    step waits for the last one. -> [(token ids, their logprobs)], G consecutive ones per prompt."""
    async def one(i: int):
        ids, lps = [], []
        async for new_ids, new_lps, _, _ in engine.stream(f"r{tag}.{i}", prompts[i // G],
                                                          Sampling(max_tokens=max_tokens)):
            ids += new_ids
            lps += new_lps
        return ids, lps
    return await asyncio.gather(*(one(i) for i in range(len(prompts) * G)))


def batch(prompts: list[list[int]], samples: list, G: int) -> dict:
    """Right-padded tensors [N, T]: a response token at position p has its behaviour logprob (the engine's)
    and its loss mask at column p, where token_logprobs() puts its logprob under the trainer's weights."""
    rows = [(prompts[i // G], ids, lps) for i, (ids, lps) in enumerate(samples)]
    N, T = len(rows), max(len(p) + len(ids) for p, ids, _ in rows)
    t = {"input_ids": torch.zeros(N, T, dtype=torch.long), "attn": torch.zeros(N, T, dtype=torch.long),
         "mask": torch.zeros(N, T), "old_logp": torch.zeros(N, T)}
    for i, (p, ids, lps) in enumerate(rows):
        n = len(p) + len(ids)
        t["input_ids"][i, :n] = torch.tensor(p + ids)
        t["attn"][i, :n] = 1
        t["mask"][i, len(p):n] = 1                       # the response's tokens are trained, the prompt's not
        t["old_logp"][i, len(p):n] = torch.tensor(lps)
    return t


def train(cfg: SyncConfig, log=print) -> list[dict]:
    """The loop; returns one row of metrics per step (and writes them to cfg.out)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)          # (as train.py's one-process run: engine and trainer take turns)
    model_dir = str(tiny_model.ensure_tiny_model(log=log))
    tok = AutoTokenizer.from_pretrained(model_dir)
    # two copies of the weights: the engine's (sampling) and the trainer's (gradients)
    engine = TorchEngine.from_dir(model_dir, max_num_seqs=cfg.max_concurrency, seed=cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng, B, G, rows = random.Random(cfg.seed), cfg.batch_groups, cfg.group_size, []
    out = open(cfg.out, "w") if cfg.out else None
    t_start = time.monotonic()
    for step in range(cfg.steps):
        t0 = time.monotonic()
        # 1. rollout: B prompts, G samples each, all of the current weights (version = step); 2. rewards:
        # the task's verifier on each answer's text; a group whose rewards are all equal has no signal for
        # GRPO: dropped, and more prompts sampled until B groups have one (DAPO's dynamic sampling)
        kept, all_rewards = [], []
        for rounds in range(1, 21):
            problems = [task.make_problem(rng) for _ in range(B)]
            prompts = [tok.encode(p.prompt) for p in problems]
            samples = asyncio.run(rollout(engine, prompts, G, cfg.max_tokens, step * 100 + rounds))
            for j, p in enumerate(problems):
                group = samples[j * G:(j + 1) * G]
                rewards = [task.reward(p, tok.decode(ids, skip_special_tokens=True)) for ids, _ in group]
                all_rewards += rewards
                if len(set(rewards)) > 1:
                    kept.append((prompts[j], group, rewards))
            if len(kept) >= B:
                break
        else:
            raise RuntimeError(f"step {step + 1}: fewer than {B} groups with unequal rewards in 20 rounds "
                               f"of {B} prompts")
        kept = kept[:B]                        # (the rest of the last round's: generated in vain)
        prompts, samples = [k[0] for k in kept], [s for k in kept for s in k[1]]
        rewards = torch.tensor([r for k in kept for r in k[2]])
        # 3. advantages: each reward against its group's (GRPO: (r - mean) / (std + eps), per prompt)
        advantages = losses.estimate_advantages(rewards, G, "grpo")
        t1 = time.monotonic()
        # 4. the loss and one optimizer step (PPO's clipped surrogate; here r = pi / mu is 1 up to rounding:
        #    the samples are of these very weights)
        t = batch(prompts, samples, G)
        model.train()
        logp = token_logprobs(model, t["input_ids"], t["attn"], t["mask"])                 # [N, T]
        loss, metrics = losses.compute_policy_loss(logp, t["old_logp"], advantages, t["mask"], "ppo",
                                                   clip_low=0.2, clip_high=0.28)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        t2 = time.monotonic()
        # 5. the new weights into the engine (it is idle: every request of the step has ended)
        engine.load_state(model.state_dict().items())
        t3 = time.monotonic()
        row = {"step": step + 1, "reward_mean": sum(all_rewards) / len(all_rewards), "loss": loss.item(),
               "clip_frac": metrics["clip_frac"], "grad_norm": grad_norm, "rollout_rounds": rounds,
               "groups_filtered": len(all_rewards) // G - len(kept),
               "response_len_mean": sum(len(ids) for ids, _ in samples) / len(samples),
               "time_rollout": t1 - t0, "time_train": t2 - t1, "time_weight_sync": t3 - t2,
               "time_step": t3 - t0}
        rows.append(row)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        log(f"step {step + 1:4d}/{cfg.steps} | reward {row['reward_mean']:.3f} | loss {row['loss']:+.4f} | "
            f"{row['time_step']:.2f}s (rollout {row['time_rollout']:.2f} train {row['time_train']:.2f} "
            f"sync {row['time_weight_sync']:.3f})")
    engine.shutdown()
    if out:
        out.close()
    if rows:
        k = min(10, len(rows))
        first, last = (sum(r["reward_mean"] for r in part) / k for part in (rows[:k], rows[-k:]))
        steady = rows[1:] or rows                    # (step 1 pays the first forward's warm-up)
        log(f"done: {len(rows)} steps in {time.monotonic() - t_start:.1f}s, "
            f"{sum(r['time_step'] for r in steady) / len(steady):.2f} s a step after the first; "
            f"reward {first:.3f} (first {k} steps) -> {last:.3f} (last {k})")
    return rows


if __name__ == "__main__":
    c = parse_cli(SyncConfig, doc=__doc__)
    print("labs/sync_grpo.py:", json.dumps(asdict(c)))
    train(c)
