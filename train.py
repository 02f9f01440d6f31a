"""train.py: asynchronous RL post-training, ROLL Flash style. The entry point.

    torchrun --nproc-per-node 40 train.py --rollout-gpus 24 --train-gpus 16 --model DIR --data FILE   # GPU cluster
    torchrun --nproc-per-node 3 train.py --rollout-gpus 2 --train-gpus 1                              # this CPU box
    bash run.sh                                   # the same, after setting everything up

Roles, from torchrun's environment alone: global ranks [0, train_gpus) are trainer ranks, the rest
are rollout ranks. Process groups:
    default group      all ranks (gloo): set-up and the queue server's key
    trainer group      trainer ranks: FSDP2 data parallel (NCCL on GPU, gloo on CPU)
    weight-sync group  trainer rank 0 + every rollout rank: the weight broadcast
Trainer rank 0 also runs the controller and serves the buffer's queues over TCP
(MASTER_ADDR : MASTER_PORT + 1, with a random authkey shared through the default group).
Each rollout rank runs one vLLM engine behind an LLMProxy and an EnvManager that pulls tasks.

One step on the trainer side (rank 0 drives, the other trainer ranks follow):
    collect a batch (controller)  ->  train_step (all trainer ranks)  ->  gather full weights
    ->  suspend rollout, broadcast, resume (controller)  ->  metrics line + metrics.jsonl
Rollout never waits for training, except during the weight sync and where the async ratio stops
admission. --async-ratio 0 is the synchronous baseline in the same code.
"""

import asyncio
import dataclasses
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    rollout_gpus: int = opt(2, "ranks that run a vLLM engine (one GPU each; CPU here)")
    train_gpus: int = opt(1, "ranks that train (FSDP2 across them)")
    model: str = opt("", "HF model dir; empty = the embedded tiny model (built on first use)")
    data: str = opt("", "JSONL/parquet with prompt + answer rows; empty = generated addition problems")
    env: str = opt("", "multi-turn environment name (env_manager/envs); empty = single-turn RLVR")
    out_dir: str = opt("runs/default", "metrics.jsonl and checkpoint/ go here")
    resume: bool = opt(False, "continue from out_dir/checkpoint (step, version, data position, optimizer)")
    steps: int = opt(80, "training steps (weight versions) to run")
    async_ratio: int = opt(2, "max policy versions a trained sample may lag; 0 = synchronous")
    loss: str = opt("ppo", "reinforce | ppo | decoupled_ppo | tis | cispo | topr | gspo")
    lr: float = opt(3e-4, "AdamW learning rate (linear warm-up over the first 10 steps)")
    batch_groups: int = opt(32, "prompts per step")
    group_size: int = opt(8, "samples per prompt (GRPO group)")
    redundant: int = opt(4, "extra prompts admitted per step for dynamic filtering")
    rollout_mode: str = opt("queue", "queue (per-sample scheduling) | batch (barrier baseline)")
    replicate: bool = opt(True, "prompt replication: a prompt's samples spread over all engines")
    suspend_mode: str = opt("keep", "weight update under running requests: keep | abort (resubmit)")
    max_tokens: int = opt(8, "response tokens per model turn")
    max_concurrency: int = opt(64, "trajectories in flight per rollout rank")
    micro_batch: int = opt(64, "sequences per forward/backward on a trainer rank")
    bucket_mb: int = opt(64, "weight broadcast bucket, MiB")
    save_every: int = opt(10, "checkpoint every N steps (and at the end); 0 = only at the end")
    check_sync: bool = opt(True, "after each sync, compare engine and trainer logprobs on a probe")
    timeout_s: float = opt(600.0, "max wait for any queue, ack or collective before failing")
    seed: int = opt(0, "seeds data order and the trainer")

    def __post_init__(self):
        if self.rollout_gpus < 1 or self.train_gpus < 1:
            raise ValueError("--rollout-gpus and --train-gpus must both be >= 1")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        from losses import VARIANTS
        if self.loss not in VARIANTS:
            raise ValueError(f"--loss {self.loss!r}: must be one of {', '.join(VARIANTS)}")
        if self.rollout_mode not in ("queue", "batch"):
            raise ValueError(f"--rollout-mode must be queue or batch, got {self.rollout_mode!r}")
        if self.suspend_mode not in ("keep", "abort"):
            raise ValueError(f"--suspend-mode must be keep or abort, got {self.suspend_mode!r}")


