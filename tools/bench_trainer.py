"""bench_trainer.py: the trainer at scale (issue 30), measured on CPU: each case in a fresh subprocess, its
memory as the peak resident set after a reset (/proc/self/clear_refs; glibc told to return freed blocks at
once, MALLOC_MMAP_THRESHOLD_, so the resident set follows what is live), the before and after side by side.

    .venv/bin/python tiny_model.py --out-dir .cache/qwen2-103m --hidden 1024 --layers 8 --heads 16 \\
        --intermediate 2816 --sft-steps 0              # the 103M model (random weights; ~2 min, once)
    .venv/bin/python -m tools.bench_trainer logprobs   # one log-prob fwd+bwd, B 8 x T 2048, V 151,936
    .venv/bin/python -m tools.bench_trainer packing    # padded share of micro-batches, long-tail lengths
    .venv/bin/python -m tools.bench_trainer checkpointing   # 103M fwd+bwd activations, with and without
    .venv/bin/python -m tools.bench_trainer start      # 2 FSDP ranks' start-up memory, 103M
    .venv/bin/python -m tools.bench_trainer memplan    # memplan.py's plan against a measured 103M step
    .venv/bin/python -m tools.bench_trainer start --model .cache/tiny-qwen2    # a quick look, another model

logprobs: a one-layer Qwen2 (hidden 256, vocabulary 151,936, tied); today's token_logprobs (full [B, T, V]
logits and their log_softmax) against model.PolicyNet's chunks, every position selected. Today's does
not fit this machine at B 8 (~40 GB), so it runs at the smaller --old-batch sizes and its B 8 figure is
their linear extrapolation (printed as such). start: each of 2 FSDP ranks' memory over its start, today's
way (every rank loads the whole model and moves it to its device, then shards: on CPU `.to(device)` is a
no-op over lazily mapped file pages, so the copy it makes on a GPU is made explicitly) against the sharded
start; the peak of anonymous memory (what the rank allocated: on a GPU, its device memory), sampled every
millisecond, beside the whole resident set (with the safetensors pages it mapped to read them).
memplan: the plan's components against the tensors' bytes, and its total against the peak resident set
of a second train step (the first allocates AdamW's moments after its backward) over the set before the
model. Prints a table per case and the JSON it came from.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_103M = ROOT / ".cache" / "qwen2-103m"
MiB = 1 << 20



def padded_share(parts: list[list[int]], lengths: list[int]) -> float:
    """The share of the micro-batches' token slots (rows x longest) that is padding."""
    slots = sum(len(p) * max(lengths[i] for i in p) for p in parts if p)
    return 1.0 - sum(lengths) / max(slots, 1)

def _status(key: str) -> int:
    """/proc/self/status's key (VmRSS, VmHWM), bytes."""
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")      # VmHWM := VmRSS (Linux >= 4.0)


def rss() -> int:
    return _status("VmRSS")


def peak() -> int:
    return _status("VmHWM")


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon: what it allocated, not the file pages
    it mapped), sampled every millisecond by a thread while in the `with` block; .peak in bytes."""

    def __enter__(self):
        import threading
        self.peak, self.stop = _status("RssAnon"), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def model_name(model_dir) -> str:
    """How the tables name a model: 103M for the default, else its directory's name."""
    return "103M" if Path(model_dir).resolve() == MODEL_103M.resolve() else Path(model_dir).name


