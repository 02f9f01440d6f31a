"""ext/served.py: a model in the loop, served by ranks of its own: what a distillation teacher
(ext/distill.py) and an LLM judge (ext/judge.py) run on. Not a flag: the library those two extensions share.

An extension with K served ranks (Extension.extra_ranks, after the rollout ranks) runs serve() on each: a vLLM
engine of its model (never a weight sync), which answers every rollout rank's requests:

    ("score", ids, T)                  -> the log-prob of each token after the first, given the ones before,
                                          of softmax(logits / T) (vLLM's prompt log-probs; T None: 1)
    ("generate", (ids, max_tokens))    -> the greedy continuation's token ids (through its EOS)

How rollout ranks reach served ranks (the transport's named side queues, on trainer rank 0's queue server):
one shared request queue NAME that every idle served rank pulls from, so the load balances itself (least
loaded, no assignment to keep; a served rank that dies leaves the others to answer), a reply queue NAME<r> per
rollout rank r, and NAME_ready<r>, where each served rank announces (index, its context) once its engine is
up. A request whose answer does not come within the caller's timeout fails its sample (rollout.EnvFailure:
counted, tried again with a new trajectory): a served rank that died or hangs costs those samples and a
bounded wait, never the run. Both directions go in lists, one round trip per tick each.
"""

import asyncio
import os
import time

from rollout import EnvFailure

NICE = 19                    # a CPU served rank's niceness: the lowest priority
POLL_S = (0.002, 0.008)      # an empty queue is polled after 2 ms, then ever less often, up to 8 ms


async def _call(transport, fn, *args):
    """A named queue's call: off the loop where it is a round trip to the queue server."""
    return await asyncio.to_thread(fn, *args) if transport.round_trips else fn(*args)


class ServedClient:
    """A rollout rank's side: requests to NAME's served ranks, answers back to the callers awaiting them. One
    task per rank (the pump) sends the requests made since its last tick and wakes the callers answered."""

    def __init__(self, transport, rank: int, name: str, num_ranks: int, startup_s: float):
        self.transport, self.rank, self.name = transport, rank, name
        self.num_ranks, self.startup_s = num_ranks, startup_s
        self.requests, self.replies = transport.named(name), transport.named(f"{name}{rank}")
        self.waiting: dict[str, asyncio.Future] = {}
        self.outbox: list = []                   # requests not sent yet
        self.pump: asyncio.Task | None = None
        self.context = 0                         # the served ranks' context (tokens), once they are up
        self.up: asyncio.Task | None = None      # waiting for them
        self.sent = 0

    async def _ready(self):
        """Wait for every served rank's engine (its start takes as long as a rollout rank's)."""
        ready, got = self.transport.named(f"{self.name}_ready{self.rank}"), []
        deadline = time.monotonic() + self.startup_s
        while len(got) < self.num_ranks:
            got += await _call(self.transport, ready.get_many, self.num_ranks)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout rank {self.rank}: {len(got)} of {self.num_ranks} {self.name} "
                                   f"ranks up within {self.startup_s:.0f}s (--startup-timeout-s)")
            await asyncio.sleep(0 if len(got) == self.num_ranks else 0.5)
        self.context = min(c for _, c in got)

    async def _pump(self):
        wait = POLL_S[0]
        while True:
            if self.outbox:
                out, self.outbox = self.outbox, []
                await _call(self.transport, self.requests.put_many, out)
            got = await _call(self.transport, self.replies.get_many, 1024)
            for rid, answer in got:
                fut = self.waiting.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
            wait = POLL_S[0] if got or self.outbox else min(2 * wait, POLL_S[1])
            await asyncio.sleep(0 if got else wait)

    async def start(self):
        """Wait for the served ranks (the first caller starts the wait; the others wait with it)."""
        if self.up is None:
            self.up = asyncio.get_running_loop().create_task(self._ready())
        await asyncio.shield(self.up)
        if self.pump is None or self.pump.done():
            self.pump = asyncio.get_running_loop().create_task(self._pump())

    async def ask(self, op: str, ids: list[int], arg, timeout_s: float, where: str, flag: str):
        """One request's answer; EnvFailure (named by `where`) when it is too long for the served model's
        context, does not come within timeout_s (the caller's `flag`), or the served rank failed it."""
        await self.start()
        if len(ids) > self.context:
            raise EnvFailure(f"{where}: the sample's {len(ids)} tokens exceed the {self.name}'s context "
                             f"({self.context})")
        self.sent += 1
        rid = f"{self.rank}.{self.sent}"
        fut = self.waiting[rid] = asyncio.get_running_loop().create_future()
        self.outbox.append((self.rank, rid, op, ids, arg))        # (the pump sends it with the others)
        try:
            async with asyncio.timeout(timeout_s):
                answer = await fut
        except TimeoutError:
            raise EnvFailure(f"{where}: no answer within {timeout_s:.0f}s ({flag}): a {self.name} rank dead "
                             f"or overloaded?", timeout=True) from None
        finally:
            self.waiting.pop(rid, None)
        if isinstance(answer, str):
            raise EnvFailure(f"{where}: {answer}")
        return answer


