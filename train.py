"""train.py: asynchronous RL post-training, ROLL Flash style. The entry point.

    torchrun --nproc-per-node 40 train.py --rollout-gpus 24 --train-gpus 16 --model DIR --data FILE   # GPUs
    torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1   # this CPU box
    bash run.sh                                   # the same, after setting everything up
    python train.py --steps 40                    # no torchrun: the whole system in one process, to step
                                                  # through (docs/tour.md); no vLLM needed

Ranks [0, train_gpus) train (FSDP2 over the trainer group: NCCL on GPU, gloo on CPU); each other rank
runs one vLLM engine behind an LLMProxy and an EnvManager that pulls work. Trainer rank 0 also runs
the controller, serves the buffer's queues over TCP (MASTER_PORT + 1) and sends the weights straight
into the engines (weight_sync.py: a broadcast over a group formed on the default group's store).
One step (rl_loop): collect -> advantages -> train -> sync weights -> extensions (eval) -> log -> save.
Rollout never waits for training, except during the weight sync and where the async ratio stops
admission; --async-ratio 0 is the synchronous baseline in the same code. Every setting is one --flag,
declared once by the component that owns it (Config composes them; each ext/ file brings its own).
Design and measurements: DESIGN.md, results/README.md.
"""

import asyncio
import dataclasses
import functools
import gc
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import ext
from buffer import PROBE_TEXT, ManagerQueues, SampleBuffer, die_with_parent, queue_bind
from config import Extensions, check, extensions, opt, parse_cli, part
from controller import AsyncController, ControllerConfig, WholeBatch, rl_step
from env_manager import RolloutConfig, for_rank
from proxy import LLMProxy, Sampling
from ranks import TrainerRanks, collective, init_distributed, pin_engine_gpu, trainer_ranks
from rollout import PromptFormat
from runlog import RunLog, print0, probe_verdict, start_line, start_metrics
from task import DataConfig, problem_stream
from trainer import TrainConfig, check_model_dir, check_run_dir
from vllm_engine import VLLMEngine, export_startup_timeout
from weight_sync import TRANSPORTS, weight_layout

ext.load()                # every ext/ file registers its flags and hooks
if __name__ == "__mp_main__":     # this file re-imported in vLLM's engine processes, which a rank spawned:
    die_with_parent(watch=True)    # they end with it however it ends (SIGKILL too), or keep its core busy


@dataclass
class Config:
    rollout_gpus: int = opt(1, "ranks that run a vLLM engine (one GPU each; on CPU one core each)")
    train_gpus: int = opt(1, "ranks that train (FSDP2 across them)")
    model: str = opt("", "HF model dir; empty = the embedded tiny model (built on first use)")
    out_dir: str = opt("runs/default", "metrics.jsonl and checkpoint/ go here")
    resume: str = opt("no", "continue from out_dir/checkpoint (step, version, data position, optimizer): "
                            "no | yes (--resume alone) | auto (if there is one; for torchrun --max-restarts)",
                      const="yes")
    overwrite: bool = opt(False, "start afresh in an out_dir that holds a checkpoint (its metrics and "
                                 "checkpoint go)")
    steps: int = opt(80, "training steps (weight versions) to run")
    time_limit_min: float = opt(0.0, "end the run (evaluate, checkpoint, summarise) after the first step "
                                     "that ends past this many minutes of training (start-up excluded); "
                                     "0 = no limit")
    bucket_mb: int = opt(64, "weight broadcast bucket, MiB")
    weight_transport: str = opt("auto", "how the weights reach the engines (weight_sync.TRANSPORTS): group "
                                        "(rank 0 broadcasts over one gloo/NCCL group) | ipc (trainer rank "
                                        "i hands engine i its buckets: ext/colocate.py) | auto (ipc under "
                                        "--colocate, else group)")
    save_every: int = opt(10, "checkpoint every N steps (and at the end); 0 = only at the end")
    print_world_size: bool = opt(False, "print how many ranks these flags need (torchrun's --nproc-per-node "
                                        "on one node, the extensions' engines included), then exit")
    check_sync_every: int = opt(10, "compare engine and trainer logprobs on a probe at start and every N "
                                    "syncs; 0 = never")
    data: DataConfig = part(DataConfig)                   # --data, ...
    controller: ControllerConfig = part(ControllerConfig)  # --batch-groups, --async-ratio, --timeout-s, ...
    rollout: RolloutConfig = part(RolloutConfig)          # --max-concurrency, --max-tokens, --dtype, ...
    train: TrainConfig = part(TrainConfig)                # --loss, --lr, --clip-high, ..., --seed
    ext: dict = extensions()                              # --lora-rank, --tail-batching, --eval-every, ...

    def __post_init__(self):
        check(self, at_least=dict(rollout_gpus=1, train_gpus=1, steps=1, bucket_mb=1, save_every=0,
                                  check_sync_every=0, time_limit_min=0),
              one_of=dict(resume=("no", "yes", "auto"), weight_transport=("auto", *TRANSPORTS)))
        if self.resume != "no" and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        Extensions.configure(self)             # each extension's flags against the rest (may settle "auto")
        if self.weight_transport == "auto":
            self.weight_transport = "group"
        getattr(TRANSPORTS[self.weight_transport], "configure", lambda cfg: None)(self)