def parse_config(argv=None) -> Config:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            ap.add_argument(flag, type=typ, default=f.default, help=f.metadata["help"] + " (default: %(default)s)")
    try:
        return Config(**vars(ap.parse_args(argv)))
    except ValueError as e:
        ap.error(str(e))


# ---------------------------------------------------------------------------------------------
# distributed init / cleanup


def init_distributed(cfg: Config):
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        sys.exit(f"train.py: {', '.join(missing)} not set: launch with torchrun, e.g.\n"
                 f"  torchrun --nproc-per-node 3 train.py --rollout-gpus 2 --train-gpus 1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.rollout_gpus + cfg.train_gpus != world:
        sys.exit(f"train.py: --rollout-gpus {cfg.rollout_gpus} + --train-gpus {cfg.train_gpus} = "
                 f"{cfg.rollout_gpus + cfg.train_gpus}, but torchrun started {world} ranks (WORLD_SIZE)")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = timedelta(seconds=cfg.timeout_s)
    dist.init_process_group("gloo", timeout=timedelta(seconds=max(cfg.timeout_s, 1800)))  # long: first rank builds the model
    backend = "nccl" if cuda else "gloo"
    trainer_ranks = list(range(cfg.train_gpus))
    trainer_group = dist.new_group(trainer_ranks, timeout=timeout, backend=backend)
    sync_group = dist.new_group([0] + list(range(cfg.train_gpus, world)), timeout=timeout, backend=backend)
    return rank, world, ("cuda" if cuda else "cpu"), trainer_group, sync_group


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


def print0(*args):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, flush=True)


# ---------------------------------------------------------------------------------------------
# trainer ranks


PROBE_TEXT = "123+456=579"   # the weight-sync probe: any token sequence the model's vocab covers