async def answer_request(proxy, op: str, ids: list[int], arg, context: int, request_id: str, who: str):
    """One request's answer from a served rank's engine (the module docstring's ops), or the failure named."""
    from proxy import Sampling
    try:
        if op == "score":           # (arg: the temperature; at another than 1, vllm_engine's score says how)
            return await (proxy.score(ids) if arg in (None, 1) else proxy.engine.score(list(ids), arg))
        greedy = Sampling(max_tokens=max(1, min(arg, context - len(ids))), temperature=0.0)
        return (await proxy.generate(ids, greedy, request_id=request_id)).token_ids   # at most arg tokens
    except Exception as e:     # (a request's own failure, named; an engine that died fails them all)
        return f"{who}: {e!r}"[:500]


async def serve(cfg, model_dir: str, name: str, index: int, device: str, engine_core: str,
                buffer_addr: tuple):
    """A served rank: its engine up, then every request it takes answered (concurrent requests batch in the
    engine), until a stop (None on the request queue) or the queue server's end."""
    from buffer import ManagerQueues
    from proxy import LLMProxy
    who, rc = f"{name} rank {index}", cfg.rollout
    if device == "cpu":
        # its engine runs on the last of the host cores, which ranks.init_distributed leaves this rank, not on
        # a rollout engine's core: two vLLM engines on one core starve each other, each worker spinning
        # between requests (measured: DESIGN.md, "A model in the loop"). It shares that core with a trainer,
        # so the lowest priority (inherited by the engine's processes) leaves the core to training; the
        # served model's latency costs no generation (a sample waiting for it frees its slot)
        engine_core = str(max(os.sched_getaffinity(0)))
        os.nice(NICE)
    proxy = await LLMProxy.start_vllm(model_dir, rank=index, timeout_s=cfg.controller.timeout_s,
                                      startup_timeout_s=cfg.controller.startup_timeout_s,
                                      cpu_cores=engine_core, max_num_seqs=rc.max_concurrency, dtype=rc.dtype,
                                      enforce_eager=True if device == "cpu" else None,
                                      seed=cfg.train.seed + 1000 + index)
    try:
        queues = await asyncio.to_thread(ManagerQueues.connect, *buffer_addr, cfg.rollout_gpus,
                                         cfg.controller.startup_timeout_s, who)
        context = proxy.engine.llm.model_config.max_model_len
        for r in range(cfg.rollout_gpus):               # (each rollout rank reads its own)
            await asyncio.to_thread(queues.named(f"{name}_ready{r}").put_many, [(index, context)])
        requests, running = queues.named(name), set()
        replies = [queues.named(f"{name}{r}") for r in range(cfg.rollout_gpus)]
        answers: list[list] = [[] for _ in replies]      # per rollout rank, answered and not sent yet

        async def answer(rank: int, rid: str, op: str, ids: list[int], arg):
            out = await answer_request(proxy, op, ids, arg, context, f"{name}-{rid}", who)
            answers[rank].append((rid, out))     # (after the await: the list to send may be a new one now)
        wait = POLL_S[0]
        while True:
            try:
                for rank, out in enumerate(answers):      # each tick: every answer so far, a list a rank
                    if out:
                        answers[rank] = []
                        await asyncio.to_thread(replies[rank].put_many, out)
                got = await asyncio.to_thread(requests.get_many, 1024)
            except (EOFError, ConnectionError):      # the queue server is gone: trainer rank 0's run ended
                break                                # (a crash there is named at the final barrier)
            if None in got:            # the run ended (rank 0 puts one stop per served rank)
                break
            for rank, rid, op, ids, arg in got:
                task = asyncio.get_running_loop().create_task(answer(rank, rid, op, ids, arg))
                running.add(task)
                task.add_done_callback(running.discard)
            wait = POLL_S[0] if got or running else min(2 * wait, POLL_S[1])
            await asyncio.sleep(0 if got else wait)
    finally:
        proxy.shutdown()


