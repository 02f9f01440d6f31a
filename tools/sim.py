"""sim.py: the project's own scheduling code at cluster scale, in fast-forwarded virtual time.

    python -m tools.sim queue          # queue scheduling vs batch rollout, 8x8, 0 and 16 redundant prompts
    python -m tools.sim replication    # prompt replication on/off at 64x16 and 16x32
    python -m tools.sim envasync       # env-level async rollout vs lockstep envs (latency 10 +- 10 s),
                                       # + redundant envs
    python -m tools.sim scaling        # async vs sync, 16..128 GPUs, same GPU budget
    python -m tools.sim split          # rollout/train split sweep on 40 GPUs
    python -m tools.sim ratio          # async ratio 0, 1, 2, 4, 8
    python -m tools.sim calibrate      # time split of one synchronous colocated step (the constants' check)
    python -m tools.sim sweep          # the async ratio 0, 1, 2, 4, 8 on a long tail: s/step beside staleness
    python -m tools.sim rollpacker     # RollPacker's tail batching / streaming trainer vs async, 32 GPUs
                                       # (--gpus N), long-response and default workloads
    python -m tools.sim all            # everything; each writes results/NAME.md and results/NAME.png
    common flags: --steps N (per run; default 4) --warmup N (async runs; default 2) --seed N --chunk TOKENS

What runs for real: controller.AsyncController (admission under the async ratio, group assembly,
dynamic filtering, stale eviction, the three-phase weight sync), buffer.SampleBuffer over LocalQueues,
one env_manager.EnvManager per rollout GPU over proxy.LLMProxy(tools.fake_engine.FakeTimedEngine), and
ext.faults.LatencyEnv / ext.faults.FaultyEnv. All of it on one looptime event loop whose clock jumps to the
next timer whenever every task sleeps, so an hour of a 128-GPU run takes seconds. The glue here:
- trainer: the loop of train.py (collect -> train -> sync_weights) with training as a sleep of
  train_time(tokens, T) = tokens / (T * train_tok_s) + train_overhead_s;
- weight sync: the real protocol (controller.sync_weights, EnvManager._sync) with no group: the
  engine is paused for the whole transfer, as in the paper, so the fake engine's receive_weights
  sleeps broadcast + load while suspended and counts the load, and the trainer's send waits until
  every engine has the new weights (as weight_sync.py's broadcast holds the trainer). Both times come
  from the model's bytes (weight_sync_s): over NVLink within one node, over the inter-node link when
  the run spans nodes, then the engine's load; every table prints what it assumed (sync_note);
- engines: tools.fake_engine.FakeTimedEngine as a vLLM engine on one 80 GB GPU (sim_engine): a KV-cache
  budget of kv_tokens (admission while the blocks fit, preemption + recompute when they run out),
  step time t0 + k * running + k_ctx * context tokens + k_prefill * prefilled tokens; the
  constants are derived for an 8B model at SimConfig, and sim_vs_real.py checks the same model
  against real vLLM CPU engines;
- workload (Workload): every prompt has a difficulty, drawn from its group's env seed, that sets
  both its pass rate and the median of its samples' lengths (a hard prompt: low pass rate and long
  answers for the whole group), and a prompt length of its own. The fake engine learns which prompt
  it generates for from the prompt's first token (Tok). Over all samples the lengths stay
  lognormal(len_median, len_sigma) capped at max_tokens, in whole chunks;
- rewards: the fake engine emits random tokens, so no verifier can score them. SimEnv (wrapping
  the env the EnvManager builds) gives each sample reward ~ Bernoulli(p), p its prompt's pass rate,
  after a verifier latency (reward_s, overlapped with generation as in ROLL Flash). Per-prompt pass
  rates make dynamic filtering drop E[p^G + (1-p)^G] of the groups (22% at G = 8 with p uniform),
  roughly DAPO's filter rate;
- multi-turn (envasync): SimEnv ends a trajectory after `turns` turns, one-token observations;
  ext.faults.LatencyEnv adds normal(mean, std) latency to reset and every step. The sync-env baseline
  (LockstepEnv) puts an asyncio.Barrier over all trajectories of one engine before and after each
  env call: every turn the engine's batch is generated, then all its envs step, then the next turn
  (turn time = slowest generation + slowest env), the classic batched env loop.
The synchronous baselines: colocated = all N GPUs generate (async ratio 0), then the same N GPUs
train (train_time(T = N)); split sync = R GPUs generate, T train, async ratio 0; async = R/T with
ratio alpha. Synchronous runs spread a step's tasks evenly (max_concurrency = the even share, see
even()); async runs let 1.5x max_num_seqs trajectories per engine be in flight, so the engine stays
full while some trajectories wait for their verifier. The ideal pipeline bound of a split run is
min(rollout capacity, train capacity): R engines at full occupancy (engine_tok_s: max_num_seqs
sequences, or fewer when their KV does not fit, at the workload's mean context) over the step's
expected token demand (B*G*E[len] / (1 - filter rate), by Monte Carlo over the run's own Workload),
and 1 / train_time(T). It ignores the weight sync and the freshness bound, so both show up as lost
efficiency.

Simplifications (all deliberate; each is documented at its constant):
- time resolution: one fake-engine token stands for `chunk` = 64 real tokens (one fake step is chunk
  decode steps, ~1.8 s at full batch). This coarsens joins, lengths, KV blocks (one block = one
  chunk) and suspends (a suspend waits for the chunk in flight: ~1.8 s more per weight sync than
  vLLM's one decode step); it is what makes ~10^3 samples per second of real time possible in Python;
- the engines: no per-step token budget (a long prefill is one step), no prefix caching (each sample
  prefills its prompt), recompute-only preemption (fake_engine.py);
- the EnvManager polls every poll_s = 1 s of virtual time (the real one: 10 ms) so 128 managers
  don't spend the run polling; an idle manager picks up tasks and sync commands <= 1 s late;
- the colocated baseline pays the same weight-sync time as a split run on as many GPUs (no offload
  cost).
"""

import argparse
import asyncio
import dataclasses
import functools
import itertools
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import looptime

import ext
from buffer import LocalQueues, SampleBuffer
from controller import AsyncController, ControllerConfig, WholeBatch, rl_step
from env_manager import EnvManager, RolloutConfig
from ext.deadlines import DeadlineConfig, EnvDeadline
from ext.faults import FaultyEnv, LatencyEnv
from ext.stream_trainer import TrainStream
from ext.tail_batching import TailBatching
from ext.verifiers import VerifierConfig
from tools.fake_engine import FakeTimedEngine
from tools.local import run_local
from proxy import LLMProxy
from task import Problem

ext.load()           # (the envs: --env guess)
RESULTS = Path(__file__).resolve().parent.parent / "results"


def sub_config(cls, src, **overrides):
    """An instance of dataclass `cls` from the fields of `src` with the same names, then `overrides`
    (SimConfig -> a component's config). `cls` validates them (its __post_init__)."""
    names = {f.name for f in dataclasses.fields(cls)}
    shared = {f.name: getattr(src, f.name) for f in dataclasses.fields(src) if f.name in names}
    return cls(**{**shared, **overrides})


