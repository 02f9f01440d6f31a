"""train.py: asynchronous RL post-training, ROLL Flash style. The entry point.

    torchrun --nproc-per-node 40 train.py --rollout-gpus 24 --train-gpus 16 --model DIR --data FILE   # GPU cluster
    torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1                              # this CPU box
    bash run.sh                                   # the same, after setting everything up

Roles, from torchrun's environment alone: global ranks [0, train_gpus) are trainer ranks, the rest
are rollout ranks. Process groups:
    default group      all ranks (gloo): set-up and the queue server's key
    trainer group      trainer ranks: FSDP2 data parallel (NCCL on GPU, gloo on CPU)
    weight-sync group  trainer rank 0 + every engine's vLLM workers: the weight broadcast, straight
                       into the engines (weight_sync.py; formed on the default group's store)
Trainer rank 0 also runs the controller and serves the buffer's queues over TCP
(MASTER_ADDR : MASTER_PORT + 1, with a random authkey shared through the default group).
Each rollout rank runs one vLLM engine behind an LLMProxy and an EnvManager that pulls tasks.

One step on the trainer side (rank 0 drives, the other trainer ranks follow):
    collect a batch (controller)  ->  train_step (all trainer ranks)
    ->  suspend rollout, gather + broadcast bucket by bucket, resume (controller)  ->  metrics line
Rollout never waits for training, except during the weight sync and where the async ratio stops
admission. --async-ratio 0 is the synchronous baseline in the same code.

What rank 0 prints and records (metrics.jsonl, events.jsonl, --tracker, the summary): runlog.py;
library logs stay at warning level unless --verbose: quiet.py; pictures of a run: tools/plot.py.
"""

import asyncio
import dataclasses
import functools
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

import quiet
from config import opt, parse_cli, sub_config
from controller import ControllerConfig
from env_manager import RolloutConfig
from runlog import RunLog, check_tracker, print0
from trainer import TrainConfig

if __name__ == "__mp_main__":
    # This file, re-imported in a process that multiprocessing spawned from a rank: vLLM's engine core
    # (spawned by a rollout rank) and its worker (spawned by the engine core). Such a process must
    # end with its parent, however the parent ends (SIGKILL included), or it keeps its core busy.
    from buffer import die_with_parent
    die_with_parent(watch=True)


