"""train.py: asynchronous RL post-training, ROLL Flash style. The entry point.

    torchrun --nproc-per-node 40 train.py --rollout-gpus 24 --train-gpus 16 --model DIR --data FILE   # GPUs
    torchrun --nproc-per-node 2 train.py --rollout-gpus 1 --train-gpus 1   # this CPU box
    bash run.sh                                   # the same, after setting everything up

Ranks [0, train_gpus) train (FSDP2 over the trainer group: NCCL on GPU, gloo on CPU); each other rank
runs one vLLM engine behind an LLMProxy and an EnvManager that pulls work. Trainer rank 0 also runs
the controller, serves the buffer's queues over TCP (MASTER_PORT + 1) and broadcasts the weights
straight into the engines (weight_sync.py, a group formed on the default group's store).
One step (rl_loop): collect -> advantages -> train -> sync weights -> eval -> log -> save. Rollout
never waits for training, except during the weight sync and where the async ratio stops admission;
--async-ratio 0 is the synchronous baseline in the same code. Every setting is one --flag, declared
once by the component that owns it (Config composes them). Design and measurements: DESIGN.md.
"""

import asyncio
import dataclasses
import functools
import gc
import json
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import quiet
from buffer import ManagerQueues, SampleBuffer
from config import opt, parse_cli, part
from controller import AsyncController, ControllerConfig, problem_stream, rl_step
from env_manager import EnvManager, RolloutConfig
from envs import FaultConfig, PromptFormat
from lora import LoraConfig, check_lora
from proxy import LLMProxy, Sampling
from vllm_engine import VLLMEngine, cpu_layout, engine_gpu
from runlog import RunLog, check_tracker, eval_line, print0, probe_verdict, trim_metrics
from stream import TrainStream
from task import DataConfig, Problem, load_dataset
from timeline import RankEvents
from trainer import TrainConfig, Trainer, check_model_dir, check_run_dir
from trainer_ranks import PROBE_TEXT, TrainerRanks, collective
from weight_ipc import IpcSender
from weight_sync import Sender, weight_meta

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
    colocate: bool = opt(False, "GPU: the synchronous baseline on shared GPUs: rollout rank i on trainer "
                                "rank i's GPU; engines sleep (free their memory) while the trainer trains; "
                                "needs --async-ratio 0 and --rollout-gpus == --train-gpus")
    bucket_mb: int = opt(64, "weight broadcast bucket, MiB")
    weight_transport: str = opt("auto", "how the weights reach the engines: group (trainer rank 0 broadcasts "
                                        "into every engine over one gloo/NCCL group) | ipc (trainer rank i "
                                        "hands engine i IPC handles of buckets: CUDA IPC on a GPU, shared "
                                        "memory on CPU; needs --rollout-gpus == --train-gpus, each pair on "
                                        "one node, on GPUs one GPU: --colocate) | auto (ipc if --colocate)")
    save_every: int = opt(10, "checkpoint every N steps (and at the end); 0 = only at the end")
    eval_every: int = opt(0, "held-out accuracy (greedy and mean@k) every N versions and at the end; "
                             "0 = never")
    check_sync_every: int = opt(10, "compare engine and trainer logprobs on a probe at start and every N "
                                    "syncs; 0 = never")
    verbose: bool = opt(False, "show every library log line (vLLM INFO, progress bars); default: warnings "
                               "and errors only")
    tracker: str = opt("none", "also send metrics.jsonl's rows to: none | tensorboard | wandb | trackio "
                               "(rank 0)")
    tracker_project: str = opt("roll-flash-nano", "project for --tracker wandb / trackio (the run: "
                                                  "out_dir's name)")
    dry_run: str = opt("", "print the memory plan (memplan.py) for --model and the layout given, then exit "
                           "before any process group or engine starts (no torchrun needed): gpu | cpu | auto "
                           "(--dry-run alone: this machine's)", const="auto")
    max_events: int = opt(100_000, "request events kept in out_dir/events.jsonl for tools/plot.py's "
                                   "timeline; 0 = no events file")
    data: DataConfig = part(DataConfig)                   # --data, --task, --eval-data, ...
    controller: ControllerConfig = part(ControllerConfig)  # --batch-groups, --async-ratio, --timeout-s, ...
    rollout: RolloutConfig = part(RolloutConfig)          # --max-concurrency, --max-tokens, --dtype, ...
    faults: FaultConfig = part(FaultConfig)               # --env-fail-rate, ... (testing)
    train: TrainConfig = part(TrainConfig)                # --loss, --lr, --clip-high, ..., --seed
    lora: LoraConfig = part(LoraConfig)                   # --lora-rank, --lora-alpha, ...

    def __post_init__(self):
        if self.resume not in ("no", "yes", "auto"):
            raise ValueError(f"--resume must be no, yes or auto, got {self.resume!r}")
        if self.resume != "no" and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        if self.dry_run not in ("", "gpu", "cpu", "auto"):
            raise ValueError(f"--dry-run must be gpu, cpu or auto (alone: auto), got {self.dry_run!r}")
        for name, low in (("rollout_gpus", 1), ("train_gpus", 1), ("steps", 1), ("bucket_mb", 1),
                          ("save_every", 0), ("eval_every", 0), ("check_sync_every", 0), ("max_events", 0),
                          ("time_limit_min", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if self.colocate and (self.controller.async_ratio != 0 or self.rollout_gpus != self.train_gpus):
            raise ValueError("--colocate: the same GPUs generate then train, so it needs --async-ratio 0 and "
                             "--rollout-gpus == --train-gpus")
        if self.weight_transport not in ("auto", "group", "ipc"):
            raise ValueError(f"--weight-transport must be auto, group or ipc, got {self.weight_transport!r}")
        if self.colocate and self.weight_transport == "group":
            raise ValueError("--colocate --weight-transport group: NCCL refuses a group holding two ranks of "
                             "one GPU; colocated weights go by CUDA IPC (--weight-transport ipc or auto)")
        if self.weight_transport == "auto":
            self.weight_transport = "ipc" if self.colocate else "group"
        if self.weight_transport == "ipc" and self.rollout_gpus != self.train_gpus:
            raise ValueError(f"--weight-transport ipc: trainer rank i hands engine i its weights, so it "
                             f"needs --rollout-gpus == --train-gpus (got {self.rollout_gpus} and "
                             f"{self.train_gpus})")
        check_tracker(self.tracker)        # a missing optional package is named now, before anything starts


# ---------------------------------------------------------------------------------------------
# the loop (trainer rank 0)


async def rl_loop(cfg: Config, ctrl, ranks, log: RunLog, send, meta, group, held_out: list,
                  state: dict | None):
    """collect -> advantages -> train -> sync weights -> eval -> log -> save, until --steps or the time
    limit."""
    def probe_due(version: int) -> bool:
        return cfg.check_sync_every > 0 and version % cfg.check_sync_every == 0

    async def train(batch, advantages, version):      # every trainer rank, in lockstep
        if cfg.colocate:
            await ctrl.sleep_engines()                 # their GPUs' memory, for training
        return ranks.train(batch, advantages, version, probe=probe_due(version + 1))

    # --stream-trainer: each complete group is trained on as it arrives (stream.py), unless it cannot apply
    fallback = cfg.train.stream_fallback(cfg.colocate)
    if fallback:
        print0(f"train.py: {fallback}")
    stream = (TrainStream(cfg.controller.group_size, RanksStream(ranks, probe_due), cfg.controller.timeout_s,
                          cfg.train.adv_estimator) if cfg.train.stream_trainer and not fallback else None)

    await log.starting(ctrl.wait_ready(ranks.probe() if probe_due(0) else None))   # engines up and warmed up
    t_train = time.monotonic()
    data_pos = state["data_position"] if state else 0
    for step in range(state["step"] if state else 0, cfg.steps):
        t0 = time.monotonic()
        s = await rl_step(ctrl, train, send, meta, group, stream,       # collect, train, sync
                          cfg.train.adv_estimator)
        evaluation = ctrl.eval_result()                                   # a round that finished meanwhile
        final = step + 1 == cfg.steps or 0 < cfg.time_limit_min * 60 < time.monotonic() - t_train
        if held_out and final:                                            # the final weights, always
            if earlier := evaluation or await ctrl.finish_eval():          # (a round still in flight first)
                print0(eval_line(earlier))
            await ctrl.start_eval(held_out, cfg.data.eval_k)
            evaluation = await ctrl.finish_eval()
        elif held_out and ctrl.version % cfg.eval_every == 0:
            await ctrl.start_eval(held_out, cfg.data.eval_k)               # held-out accuracy of this version
        log.step(step + 1, ctrl.version, {**s.info, **evaluation}, s.metrics, s.sync, s.train_s,
                 time.monotonic() - t0)
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or final:
            # data position: problems drawn so far; those admitted but not yet trained are kept apart
            ranks.save({"step": step + 1, "version": ctrl.version, "config": dataclasses.asdict(cfg),
                        "data_position": data_pos + ctrl.groups_drawn,
                        "in_flight": [dataclasses.asdict(p) for p in ctrl.in_flight_problems()],
                        "long_queue": [dataclasses.asdict(p) for p in ctrl.long_queue_problems()]})
        if final:
            break                                                         # (--time-limit-min: early)
    last = await ctrl.finish_sync()                                        # the last sync's acks
    ranks_stats = await ctrl.stop()
    stats = {"controller": ctrl.counters(), "rollout_ranks": [
        {**{k: v for k, v in r.items() if k != "proxy"}, "engine_in_flight": r["proxy"]["in_flight"]}
        for r in ranks_stats]}
    (Path(cfg.out_dir) / "rollout_stats.json").write_text(json.dumps(stats, indent=2))
    diff = last.get("sync_probe_max_diff")
    log.finish(f"last sync (version {last['synced_version']}): {probe_verdict(diff, cfg)}"
               if diff is not None else "")


class RanksStream:
    """stream.TrainStream's backend: the trainer ranks' streaming ops, from a worker thread (rank 0's event
    loop goes on collecting meanwhile)."""

    def __init__(self, ranks: TrainerRanks, probe_due):
        self.ranks, self.probe_due = ranks, probe_due

    async def begin(self, version: int):
        await asyncio.to_thread(self.ranks.stream_begin, version)

    async def add(self, samples, advantages):
        await asyncio.to_thread(self.ranks.stream_add, samples, advantages)

    async def step(self, version: int):
        return await asyncio.to_thread(self.ranks.stream_step, self.probe_due(version + 1))


def run_trainer(cfg: Config, rank: int, device: str, group, store, model_dir: str, state, buffer_addr,
                adapter_dir: str = "", base_dir: str = ""):
    from transformers import AutoTokenizer
    timeout = cfg.controller.timeout_s
    trainer = Trainer(model_dir, cfg.train, group if cfg.train_gpus > 1 else None, device,
                      lora=cfg.lora, adapter_dir=adapter_dir, ref_dir=base_dir,     # (--kl-coef's reference)
                      temperature=cfg.rollout.temperature)              # log-probs of what the engines sample
    if state:
        trainer.load_optimizer(Path(cfg.out_dir) / "checkpoint")
        trainer.num_steps = state["step"]
    if cfg.weight_transport == "ipc":         # the engines start once the trainers hold their models
        collective("the trainer ranks' models built, before the engines start", dist.barrier)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    attempt = f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"    # (as init_distributed's)
    # followers wait for rank 0's next op on the store, not in a collective: a step may outlast --timeout-s
    ranks = TrainerRanks(trainer, cfg.train_gpus, group, cfg.out_dir, model_dir, tokenizer.encode(PROBE_TEXT),
                         store=dist.PrefixStore(f"{attempt}/trainer-ranks", store), timeout_s=timeout)
    ranks.release_after_train = cfg.colocate
    # the weights: rank 0 broadcasts over a group that meets on the default group's store; or (ipc) every
    # rank hands its own engine the buckets through that store. Engines receive in their own dtype
    where = dict(host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), store=store,
                 prefix=attempt, device=device, timeout_s=timeout, bucket_bytes=cfg.bucket_mb << 20)
    if cfg.weight_transport == "ipc":
        ranks.sender = IpcSender(**where, engine=rank, rank=rank)
    elif rank == 0:
        ranks.sender = Sender(**where, backend="nccl" if device.startswith("cuda") else "gloo")
    if rank != 0:
        gc.freeze()          # start-up's objects out of the collector's sight (run_rollout says why)
        return ranks.follow()

    buffer = SampleBuffer(ManagerQueues.serve(*buffer_addr, cfg.rollout_gpus, bind=queue_bind()),
                          "trainer rank 0", timeout)
    problems, make, held_out = cfg.data.sources(cfg.train.seed, evaluate=cfg.eval_every > 0)
    stream = problem_stream(problems, cfg.train.seed, state["data_position"] if state else 0, make=make)
    fmt = PromptFormat(tokenizer, cfg.rollout.chat_template)      # as the rollout ranks render prompts
    ctrl = AsyncController(cfg.controller, buffer, stream, cfg.rollout_gpus,
                           version=state["version"] if state else 0,
                           prompt_len=lambda p: len(fmt.first(p.prompt)),
                           max_model_len=cfg.rollout.max_model_len, log=print0)
    if state:      # prompts admitted but not trained when the checkpoint was written: first in line again
        ctrl.readmit.extend(Problem(**p) for p in state.get("in_flight", []))
        long_queue = [Problem(**p) for p in state.get("long_queue", [])]
        if ctrl.tb is not None:                         # --tail-batching: its long-prompt queue, as it was
            ctrl.tb.long_queue.extend(long_queue)
        else:                                           # (resumed without it: they are prompts in flight)
            ctrl.readmit.extend(long_queue)
    log = RunLog(cfg, state["step"] if state else 0)
    ctrl.events = log.events                  # the timeline: steps, sync phases, the ranks' requests
    meta = weight_meta(trainer.named_weights(), cfg.rollout.dtype)
    send = functools.partial(ranks.send_weights, meta=meta)
    gc.freeze()              # (as run_rollout's: 2 full collections of ~0.3 s in 40 default steps)
    try:
        asyncio.run(rl_loop(cfg, ctrl, ranks, log, send, meta, ranks.sender.spec(0, cfg.rollout_gpus),
                            held_out, state))
    finally:
        log.close()
        ranks.stop()
        buffer.close()


def run_rollout(cfg: Config, rank: int, device: str, model_dir: str, state, buffer_addr,
                engine_core: str = "", adapter_dir: str = ""):
    from transformers import AutoTokenizer
    index = rank - cfg.train_gpus                      # rollout rank index: its command queue
    who, rc, timeout = f"rollout rank {index} (global {rank})", cfg.rollout, cfg.controller.timeout_s
    startup = cfg.controller.startup_timeout_s
    if cfg.weight_transport == "ipc":      # (before the queues: trainer rank 0 serves them after this)
        collective("the trainer ranks' models built, before the engines start", dist.barrier)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = tokenizer.encode(PROBE_TEXT)
    events = RankEvents(index) if cfg.max_events > 0 else None     # the timeline, sent to rank 0 in the acks
    if device.startswith("cuda"):     # GPU: the engine's processes see only this rank's GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpu(int(os.environ.get("LOCAL_RANK", 0)),
                                                        os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                        torch.cuda.device_count())
    engine = dict(seed=cfg.train.seed + index, cpu_cores=engine_core, max_num_seqs=rc.max_concurrency,
                  max_model_len=rc.max_model_len, dtype=rc.dtype, kv_cache_gib=rc.kv_cache_gib,
                  gpu_memory_utilization=(engine_memory_share(cfg, model_dir, who) if device != "cpu"
                                          else 0.85),
                  use_tqdm_on_load=cfg.verbose,
                  sleep_mode=cfg.colocate, lora=cfg.lora, adapter_dir=adapter_dir,
                  enforce_eager=True if rc.enforce_eager or device == "cpu" else None)

    async def restart_engine():   # after an engine failure (EnvManager._recover): a fresh one, same settings
        print(f"{who}: the engine failed; starting a new one", flush=True)
        return await VLLMEngine.start_async(model_dir, startup, who, **engine)

    async def main():
        t = time.time()
        # the engine first: it starts while the trainer ranks build their models; trainer rank 0 serves
        # the queues once it holds its model, so the connect after this may wait for that
        proxy = await LLMProxy.start_vllm(model_dir, rank=index, timeout_s=timeout, startup_timeout_s=startup,
                                          **engine)
        proxy.version = state["version"] if state else 0
        try:
            try:
                queues = await asyncio.to_thread(ManagerQueues.connect, *buffer_addr, cfg.rollout_gpus,
                                                 startup, who)
            except TimeoutError as e:
                raise TimeoutError(f"{e}; the wait is --startup-timeout-s") from None
            buffer = SampleBuffer(queues, who, timeout)
            # warm-up: the first request pays one-off costs
            await proxy.generate(probe, Sampling(max_tokens=2))
            # torch, transformers and vLLM leave ~600k objects that live as long as the process, and
            # every full collection walks them all (~0.3 s each: measured 8 in 40 default steps, a
            # quarter of this rank's CPU); frozen, the collector walks only what the run makes
            gc.freeze()
            if events is not None:
                events.phase("engine_start", t, time.time(), proxy.version)
                proxy.events = events
            await EnvManager(proxy, buffer, tokenizer, index, rc, async_ratio=cfg.controller.async_ratio,
                             sync_timeout_s=timeout, probe_ids=probe,
                             env_wrappers=cfg.faults.wrapper(cfg.train.seed * 1000 + index),
                             restart_engine=restart_engine).run()
        finally:
            proxy.shutdown()

    asyncio.run(main())