# ---------------------------------------------------------------------------------------------
# the loop (trainer rank 0)


async def rl_loop(cfg: Config, exts, ctrl, ranks, log: RunLog, backend, send, layout, spec, state):
    """collect -> train -> sync weights -> extensions -> log -> save, until --steps or the time limit."""
    await log.starting(ctrl.wait_ready(ranks.probe() if ranks.probe_due(0) else None))   # engines up, warm
    t_train = time.monotonic()
    for step in range(state["step"] if state else 0, cfg.steps):
        t0 = time.monotonic()
        s = await rl_step(ctrl, backend, send, layout, spec)                      # collect, train, sync
        final = step + 1 == cfg.steps or 0 < cfg.time_limit_min * 60 < time.monotonic() - t_train
        extra = {k: v for d in await exts.acall("after_step", ctrl, step + 1, final) for k, v in d.items()}
        log.step(step + 1, ctrl.version, {**s.info, **extra}, s.metrics, s.sync, s.train_s,
                 time.monotonic() - t0)
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or final:     # (+ ctrl.state(): the data
            ranks.save({"step": step + 1, "version": ctrl.version, "config": dataclasses.asdict(cfg),
                        **ctrl.state()})                  # position, group ids, prompts in flight)
        if final:
            break                                                         # (--time-limit-min: early)
    last = await ctrl.finish_sync()                                        # the last sync's acks
    ranks_stats = await ctrl.stop()                                        # (its last samples counted too)
    log.write_stats(ctrl.counters(), ranks_stats)                          # rollout_stats.json
    diff = last.get("sync_probe_max_diff")
    log.finish(f"last sync (version {last['synced_version']}): {probe_verdict(diff, cfg)}"
               if diff is not None else "")


# ---------------------------------------------------------------------------------------------
# the trainer ranks and the rollout ranks


def controller_side(cfg: Config, exts, ranks: TrainerRanks, buffer: SampleBuffer, tokenizer, state):
    """Trainer rank 0's side of the run: the controller (admission, collection, the weight sync), the run's
    record, how a step's groups train, and the weights' send. -> (ctrl, log, backend, send, layout)."""
    problems, make, _ = cfg.data.sources(cfg.train.seed, exts)       # (--task, lengths, a held-out split)
    stream = problem_stream(problems, cfg.train.seed, state["data_position"] if state else 0, make=make)
    fmt = PromptFormat(tokenizer, cfg.rollout.chat_template)      # as the rollout ranks render prompts
    ctrl = AsyncController(cfg.controller, buffer, stream, cfg.rollout_gpus, state["version"] if state else 0,
                           lambda p: len(fmt.first(p.prompt)), cfg.rollout.max_model_len, print0,
                           exts.first("admission", cfg.controller), exts.first("sync_recovery"),
                           exts.first("freshness", cfg.controller))
    if state:      # the run goes on: its stream position, group ids, and prompts in flight run first
        ctrl.restore(state)
    exts.call("on_controller", ctrl, state)            # (the timeline's events, a tracker, evaluation)
    log = RunLog(cfg, exts)
    backend = (exts.first("train_backend", ranks, ranks.probe_due)        # (every trainer rank, in lockstep)
               or WholeBatch(ranks.train, cfg.controller.group_size, cfg.train.adv_estimator,
                             before=[functools.partial(e.before_train, ctrl) for e in exts]))
    layout = weight_layout(ranks.trainer.named_weights(), cfg.rollout.dtype)
    return ctrl, log, backend, functools.partial(ranks.send_weights, layout=layout), layout