@dataclass
class SimConfig:
    # cluster
    rollout_gpus: int = 24          # R: engines (EnvManager + LLMProxy + FakeTimedEngine each); colocated:
                                    # all N GPUs
    train_gpus: int = 16            # T: GPUs in the trainer's time model; colocated: the same N GPUs
    colocated: bool = False         # sync baseline: the same GPUs generate then train (needs async_ratio 0)
    # controller (controller.ControllerConfig)
    batch_groups: int = 64          # B: prompts per step
    group_size: int = 8             # G: samples per prompt
    async_ratio: int = 2            # alpha; 0 = synchronous
    redundant: int = 0              # extra prompts admitted per step (dynamic filtering head start)
    replicate: bool = True          # prompt replication
    rollout_mode: str = "queue"     # "queue" or "batch"
    filter_groups: bool = True       # DAPO dynamic filtering of all-equal-reward groups
    max_gen_batches: int = 0        # dynamic filtering's bound per step (ControllerConfig's), 0 = none
    on_max_gen_batches: str = "error"   # ... and what it does when reached: error | train
    env: str = ""                   # "" RLVR single turn; "guess" = a multi-turn env (SimEnv times it)
    env_redundancy: int = 0         # extra trajectories per env group, first G kept
    tail_batching: bool = False     # RollPacker's tail batching (ext/tail_batching.py's Admission)
    tail_oversample: float = 1.5    # ... a short round's prompts per batch, times B
    tail_extra_samples: int = 0     # ... a short round's samples per prompt beyond G
    stream_train: bool = False      # the streaming trainer: each complete group is trained on (its tokens'
                                    # share of train_time) as it arrives; the optimizer step
                                    # (train_overhead_s) once the batch is complete
    prompt_seeds: bool = False      # the workload keyed by the prompt, not by its group: a prompt run again
                                    # (tail batching's long round) draws the same difficulty and length
                                    # median. Off: each group draws its own (the older tables' setting)
    # workload: RLVR on an 8B base model, 8k cap. The paper: the longest responses exceed the median by more
    # than 20x; median 400 and sigma 1 put the cap at 20x the median, reached by ~5 of 4096 samples.
    # Per-prompt difficulty (see Workload): a prompt's quantile u ~ U(0, 1) sets its pass rate p = 1 - u and,
    # with correlation len_rho, the median of its samples' lengths; the samples of one prompt vary around it.
    len_median: float = 400         # response tokens per model turn, lognormal median over all prompts
    len_sigma: float = 1.0          # lognormal sigma over all samples (mean = 1.65x median before the cap)
    len_sigma_prompt: float = 0.7   # the part of len_sigma that is between prompts: sigma^2 = 0.7^2 + 0.71^2,
                                    # half the log-length variance is the prompt's (assumed: hard prompts give
                                    # long answers for the whole group; 0 = lengths drawn independently per
                                    # sample)
    len_rho: float = 0.7            # correlation of a prompt's log-length with its difficulty (assumed:
                                    # failed attempts run longer); 1 = the hardest prompts are also the
                                    # longest
    max_tokens: int = 8192          # cap per model turn (Sampling.max_tokens)
    prompt_median: float = 256      # prompt tokens (problem + chat template), lognormal median per prompt
    prompt_sigma: float = 0.5       # ... and sigma; capped at prompt_cap
    prompt_cap: int = 2048
    turns: int = 1                  # model turns per trajectory (multi-turn env)
    reward_s: float = 5.0           # verifier latency per sample, mean (s): sandbox / LLM-judge scale; with
                                    # it the reward phase is ~10% of a sync step (RollPacker: 5-13%), see
                                    # `calibrate`
    reward_std_s: float = 1.5
    env_mean_s: float = 0.0         # env latency per reset/step (ext.faults.LatencyEnv), mean and std (s)
    env_std_s: float = 0.0
    fail_rate: float = 0.0          # env call failure rate (ext.faults.FaultyEnv), retried by the EnvManager
    lockstep: str = ""              # sync-env baseline: "engine" (each engine's trajectories advance turn by
                                    # turn together) or "batch" (all B*G trajectories do); "" = env-level
                                    # async
    # engine model (tools.fake_engine.FakeTimedEngine): an 8B dense model in bf16 (Qwen3-8B: 8.2e9 parameters,
    # 36 layers, 8 KV heads of 128) on one 80 GB H800/H100 (3.35 TB/s HBM, 989 TFLOP/s bf16), one engine a GPU
    t0: float = 0.010               # s per decode step at batch 0: 16.4 GB of weights at ~2 TB/s achieved
                                    # (8.2 ms) + ~2 ms of scheduling, sampling and launch
    k: float = 3e-5                 # s per running sequence per step: its matmuls, 2 x 8.2e9 FLOP per token
                                    # at ~550 TFLOP/s achieved (grows the step by 4 ms at 128 sequences)
    k_ctx: float = 1.0e-7           # s per context token of the running sequences per step: attention reads
                                    # its KV, 2 (K, V) x 36 layers x 8 heads x 128 x 2 B = 147 kB per token,
                                    # at ~1.5 TB/s
    k_prefill: float = 3e-5         # s per prefilled token (prompt, or recompute after a preemption):
                                    # compute-bound, the same 16.4 GFLOP per token as a decode token's matmuls
    kv_tokens: int = 300_000        # KV-cache budget per engine, tokens: 80 GB x 0.8 gpu_memory_utilization
                                    # (room for the trainer's offloaded states and NCCL buffers) - 16.4 GB
                                    # weights - ~4 GB activations and CUDA graphs = 44 GB, / 147 kB per token
    block_size: int = 16            # tokens per KV block (vLLM's default); rounded up to one chunk in the
                                    # fake engine
    max_num_seqs: int = 128         # sequences decoding at once per engine (vLLM max_num_seqs): memory binds
                                    # first when their mean context passes kv_tokens / 128 = 2.3k tokens
    max_concurrency: int = 192      # trajectories in flight per engine (RolloutConfig): 1.5x max_num_seqs,
                                    # since a trajectory holds its slot while its verifier runs (~1/5 of its
                                    # life here); synchronous runs use an even share of the step's tasks
                                    # instead, see even()
    chunk: int = 64                 # real tokens per fake token (time resolution, see docstring)
    # trainer model
    train_tok_s: float = 4400.0     # tokens/s per trainer GPU (prompt + response tokens), calibrated so that
                                    # a colocated sync step spends ~22% training (RollPacker), see
                                    # `calibrate`. For 8B: fwd+bwd (6 x 8.2e9 FLOP/token) + old and ref
                                    # logprob passes (4 x 8.2e9) = 82 GFLOP/token, i.e. 36% of a 989 TFLOP/s
                                    # GPU, a usual training MFU
    train_overhead_s: float = 3.0   # per step: optimizer step + gathering full weights
    # weight sync (weight_sync_s; link bandwidths in WEIGHT SYNC below)
    params: float = 8.2e9           # parameters of the synced model (Qwen3-8B; Qwen3-32B: 32.8e9)
    dtype: str = "bfloat16"         # the engine's weights, what a sync sends (RolloutConfig.dtype)
    # run
    steps: int = 4                  # training steps (synchronous end-to-end runs: steps - 2, no pipeline
                                    # to fill)
    warmup: int = 2                 # first steps excluded from the steady-state numbers (pipeline fill)
    seed: int = 0
    start_version: int = 0          # the policy version the run starts at (a resumed run: its checkpoint's)
    poll_s: float = 1.0             # EnvManager poll period, virtual seconds (real: 0.01; see docstring)
    timeout_s: float = 3600.0       # every wait (queues, acks, env calls), virtual seconds
    gpus: int = 0                   # rollpacker's GPU budget (0: ROLLPACKER_GPUS)


# ---------------------------------------------------------------------------------------------
# WEIGHT SYNC: the model's bytes over the run's slowest link, then the engine's load. The paper's hardware
# is nodes of 8 H800/H100 GPUs; each value is the slow end of what that hardware does, so no table leans
# on a fast network. GB = 1e9 bytes.

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}   # bytes per parameter
GPUS_PER_NODE = 8                   # an HGX H800/H100 node
INTRA_NODE_GB_S = 150.0             # NCCL broadcast over NVLink within a node: the H800's NVLink is 400 GB/s
                                    # bidirectional, 200 GB/s each way (the H100's: 900, 450; NVIDIA's
                                    # datasheets); NCCL's broadcast bus bandwidth reaches ~75-90% of one
                                    # direction, 150 GB/s is its low end on the slower H800