def run_trainer(cfg, rank, device, trainer_group, sync_group, model_dir, state, buffer_addr):
    import task
    from buffer import Buffer, ManagerQueues
    from controller import Controller, ControllerConfig, problem_stream
    from losses import group_advantages
    from trainer import TrainConfig, Trainer, broadcast_weights, weight_meta
    from transformers import AutoTokenizer

    tcfg = TrainConfig(loss=cfg.loss, lr=cfg.lr, micro_batch=cfg.micro_batch, bucket_mb=cfg.bucket_mb, seed=cfg.seed)
    trainer = Trainer(model_dir, tcfg, trainer_group if cfg.train_gpus > 1 else None, device)
    if state:
        trainer.load_optimizer(Path(cfg.out_dir) / "checkpoint")
        trainer.num_steps = state["step"]
    step0 = state["step"] if state else 0
    version = state["version"] if state else 0
    probe = AutoTokenizer.from_pretrained(model_dir).encode(PROBE_TEXT)

    def follow():   # trainer ranks > 0: do what rank 0 says, in lockstep (collectives inside)
        while True:
            obj = [None]
            collective("waiting for trainer rank 0's next command", dist.broadcast_object_list, obj, src=0,
                       group=trainer_group)
            cmd = obj[0]
            if cmd["op"] == "stop":
                return
            if cmd["op"] == "train":
                trainer.train_step(cmd["samples"][rank], cmd["advantages"][rank])
                trainer.full_state()
                if cfg.check_sync:
                    trainer.probe_logprobs(probe)
            if cmd["op"] == "save":
                trainer.save_checkpoint(cfg.out_dir, cmd["state"], model_dir)

    def tell(cmd):
        if cfg.train_gpus > 1:
            collective(f"sending '{cmd['op']}' to the trainer ranks", dist.broadcast_object_list, [cmd], src=0,
                       group=trainer_group)

    if rank != 0:
        return follow()

    host, port, key = buffer_addr
    buffer = Buffer(ManagerQueues.serve(host, port, key, cfg.rollout_gpus), "trainer rank 0", cfg.timeout_s)
    problems = task.load_dataset(cfg.data) if cfg.data else None
    data_pos = state["data_position"] if state else 0
    stream = problem_stream(problems, cfg.seed, data_pos, make=task.make_problem)
    ccfg = ControllerConfig(batch_groups=cfg.batch_groups, group_size=cfg.group_size, async_ratio=cfg.async_ratio,
                            redundant=cfg.redundant, replicate=cfg.replicate, rollout_mode=cfg.rollout_mode,
                            env=cfg.env, timeout_s=cfg.timeout_s)
    ctrl = Controller(ccfg, buffer, stream, cfg.rollout_gpus, version=version)
    metrics_path = Path(cfg.out_dir) / "metrics.jsonl"
    last_engine: dict[int, dict] = {}

    def save(step):
        # position = problems drawn so far (admitted groups); groups admitted but untrained are re-drawn on resume
        st = {"step": step, "version": ctrl.version, "data_position": data_pos + ctrl.groups_admitted,
              "config": dataclasses.asdict(cfg)}
        tell({"op": "save", "state": st})
        trainer.save_checkpoint(cfg.out_dir, st, model_dir)

    recent: list[float] = []        # reward_mean per step, for the progress line's moving average

    async def main():
        t = time.monotonic()
        await ctrl.wait_ready()   # engines started and warmed up, so step 1 measures a step, not start-up
        print0(f"rollout ready: {cfg.rollout_gpus} engines in {time.monotonic() - t:.1f}s")
        for step in range(step0, cfg.steps):
            t0 = time.monotonic()
            batch, info = await ctrl.collect()                                  # schedule + run
            rewards = torch.tensor([s.reward for s in batch])
            adv = group_advantages(rewards, cfg.group_size).tolist()           # batch is whole groups
            shards = [batch[r::cfg.train_gpus] for r in range(cfg.train_gpus)]
            adv_shards = [adv[r::cfg.train_gpus] for r in range(cfg.train_gpus)]
            t1 = time.monotonic()
            tell({"op": "train", "samples": shards, "advantages": adv_shards})
            m = trainer.train_step(shards[0], adv_shards[0])
            named = trainer.full_state()
            ref = trainer.probe_logprobs(probe) if cfg.check_sync else None
            t2 = time.monotonic()
            sync = await ctrl.sync_weights(                                     # postprocess
                ctrl.version + 1, lambda: broadcast_weights(named, sync_group, cfg.bucket_mb << 20, device, "trainer rank 0"),
                meta=weight_meta(named))
            row = {"step": step + 1, "version": ctrl.version, **info, **m,
                   "time_train": t2 - t1, "time_weight_sync": sync["time_weight_sync"],
                   "time_broadcast": sync["time_broadcast"]}
            if ref is not None:
                diffs = [max(abs(a - b) for a, b in zip(ack["probe"], ref)) for ack in sync["acks"] if "probe" in ack]
                row["sync_probe_max_diff"] = max(diffs) if diffs else None
            busy = elapsed = 0.0
            for ack in sync["acks"]:
                e, prev = ack["engine"], last_engine.get(ack["rank"], {"busy_s": 0.0, "idle_s": 0.0})
                busy += e["busy_s"] - prev["busy_s"]
                elapsed += (e["busy_s"] + e["idle_s"]) - (prev["busy_s"] + prev["idle_s"])
                last_engine[ack["rank"]] = e
            row["rollout_utilisation"] = busy / elapsed if elapsed > 0 else 0.0
            row["time_step"] = time.monotonic() - t0
            row["samples_per_s"] = info["num_samples"] / row["time_step"]
            row["tokens_per_s"] = info["num_tokens"] / row["time_step"]
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            recent.append(info["reward_mean"])
            print0(f"step {step + 1:4d}/{cfg.steps} | v{ctrl.version} | reward {info['reward_mean']:.3f} "
                   f"(avg10 {sum(recent[-10:]) / len(recent[-10:]):.3f}) | "
                   f"stale max {info['staleness_max']} mean {info['staleness_mean']:.2f} | "
                   f"dropped {info['samples_dropped_stale']} filtered {info['groups_filtered']} | "
                   f"{row['time_step']:.2f}s (wait {info['time_wait_rollout']:.2f} train {row['time_train']:.2f} "
                   f"sync {row['time_weight_sync']:.2f}) | {row['samples_per_s']:.1f} samples/s | "
                   f"util {row['rollout_utilisation']:.2f}")
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
                save(step + 1)
        await ctrl.stop()

    try:
        asyncio.run(main())
    finally:
        tell({"op": "stop"})
        buffer.close()