def model_mib(model_dir) -> float:
    """Its weights' bytes on disk (the safetensors files; float32 as built), MiB."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / MiB


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(name: str, **kw) -> dict:
    """One case in a fresh process, one thread (the machine's cores are shared); its JSON result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536"}      # blocks >= 64 KiB are mmapped, so freeing returns them
    r = subprocess.run([sys.executable, "-m", "tools.bench_trainer", "_case", name, json.dumps(kw)], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"case {name} {kw} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the cases (each runs in its own process)


def case_logprobs(batch: int, seq: int, vocab: int, mode: str, hidden: int = 256) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from model import PolicyNet, token_logprobs
    torch.manual_seed(0)
    heads = hidden // 64
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=1, num_attention_heads=heads,
                                         num_key_value_heads=heads,
                                         max_position_embeddings=seq, tie_word_embeddings=True)).float()
    ids = torch.randint(0, vocab, (batch, seq))
    attn = torch.ones_like(ids)
    base = rss()
    reset_peak()
    t0 = time.perf_counter()
    if mode == "full":             # today's token_logprobs, as it was: [B, T, V] logits, a log_softmax copy
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    else:
        logp = token_logprobs(PolicyNet(model, chunk=1024), ids, attn)
    logp.sum().backward()
    return {"peak_mib": peak() / MiB, "extra_mib": (peak() - base) / MiB, "s": time.perf_counter() - t0}