@dataclass
class Config:
    rollout_gpus: int = opt(1, "ranks that run a vLLM engine (one GPU each; on CPU one core each)")
    train_gpus: int = opt(1, "ranks that train (FSDP2 across them)")
    model: str = opt("", "HF model dir; empty = the embedded tiny model (built on first use)")
    data: str = opt("", "JSONL/parquet with prompt + answer rows, scored by math-verify; empty = see --task")
    prompt_key: str = opt("", "--data: the prompt's field (default: the first of prompt, question, problem)")
    answer_key: str = opt("", "--data: the answer's field (default: the first of answer, solution, ground_truth)")
    task: str = opt("", "a reasoning-gym task (e.g. basic_arithmetic), its own verifier; empty with no --data = "
                        "the embedded addition task")
    reward: str = opt("", "verifier module:function (problem, response) -> float in [0, 1]; default: the task's")
    env: str = opt("", "multi-turn environment name (env_manager/envs); empty = single-turn RLVR")
    chat_template: bool = opt(True, "prompts and observations through the tokenizer's chat template, if it has one")
    out_dir: str = opt("runs/default", "metrics.jsonl and checkpoint/ go here")
    resume: str = opt("no", "continue from out_dir/checkpoint (step, version, data position, optimizer): no | yes "
                             "(--resume alone) | auto (if there is one; for torchrun --max-restarts)", const="yes")
    overwrite: bool = opt(False, "start afresh in an out_dir that holds a checkpoint (its metrics and checkpoint go)")
    steps: int = opt(80, "training steps (weight versions) to run")
    time_limit_min: float = opt(0.0, "end the run (evaluate, checkpoint, summarise) after the first step that ends past "
                                     "this many minutes of training (start-up excluded); 0 = no limit")
    async_ratio: int = opt(2, "max policy versions a trained sample may lag; 0 = synchronous")
    loss: str = opt("ppo", "reinforce | ppo | decoupled_ppo | tis | cispo | topr | gspo")
    lr: float = opt(3e-4, "AdamW learning rate (linear warm-up over the first 10 steps)")
    ppo_epochs: int = opt(1, "passes over each batch")
    mini_batches: int = opt(1, "optimizer steps per pass (the batch split into this many); decoupled_ppo's proximal "
                               "policy is frozen before the first, so its clip acts from the second on")
    recompute_old_logprobs: bool = opt(False, "old logprobs from the trainer before the update, not the engine's "
                                              "sampling logprobs (the gap between the two is logged either way)")
    clip_low: float = opt(0.2, "ppo, decoupled_ppo: ratio >= 1 - this (PPO's epsilon)")
    clip_high: float = opt(0.28, "ppo, decoupled_ppo: ratio <= 1 + this (DAPO's clip-higher)")
    dual_clip: float = opt(0.0, "ppo, decoupled_ppo: dual clip c for A < 0 (Ye et al. 2020: 3); 0 = off")
    behav_weight_cap: float = opt(0.0, "decoupled_ppo: drop tokens whose pi_prox / mu exceeds this (AReaL); 0 = off")
    tis_cap: float = opt(2.0, "tis: importance weight cap (Yao et al. 2025)")
    cispo_low: float = opt(1.0, "cispo: IS weight >= 1 - this (1 = no lower bound, MiniMax-M1)")
    cispo_high: float = opt(0.28, "cispo: IS weight <= 1 + this (MiniMax-M1 does not publish it)")
    topr_pos_weight: float = opt(1.0, "topr: weight of A > 0 tokens (Le Roux et al. 2025)")
    topr_neg_weight: float = opt(1.0, "topr: weight of A <= 0 tokens (Le Roux et al. 2025)")
    gspo_clip_low: float = opt(3e-4, "gspo: sequence ratio >= 1 - this (Zheng et al. 2025)")
    gspo_clip_high: float = opt(4e-4, "gspo: sequence ratio <= 1 + this (Zheng et al. 2025)")
    loss_agg: str = opt("token-mean", "loss aggregation: token-mean | seq-mean-token-mean")
    sample_order: str = opt("oldest", "complete groups go to the trainer oldest | freshest first (within the async ratio)")
    batch_groups: int = opt(32, "prompts per step")
    group_size: int = opt(8, "samples per prompt (GRPO group)")
    redundant: int = opt(4, "extra prompts admitted per step for dynamic filtering")
    rollout_mode: str = opt("queue", "queue (per-sample scheduling) | batch (barrier baseline)")
    replicate: bool = opt(True, "prompt replication: a prompt's samples spread over all engines")
    suspend_mode: str = opt("keep", "weight update under running requests: keep | abort (resubmit)")
    colocate: bool = opt(False, "GPU: the synchronous baseline on shared GPUs: rollout rank i on trainer rank i's "
                                "GPU (2 processes per GPU); engines sleep (free their memory) while the trainer "
                                "trains; needs --async-ratio 0 and --rollout-gpus == --train-gpus")
    max_tokens: int = opt(0, "response tokens per model turn; 0 = 8 for the embedded model, else 1024")
    max_model_len: int = opt(0, "engine context (prompt + whole trajectory), tokens; 0 = the model's own")
    dtype: str = opt("auto", "engine weights: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16")
    kv_cache_gib: float = opt(1.0, "CPU: each engine's KV cache, GiB")
    gpu_memory_utilization: float = opt(0.85, "GPU: the share of a rollout GPU's memory its engine may take")
    max_concurrency: int = opt(64, "trajectories in flight per rollout rank (also the engine's batch size)")
    filter_groups: bool = opt(True, "dynamic filtering: drop groups whose rewards are all equal (DAPO)")
    env_redundancy: int = opt(0, "multi-turn: extra trajectories per group; the first group-size to finish are kept")
    env_step_timeout_s: float = opt(30.0, "an env reset/step (or reward) slower than this fails the trajectory")
    max_retries: int = opt(2, "a failed trajectory is rerun with a fresh env up to this many times")
    reward_workers: int = opt(-1, "verifier processes per rollout rank; 0 = on its event loop; -1 = 0 for the "
                                  "embedded addition check, else 1")
    reward_timeout_s: float = opt(10.0, "a verifier call slower than this scores 0 (its process is replaced)")
    env_fail_rate: float = opt(0.0, "testing: inject env failures, the chance an env call raises")
    env_hang_rate: float = opt(0.0, "testing: inject env hangs, the chance an env call never returns")
    env_latency_s: float = opt(0.0, "testing: inject env latency, normal(mean=this, std=this) per call, seconds")
    micro_batch: int = opt(64, "sequences per forward/backward on a trainer rank")
    bucket_mb: int = opt(64, "weight broadcast bucket, MiB")
    save_every: int = opt(10, "checkpoint every N steps (and at the end); 0 = only at the end")
    eval_every: int = opt(0, "held-out accuracy (greedy and mean@k) every N versions and at the end; 0 = never")
    eval_prompts: int = opt(64, "held-out prompts per evaluation")
    eval_k: int = opt(4, "samples per held-out prompt at temperature 1 (mean@k)")
    eval_data: str = opt("", "held-out JSONL/parquet; default: the last --eval-prompts rows of --data, or "
                             "generated problems from a seed training never uses")
    check_sync_every: int = opt(10, "compare engine and trainer logprobs on a probe at start and every N syncs; 0 = never")
    timeout_s: float = opt(600.0, "max wait for any queue, ack or collective before failing")
    seed: int = opt(0, "seeds data order and the trainer")
    verbose: bool = opt(False, "show every library log line (vLLM INFO, progress bars); default: warnings and errors only")
    tracker: str = opt("none", "also send metrics.jsonl's rows to: none | tensorboard | wandb | trackio (rank 0)")
    tracker_project: str = opt("roll-flash-nano", "project name for --tracker wandb / trackio (the run is named after out_dir)")
    max_events: int = opt(100_000, "request events kept in out_dir/events.jsonl for tools/plot.py's timeline; 0 = no events file")

    def __post_init__(self):
        if self.resume not in ("no", "yes", "auto"):
            raise ValueError(f"--resume must be no, yes or auto, got {self.resume!r}")
        if self.resume != "no" and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        if self.rollout_gpus < 1 or self.train_gpus < 1:
            raise ValueError("--rollout-gpus and --train-gpus must both be >= 1")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if not (0 <= self.env_fail_rate and 0 <= self.env_hang_rate and self.env_fail_rate + self.env_hang_rate <= 1):
            raise ValueError(f"--env-fail-rate {self.env_fail_rate} and --env-hang-rate {self.env_hang_rate}: "
                             f"need rates >= 0 that sum to <= 1")
        if self.env_latency_s < 0:
            raise ValueError(f"--env-latency-s must be >= 0, got {self.env_latency_s}")
        if self.max_tokens < 0 or self.max_model_len < 0 or self.reward_workers < -1:
            raise ValueError("--max-tokens and --max-model-len must be >= 0 (0 = from the model), "
                             "--reward-workers >= -1 (-1 = auto)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.eval_every < 0 or self.eval_prompts < 1 or self.eval_k < 1:
            raise ValueError("--eval-every must be >= 0, --eval-prompts and --eval-k >= 1")
        if self.colocate and (self.async_ratio != 0 or self.rollout_gpus != self.train_gpus):
            raise ValueError("--colocate: the same GPUs generate then train, so it needs --async-ratio 0 and "
                             "--rollout-gpus == --train-gpus")
        if self.data and self.task:
            raise ValueError("--data and --task: pick one source of problems")
        if self.time_limit_min < 0:
            raise ValueError(f"--time-limit-min must be >= 0, got {self.time_limit_min}")
        if self.save_every < 0 or self.check_sync_every < 0:
            raise ValueError(f"--save-every and --check-sync-every must be >= 0, got {self.save_every}, "
                             f"{self.check_sync_every}")
        if self.max_events < 0:
            raise ValueError(f"--max-events must be >= 0, got {self.max_events}")
        check_tracker(self.tracker)        # a missing optional package is named now, before anything starts
        # every other field belongs to a component, whose config validates it
        self.controller_config(), self.rollout_config(), self.train_config()

    def controller_config(self) -> ControllerConfig:
        return sub_config(ControllerConfig, self)

    def rollout_config(self) -> RolloutConfig:
        # (0 / -1 = from the model or the task, resolved by resolved(); placeholders validate the rest until then)
        return sub_config(RolloutConfig, self, sync_timeout_s=self.timeout_s, max_tokens=self.max_tokens or 1,
                          max_total_tokens=self.max_model_len or 120, reward_workers=max(self.reward_workers, 0))

    def resolved(self, model_dir: str, device: str) -> "Config":
        """The settings that default to the model's, the task's and the device's own."""
        from transformers import AutoConfig
        embedded = not self.model
        return dataclasses.replace(
            self, max_model_len=self.max_model_len or AutoConfig.from_pretrained(model_dir).max_position_embeddings,
            max_tokens=self.max_tokens or (8 if embedded else 1024),
            dtype=self.dtype if self.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32"),
            reward_workers=self.reward_workers if self.reward_workers >= 0 else
            (0 if not (self.data or self.task or self.reward) else 1))

    def train_config(self) -> TrainConfig:
        return sub_config(TrainConfig, self)


# ---------------------------------------------------------------------------------------------
# distributed init / cleanup


class Groups(NamedTuple):
    trainer: object      # trainer ranks: FSDP2 (NCCL on GPU, gloo on CPU)
    store: object        # the default group's TCPStore (MASTER_ADDR:MASTER_PORT): the weight-sync group meets on it


def init_distributed(cfg: Config):
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        sys.exit(f"train.py: {', '.join(missing)} not set: launch with torchrun, e.g.\n"
                 f"  torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.rollout_gpus + cfg.train_gpus != world:
        sys.exit(f"train.py: --rollout-gpus {cfg.rollout_gpus} + --train-gpus {cfg.train_gpus} = "
                 f"{cfg.rollout_gpus + cfg.train_gpus}, but torchrun started {world} ranks (WORLD_SIZE)")
    cuda = torch.cuda.is_available()
    if cuda:      # this rank's GPU; under --colocate a trainer rank and a rollout rank share one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    elif cfg.colocate:
        sys.exit("train.py: --colocate needs GPUs: vLLM's sleep mode, which frees an engine's memory while the "
                 "trainer trains on the same GPU, is CUDA-only")
    timeout = timedelta(seconds=cfg.timeout_s)
    long = timedelta(seconds=max(cfg.timeout_s, 1800))             # long: the first rank may build the model
    store = restart_store(rank, world, long)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=long)
    backend = "nccl" if cuda else "gloo"
    trainer_group = dist.new_group(list(range(cfg.train_gpus)), timeout=timeout, backend=backend)
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"    # explicit: worker threads default to cuda:0
    return rank, world, device, Groups(trainer_group, store.underlying_store)


def restart_store(rank: int, world: int, timeout: timedelta):
    """The default group's key-value store, under a prefix per torchrun restart. torchrun's static
    rendezvous keeps one store for every restart of the ranks, and the ranks' own keys carry no
    attempt: a restarted rank then reads the address its killed predecessor left there and fails
    to connect (seen with --max-restarts). The prefix gives every attempt its own keys."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"     # torchrun's agent hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def engine_gpu(local_rank: int, visible: str | None, count: int) -> str:
    """CUDA_VISIBLE_DEVICES for a rollout rank's engine processes: this rank's own GPU (LOCAL_RANK
    round robin over the node's GPUs, as torch.cuda.set_device above; under --colocate two ranks share
    one), named as the parent sees it (a user's CUDA_VISIBLE_DEVICES list is honoured). vLLM's
    engine otherwise takes device 0, so every engine of a node would land on one GPU."""
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(count)]
    return ids[local_rank % len(ids)]


def collective(phase: str, fn, *args, **kwargs):
    """Run a torch.distributed call; a timeout or a dead peer fails naming this rank and the phase
    (the groups carry the timeout: --timeout-s, longer for the default group's start-up)."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        raise RuntimeError(f"rank {os.environ.get('RANK', '?')}: {phase} failed or timed out: {e}") from None


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_layout(cores: list[int], num_rollout: int) -> tuple[list[int], list[int]]:
    """CPU runs, one node: (host cores, engine cores). Each vLLM engine (its engine-core and worker
    processes) gets a core of its own, from the top; the ranks' own Python (trainer ranks, the
    controller and queue server, the rollout ranks' front ends: proxy, env manager, vLLM's output
    processing) shares the rest. Measured on 2 cores (README, "Where the time goes"): with the rollout
    rank's Python on its engine's core, that core was saturated (a third of it vLLM's spin-waits)
    while the trainer's core idled 59% of the time. With no core to spare, everything shares."""
    if len(cores) > num_rollout:
        return cores[:len(cores) - num_rollout], cores[len(cores) - num_rollout:]
    return cores, cores


def pin_cpu(cfg: "Config", rank: int) -> str:
    """Pin this rank to its host core (trainer rank t: host core t round robin, one torch thread;
    a rollout rank: all host cores) and return the core its engine gets ("" for a trainer rank).
    The engine's processes are pinned when they start (start_engine in run_rollout)."""
    host, engines = cpu_layout(sorted(os.sched_getaffinity(0)), cfg.rollout_gpus)
    torch.set_num_threads(1)
    if rank < cfg.train_gpus:
        os.sched_setaffinity(0, {host[rank % len(host)]})
        return ""
    os.sched_setaffinity(0, set(host))
    return str(engines[(rank - cfg.train_gpus) % len(engines)])


# ---------------------------------------------------------------------------------------------
# trainer ranks


PROBE_TEXT = "123+456=579"   # the weight-sync probe: any token sequence the model's vocab covers


class TrainerRanks:
    """The trainer ranks in lockstep. Rank 0 decides each op ("train", "save", "stop") and
    broadcasts it over the trainer group; then every rank runs it, because FSDP's collectives need
    all of them. Ranks > 0 just follow()."""

    def __init__(self, trainer, cfg: Config, group, model_dir: str, probe_ids: list[int]):
        self.trainer, self.cfg, self.group, self.model_dir, self.probe_ids = trainer, cfg, group, model_dir, probe_ids
        self.sender = None     # rank 0: weight_sync.Sender, set once the run's store is known

    def train(self, batch, advantages: list[float], version: int, probe: bool):
        """One batch on every rank (rank r gets batch[r::n]) at policy `version`; returns rank 0's
        metrics and, if `probe`, the trainer's probe logprobs under the new weights."""
        n = self.cfg.train_gpus
        return self._run({"op": "train", "samples": [batch[r::n] for r in range(n)], "version": version,
                          "advantages": [advantages[r::n] for r in range(n)], "probe": probe})

    def save(self, state: dict):
        self._run({"op": "save", "state": state})

    def send_weights(self, group, meta):
        """The weights into every engine over `group` (weight_sync.GroupSpec): each trainer rank
        gathers them weight by weight (FSDP), rank 0 broadcasts them bucket by bucket (self.sender,
        set on rank 0). Runs in the controller's thread while rank 0's event loop waits."""
        self._run({"op": "send", "group": group, "meta": meta})

    def probe(self) -> list[float]:
        """The trainer's logprobs of the probe sequence (a forward pass on every rank under FSDP)."""
        return self._run({"op": "probe"})

    def stop(self):
        self._tell({"op": "stop"})

    def follow(self):
        while True:
            box = [None]
            collective("waiting for trainer rank 0's next op", dist.broadcast_object_list, box, src=0,
                       group=self.group)
            if box[0]["op"] == "stop":
                return
            self._do(box[0])

    def _run(self, op: dict):
        self._tell(op)
        return self._do(op)

    def _tell(self, op: dict):
        if self.cfg.train_gpus > 1:
            collective(f"sending '{op['op']}' to the trainer ranks", dist.broadcast_object_list, [op], src=0,
                       group=self.group)

    def _do(self, op: dict):
        if self.cfg.train_gpus > 1:    # FSDP: the op's collectives (batch plan, forward/backward, gathers) name it
            return collective(f"the trainer ranks' '{op['op']}'", self._op, op)
        return self._op(op)

    def _op(self, op: dict):
        tr = self.trainer
        if op["op"] == "train":
            metrics = tr.train_step(op["samples"][tr.rank], op["advantages"][tr.rank], op["version"])
            return metrics, (tr.probe_logprobs(self.probe_ids) if op["probe"] else None)
        if op["op"] == "send":                                         # gathers: collective under FSDP
            if tr.rank == 0:
                return self.sender.send(op["group"], tr.iter_full_state(), op["meta"])
            for _ in tr.iter_full_state():
                pass
        if op["op"] == "probe":
            return tr.probe_logprobs(self.probe_ids)
        if op["op"] == "save":
            tr.save_checkpoint(self.cfg.out_dir, op["state"], self.model_dir)


def evaluation_set(cfg: Config, problems):
    """--eval-every: the held-out prompts, and the training problems left. --eval-data if given;
    else the last --eval-prompts rows of --data (kept out of training); else generated ones from a
    seed training never uses (the embedded task, --task)."""
    import random

    import task
    n = cfg.eval_prompts
    if cfg.eval_data:
        return task.load_dataset(cfg.eval_data, cfg.prompt_key, cfg.answer_key)[:n], problems
    if problems is not None:
        if len(problems) <= n:
            raise ValueError(f"--eval-every: --data has {len(problems)} rows, too few to hold out --eval-prompts {n}; "
                             f"pass --eval-data")
        return problems[-n:], problems[:-n]
    if cfg.task:
        make = task.reasoning_gym_maker(cfg.task, cfg.seed + 1_000_003)
        return [make(random.Random(i)) for i in range(n)], None
    return task.make_problems(n, seed=cfg.seed + 1_000_003), None


def eval_line(e: dict) -> str:
    return f"evaluation of version {e['eval_version']}: " + ", ".join(
        f"{k.removeprefix('eval_').replace('_at_', '@')} {v:.3f}" for k, v in e.items() if k != "eval_version")


def run_trainer(cfg: Config, rank: int, device: str, groups: Groups, model_dir: str, state, buffer_addr):
    import task
    from buffer import ManagerQueues, SampleBuffer
    from controller import AsyncController, problem_stream
    from envs import PromptFormat
    from losses import group_advantages
    from trainer import Trainer
    from weight_sync import Sender, weight_meta
    from transformers import AutoTokenizer

    trainer = Trainer(model_dir, cfg.train_config(), groups.trainer if cfg.train_gpus > 1 else None, device)
    if state:
        trainer.load_optimizer(Path(cfg.out_dir) / "checkpoint")
        trainer.num_steps = state["step"]
    probe = AutoTokenizer.from_pretrained(model_dir).encode(PROBE_TEXT)
    ranks = TrainerRanks(trainer, cfg, groups.trainer, model_dir, probe)
    if rank != 0:
        return ranks.follow()

    host, port, key = buffer_addr
    buffer = SampleBuffer(ManagerQueues.serve(host, port, key, cfg.rollout_gpus), "trainer rank 0", cfg.timeout_s)
    problems = task.load_dataset(cfg.data, cfg.prompt_key, cfg.answer_key) if cfg.data else None
    eval_set = []
    if cfg.eval_every:
        eval_set, problems = evaluation_set(cfg, problems)
    make = task.reasoning_gym_maker(cfg.task, cfg.seed) if cfg.task else task.make_problem
    data_pos = state["data_position"] if state else 0
    stream = problem_stream(problems, cfg.seed, data_pos, make=make)
    fmt = PromptFormat(AutoTokenizer.from_pretrained(model_dir), cfg.chat_template)   # as the rollout ranks render prompts
    ctrl = AsyncController(cfg.controller_config(), buffer, stream, cfg.rollout_gpus,
                           version=state["version"] if state else 0, prompt_len=lambda p: len(fmt.first(p.prompt)),
                           log=print0)
    if state:      # prompts admitted but not trained when the checkpoint was written: first in line again
        ctrl.readmit.extend(task.Problem(**p) for p in state.get("in_flight", []))
    log = RunLog(cfg, state["step"] if state else 0)
    ctrl.events = log.events                  # the timeline: steps, sync phases, the ranks' requests
    # the weight-sync group meets on the default group's store; engines receive in their own dtype
    sender = Sender(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), store=groups.store,
                    prefix=f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                    backend="nccl" if device.startswith("cuda") else "gloo", device=device,
                    timeout_s=cfg.timeout_s, bucket_bytes=cfg.bucket_mb << 20)
    group = sender.spec(0, cfg.rollout_gpus)
    ranks.sender = sender
    meta = weight_meta(trainer.named_weights(), cfg.dtype)
    send = functools.partial(ranks.send_weights, meta=meta)

    def probe_due(version: int) -> bool:
        return cfg.check_sync_every > 0 and version % cfg.check_sync_every == 0

    async def main():
        await log.starting(ctrl.wait_ready(ranks.probe() if probe_due(0) else None))   # engines up and warmed up
        t_train = time.monotonic()
        for step in range(state["step"] if state else 0, cfg.steps):
            t0 = time.monotonic()
            batch, info = await ctrl.collect()                                 # schedule + run: B fresh groups
            if cfg.colocate:
                await ctrl.sleep_engines()                                     # their GPUs' memory, for training
            adv = group_advantages(torch.tensor([s.reward for s in batch]), cfg.group_size).tolist()
            t1 = time.monotonic()
            metrics, probe_ref = ranks.train(batch, adv, ctrl.version, probe=probe_due(ctrl.version + 1))
            t2 = time.monotonic()
            sync = await ctrl.sync_weights(ctrl.version + 1, send, meta, probe_ref, group)   # postprocess
            evaluation = ctrl.eval_result()                                   # a round that finished meanwhile
            final = step + 1 == cfg.steps or 0 < cfg.time_limit_min * 60 < time.monotonic() - t_train
            if eval_set and final:                                            # the final weights, always
                if earlier := evaluation or await ctrl.finish_eval():          # (a round still in flight first)
                    print0(eval_line(earlier))
                await ctrl.start_eval(eval_set, cfg.eval_k)
                evaluation = await ctrl.finish_eval()
            elif eval_set and ctrl.version % cfg.eval_every == 0:
                await ctrl.start_eval(eval_set, cfg.eval_k)                    # held-out accuracy of this version
            log.step(step + 1, ctrl.version, {**info, **evaluation}, metrics, sync, t2 - t1, time.monotonic() - t0)
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or final:
                # data position: problems drawn so far; those admitted but not yet trained are kept apart
                ranks.save({"step": step + 1, "version": ctrl.version, "config": dataclasses.asdict(cfg),
                            "data_position": data_pos + ctrl.groups_drawn,
                            "in_flight": [dataclasses.asdict(p) for p in ctrl.in_flight_problems()]})
            if final:
                break                                                         # (--time-limit-min: early)
        last = await ctrl.finish_sync()                                        # the last sync's acks
        ranks_stats = await ctrl.stop()
        stats = {"controller": ctrl.counters(), "rollout_ranks": [
            {**{k: v for k, v in r.items() if k != "proxy"}, "engine_in_flight": r["proxy"]["in_flight"]}
            for r in ranks_stats]}
        (Path(cfg.out_dir) / "rollout_stats.json").write_text(json.dumps(stats, indent=2))
        log.finish(f"last sync (version {last['synced_version']}): probe diff {last['sync_probe_max_diff']:.1e}"
                   if last.get("sync_probe_max_diff") is not None else "")

    try:
        asyncio.run(main())
    finally:
        log.close()
        ranks.stop()
        buffer.close()


# ---------------------------------------------------------------------------------------------
# rollout ranks


def injected_faults(cfg: Config, index: int):
    """--env-latency-s / --env-fail-rate / --env-hang-rate: wrap every env (testing the failure paths)."""
    if not (cfg.env_latency_s or cfg.env_fail_rate or cfg.env_hang_rate):
        return None
    import random

    from envs import FaultyEnv, LatencyEnv
    rng = random.Random(cfg.seed * 1000 + index)

    def wrap(env):
        if cfg.env_latency_s:
            env = LatencyEnv(env, cfg.env_latency_s, cfg.env_latency_s, rng)
        return FaultyEnv(env, cfg.env_fail_rate, cfg.env_hang_rate, rng) if cfg.env_fail_rate or cfg.env_hang_rate else env
    return wrap


def run_rollout(cfg: Config, rank: int, device: str, groups: Groups, model_dir: str, state, buffer_addr,
                engine_core: str = ""):
    from buffer import ManagerQueues, SampleBuffer
    from env_manager import EnvManager
    from proxy import LLMProxy, Sampling, VLLMEngine
    from timeline import RankEvents
    from transformers import AutoTokenizer

    index = rank - cfg.train_gpus                      # rollout rank index: its command queue
    who = f"rollout rank {index} (global {rank})"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = tokenizer.encode(PROBE_TEXT)
    host, port, key = buffer_addr
    buffer = SampleBuffer(ManagerQueues.connect(host, port, key, cfg.rollout_gpus, cfg.timeout_s), who, cfg.timeout_s)

    events = RankEvents(index) if cfg.max_events > 0 else None     # the timeline, sent to rank 0 in the acks

    if device.startswith("cuda"):     # GPU: the engine's processes see only this rank's GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu(int(os.environ.get("LOCAL_RANK", 0)),
                                                        os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    start = functools.partial(VLLMEngine.start, model_dir, seed=cfg.seed + index, cpu_cores=engine_core,
                                     max_num_seqs=cfg.max_concurrency, max_model_len=cfg.max_model_len,
                                     dtype=cfg.dtype, kv_cache_gib=cfg.kv_cache_gib,
                                     gpu_memory_utilization=cfg.gpu_memory_utilization, use_tqdm_on_load=cfg.verbose,
                                     sleep_mode=cfg.colocate)

    def start_engine():   # (in a worker thread) CPU: the engine's processes inherit this thread's core, its own
        if engine_core:
            os.sched_setaffinity(0, {int(engine_core)})
        return start()

    async def restart_engine():   # after an engine failure (EnvManager._recover): a fresh one, same settings
        print(f"{who}: the engine failed; starting a new one", flush=True)
        return await asyncio.to_thread(start_engine)

    async def main():
        t = time.time()
        engine = await asyncio.wait_for(asyncio.to_thread(start_engine), max(cfg.timeout_s, 300))
        proxy = LLMProxy(engine, rank=index, timeout_s=cfg.timeout_s)
        proxy.version = state["version"] if state else 0
        try:
            await proxy.generate(probe, Sampling(max_tokens=2))    # warm-up: the first request pays one-off costs
            if events is not None:
                events.phase("engine_start", t, time.time(), proxy.version)
                proxy.events = events
            await EnvManager(proxy, buffer, tokenizer, index, cfg.rollout_config(),
                             probe_ids=probe, env_wrappers=injected_faults(cfg, index),
                             restart_engine=restart_engine).run()
        finally:
            proxy.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------


def check_run_dir(cfg: Config) -> dict | None:
    """Before any process group or engine starts: does what out_dir holds fit what was asked?
    Returns the checkpoint state to resume from (None: a fresh run); exits naming the problem."""
    from trainer import read_checkpoint_state
    out = Path(cfg.out_dir)
    state = read_checkpoint_state(cfg.out_dir)
    if cfg.resume == "no" or (cfg.resume == "auto" and state is None):
        if state is not None and not cfg.overwrite:
            sys.exit(f"train.py: --out-dir {out} holds a checkpoint (step {state['step']}): pass --resume to "
                     f"continue it, or --overwrite to start over (its metrics and checkpoint are then replaced)")
        try:                                    # writable? (rank 0 writes; every rank checks, cheaply)
            out.mkdir(parents=True, exist_ok=True)
            probe = out / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            sys.exit(f"train.py: --out-dir {out} cannot be written: {e.strerror}")
        return None
    if state is None:
        sys.exit(f"train.py: --resume: no checkpoint in {out / 'checkpoint'}")
    saved = state.get("config", {})
    if saved.get("train_gpus", cfg.train_gpus) != cfg.train_gpus:
        sys.exit(f"train.py: --resume: the checkpoint was written by {saved['train_gpus']} trainer ranks "
                 f"(--train-gpus {saved['train_gpus']}); its optimizer is sharded that way, so resume with the same")
    if cfg.model and cfg.model != saved.get("model", cfg.model):
        sys.exit(f"train.py: --resume: --model {cfg.model} is not the model this run started from "
                 f"({saved.get('model') or 'the embedded tiny model'}); a resumed run continues its checkpoint")
    if cfg.steps <= state["step"]:
        if cfg.resume == "auto":      # a restart after the final checkpoint: the run is complete
            print(f"train.py: --resume auto: the checkpoint in {out} is at step {state['step']} >= --steps "
                  f"{cfg.steps}: nothing left to do", flush=True)
            sys.exit(0)
        sys.exit(f"train.py: --resume: the checkpoint is at step {state['step']}, so --steps {cfg.steps} leaves "
                 f"nothing to do; pass --steps > {state['step']}")
    return state


def check_inputs(cfg: Config, resuming: bool):
    """--model and --data, read before anything starts: a bad one is named with what is wrong."""
    if cfg.model and not resuming:      # (a resumed run loads its own checkpoint)
        model = Path(cfg.model)
        if not model.is_dir():
            sys.exit(f"train.py: --model {model}: no such directory")
        if not (model / "config.json").exists():
            sys.exit(f"train.py: --model {model}: not a Hugging Face model dir (no config.json)")
        try:
            json.loads((model / "config.json").read_text())
        except ValueError as e:
            sys.exit(f"train.py: --model {model}: config.json is not valid JSON ({e})")
        if not any(model.glob("*.safetensors")) and not any(model.glob("pytorch_model*.bin")):
            sys.exit(f"train.py: --model {model}: no weights (*.safetensors or pytorch_model*.bin)")
        try:
            from transformers import AutoTokenizer
            AutoTokenizer.from_pretrained(str(model))
        except Exception as e:
            sys.exit(f"train.py: --model {model}: its tokenizer does not load: {e}")
    if cfg.data:
        import task
        try:
            task.load_dataset(cfg.data)
        except (OSError, ValueError, ImportError) as e:
            sys.exit(f"train.py: {e}" if str(e).startswith("--data") else f"train.py: --data {cfg.data}: {e}")


def trim_metrics(out_dir: str, step: int):
    """Resume: drop the rows a crashed run wrote after its last checkpoint (they are trained again)."""
    path = Path(out_dir) / "metrics.jsonl"
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        keep = [line for line in rows if json.loads(line)["step"] <= step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)


def main():
    cfg = parse_cli(Config, doc=__doc__)
    quiet.setup(cfg.verbose)          # before vLLM or transformers load: library logs at warning level
    from buffer import die_with_parent
    die_with_parent()             # a rank ends with torchrun, even if torchrun is SIGKILLed
    state = check_run_dir(cfg)
    check_inputs(cfg, resuming=state is not None)
    if state and not cfg.model:     # what the checkpoint records: the model the run started from
        cfg = dataclasses.replace(cfg, model=state.get("config", {}).get("model", ""))
    rank, world, device, groups = init_distributed(cfg)
    engine_core = pin_cpu(cfg, rank) if device == "cpu" else ""
    try:
        model_dir = str(Path(cfg.out_dir) / "checkpoint") if state else cfg.model
        if not model_dir:
            import tiny_model
            if rank == 0:
                tiny_model.ensure_tiny_model(log=print0)
            collective("waiting for rank 0 to build the tiny model", dist.barrier)
            model_dir = str(tiny_model.DEFAULT_DIR)
        if not (Path(model_dir) / "config.json").exists():
            raise SystemExit(f"--model {model_dir}: not a Hugging Face model dir (no config.json)")
        cfg = cfg.resolved(model_dir, device)
        if rank == 0:
            if state:
                trim_metrics(cfg.out_dir, state["step"])
            else:
                (Path(cfg.out_dir) / "metrics.jsonl").unlink(missing_ok=True)
            print0(f"train.py: {world} ranks = {cfg.train_gpus} trainer + {cfg.rollout_gpus} rollout, "
                   f"model {model_dir} (context {cfg.max_model_len}, {cfg.dtype}, up to {cfg.max_tokens} tokens a turn), "
                   f"async ratio {cfg.async_ratio}, loss {cfg.loss}, device {device}"
                   + (f", resuming at step {state['step']} version {state['version']}" if state else ""))
        # the queue server's address and key, shared through the default group
        addr = [(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, secrets.token_bytes(16))]
        collective("sharing the queue server's address", dist.broadcast_object_list, addr, src=0)
        if rank < cfg.train_gpus:
            run_trainer(cfg, rank, device, groups, model_dir, state, addr[0])
        else:
            run_rollout(cfg, rank, device, groups, model_dir, state, addr[0], engine_core)
        collective("final barrier", dist.barrier)
    finally:
        cleanup()

if __name__ == "__main__":
    main()