# ---------------------------------------------------------------------------------------------
# rollout ranks


def run_rollout(cfg, rank, device, sync_group, model_dir, state, buffer_addr):
    from buffer import Buffer, ManagerQueues
    from env_manager import EnvManager, RolloutConfig
    from proxy import LLMProxy, Sampling
    from trainer import receive_weights
    from transformers import AutoTokenizer

    index = rank - cfg.train_gpus                      # rollout rank index: its command queue
    who = f"rollout rank {index} (global {rank})"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = tokenizer.encode(PROBE_TEXT)
    host, port, key = buffer_addr
    buffer = Buffer(ManagerQueues.connect(host, port, key, cfg.rollout_gpus, cfg.timeout_s), who, cfg.timeout_s)
    rcfg = RolloutConfig(max_concurrency=cfg.max_concurrency, max_tokens=cfg.max_tokens, async_ratio=cfg.async_ratio)

    async def main():
        # CPU: one core per engine, round robin over this node's cores (see proxy.VLLMEngine.start)
        cores = str(int(os.environ.get("LOCAL_RANK", index)) % os.cpu_count()) if device == "cpu" else ""
        proxy = await LLMProxy.start_vllm(model_dir, rank=index, timeout_s=cfg.timeout_s, seed=cfg.seed + index,
                                          cpu_cores=cores)
        proxy.version = state["version"] if state else 0
        await proxy.generate(probe, Sampling(max_tokens=2))    # warm-up: the first request pays one-off costs
        await buffer.put_ack({"rank": index, "phase": "ready", "version": None})

        async def weight_sync(cmd):                    # suspend -> receive broadcast -> load -> resume
            v = cmd["version"]
            await proxy.suspend(cfg.suspend_mode)
            await buffer.put_ack({"rank": index, "phase": "suspended", "version": v})
            named = await asyncio.to_thread(receive_weights, cmd["meta"], sync_group, cfg.bucket_mb << 20, device, who)
            await proxy.update_weights(named, v)
            await proxy.resume()
            ack = {"rank": index, "phase": "loaded", "version": v, "engine": proxy.stats()}
            if cfg.check_sync:
                ack["probe"] = await proxy.score(probe)
            await buffer.put_ack(ack)

        try:
            await EnvManager(proxy, buffer, tokenizer, index, rcfg, weight_sync=weight_sync).run()
        finally:
            proxy.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------


def main():
    cfg = parse_config()
    rank, world, device, trainer_group, sync_group = init_distributed(cfg)
    try:
        state = None
        if cfg.resume:
            from trainer import read_checkpoint_state
            state = read_checkpoint_state(cfg.out_dir)
            if state is None:
                raise SystemExit(f"--resume: no checkpoint in {cfg.out_dir}/checkpoint")
        model_dir = cfg.model
        if state:
            model_dir = str(Path(cfg.out_dir) / "checkpoint")
        elif not model_dir:
            import tiny_model
            if rank == 0:
                tiny_model.ensure_tiny_model(log=print0)
            collective("waiting for rank 0 to build the tiny model", dist.barrier)
            model_dir = str(tiny_model.DEFAULT_DIR)
        if not (Path(model_dir) / "config.json").exists():
            raise SystemExit(f"--model {model_dir}: not a Hugging Face model dir (no config.json)")
        if rank == 0:
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            if not cfg.resume:
                (Path(cfg.out_dir) / "metrics.jsonl").unlink(missing_ok=True)
            print0(f"train.py: {world} ranks = {cfg.train_gpus} trainer + {cfg.rollout_gpus} rollout, "
                   f"model {model_dir}, async ratio {cfg.async_ratio}, loss {cfg.loss}, device {device}"
                   + (f", resuming at step {state['step']} version {state['version']}" if state else ""))
        # the queue server's address and key, shared through the default group
        addr = [(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, secrets.token_bytes(16))]
        collective("sharing the queue server's address", dist.broadcast_object_list, addr, src=0)
        if rank < cfg.train_gpus:
            run_trainer(cfg, rank, device, trainer_group, sync_group, model_dir, state, addr[0])
        else:
            run_rollout(cfg, rank, device, sync_group, model_dir, state, addr[0])
        collective("final barrier", dist.barrier)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