_CLIENTS: dict[tuple, ServedClient] = {}


def client(transport, rank: int, name: str, num_ranks: int, startup_s: float) -> ServedClient:
    """Rollout rank `rank`'s client of NAME's served ranks: one a process and name, shared by every extension
    that asks them (a judge on the teacher's ranks shares the teacher's), since the answers come back on one
    queue a rank."""
    key = (id(transport), rank, name)
    if key not in _CLIENTS:
        _CLIENTS[key] = ServedClient(transport, rank, name, num_ranks, startup_s)
    return _CLIENTS[key]


def run_rank(cfg, model_dir: str, name: str, index: int, device: str, engine_core: str, buffer_addr: tuple):
    """Extension.run_extra_rank for a served model."""
    from ranks import pin_engine_gpu
    pin_engine_gpu(device)           # GPU: the engine sees only this rank's GPU
    asyncio.run(serve(cfg, model_dir, name, index, device, engine_core, buffer_addr))


def stop(ctrl, name: str, num_ranks: int):
    """The run ended: one stop per served rank, on their queue (they then join the final barrier)."""
    ctrl.buffer.transport.named(name).put_many([None] * num_ranks)


def check_model_dir(flag: str, path: str, built_by: str = ""):
    from pathlib import Path
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"{flag} {path}: not a Hugging Face model dir (no config.json)"
                         + (f" ({built_by} builds it)" if built_by else ""))


# the fields of a model's config.json that bound its context (vLLM reads the same ones)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
               "max_sequence_length", "max_seq_length", "seq_len")


def served_context(model_dir: str) -> int:
    """The context (tokens) a served rank's engine gets for model_dir (serve() leaves vLLM's default), as
    vLLM derives it from config.json: model_max_length, else the least of LENGTH_KEYS (none: 2048), times the
    factor of a RoPE scaling that stretches positions (linear, dynamic). Read at start-up, before any engine
    exists."""
    import json
    from pathlib import Path
    c = json.loads((Path(model_dir) / "config.json").read_text())
    c = c.get("text_config") or c
    n = c.get("model_max_length") or min((c[k] for k in LENGTH_KEYS if c.get(k)), default=2048)
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) in ("linear", "dynamic"):
        n *= rope.get("factor") or 1
    return int(n)


def drawn_problems(cfg, n: int = 1000) -> tuple[list, str]:
    """(problems, what they are): what training may send a served model, for a start-up bound on its
    requests: every row of --data, else n problems drawn as training draws them (the extensions' generator,
    --task, and a workload's lengths)."""
    import random
    from config import EXTENSIONS, Extension, Extensions
    hooks = ("problem_maker", "problem_source")          # (only the extensions that shape the problems)
    exts = [c(cfg, cfg.ext.get(name)) for name, c in EXTENSIONS.items() if c.wanted(cfg.ext.get(name))
            and any(getattr(c, h, None) is not getattr(Extension, h, None) for h in hooks)]
    problems, make, _ = cfg.data.sources(cfg.train.seed, Extensions(sorted(exts, key=lambda e: e.order)))
    if problems is not None:
        return problems, (f"--data {cfg.data.data} ({len(problems)} rows)" if cfg.data.data
                          else f"the task's {len(problems)} problems")
    rng = random.Random(cfg.train.seed)
    return [make(rng) for _ in range(n)], f"{n} drawn problems"