def run_trainer(cfg: Config, exts, rank: int, device: str, trainer_group, store, model_dir: str, state,
                buffer_addr, base_dir: str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    attempt = f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"    # (as init_distributed's)
    ranks = trainer_ranks(cfg, exts, rank, device, trainer_group, model_dir, state, base_dir, tokenizer,
                          mailbox=dist.PrefixStore(f"{attempt}/trainer-ranks", store),
                          host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), store=store,
                          prefix=attempt)
    if rank != 0:
        gc.freeze()          # start-up's objects out of the collector's sight (run_rollout says why)
        return ranks.follow()
    buffer = SampleBuffer(ManagerQueues.serve(*buffer_addr, cfg.rollout_gpus, bind=queue_bind()),
                          "trainer rank 0", cfg.controller.timeout_s)
    ctrl, log, backend, send, layout = controller_side(cfg, exts, ranks, buffer, tokenizer, state)
    gc.freeze()              # (as run_rollout's: 2 full collections of ~0.3 s in 40 default steps)
    try:
        asyncio.run(rl_loop(cfg, exts, ctrl, ranks, log, backend, send, layout,
                            ranks.sender.spec(0, cfg.rollout_gpus), state))
    finally:
        log.close()
        ranks.stop()
        buffer.close()


def run_rollout(cfg: Config, exts, rank: int, device: str, model_dir: str, state, buffer_addr,
                engine_core: str = ""):
    from transformers import AutoTokenizer
    index = rank - cfg.train_gpus                      # rollout rank index: its command queue
    who, rc, timeout = f"rollout rank {index} (global {rank})", cfg.rollout, cfg.controller.timeout_s
    startup = cfg.controller.startup_timeout_s
    if getattr(TRANSPORTS[cfg.weight_transport], "engines_after_trainers", False):   # (before the queues)
        collective("the trainer ranks' models built, before the engines start", dist.barrier)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pin_engine_gpu(device)            # GPU: the engine's processes see only this rank's GPU
    engine = dict(seed=cfg.train.seed + index, cpu_cores=engine_core, max_num_seqs=rc.max_concurrency,
                  max_model_len=rc.max_model_len, dtype=rc.dtype, kv_cache_gib=rc.kv_cache_gib,
                  gpu_memory_utilization=rc.gpu_memory_utilization or 0.85,
                  enforce_eager=True if rc.enforce_eager or device == "cpu" else None,
                  on_engine=lambda e: exts.call("on_engine", e))
    for args in exts.call("engine_args", model_dir, device, who):     # (LoRA, --colocate's sleep mode)
        engine.update(args)

    async def start_engine():     # vLLM's, or an extension's (ext/torch_engine.py); also after an engine
        own = exts.first("rollout_engine", model_dir, who, engine)    # failure (ext/recovery.py): a fresh one
        return await (own or VLLMEngine.start_async(model_dir, startup, who, **engine))

    async def main():
        t = time.time()
        # the engine first: it starts while the trainer ranks build their models; trainer rank 0 serves
        # the queues once it holds its model, so the connect after this may wait for that
        proxy = LLMProxy(await start_engine(), rank=index, timeout_s=timeout)
        proxy.version = state["version"] if state else 0
        try:
            queues = ManagerQueues.connect, *buffer_addr, cfg.rollout_gpus, startup, who
            buffer = SampleBuffer(await asyncio.to_thread(*queues), who, timeout)
            await proxy.generate(tokenizer.encode(PROBE_TEXT), Sampling(max_tokens=2))   # warm-up: paid once
            gc.freeze()    # torch's, transformers' and vLLM's ~600k lifelong objects out of the collector's
            # sight: a full collection walked them all (~0.3 s each, 8 in 40 default steps: 1/4 of the CPU)
            exts.call("on_proxy", proxy, index, t)              # (the timeline's recorder)
            await for_rank(cfg, exts, proxy, buffer, tokenizer, index, start_engine).run()
        finally:
            proxy.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# launch


def checked(cfg: Config) -> tuple[Config, dict | None]:
    """Before any process starts: the run dir (a resume's state), the model dir, the data; a resumed run
    goes on with the model it started from. Exits naming the problem. -> (cfg, state or None)."""
    state = check_run_dir(cfg.out_dir, cfg.resume, cfg.overwrite, cfg.steps, cfg.train_gpus, cfg.model)
    if cfg.model and not state:       # (a resumed run loads its own checkpoint)
        check_model_dir(cfg.model)
    cfg.data.check()                  # (a bad row: its file and line)
    if state and not cfg.model:     # what the checkpoint records: the model the run started from
        cfg = dataclasses.replace(cfg, model=state.get("config", {}).get("model", ""))
    return cfg, state