def engine_memory_share(cfg: Config, model_dir: str, who: str) -> float:
    """GPU: the engine's --gpu-memory-utilization. Unless given: 0.85 of its own GPU; under --colocate
    what is free now (the trainer rank on this GPU holds its model: run_trainer's barrier) less what
    that rank adds while the engine is awake (memplan.colocated_headroom), as a share of the GPU."""
    if cfg.rollout.gpu_memory_utilization or not cfg.colocate:
        return cfg.rollout.gpu_memory_utilization or 0.85
    import memplan
    from transformers import AutoConfig
    free, total = torch.cuda.mem_get_info()
    fixed = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.85))
    plan = memplan.make_plan(AutoConfig.from_pretrained(model_dir), fixed, gpu=True, gpu_gib=total / 2**30)
    try:
        headroom = memplan.colocated_headroom(plan.trainer, cfg.bucket_mb << 20)
        share = memplan.colocated_share(total, free, headroom, plan.engine["weights"])
    except ValueError as e:
        raise SystemExit(f"train.py: {who}: {e}") from None
    print(f"{who}: --colocate: the engine takes {share:.3f} of the GPU ({free / 2**30:.1f} of "
          f"{total / 2**30:.1f} GiB free at its start)", flush=True)
    return share


# ---------------------------------------------------------------------------------------------
# distributed init / cleanup, from torchrun's environment