INTER_NODE_GB_S = 25.0              # NCCL broadcast across nodes, bounded by one NIC: a 200 Gb/s HDR
                                    # InfiniBand / RoCE NIC at line rate, or half of a 400 Gb/s NDR /
                                    # ConnectX-7 one; NCCL can stripe its channels over a node's 4-8 NICs,
                                    # so a real cluster is often faster
LOAD_GB_S = 16.0                    # the engine's load of the received tensors (vLLM load_weights): they
                                    # are on its GPU already, so per-tensor Python weight loaders (~400
                                    # tensors for Qwen3-8B, QKV and gate/up fused) and a device copy. Assumed,
                                    # not measured here: ~1 s for 8B, the load_s this replaced; a
                                    # reload of Qwen3-8B from its checkpoint files takes 3.5 s on an H200
                                    # (vLLM PR #49459), which also reads the files and crosses PCIe


def model_gb(cfg) -> float:
    return cfg.params * DTYPE_BYTES[cfg.dtype] / 1e9


def weight_sync_s(cfg) -> tuple[float, float]:
    """(broadcast, load) seconds of one weight sync, the engines paused for both. A pipelined (ring / chain)
    NCCL broadcast of a message this large takes bytes / the slowest link's bandwidth, however many engines
    receive it: NVLink when the run's GPUs fit one node, the inter-node link when it spans nodes (then some
    engines are on another node than the trainer's sender). A colocated run's GPUs are rollout_gpus."""
    gpus = cfg.rollout_gpus if cfg.colocated else cfg.rollout_gpus + cfg.train_gpus
    link = INTRA_NODE_GB_S if gpus <= GPUS_PER_NODE else INTER_NODE_GB_S
    return model_gb(cfg) / link, model_gb(cfg) / LOAD_GB_S


def sync_note(cfg) -> str:
    """The weight-sync assumption, as the tables print it."""
    gb, load = model_gb(cfg), model_gb(cfg) / LOAD_GB_S
    return (f"weight sync (engines paused): {gb:.1f} GB ({cfg.params / 1e9:.3g}B parameters in "
            f"{cfg.dtype}) at {INTRA_NODE_GB_S:.0f} GB/s intra-node = {gb / INTRA_NODE_GB_S:.2f} s on one "
            f"{GPUS_PER_NODE}-GPU node, at {INTER_NODE_GB_S:.0f} GB/s inter-node = "
            f"{gb / INTER_NODE_GB_S:.2f} s across nodes; + load at {LOAD_GB_S:.0f} GB/s = {load:.2f} s")


# ---------------------------------------------------------------------------------------------
# glue: tokenizer, envs, models