def resolved(cfg: Config, exts, state, rank: int, world: int, device: str, barrier=lambda: None):
    """The model dirs (the embedded model built by rank 0 first: barrier() waits for it) and every setting
    that depends on them; rank 0 prints the start line. -> (cfg, model_dir, base_dir)."""
    base_dir = cfg.model          # the model the run started from (--kl-coef's reference)
    if not base_dir:              # the embedded model (an env's own: --env calc's calls the calculator)
        import tiny_model
        build = exts.first("embedded_model") or tiny_model.ensure_tiny_model
        if rank == 0:
            build(log=print0)
        barrier()
        base_dir = str(build(log=lambda *a: None))
    ckpt = str(Path(cfg.out_dir) / "checkpoint") if state else ""    # (resumed: an extension may say
    model_dir = exts.first("start_from", base_dir, ckpt, state) or ckpt or base_dir   # otherwise: LoRA's)
    if not (Path(model_dir) / "config.json").exists():
        raise SystemExit(f"--model {model_dir}: not a Hugging Face model dir (no config.json)")
    cfg = exts.resolve(cfg)                                                     # (--env calc's replies, ...)
    rollout = cfg.rollout.resolved(model_dir, device, not cfg.model)                 # context, dtype
    cfg = exts.update(dataclasses.replace(cfg, rollout=rollout, train=cfg.train.resolved(device)))
    if rank == 0:
        start_metrics(cfg.out_dir, state)          # (a resume: the rows past its checkpoint go)
        print0(start_line(cfg, world, model_dir, device, state))
        for lines in exts.call("startup_lines", model_dir, device):        # (the memory plan)
            print0(lines)
    return cfg, model_dir, base_dir


def main():
    cfg = parse_cli(Config, doc=__doc__)
    export_startup_timeout(cfg.controller.startup_timeout_s)
    exts = Extensions.start(cfg)
    extra = sum(exts.call("extra_ranks"))     # ranks the extensions add after the rollout ranks (a teacher's)
    if cfg.print_world_size:          # (run.sh: torchrun's --nproc-per-node for these flags)
        return print(cfg.train_gpus + cfg.rollout_gpus + extra)
    exts.call("before_launch")        # (library logs at warning level; --dry-run: the memory plan, then exit)
    if "WORLD_SIZE" not in os.environ:          # not under torchrun: the whole system in one process
        alone = exts.first("without_torchrun")  # (ext/one_process.py, given this module's pieces)
        if alone is None:
            sys.exit("train.py: launch with torchrun, e.g.\n  torchrun --nproc-per-node 2 train.py "
                     "--rollout-gpus 1 --train-gpus 1")
        return alone(cfg, exts, extra, sys.modules[__name__])
    die_with_parent()                 # a rank ends with torchrun, even if torchrun is SIGKILLed
    cfg, state = checked(cfg)
    rank, world, device, engine_core, trainer_group, store = init_distributed(cfg, extra)
    try:
        cfg, model_dir, base_dir = resolved(cfg, exts, state, rank, world, device, lambda: collective(
            "waiting for rank 0 to build the tiny model", dist.barrier))
        # the queue server's address and key, shared through the default group
        addr = [(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, secrets.token_bytes(16))]
        collective("sharing the queue server's address", dist.broadcast_object_list, addr, src=0)
        if rank < cfg.train_gpus:
            run_trainer(cfg, exts, rank, device, trainer_group, store, model_dir, state, addr[0], base_dir)
        elif rank < cfg.train_gpus + cfg.rollout_gpus:
            run_rollout(cfg, exts, rank, device, model_dir, state, addr[0], engine_core)
        else:                         # an extension's rank (a teacher's engine): the owner runs it
            index = rank - cfg.train_gpus - cfg.rollout_gpus
            for e in exts:
                if index < (e.extra_ranks() or 0):
                    e.run_extra_rank(index, device, engine_core, addr[0], state)
                    break
                index -= e.extra_ranks() or 0
        collective("final barrier", dist.barrier)
    finally:
        gc.unfreeze()        # frozen objects are collected at exit again (else triton reports leaks)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