def rank_places(world: int, local_world: int, visible: str | None, count: int) -> list[tuple[int, str]]:
    """(node, GPU) of every global rank from torchrun's environment alone: rank r is local rank
    r % local_world on node r // local_world (torchrun starts as many ranks on every node) and takes
    the GPU init_distributed and run_rollout give that local rank (vllm_engine.engine_gpu)."""
    return [(r // local_world, engine_gpu(r % local_world, visible, count)) for r in range(world)]


def layout_errors(places: list[tuple[int, str]], train: int, transport: str, cuda: bool) -> list[str]:
    """What is wrong with this layout, before any group forms: an NCCL group (GPU: the trainer group;
    the weight-sync group, trainer rank 0 and every engine) holding two ranks of one GPU, which NCCL
    refuses; an ipc pair (trainer rank i, rollout rank i) not on one GPU (CPU: one node)."""
    def name(r: int) -> str:
        return f"trainer rank {r}" if r < train else f"rollout rank {r - train} (global rank {r})"

    def where(r: int) -> str:
        return f"node {places[r][0]}'s GPU {places[r][1]}" if cuda else f"node {places[r][0]}"
    errors = []
    groups = {"the trainer group (FSDP)": range(train)}
    if transport == "group":
        groups["the weight-sync group"] = [0, *range(train, len(places))]
    for group, members in groups.items():
        seen: dict = {}
        for r in members:
            if cuda and places[r] in seen:
                errors.append(f"{group} would hold {name(seen[places[r]])} and {name(r)}, both on "
                              f"{where(r)}: NCCL refuses two ranks of one GPU")
            seen.setdefault(places[r], r)
    if transport == "ipc":
        for i, j in zip(range(train), range(train, len(places))):
            if (places[i] if cuda else places[i][0]) != (places[j] if cuda else places[j][0]):
                errors.append(f"the ipc transport pairs {name(i)} ({where(i)}) with {name(j)} ({where(j)}): "
                              + ("CUDA IPC needs both on one GPU (--colocate)" if cuda
                                 else "shared memory needs both on one node"))
    return errors


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
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    errors = layout_errors(rank_places(world, local_world, os.environ.get("CUDA_VISIBLE_DEVICES"),
                                       torch.cuda.device_count() if cuda else 1),
                           cfg.train_gpus, cfg.weight_transport, cuda)
    if errors:
        sys.exit("train.py: this layout cannot run (torchrun's ranks on their GPUs, before any group "
                 "forms):\n  " + "\n  ".join(errors))
    if cuda:      # this rank's GPU; under --colocate a trainer rank and a rollout rank share one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    elif cfg.colocate:
        sys.exit("train.py: --colocate needs GPUs: vLLM's sleep mode, which frees an engine's memory while "
                 "the trainer trains on the same GPU, is CUDA-only")
    # long: start-up collectives wait for rank 0 to build the tiny model, or (ipc) the trainers' models
    long = timedelta(seconds=max(cfg.controller.timeout_s, cfg.controller.startup_timeout_s))
    # The default group's store, under a prefix per torchrun restart: torchrun's static rendezvous keeps
    # one store for every restart, and a restarted rank would read the address its killed predecessor left.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"     # torchrun's agent hosts the store
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=not agent and rank == 0,
        timeout=long))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=long)
    trainer_group = dist.new_group(list(range(cfg.train_gpus)),
                                   timeout=timedelta(seconds=cfg.controller.timeout_s),
                                   backend="nccl" if cuda else "gloo")
    # explicit: worker threads default to cuda:0
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    engine_core = ""
    if not cuda:   # CPU: trainer rank t on host core t (one thread); rollout ranks share the host cores
        host, engines = cpu_layout(sorted(os.sched_getaffinity(0)), cfg.rollout_gpus)
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {host[rank % len(host)]} if rank < cfg.train_gpus else set(host))
        engine_core = str(engines[(rank - cfg.train_gpus) % len(engines)]) if rank >= cfg.train_gpus else ""
    # the default group's TCPStore: the weight-sync group meets there, and the trainer ranks' mailboxes
    return rank, world, device, engine_core, trainer_group, store.underlying_store


