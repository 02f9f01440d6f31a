"""ext/one_process.py: `python train.py` without torchrun runs the whole system in one process and one event
loop, to step through in a debugger (docs/tour.md) and on an install without vLLM.

    python train.py --steps 40                  # the controller, one env manager and the trainer, one loop

train.py calls the `without_torchrun` hook when torchrun's environment is missing, handing over its own
module: this file composes the trainer's side and one rollout rank's side exactly as train.py's ranks do
(ranks.trainer_ranks, train.controller_side, env_manager.for_rank, train.rl_loop), over in-process queues,
with ext/torch_engine.py's plain-torch engine where a rollout rank runs vLLM, and the weights handed over in
process (--weight-transport inprocess, ext/torch_engine.py's HANDOFF).

What differs from the real run: a training step blocks the loop, so rollout waits while the trainer trains (no
overlap; the async ratio still lets rollout run ahead between steps, and versions and staleness mean what they
mean there); the weights pass in process; one engine and one trainer rank only.
"""

import asyncio
import dataclasses
import os
import sys
import time

import torch

from buffer import LocalQueues, SampleBuffer
from config import Extension, extension
from ext.torch_engine import TorchEngine
from env_manager import for_rank
from proxy import LLMProxy
from ranks import trainer_ranks

ONE_PROCESS = ("train.py: one process (no torchrun): the controller, one env manager and the trainer on one "
               "event loop, with a plain-torch engine (ext/torch_engine.py) in vLLM's place; rollout and "
               "training take turns here. The real system: bash run.sh, or torchrun --nproc-per-node 2 "
               "train.py --rollout-gpus 1 --train-gpus 1")


def one_process_config(cfg):
    """The one-process run's settings: one engine and one trainer rank, the weights handed over in process."""
    if cfg.rollout_gpus != 1 or cfg.train_gpus != 1:
        sys.exit(f"train.py: one process runs one engine and one trainer (--rollout-gpus 1 --train-gpus 1), "
                 f"not {cfg.rollout_gpus} and {cfg.train_gpus}: launch with torchrun for more, e.g.\n"
                 f"  torchrun --nproc-per-node {cfg.rollout_gpus + cfg.train_gpus} train.py --rollout-gpus "
                 f"{cfg.rollout_gpus} --train-gpus {cfg.train_gpus}")
    if cfg.weight_transport not in ("auto", "group", "inprocess"):
        sys.exit(f"train.py: one process hands the weights over in process: --weight-transport "
                 f"{cfg.weight_transport} needs torchrun")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)      # (engine and trainer take turns on one thread: torch's own threads
    return dataclasses.replace(cfg, weight_transport="inprocess")      # spin against it, many times slower)


def run(cfg, exts, extra: int, train):
    """The run, train.py's main without torchrun (train: that module)."""
    print(ONE_PROCESS, flush=True)
    if extra:
        sys.exit(f"train.py: the extensions' {extra} more engines (--teacher-gpus, ...) need torchrun: "
                 f"bash run.sh with the same flags starts them")
    cfg, state = train.checked(cfg)
    cfg = exts.update(one_process_config(cfg))
    cfg, model_dir, base_dir = train.resolved(cfg, exts, state, 0, 1, "cpu")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ranks = trainer_ranks(cfg, exts, 0, "cpu", None, model_dir, state, base_dir, tokenizer)
    buffer = SampleBuffer(LocalQueues(1), "one process", cfg.controller.timeout_s)
    ctrl, log, backend, send, layout = train.controller_side(cfg, exts, ranks, buffer, tokenizer, state)
    rc = cfg.rollout
    engine = TorchEngine.from_dir(model_dir, max_num_seqs=rc.max_concurrency, seed=cfg.train.seed,
                                  max_model_len=rc.max_model_len)
    proxy = LLMProxy(engine, rank=0, timeout_s=cfg.controller.timeout_s)
    proxy.version = state["version"] if state else 0
    exts.call("on_proxy", proxy, 0, time.time())             # (the timeline's recorder: the engine's row)
    manager = for_rank(cfg, exts, proxy, buffer, tokenizer, 0)

    async def both():
        rollout = asyncio.create_task(manager.run(), name="rollout rank 0")
        training = asyncio.create_task(train.rl_loop(cfg, exts, ctrl, ranks, log, backend, send, layout,
                                                     ranks.sender.spec(0, 1), state), name="trainer rank 0")
        done, _ = await asyncio.wait({rollout, training}, return_when=asyncio.FIRST_EXCEPTION)
        if rollout in done and rollout.exception() is not None:     # a crashed rollout side ends the run
            training.cancel()
        await asyncio.gather(training, rollout)       # (rl_loop ends by stopping the env manager)
    try:
        asyncio.run(both())
    finally:
        log.close()
        proxy.shutdown()


@extension
class OneProcess(Extension):
    """python train.py without torchrun: the whole system in one process (this module's run)."""
    name = "one_process"

    def without_torchrun(self):
        return run