def case_checkpointing(tokens: int, seq: int, on: bool, model: str = str(MODEL_103M)) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from model import PolicyNet, token_logprobs
    model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).train()
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net = PolicyNet(model)
    ids = torch.randint(2, 60, (tokens // seq, seq))
    attn = torch.ones_like(ids)
    token_logprobs(net, ids, attn).sum().backward()          # a first pass allocates the gradients
    base = rss()
    reset_peak()
    token_logprobs(net, ids, attn).sum().backward()
    return {"activations_mib": (peak() - base) / MiB}


def _start_rank(rank: int, world: int, port: int, mode: str, out: str, model_dir: str):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import trainer
    base, anon = rss(), _status("RssAnon")
    reset_peak()
    with AnonPeak() as sampled:
        if mode == "full":    # today's start: the whole model onto this rank's device, then sharded
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            for p in model.parameters():     # what .to(cuda) does; on CPU .to() leaves lazily mapped pages
                p.data = p.data.clone()
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            model = trainer.Trainer(model_dir, trainer.TrainConfig(), dist.group.WORLD).model
    local = sum(p.to_local().nbytes for p in model.parameters())
    Path(f"{out}.{rank}").write_text(json.dumps({
        "anon_peak_mib": (sampled.peak - anon) / MiB, "rss_peak_mib": (peak() - base) / MiB,
        "shard_mib": local / MiB, "after_mib": (rss() - base) / MiB}))
    dist.barrier()
    dist.destroy_process_group()


def case_start(mode: str, model: str = str(MODEL_103M)) -> dict:
    import tempfile

    import torch.multiprocessing as mp
    out = tempfile.mktemp()
    mp.spawn(_start_rank, args=(2, free_port(), mode, out, model), nprocs=2)
    return {f"rank{r}": json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)}


def _memplan_rank(rank: int, world: int, port: int, rows: int, seq: int, out: str, model_dir: str):
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (imported before the baseline)

    import trainer
    from buffer import Sample
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    samples = [Sample(f"t{i}", f"g{i}", torch.randint(2, 60, (16,)).tolist(),
                      torch.randint(2, 60, (seq - 16,)).tolist(), [-1.0] * (seq - 16), [1] * (seq - 16),
                      [0] * (seq - 16), 1.0) for i in range(rows)]
    cfg = trainer.TrainConfig(max_tokens_per_micro=rows * seq)
    base = rss()
    tr = trainer.Trainer(model_dir, cfg, dist.group.WORLD if world > 1 else None)
    adv = [1.0, -1.0] * (rows // 2)
    tr.train_step(samples, adv)          # the first step allocates the moments, after its backward
    reset_peak()
    tr.train_step(samples, adv)
    weights = sum(getattr(p, "_local_tensor", p).nbytes for p in tr.model.parameters())
    grads = sum(getattr(p.grad, "_local_tensor", p.grad).nbytes for p in tr.model.parameters())
    result = {"weights": weights, "gradients": grads,
              "AdamW moments": tr.memory()["optimizer_state_mb"] * 1e6, "total_peak": peak() - base}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def case_memplan(ranks: int, rows: int, seq: int, model: str = str(MODEL_103M)) -> dict:
    import tempfile

    import torch.multiprocessing as mp
    out = tempfile.mktemp()
    if ranks == 1:
        _memplan_rank(0, 1, 0, rows, seq, out, model)
    else:
        mp.spawn(_memplan_rank, args=(ranks, free_port(), rows, seq, out, model), nprocs=ranks)
    return json.loads(Path(f"{out}.0").read_text())


# ---------------------------------------------------------------------------------------------
# the comparisons


def logprobs(args) -> dict:
    res = {"full": {b: run_case("logprobs", batch=b, seq=args.seq, vocab=args.vocab, mode="full")
                    for b in args.old_batch},
           "chunked": {b: run_case("logprobs", batch=b, seq=args.seq, vocab=args.vocab, mode="chunked")
                       for b in args.batch}}
    print(f"| B x T (V {args.vocab:,}) | today: peak RSS (extra) | chunked: peak RSS (extra) | ratio |")
    print("|---|---|---|---|")
    old = res["full"]
    b0, b1 = min(old), max(old)
    for b in sorted(set(args.batch) | set(args.old_batch)):
        new = res["chunked"].get(b)
        if b in old:
            o, how = old[b], ""
        else:     # linear in B from the two smallest measured (the logits are B x T x V)
            slope = (old[b1]["peak_mib"] - old[b0]["peak_mib"]) / max(b1 - b0, 1)
            o = {"peak_mib": old[b1]["peak_mib"] + slope * (b - b1),
                 "extra_mib": old[b1]["extra_mib"] + slope * (b - b1)}
            how = " (extrapolated)"
        cell = (f"{new['peak_mib']:,.0f} MiB ({new['extra_mib']:,.0f})" if new else "-")
        ratio = f"{o['peak_mib'] / new['peak_mib']:.1f}x" if new else "-"
        print(f"| {b} x {args.seq} | {o['peak_mib']:,.0f} MiB ({o['extra_mib']:,.0f}){how} | {cell} "
              f"| {ratio} |")
    return res


def packing(args) -> dict:
    import random

    from model import pack_by_tokens, split
    rng = random.Random(0)
    # prompt ~300 tokens + a lognormal response (median 1k, a long tail up to the 32k context)
    lengths = [min(32768, 300 + int(rng.lognormvariate(7.0, 1.2))) for _ in range(args.samples)]
    old = split(list(range(len(lengths))), -(-len(lengths) // args.micro_batch))
    new = pack_by_tokens(lengths, args.max_tokens)
    res = {}
    print(f"{len(lengths)} samples, lengths lognormal: median {sorted(lengths)[len(lengths) // 2]:,}, "
          f"max {max(lengths):,}, {sum(lengths):,} tokens")
    print("| micro-batches | count | padded share | largest (rows x longest) |")
    print("|---|---|---|---|")
    for name, parts in ((f"--micro-batch {args.micro_batch}", old),
                        (f"--max-tokens-per-micro {args.max_tokens}", new)):
        largest = max(len(p) * max(lengths[i] for i in p) for p in parts)
        res[name] = {"count": len(parts), "padded_share": padded_share(parts, lengths), "largest": largest}
        print(f"| {name} | {len(parts)} | {res[name]['padded_share']:.1%} | {largest:,} tokens |")
    return res


def checkpointing(args) -> dict:
    res = {on: run_case("checkpointing", tokens=args.tokens, seq=args.seq, on=on, model=args.model)
           for on in (False, True)}
    off, on = res[False]["activations_mib"], res[True]["activations_mib"]
    less = f"{off / on:.1f}x less" if on > 0 else "none measured"       # (a small model's may round to 0)
    print(f"{model_name(args.model)} model, {args.tokens:,} tokens ({args.tokens // args.seq} x {args.seq}), "
          f"fp32, one fwd+bwd: activations {off:,.0f} MiB without checkpointing, {on:,.0f} MiB with: {less}")
    return res


def start(args) -> dict:
    res = {mode: run_case("start", mode=mode, model=args.model) for mode in ("full", "sharded")}
    print(f"| start-up, {model_name(args.model)} (fp32 {model_mib(args.model):,.0f} MiB), 2 ranks | peak "
          "allocated, rank 0 / 1 | peak RSS (+ mapped file), rank 0 / 1 | each rank's shard |")
    print("|---|---|---|---|")
    for mode, label in (("full", "today: whole model to the device, then shard"),
                        ("sharded", "meta, shard, read own shards")):
        r0, r1 = res[mode]["rank0"], res[mode]["rank1"]
        print(f"| {label} | {r0['anon_peak_mib']:,.0f} / {r1['anon_peak_mib']:,.0f} MiB | "
              f"{r0['rss_peak_mib']:,.0f} / {r1['rss_peak_mib']:,.0f} MiB | {r0['shard_mib']:,.0f} MiB |")
    return res


def memplan_check(args) -> dict:
    from dataclasses import replace

    from transformers import AutoConfig

    from ext import memplan
    import train
    hf = AutoConfig.from_pretrained(args.model)
    out = {}
    for ranks in args.ranks:
        got = run_case("memplan", ranks=ranks, rows=args.rows, seq=args.seq, model=args.model)
        cfg = train.Config(train_gpus=ranks)
        cfg = replace(cfg, train=replace(cfg.train, max_tokens_per_micro=args.rows * args.seq))
        plan = memplan.make_plan(hf, cfg, gpu=False, model=model_name(args.model))
        t = plan.trainer
        rows = [("weights", t["weights (fp32 masters)"], got["weights"]),
                ("gradients", t["gradients"], got["gradients"]),
                ("AdamW moments", t["AdamW moments"], got["AdamW moments"]),
                ("total (peak of a step)", sum(t.values()), got["total_peak"])]
        counted = ("weights (fp32 masters)", "gradients", "AdamW moments")
        print(f"\n{ranks} trainer rank(s), {model_name(args.model)} fp32, {args.rows} x {args.seq} tokens a "
              f"micro-batch; the plan's other parts: "
              + ", ".join(f"{k} {v / MiB:,.0f} MiB" for k, v in t.items() if k not in counted))
        print("| component | plan | measured | plan / measured |")
        print("|---|---|---|---|")
        for name, p, m in rows:
            print(f"| {name} | {p / MiB:,.0f} MiB | {m / MiB:,.0f} MiB | {p / m:.2f} |")
        out[ranks] = {"plan": t, "measured": got}
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_case":
        fn = globals()[f"case_{argv[1]}"]
        print(json.dumps(fn(**json.loads(argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("logprobs")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--old-batch", type=int, nargs="+", default=[1, 2], help="today's way (B 8 needs ~40 GB)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151_936)
    p = sub.add_parser("packing")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32768)
    p = sub.add_parser("checkpointing")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    sub.add_parser("start")
    p = sub.add_parser("memplan")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    for name in ("checkpointing", "start", "memplan"):     # the cases that load a model
        sub.choices[name].add_argument("--model", default=str(MODEL_103M),
                                       help="the model dir (default: the 103M model; a small one: quick)")
    args = ap.parse_args(argv)
    if args.cmd not in ("packing", "logprobs") and not (Path(args.model) / "config.json").exists():
        sys.exit(f"bench_trainer: {args.model} missing: build it first (see --help)")
    res = {"logprobs": logprobs, "packing": packing, "checkpointing": checkpointing, "start": start,
           "memplan": memplan_check}[args.cmd](args)
    print(json.dumps(res, default=str))
    return res


if __name__ == "__main__":
    main()