def memory_plan(cfg: Config, model_dir: str, gpu: bool) -> str:
    """memplan.py's plan for this model (model_dir's config; none: the embedded one's) and layout."""
    import memplan
    import tiny_model
    from transformers import AutoConfig
    tiny = tiny_model.CALC if cfg.controller.env == "calc" else tiny_model.TinyConfig()
    hf = AutoConfig.from_pretrained(model_dir) if model_dir else tiny_model.hf_config(tiny)
    gib = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
           if gpu and torch.cuda.is_available() else None)
    name = Path(model_dir).name or "the embedded model"
    return memplan.format_plan(memplan.make_plan(hf, cfg, gpu, name, gib))


def queue_bind() -> str | None:
    """Where trainer rank 0's queue server listens: on one node, MASTER_ADDR (loopback stays loopback);
    across nodes every interface, because under torchrun's c10d rendezvous MASTER_ADDR is node 0's
    name, which node 0 itself may resolve to a loopback address (127.0.1.1 on many Ubuntu hosts and
    containers) that the other nodes cannot reach. The clients connect to MASTER_ADDR either way."""
    world = int(os.environ["WORLD_SIZE"])
    return "" if int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world else None


def export_startup_timeout(cfg: Config):
    """vLLM's own wait for its engine core (VLLM_ENGINE_READY_TIMEOUT_S, default 600 s, read once when
    vLLM's engine client is imported: so before any vLLM import) follows --startup-timeout-s, a minute
    longer: the rank's own wait fires first and names the flag."""
    os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(math.ceil(cfg.controller.startup_timeout_s) + 60)


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def main():
    cfg = parse_cli(Config, doc=__doc__)
    export_startup_timeout(cfg)
    quiet.setup(cfg.verbose)          # before vLLM or transformers load: library logs at warning level
    if cfg.dry_run:                   # the memory plan, then nothing else
        if cfg.model and not (Path(cfg.model) / "config.json").exists():
            sys.exit(f"train.py: --model {cfg.model}: no config.json (a Hugging Face model dir)")
        gpu = cfg.dry_run == "gpu" or (cfg.dry_run == "auto" and torch.cuda.is_available())
        try:
            return print(memory_plan(cfg, cfg.model, gpu))
        except ValueError as e:                 # (--colocate: no room left for the engine)
            sys.exit(f"train.py: {e}")
    from buffer import die_with_parent
    die_with_parent()                 # a rank ends with torchrun, even if torchrun is SIGKILLed
    state = check_run_dir(cfg.out_dir, cfg.resume, cfg.overwrite, cfg.steps, cfg.train_gpus, cfg.model)
    if cfg.model and not state:       # (a resumed run loads its own checkpoint)
        check_model_dir(cfg.model)
    if cfg.data.data:
        try:
            load_dataset(cfg.data.data, cfg.data.prompt_key, cfg.data.answer_key)
        except (OSError, ValueError, ImportError) as e:
            sys.exit(f"train.py: {e}" if str(e).startswith("--data")
                     else f"train.py: --data {cfg.data.data}: {e}")
    if state and not cfg.model:     # what the checkpoint records: the model the run started from
        cfg = dataclasses.replace(cfg, model=state.get("config", {}).get("model", ""))
    saved_rank = (state or {}).get("config", {}).get("lora", {}).get("lora_rank", 0)
    if state and saved_rank != cfg.lora.lora_rank:
        sys.exit(f"train.py: --resume: the checkpoint was trained with --lora-rank {saved_rank}; resume with "
                 f"the same (got {cfg.lora.lora_rank})")
    rank, world, device, engine_core, trainer_group, store = init_distributed(cfg)
    try:
        # a resumed run starts from its checkpoint: the full model, or (LoRA) the base plus its adapter
        ckpt = str(Path(cfg.out_dir) / "checkpoint") if state else ""
        adapter_dir = ckpt if cfg.lora.lora_rank else ""
        base_dir = cfg.model          # the model the run started from (--kl-coef's reference)
        if not base_dir:     # the embedded model (--env calc: the one warm-started to call the calculator)
            import tiny_model
            out, tiny = ((tiny_model.CALC_DIR, tiny_model.CALC) if cfg.controller.env == "calc"
                         else (tiny_model.DEFAULT_DIR, tiny_model.TinyConfig()))
            if rank == 0:
                tiny_model.ensure_tiny_model(out, tiny, log=print0)
            collective("waiting for rank 0 to build the tiny model", dist.barrier)
            base_dir = str(out)
        model_dir = ckpt if ckpt and not adapter_dir else base_dir
        if not (Path(model_dir) / "config.json").exists():
            raise SystemExit(f"--model {model_dir}: not a Hugging Face model dir (no config.json)")
        if cfg.lora.lora_rank:
            try:
                check_lora(cfg.lora, model_dir)
            except ValueError as e:
                raise SystemExit(f"train.py: {e}") from None
        custom_reward = bool(cfg.data.data or cfg.data.task or cfg.rollout.reward)
        cfg = dataclasses.replace(cfg, rollout=cfg.rollout.resolved(model_dir, device, not cfg.model,
                                                                    custom_reward, cfg.controller.env),
                                  train=cfg.train.resolved(device))      # precision, checkpointing
        rc = cfg.rollout
        if rank == 0:
            if state:
                trim_metrics(cfg.out_dir, state["step"])
            else:
                (Path(cfg.out_dir) / "metrics.jsonl").unlink(missing_ok=True)
            print0(f"train.py: {world} ranks = {cfg.train_gpus} trainer + {cfg.rollout_gpus} rollout, "
                   f"model {model_dir} (context {rc.max_model_len}, {rc.dtype}, "
                   f"up to {rc.max_tokens} tokens a turn), "
                   f"async ratio {cfg.controller.async_ratio}, loss {cfg.train.loss}, device {device}, "
                   f"weights: {cfg.weight_transport}"
                   + (f", resuming at step {state['step']} version {state['version']}" if state else ""))
            print0(memory_plan(cfg, model_dir, device.startswith("cuda")))
        # the queue server's address and key, shared through the default group
        addr = [(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, secrets.token_bytes(16))]
        collective("sharing the queue server's address", dist.broadcast_object_list, addr, src=0)
        if rank < cfg.train_gpus:
            run_trainer(cfg, rank, device, trainer_group, store, model_dir, state, addr[0], adapter_dir,
                        base_dir)
        else:
            run_rollout(cfg, rank, device, model_dir, state, addr[0], engine_core, adapter_dir)
        collective("final barrier", dist.barrier)
    finally:
        gc.unfreeze()        # frozen objects are collected at exit again (else triton reports leaks)
        cleanup()


if __name__ == "__main__":
    main()