class Tok:
    """One token per character; the fake engine's random tokens decode to '' (no text needed). A prompt
    "P<seed>:<n>" (SimEnv) encodes to n tokens, the first SEED_ID + seed, so the fake engine's length
    hook knows which prompt it is generating for."""
    eos_token_id = 1
    SEED_ID = 1000

    @staticmethod
    def prompt_text(seed: int, n: int) -> str:
        return f"P{seed}:{n}"

    def encode(self, text, add_special_tokens=True):
        if text.startswith("P") and ":" in text:
            seed, n = text[1:].split(":")
            return [self.SEED_ID + int(seed)] + [2] * (int(n) - 1)
        return [2 + ord(c) % 60 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return ""


class Workload:
    """Per-prompt difficulty, drawn from the prompt's env seed (the same for every sample of a group,
    on every rank): quantile u ~ U(0, 1); pass rate p = 1 - u (uniform over prompts, so dynamic
    filtering drops E[p^G + (1-p)^G] of the groups: 22% at G = 8); the median of its response lengths
    len_median * exp(len_sigma_prompt * z), z = len_rho * Phi^-1(u) + sqrt(1 - len_rho^2) * e, e ~ N(0, 1);
    each sample's length lognormal around it with sigma sqrt(len_sigma^2 - len_sigma_prompt^2), so over
    all samples lengths are lognormal(len_median, len_sigma) as before; a prompt length of its own.
    Lengths are in fake-engine tokens (chunks)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.sigma_within = math.sqrt(max(0.0, cfg.len_sigma ** 2 - cfg.len_sigma_prompt ** 2))
        self.cap = max(1, cfg.max_tokens // cfg.chunk)

    @functools.lru_cache(maxsize=1 << 16)
    def prompt(self, seed: int) -> tuple[float, float, int]:
        """(pass rate, log of the median response length in chunks, prompt length in chunks)."""
        c, rng = self.cfg, random.Random(seed)
        u = min(max(rng.random(), 1e-9), 1 - 1e-9)
        z = c.len_rho * statistics.NormalDist().inv_cdf(u) + math.sqrt(1 - c.len_rho ** 2) * rng.gauss(0, 1)
        plen = min(c.prompt_cap, rng.lognormvariate(math.log(c.prompt_median), c.prompt_sigma))
        return 1 - u, math.log(c.len_median / c.chunk) + c.len_sigma_prompt * z, max(1, round(plen / c.chunk))

    def length(self, seed: int, rng: random.Random) -> int:
        return max(1, min(self.cap, int(rng.lognormvariate(self.prompt(seed)[1], self.sigma_within))))

    def length_of_prompt(self, prompt_ids, rng: random.Random) -> int:
        """The fake engine's hook: the prompt's first token carries its seed (Tok.prompt_ids)."""
        return self.length(prompt_ids[0] - Tok.SEED_ID, rng)


class SimEnv:
    """Times and rewards the env the EnvManager built: `turns` turns, one-token observations,
    reward ~ Bernoulli(p) at the end after the verifier latency, p the prompt's pass rate (Workload)."""

    def __init__(self, env, cfg: SimConfig, rng: random.Random, workload: Workload):
        self.env, self.cfg, self.rng, self.turn, self.p, self.workload = env, cfg, rng, 0, 0.0, workload

    async def reset(self, seed):
        await self.env.reset(seed)
        problem = getattr(self.env, "problem", None)          # (prompt_seeds: the prompt's own seed)
        seed = problem.meta.get("sim_seed", seed) if problem is not None else seed
        self.p, _, plen = self.workload.prompt(seed)
        return Tok.prompt_text(seed, plen)

    async def step(self, action):
        await self.env.step(action)         # the real env's step runs; its text and reward are replaced
        self.turn += 1
        if self.turn < self.cfg.turns:
            return "o", 0.0, False, {}
        await asyncio.sleep(max(0.0, self.rng.gauss(self.cfg.reward_s, self.cfg.reward_std_s)))
        return "", float(self.rng.random() < self.p), True, {}


class LockstepEnv:
    """Sync-env baseline: every trajectory of one engine waits for all the others after its
    generation and after its env call (a batched generate -> batched env step loop)."""

    def __init__(self, env, barrier: asyncio.Barrier):
        self.env, self.barrier = env, barrier

    async def reset(self, seed):
        obs = await self.env.reset(seed)
        await self.barrier.wait()
        return obs

    async def step(self, action):
        await self.barrier.wait()
        out = await self.env.step(action)
        await self.barrier.wait()
        return out


def sim_engine(cfg: SimConfig, workload: Workload, seed: int) -> FakeTimedEngine:
    """One engine in fake tokens: a fake token is `chunk` real tokens, so one fake step is `chunk` decode
    steps over `chunk` times the context, and the KV budget and block are counted in chunks."""
    c = cfg.chunk
    return FakeTimedEngine(t0=c * cfg.t0, k=c * cfg.k, k_ctx=c * c * cfg.k_ctx, k_prefill=c * cfg.k_prefill,
                           kv_tokens=cfg.kv_tokens // c, block_size=max(1, cfg.block_size // c),
                           max_num_seqs=cfg.max_num_seqs, length_of_prompt=workload.length_of_prompt,
                           load_s=sum(weight_sync_s(cfg)), seed=seed)   # suspended for the transfer too


def train_time(cfg: SimConfig, tokens: float, gpus: int) -> float:
    return tokens / (gpus * cfg.train_tok_s) + cfg.train_overhead_s


def engine_tok_s(cfg: SimConfig) -> float:
    """Tokens/s of one engine kept full: max_num_seqs sequences (fewer when their KV does not fit
    kv_tokens) at this workload's time-weighted mean context. Prefill is left out (a 256-token prompt
    costs 8 ms once per sample, well under 1% of its decode time)."""
    ctx = demand(cfg)[2]
    n = min(cfg.max_num_seqs, cfg.kv_tokens / ctx)
    return n / (cfg.t0 + cfg.k * n + cfg.k_ctx * n * ctx)


def demand(cfg: SimConfig) -> tuple[float, float, float]:
    """Expected tokens generated per step (filtered groups included), tokens per trained sample, and the
    mean context of a running sequence (weighted by its time in the engine), all in real tokens."""
    key = tuple(getattr(cfg, f) for f in ("len_median", "len_sigma", "len_sigma_prompt", "len_rho",
                                          "max_tokens", "prompt_median", "prompt_sigma", "prompt_cap",
                                          "chunk", "turns"))
    response, per_sample, ctx, ps = _demand(key)
    g = cfg.group_size if cfg.filter_groups else 0
    q = statistics.fmean(p ** g + (1 - p) ** g for p in ps) if g else 0.0
    return cfg.batch_groups * cfg.group_size * response / (1 - q), per_sample, ctx


@functools.lru_cache
def _demand(key: tuple):
    """Monte Carlo over the run's own Workload (fixed seeds): mean response and sample tokens, mean
    running context, pass rates."""
    c = SimConfig(**dict(zip(("len_median", "len_sigma", "len_sigma_prompt", "len_rho", "max_tokens",
                              "prompt_median", "prompt_sigma", "prompt_cap", "chunk", "turns"), key)))
    w, rng = Workload(c), random.Random(12345)
    resp = plen = life = weighted_ctx = 0.0
    ps = []
    for seed in range(20_000):
        p, _, pl = w.prompt(seed + (1 << 40))
        ps.append(p)
        for _ in range(2):
            n = sum(w.length(seed + (1 << 40), rng) for _ in range(c.turns))
            resp += n
            plen += pl
            life += n
            weighted_ctx += n * pl + n * n / 2         # the context grows from pl to pl + n over n steps
    samples = 40_000
    response = resp / samples * c.chunk
    return response, response + (plen / samples + c.turns) * c.chunk, weighted_ctx / life * c.chunk, ps


def ideal_steps_per_s(cfg: SimConfig, occupancy: float = 1.0) -> float:
    gen_tokens, sample_tokens, _ = demand(cfg)
    rollout = occupancy * cfg.rollout_gpus * engine_tok_s(cfg) / gen_tokens
    train = 1 / train_time(cfg, cfg.batch_groups * cfg.group_size * sample_tokens, cfg.train_gpus)
    return min(rollout, train)


def best_split(cfg: SimConfig, gpus: int, occupancy: float = 1.0) -> int:
    """Rollout GPUs that maximise the ideal bound on `gpus` GPUs, the engines kept `occupancy` busy."""
    return max(range(1, gpus),
               key=lambda r: ideal_steps_per_s(replace(cfg, rollout_gpus=r, train_gpus=gpus - r), occupancy))


# ---------------------------------------------------------------------------------------------
# one run


def sim_problems(cfg: SimConfig):
    """The prompt stream: all alike (the workload keyed by each group's env seed), or with prompt_seeds
    one seed per prompt (the workload keyed by the prompt, so a prompt run again is the same prompt)."""
    if not cfg.prompt_seeds:
        return iter(lambda: Problem("q", ""), None)
    return (Problem(f"q{i}", "", meta={"sim_seed": (cfg.seed << 32) + i}) for i in itertools.count())


class SimStream:
    """The streaming trainer's time model (TrainStream's backend): each complete group costs its
    tokens' share of train_time as it arrives, the optimizer step train_overhead_s at the end."""

    def __init__(self, cfg: SimConfig, gpus: int):
        self.cfg, self.gpus, self.tokens = cfg, gpus, 0

    async def begin(self, version):
        self.tokens = 0

    async def add(self, samples, advantages):
        tokens = sum(s.num_tokens for s in samples) * self.cfg.chunk
        self.tokens += tokens
        await asyncio.sleep(tokens / (self.gpus * self.cfg.train_tok_s))

    async def step(self, version):
        await asyncio.sleep(self.cfg.train_overhead_s)
        return {"tokens": self.tokens}, None


async def _simulate(cfg: SimConfig, problems=None, observe=None, setup=None, workload=None,
                    finisher=None) -> dict:
    """One run; problems: the prompt stream (default sim_problems); setup(ctrl): called once the
    controller is built, observe(ctrl, step) after each step (tests); workload: the prompts' pass rates and
    lengths (default Workload(cfg); tools/domains_study.py: one per domain); finisher: every rank's sample
    finisher (EnvManager's)."""
    loop = asyncio.get_running_loop()
    R = cfg.rollout_gpus
    T = R if cfg.colocated else cfg.train_gpus
    buffer = SampleBuffer(LocalQueues(R), "sim", cfg.timeout_s)
    ccfg = sub_config(ControllerConfig, cfg)
    admission = TailBatching(ccfg, cfg.tail_oversample, cfg.tail_extra_samples) if cfg.tail_batching else None
    ctrl = AsyncController(ccfg, buffer, problems or sim_problems(cfg), R, version=cfg.start_version,
                           admission=admission)
    if setup is not None:
        setup(ctrl)
    turn_cap = max(1, cfg.max_tokens // cfg.chunk)
    workload = workload or Workload(cfg)
    rcfg = sub_config(RolloutConfig, cfg, max_tokens=turn_cap, env_step_timeout_s=cfg.timeout_s,
                      max_turns=cfg.turns,
                      max_model_len=2 + -(-cfg.prompt_cap // cfg.chunk) + cfg.turns * (turn_cap + 1),
                      stop_timeout_s=cfg.timeout_s)
    batch_barrier = asyncio.Barrier(cfg.batch_groups * cfg.group_size) if cfg.lockstep == "batch" else None
    proxies, managers = [], []
    for r in range(R):
        engine = sim_engine(cfg, workload, seed=cfg.seed * 10007 + r)
        proxy = LLMProxy(engine, rank=r, timeout_s=cfg.timeout_s)
        proxy.version = cfg.start_version         # (as train.py's rollout ranks: the checkpoint's weights)
        rng = random.Random(cfg.seed * 7919 + r)
        barrier = asyncio.Barrier(cfg.max_concurrency) if cfg.lockstep == "engine" else batch_barrier

        def wrap(env, rng=rng, barrier=barrier):
            env = SimEnv(env, cfg, rng, workload)
            if cfg.env_mean_s or cfg.env_std_s:
                env = LatencyEnv(env, cfg.env_mean_s, cfg.env_std_s, rng)
            if cfg.fail_rate:
                env = FaultyEnv(env, cfg.fail_rate, 0.0, rng)
            return LockstepEnv(env, barrier) if barrier else env

        proxies.append(proxy)
        managers.append(EnvManager(proxy, buffer, Tok(), r, rcfg,
                                   sync_timeout_s=cfg.timeout_s, env_wrappers=wrap, finisher=finisher,
                                   deadline=EnvDeadline.of(rcfg, DeadlineConfig(),
                                                           VerifierConfig().reward_timeout_s)))

    rows = []

    async def train(batch, advantages, version):  # modelled training time
        tokens = sum(s.num_tokens for s in batch) * cfg.chunk
        await asyncio.sleep(train_time(cfg, tokens, T))
        return {"tokens": tokens}, None

    # the trainer's side of the broadcast: until every engine has it
    async def send(spec):
        async with asyncio.timeout(cfg.timeout_s):   # (virtual seconds; the engines model the transfer)
            while any(p.version <= ctrl.version for p in proxies):
                await asyncio.sleep(0.05)

    backend = (TrainStream(cfg.group_size, SimStream(cfg, T), cfg.timeout_s) if cfg.stream_train
               else WholeBatch(train, cfg.group_size))

    async def trainer():                          # train.py's loop (controller.rl_step)
        for _ in range(cfg.steps):
            s = await rl_step(ctrl, backend, send)
            rows.append({**s.info, "t_end": loop.time(), "time_rollout": s.info["time_wait_rollout"],
                         "time_train": s.train_s, "time_sync": s.sync["time_weight_sync"],
                         "tokens": s.metrics["tokens"], "time_trainer_busy": s.metrics["time_trainer_busy"],
                         "tokens_generated": sum(p.num_tokens for p in proxies) * cfg.chunk,
                         "tokens_aborted": sum(m.counters["tokens_aborted"] for m in managers) * cfg.chunk})
            if observe is not None:
                observe(ctrl, s)

    await run_local(ctrl, managers, trainer(), cfg.timeout_s * (cfg.steps + 1))
    for p in proxies:
        p.shutdown()
    out = summarize(cfg, rows, R)
    out["proxy_versions"] = [p.version for p in proxies]
    out["engine_loads"] = [p.engine.num_loads for p in proxies]
    out["preemptions"] = sum(p.engine.num_preemptions for p in proxies) / cfg.steps   # per step, whole run
    return out


def summarize(cfg: SimConfig, rows: list[dict], R: int) -> dict:
    """Steady state: the steps after the warm-up."""
    m = rows[cfg.warmup:]
    t_start = rows[cfg.warmup - 1]["t_end"] if cfg.warmup else 0.0
    elapsed = m[-1]["t_end"] - t_start
    gen = m[-1]["tokens_generated"] - (rows[cfg.warmup - 1]["tokens_generated"] if cfg.warmup else 0)
    out = {
        "step_s": elapsed / len(m),
        "samples_per_s": sum(r["num_samples"] for r in m) / elapsed,
        "rollout_s": statistics.fmean(r["time_rollout"] for r in m),
        "train_s": statistics.fmean(r["time_train"] for r in m),
        "sync_s": statistics.fmean(r["time_sync"] for r in m),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in m),
        "dropped_stale": sum(r["samples_dropped_stale"] for r in m) / len(m),
        "filtered": sum(r["groups_filtered"] for r in m) / len(m),
        # the trainer's idle share of the steady state, and the generated tokens aborted (thrown away) in it
        "trainer_idle": 1 - sum(r["time_trainer_busy"] for r in m) / elapsed,
        "aborted_share": (m[-1]["tokens_aborted"] - (rows[cfg.warmup - 1]["tokens_aborted"] if cfg.warmup
                                                     else 0)) / max(gen, 1),
        # decode throughput / full-occupancy throughput
        "engine_util": gen / (R * engine_tok_s(cfg) * elapsed),
        "rows": rows,
    }
    if not cfg.colocated and cfg.async_ratio > 0:
        # the bound of the expected workload (splits, plots)
        out["ideal_steps_per_s"] = ideal_steps_per_s(cfg)
        # efficiency: against the bound of the work this window really held, since a few steps of a
        # long-tailed workload can be much lighter or heavier than its expectation. Generated tokens
        # include work later filtered or aborted as stale, which the pipeline had to do as well.
        rollout = R * engine_tok_s(cfg) / (gen / len(m))
        train = 1 / train_time(cfg, statistics.fmean(r["tokens"] for r in m), cfg.train_gpus)
        out["efficiency"] = (1 / out["step_s"]) / min(rollout, train)
    return out


def simulate(cfg: SimConfig, problems=None, observe=None, setup=None, workload=None, finisher=None) -> dict:
    if cfg.colocated and cfg.async_ratio != 0:
        raise ValueError("a colocated run is synchronous: async_ratio must be 0")
    if cfg.colocated and cfg.stream_train:
        raise ValueError("a colocated run trains on the engines' GPUs once they are done: the streaming "
                         "trainer needs GPUs of its own (a split run)")
    if cfg.lockstep not in ("", "engine", "batch"):
        raise ValueError(f"lockstep must be '', 'engine' or 'batch', got {cfg.lockstep!r}")
    if cfg.lockstep and (cfg.async_ratio or cfg.filter_groups or cfg.redundant or cfg.env_redundancy
                         or cfg.fail_rate
                         or cfg.batch_groups * cfg.group_size != cfg.rollout_gpus * cfg.max_concurrency):
        raise ValueError("lockstep: needs a synchronous run whose batch fills every engine exactly "
                         "(B*G == R*max_concurrency), no filtering, no redundancy, no failures")
    loop = looptime.new_event_loop(noop_cycles=0)   # nothing external happens: advance time at once
    try:
        return loop.run_until_complete(_simulate(cfg, problems, observe, setup, workload, finisher))
    finally:
        loop.close()


# ---------------------------------------------------------------------------------------------
# experiments: each returns (title, markdown table lines, plot function)

RLVR = SimConfig()                                     # the defaults: 8B-class RLVR, 8k cap
AGENT = SimConfig(env="guess", turns=10, len_median=256, len_sigma=0.5, max_tokens=1024, chunk=32,
                  reward_s=0.0, reward_std_s=0.0, filter_groups=False, env_mean_s=10.0, env_std_s=10.0,
                  max_num_seqs=32, rollout_gpus=8, batch_groups=32, group_size=8, async_ratio=0)


def colocated(cfg: SimConfig, gpus: int) -> SimConfig:
    """The synchronous baseline: all `gpus` GPUs generate, then the same GPUs train. No pipeline to
    fill, so no warm-up steps."""
    return replace(even(cfg, gpus), train_gpus=gpus, colocated=True, async_ratio=0, warmup=0)


def even(cfg: SimConfig, rollout_gpus: int) -> SimConfig:
    """A synchronous run's best max_concurrency: one step's tasks spread evenly over the engines.
    EnvManager._pull_tasks takes up to its free slots at once (one task per group per poll period), so
    with a larger value the ranks that poll first take more than their share of a sync step's batch
    and the others idle at its end."""
    tasks = (cfg.batch_groups + cfg.redundant) * (cfg.group_size + (cfg.env_redundancy if cfg.env else 0))
    share = min(cfg.max_concurrency, max(cfg.group_size, math.ceil(tasks / rollout_gpus)))
    return replace(cfg, rollout_gpus=rollout_gpus, max_concurrency=share)


def table(headers: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
           ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]


# The length median the paper's own queue-scheduling times imply under this engine model: its 37 s per step is
# ~2.4k tokens of decoding for the 8th good group at ~13 ms per step, the longest sample of a group of 8 is
# ~3x its prompt's median, so the median prompt answers ~1k tokens (and its 125 s batch rollout is the 8k
# cap).
PAPER_QUEUE_MEDIAN = 1000


def exp_queue(base: SimConfig):
    """8x8 on one 8-GPU node, synchronous; per-step generation time (the collect phase). Two workloads:
    the default (median 400, cap 20x the median) and the median the paper's times imply."""
    rows, res = [], {}
    workloads = {"default (median 400)": base,
                 f"median {PAPER_QUEUE_MEDIAN}": replace(base, len_median=PAPER_QUEUE_MEDIAN)}
    for wname, w in workloads.items():
        for redundant in (0, 16):
            for mode in ("batch", "queue"):
                # small, cheap steps: twice as many
                cfg = colocated(replace(w, batch_groups=8, group_size=8, redundant=redundant,
                                        rollout_mode=mode, steps=2 * base.steps), 8)
                res[wname, mode, redundant] = r = simulate(cfg)
                rows.append([wname, mode, redundant, r["rollout_s"], r["filtered"], r["engine_util"]])
    ratios = {(w, n): res[w, "batch", n]["rollout_s"] / res[w, "queue", n]["rollout_s"]
              for w in workloads for n in (0, 16)}
    lines = table(["workload", "rollout", "redundant prompts", "generation s/step", "groups filtered/step",
                   "engine occupancy"], rows) + [""] + [
        f"{w}: batch / queue generation time {ratios[w, 16]:.2f}x with 16 redundant prompts, "
        f"{ratios[w, 0]:.2f}x with "
        "none" for w in workloads] + ["", "paper: 125 s -> 37 s, 3.4x with 16 redundant prompts"]

    def plot(ax):
        for i, (w, mode) in enumerate((w, m) for w in workloads for m in ("batch", "queue")):
            ax.bar([x + 0.2 * i for x in (0, 1)], [res[w, mode, n]["rollout_s"] for n in (0, 16)], 0.2,
                   label=f"{mode}, {w}")
        ax.set_xticks([0.3, 1.3], ["0 redundant", "16 redundant"])
        ax.set_ylabel("generation time per step (s)")
        ax.legend(fontsize=7)
    return "queue scheduling vs batch rollout (8x8, 8 GPUs)", lines, plot


# A long-response (Think-style) workload on the same engines: median 4k, cap 16k. 128 sequences per engine
# then need ~600k tokens of KV against kv_tokens = 300k, so the engines are memory-bound and preempt.
LONG = dict(len_median=4000, max_tokens=16384, chunk=128)


def memory_note(cfg: SimConfig) -> str:
    ctx = demand(cfg)[2]
    return (f"mean running context {ctx:.0f} tokens: {cfg.max_num_seqs} sequences need "
            f"{cfg.max_num_seqs * ctx / 1e3:.0f}k "
            f"of the {cfg.kv_tokens / 1e3:.0f}k KV tokens")


def exp_replication(base: SimConfig):
    """Synchronous rollout, no filtering, one 8-GPU node: generation time per step with a group's samples
    as one task (one engine) or replicated, for the default workload (memory never binds) and a
    long-response one (it does)."""
    rows, ratio = [], {}
    cases = [(w, b, g) for w in ("default", "long") for b, g in ((64, 16), (16, 32))]
    for w, b, g in cases:
        t = {}
        for rep in (False, True):
            cfg = colocated(replace(base, batch_groups=b, group_size=g, replicate=rep, filter_groups=False,
                                    steps=2 * base.steps if w == "default" else base.steps - 1,
                                    **(LONG if w == "long" else {})), 8)
            t[rep] = r = simulate(cfg)
            rows.append([w, f"{b}x{g}", "on" if rep else "off", r["rollout_s"], r["preemptions"],
                         r["engine_util"]])
        ratio[w, b, g] = t[False]["rollout_s"] / t[True]["rollout_s"]
    lines = table(["workload", "batch x responses", "replication", "generation s/step", "preemptions/step",
                   "engine occupancy"], rows) + [
        "", "off / on: " + ", ".join(f"{v:.2f}x at {b}x{g} ({w})" for (w, b, g), v in ratio.items())
        + " (paper: 1.84x at 64x16, 1.95x at 16x32)",
        "", "default: median 400, cap 8k, " + memory_note(base) + "; long: median 4k, cap 16k, "
        + memory_note(replace(base, **LONG))]

    def plot(ax):
        ax.bar(range(len(cases)), list(ratio.values()))
        ax.set_xticks(range(len(cases)), [f"{b}x{g}\n{w}" for w, b, g in cases])
        ax.axhline(1.0, color="k", ls="--")
        ax.set_ylabel("generation time, replication off / on")
    return "prompt replication (8 GPUs)", lines, plot


def exp_envasync(base: SimConfig):
    """Multi-turn, 8 engines x 32 trajectories, 10 turns, env latency normal(10, 10) s per reset and step,
    synchronous training; rollout time per step."""
    variants = [("lockstep envs per engine (sync baseline)", replace(base, lockstep="engine")),
                ("lockstep envs, whole batch", replace(base, lockstep="batch")),
                ("env-level async", base),
                ("env-level async + redundant env rollout", replace(base, env_redundancy=2))]
    res = [(name, simulate(colocated(cfg, cfg.rollout_gpus))) for name, cfg in variants]
    t_sync = res[0][1]["rollout_s"]
    rows = [[name, r["rollout_s"], t_sync / r["rollout_s"], r["step_s"], r["engine_util"]] for name, r in res]
    t_batch = res[1][1]["rollout_s"]
    lines = table(["rollout", "rollout s/step", "speedup vs per-engine lockstep", "step s",
                   "engine occupancy"], rows) + [
        "", f"env-level async: {rows[2][2]:.2f}x over per-engine lockstep, "
        f"{t_batch / res[2][1]['rollout_s']:.2f}x over whole-batch lockstep (paper 2.46x); with redundant "
        f"env rollout (10 trajectories per group of 8, the first 8 kept; 25% more env instances, same "
        f"engines): {rows[3][2]:.2f}x over per-engine, {t_batch / res[3][1]['rollout_s']:.2f}x over "
        f"whole-batch lockstep (paper, real envs: ALFWorld 2.72x, SWE 1.81x)",
        "", "The lockstep baselines pay the slowest of the batch's env calls every turn: normal(10, 10) "
        "clipped at 0 has a thin tail (the slowest of 256 draws is ~38 s), which bounds the gain near 2.1x "
        "even with free generation."]

    def plot(ax):
        ax.bar(range(len(res)), [r["rollout_s"] for _, r in res])
        ax.set_xticks(range(len(res)), ["lockstep\nper engine", "lockstep\nbatch", "env async",
                                        "+ redundant"])
        ax.set_ylabel("rollout time per step (s)")
    return "environment-level asynchronous rollout (latency 10 +- 10 s)", lines, plot


def e2e(base: SimConfig, gpus: int, rollout_gpus: int, alpha: int) -> dict:
    """One end-to-end run on `gpus` GPUs: colocated sync (rollout_gpus=0) or split with ratio alpha."""
    if rollout_gpus == 0:        # sync steps are all alike: one fewer
        return simulate(replace(colocated(base, gpus), steps=max(2, base.steps - 1)))
    return simulate(replace(base, rollout_gpus=rollout_gpus, train_gpus=gpus - rollout_gpus,
                            async_ratio=alpha))


# end-to-end runs: the batch grows with the cluster (weak scaling), half an engine per GPU
SAMPLES_PER_GPU = 64


def scaled(base: SimConfig, gpus: int) -> SimConfig:
    """B*G = 64 samples per GPU, plus 25% redundant prompts (the filter rate is 22%)."""
    b = gpus * SAMPLES_PER_GPU // base.group_size
    return replace(base, batch_groups=b, redundant=b // 4)


# Rollout occupancy at alpha 2 under this workload's long tail: groups waiting on their longest sample
# hold the admission window, and samples that outlive alpha + 1 steps are aborted (`ratio` and `split`
# measure 0.7-0.8 at the split the ideal bound calls balanced). Sizing the rollout pool for it is how
# one would pick a split in practice ("provisioned"); `scaling` also runs the balanced split at 128 GPUs.
ALPHA2_OCCUPANCY = 0.75


def exp_scaling(base: SimConfig):
    rows, xs, sync_tp, async_tp, ideal_tp = [], [], [], [], []
    for n in (16, 32, 64, 128):
        cfg = scaled(base, n)
        r = best_split(cfg, n, ALPHA2_OCCUPANCY)
        s, a = e2e(cfg, n, 0, 0), e2e(cfg, n, r, 2)
        xs.append(n); sync_tp.append(s["samples_per_s"]); async_tp.append(a["samples_per_s"])
        ideal_tp.append(a["ideal_steps_per_s"] * cfg.batch_groups * cfg.group_size)
        rows.append([n, f"{cfg.batch_groups}x{cfg.group_size}", s["samples_per_s"], f"{r}/{n - r}",
                     a["samples_per_s"], a["samples_per_s"] / s["samples_per_s"], ideal_tp[-1],
                     a["efficiency"], a["staleness_max"], a["dropped_stale"], a["sync_s"]])
    rb = best_split(cfg, 128)
    b = e2e(cfg, 128, rb, 2)
    lines = table(["GPUs", "batch", "sync colocated samples/s", "async split R/T", "async samples/s",
                   "speedup", "ideal samples/s", "efficiency", "max staleness", "stale drops/step",
                   "weight sync s"], rows) + [
        "", f"async: alpha 2, split provisioned for a rollout pool kept {ALPHA2_OCCUPANCY:.0%} busy; at "
        f"the split the ideal bound calls balanced ({rb}/{128 - rb}) 128 GPUs give "
        f"{b['samples_per_s']:.3g} samples/s, efficiency {b['efficiency']:.1%}. Efficiency = achieved / "
        f"ideal pipeline bound of the split.",
        "", f"async / sync: {', '.join(f'{r[5]:.2f}x' for r in rows)} at "
        f"{', '.join(str(x) for x in xs)} GPUs "
        f"(paper: up to 2.24x, near-linear async scaling); async efficiency at 128 GPUs: {rows[-1][7]:.1%}"]

    def plot(ax):
        ax.plot(xs, sync_tp, "o-", label="sync (colocated)")
        ax.plot(xs, async_tp, "o-", label="async (alpha 2)")
        ax.plot(xs, ideal_tp, "k--", label="ideal pipeline bound (async split)")
        ax.set_xscale("log", base=2); ax.set_yscale("log", base=2)
        ax.set_xlabel("GPUs"); ax.set_ylabel("trained samples/s")
        ax.legend()
    return f"async vs sync scaling (same GPU budget, {SAMPLES_PER_GPU} samples per GPU)", lines, plot


def exp_split(base: SimConfig):
    n, cfg = 40, scaled(base, 40)
    sync = e2e(cfg, n, 0, 0)
    rows, xs, ys = [["colocated sync", 0, sync["samples_per_s"], 1.0, "", ""]], [], []
    for r in (8, 12, 16, 20, 24, 28):
        a = e2e(cfg, n, r, 2)
        xs.append(r); ys.append(a["samples_per_s"] / sync["samples_per_s"])
        ideal = a["ideal_steps_per_s"] * cfg.batch_groups * cfg.group_size
        rows.append([f"{r}/{n - r}", 2, a["samples_per_s"], ys[-1], ideal, a["efficiency"]])
    best, balanced = xs[ys.index(max(ys))], best_split(cfg, n)
    lines = table(["rollout/train GPUs", "alpha", "samples/s", "speedup vs colocated sync", "ideal samples/s",
                   "efficiency"], rows) + [
        "", f"24/16: {ys[xs.index(24)]:.2f}x, best {best}/{n - best}: {max(ys):.2f}x; ideal-bound split "
        f"{balanced}/{n - balanced} (paper: 24/16 close to best, about 2x)"]

    def plot(ax):
        ax.plot(xs, ys, "o-")
        ax.axhline(1.0, color="k", ls="--", label="colocated sync")
        ax.set_xlabel("rollout GPUs (of 40)"); ax.set_ylabel("speedup over colocated sync")
        ax.legend()
    return "rollout/train split on 40 GPUs (async ratio 2)", lines, plot


def exp_ratio(base: SimConfig):
    """At the split the ideal bound calls balanced, where the pipeline is most sensitive to alpha."""
    n, cfg = 40, scaled(base, 40)
    r = best_split(cfg, n)
    sync = e2e(cfg, n, 0, 0)
    rows, xs, ys = [["colocated sync", "", sync["samples_per_s"], 1.0, 0, ""]], [], []
    for alpha in (0, 1, 2, 4, 8):
        a = e2e(cfg, n, r, alpha) if alpha else simulate(replace(even(cfg, r), train_gpus=n - r,
                                                                 async_ratio=0, warmup=0))
        xs.append(alpha); ys.append(a["samples_per_s"] / sync["samples_per_s"])
        rows.append([f"{r}/{n - r} split", alpha, a["samples_per_s"], ys[-1], a["staleness_max"],
                     a.get("efficiency", "")])
    lines = table(["setup", "alpha", "samples/s", "speedup vs colocated sync", "max staleness",
                   "efficiency"], rows) + [
        "", f"alpha 2 reaches {ys[2] / max(ys):.0%} of the best speedup "
        f"({max(ys):.2f}x at alpha {xs[ys.index(max(ys))]}) "
        "(paper: alpha = 2 is near-maximal)"]

    def plot(ax):
        ax.plot(xs, ys, "o-")
        ax.axhline(1.0, color="k", ls="--", label="colocated sync")
        ax.set_xlabel("async ratio alpha"); ax.set_ylabel("speedup over colocated sync")
        ax.legend()
    return f"async ratio sweep (40 GPUs, {r} rollout / {n - r} train)", lines, plot


def exp_calibrate(base: SimConfig):
    """Where a synchronous colocated step's time goes (RollPacker: rollout 66-72%, reward 5-13%, train
    21-23%)."""
    cfg = replace(scaled(base, 32), steps=base.steps + 2)
    r = simulate(colocated(cfg, 32))
    r0 = simulate(colocated(replace(cfg, reward_s=0.0, reward_std_s=0.0), 32))
    reward = max(0.0, r["rollout_s"] - r0["rollout_s"])
    parts = {"rollout (generation)": r["rollout_s"] - reward, "reward (critical path)": reward,
             "train": r["train_s"], "weight sync": r["sync_s"]}
    total = sum(parts.values())
    lines = table(["phase", "s/step", "share"], [[k, v, f"{v / total:.0%}"] for k, v in parts.items()]) + [
        "", "reward = the growth of the rollout phase when the verifier latency is switched on (same seed); "
        "paper (RollPacker, 14B, 16k): rollout 66-72%, reward 5-13%, train 21-23%"]

    def plot(ax):
        ax.pie(list(parts.values()), labels=list(parts), autopct="%.0f%%")
    return (f"time split of a synchronous colocated step (32 GPUs, {cfg.batch_groups}x{cfg.group_size})",
            lines, plot)


# RollPacker's comparison runs on 32 GPUs by default: at the 128 (--gpus 128) its twelve runs
# take over 50 minutes of real time here (two 128-GPU rows, README: RollPacker)
ROLLPACKER_GPUS = 32


def exp_rollpacker(base: SimConfig):
    """RollPacker (tail batching, streaming trainer) against ROLL Flash (async ratio 2), same GPUs, same
    seeds, prompts keyed by their own seed (a deferred prompt is the same prompt in its long round), on the
    long-response workload and on the default. Sync runs are colocated; the split runs use the split
    `scaling` provisions for alpha 2. Plain sync is this project's: queue rollout with 25% redundant
    prompts, so a step ends at its B-th good group and aborts the rest (those prompts are never trained);
    the batch-rollout row waits for every admitted group, as veRL (RollPacker's baseline) does."""
    n, rows, res, names = base.gpus or ROLLPACKER_GPUS, [], {}, {}
    steps = max(6, base.steps + 2)           # two short-short-long cycles of tail batching
    workloads = {"long (median 4k, cap 16k)": replace(base, **LONG), "default (median 400, cap 8k)": base}
    for wname, w in workloads.items():
        cfg = replace(scaled(replace(w, prompt_seeds=True), n), steps=steps)
        r = best_split(cfg, n, ALPHA2_OCCUPANCY)
        split = replace(cfg, rollout_gpus=r, train_gpus=n - r)
        tail = dict(tail_batching=True)
        runs = {"plain sync": colocated(cfg, n),
                "plain sync, batch rollout (veRL's)": replace(colocated(cfg, n), rollout_mode="batch"),
                "sync + tail batching": replace(colocated(cfg, n), **tail),
                f"sync + tail + streaming trainer ({r}/{n - r})":
                    replace(even(split, r), async_ratio=0, warmup=1, stream_train=True, **tail),
                f"async ratio 2 ({r}/{n - r})": replace(split, async_ratio=2),
                f"async ratio 2 + tail batching ({r}/{n - r})": replace(split, async_ratio=2, **tail)}
        names[wname] = list(runs)
        for name, c in runs.items():
            res[wname, name] = x = simulate(c)
            rows.append([wname, name, x["step_s"], x["samples_per_s"],
                         x["samples_per_s"] / res[wname, "plain sync"]["samples_per_s"], x["aborted_share"],
                         x["staleness_max"], x["staleness_mean"], x["trainer_idle"],
                         "".join((row.get("round") or "-")[0] for row in x["rows"])])
            print("  " + table([], [rows[-1]])[-1], flush=True)      # (a long experiment: progress)
    long_w = next(iter(workloads))
    tail_sps = res[long_w, "sync + tail batching"]["samples_per_s"]
    gain = tail_sps / res[long_w, "plain sync"]["samples_per_s"]
    gain_batch = tail_sps / res[long_w, "plain sync, batch rollout (veRL's)"]["samples_per_s"]
    lines = table(["workload", "run", "s/step", "samples/s", "vs plain sync", "tokens thrown away",
                   "max staleness", "mean staleness", "trainer idle", "rounds"], rows) + [
        "", f"long workload: sync + tail batching / plain sync = {gain:.2f}x trained samples/s at "
        f"staleness 0 (target >= 1.5x); / sync with batch rollout = {gain_batch:.2f}x. Tail batching: "
        f"over-sampling {base.tail_oversample}x, rounds s = short, "
        "l = long, - = plain; tokens thrown away = model tokens of aborted trajectories / generated; "
        "trainer idle = 1 - training time / wall time (colocated: the same GPUs, idle while they generate).",
        f"{n} GPUs, {SAMPLES_PER_GPU} samples per GPU + 25% redundant prompts (dynamic filtering), "
        f"{steps} steps per run (split sync: 1 warm-up step, async: {base.warmup})."]

    def plot(ax):
        for i, wname in enumerate(workloads):
            ax.bar([x + 0.4 * i for x in range(len(names[wname]))],
                   [res[wname, k]["samples_per_s"] / res[wname, "plain sync"]["samples_per_s"]
                    for k in names[wname]],
                   0.4, label=wname)
        ax.set_xticks([x + 0.2 for x in range(len(names[long_w]))],
                      ["sync", "sync\nbatch", "sync\n+ tail", "sync + tail\n+ stream", "async 2",
                       "async 2\n+ tail"])
        ax.axhline(1.0, color="k", ls="--")
        ax.set_ylabel("trained samples/s, / plain sync")
        ax.legend(fontsize=7)
    return f"RollPacker vs ROLL Flash ({n} GPUs, same budget)", lines, plot


# a small split cluster (4 engines, 4 trainer GPUs) on a long-tailed workload (median 1k tokens, sigma 1.3,
# cap 16k), where the async ratio decides how much of the long tail the trainer waits for: the lab instrument
SWEEP = replace(RLVR, rollout_gpus=4, train_gpus=4, batch_groups=16, group_size=8, redundant=4,
                len_median=1000, len_sigma=1.3, max_tokens=16384, chunk=128, steps=10, warmup=3)


def exp_sweep(base: SimConfig):
    """The async ratio as a lab instrument (docs/tour.md): alpha 0, 1, 2, 4, 8, the same cluster and
    workload (SWEEP), seconds per step beside the staleness of the trained samples."""
    rows, xs, step_s, mean, most = [], [], [], [], []
    for alpha in (0, 1, 2, 4, 8):
        r = simulate(replace(base, async_ratio=alpha))
        xs.append(alpha), step_s.append(r["step_s"]), mean.append(r["staleness_mean"])
        most.append(r["staleness_max"])
        rows.append([alpha, r["step_s"], r["staleness_mean"], r["staleness_max"], r["dropped_stale"],
                     r["trainer_idle"]])
    lines = table(["alpha", "s/step", "staleness mean", "staleness max", "dropped stale/step",
                   "trainer idle"], rows) + [
        "", f"alpha 0 -> 8: {step_s[0] / step_s[-1]:.2f}x faster steps for a mean staleness of "
        f"{mean[-1]:.2f} versions (max {most[-1]})"]

    def plot(axes):
        left, right = axes
        left.plot(xs, step_s, "o-")
        left.set_xlabel("async ratio alpha"), left.set_ylabel("seconds per step (virtual)")
        right.plot(xs, mean, "o-", label="mean"), right.plot(xs, most, "s--", label="max")
        right.plot(xs, xs, ":", color="grey", label="the bound (alpha)")
        right.set_xlabel("async ratio alpha"), right.set_ylabel("staleness of trained samples (versions)")
        right.legend()
    plot.panels = 2
    return (f"async ratio sweep, long tail ({base.rollout_gpus} engines + {base.train_gpus} trainer GPUs, "
            f"{base.batch_groups}x{base.group_size})"), lines, plot


EXPERIMENTS = {"queue": (exp_queue, RLVR), "replication": (exp_replication, RLVR),
               "envasync": (exp_envasync, AGENT), "scaling": (exp_scaling, RLVR), "split": (exp_split, RLVR),
               "ratio": (exp_ratio, RLVR), "calibrate": (exp_calibrate, RLVR),
               "rollpacker": (exp_rollpacker, RLVR), "sweep": (exp_sweep, SWEEP)}


def run_experiment(name: str, overrides: dict):
    fn, base = EXPERIMENTS[name]
    t = time.time()
    title, body, plot = fn(replace(base, **overrides))
    flags = "".join(f" --{k} {v}" for k, v in overrides.items())
    lines = [f"# {title}", "",
             f"`python -m tools.sim {name}{flags}` (virtual time; {time.time() - t:.0f} s of real time)", "",
             *body, "", sync_note(base)]
    print("\n".join(lines) + "\n", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = getattr(plot, "panels", 1)                     # (a plot may ask for panels side by side)
    fig, ax = plt.subplots(1, panels, figsize=(6 * panels, 4))
    plot(ax)
    if panels > 1:
        fig.suptitle(title, fontsize=9)
    else:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "all"])
    ap.add_argument("--steps", type=int, help="training steps per run (default: per experiment)")
    ap.add_argument("--warmup", type=int, help="steps left out of the steady-state numbers")
    ap.add_argument("--seed", type=int, help="seed of every random draw")
    ap.add_argument("--chunk", type=int, help="real tokens per fake-engine token (time resolution)")
    ap.add_argument("--gpus", type=int, help=f"rollpacker: the GPU budget (default {ROLLPACKER_GPUS})")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "experiment" and v is not None}
    for name in EXPERIMENTS if args.experiment == "all" else [args.experiment]:
        run_experiment(name, overrides)


if __name__ == "__main__":
    sys.exit(main())
