"""gpu_check.py: the trainer side's GPU paths on one GPU, measured and checked in one run (under 8 minutes on
one H100 or H200), with torch, transformers, safetensors and numpy only: no vLLM, no network, no pytest.

    python -m tools.gpu_check --out results/gpu_check-h100.json   # CUDA: Qwen2 0.5B and 1.5B shapes
    python -m tools.gpu_check --tiny --out /tmp/gpu_check.json     # CPU, seconds: the same code, a tiny shape

The models are built here with random weights from Qwen2Config: Qwen2.5-0.5B's and -1.5B's shapes
(vocabulary 151,936, tied embeddings), saved in bfloat16 with a small local tokenizer. The checks, each
recorded in the JSON whether it passes or fails (one failure does not stop the others):

  build       the two model dirs
  ipc         ext/colocate.py's ipc: the 0.5B's weights from the trainer (fp32) to a worker process (spawned,
              as an
              engine's worker is) in bfloat16 through two reused buckets: CUDA IPC on a GPU (shared memory on
              CPU), bit-exact (sha256 per tensor), the embedding (272 MB) larger than a 64 MiB bucket; GB/s
  fsdp        FSDP2 on one rank (Trainer(fsdp=True): the multi-rank path on a group of one), bf16: float32
              sharded masters, bfloat16 compute, the probe against a float32 forward within bf16's probe
              tolerance, a step, save_checkpoint, a resumed trainer (weights bit-exact, optimizer loaded)
              taking the same next step as the original
  stream      the streaming trainer's step (ext/stream_trainer.py's ops on TrainerRanks) on that FSDP trainer
              over a
              group of one (NCCL on a GPU), against train_step on the same batch
  logprobs    one fwd+bwd of log-probs: model.PolicyNet's LM-head chunks against full [B, T, V] logits,
              peak memory and the values
  train_X     the one-rank trainer (bf16, checkpointing on: a GPU's defaults) on model X, two timed steps
  memplan_X   ext/memplan.trainer_bytes per component against train_X's tensors, its total against the peak
  throughput_X  train_X's tokens/s and MFU (model FLOPs over the GPU's dense bf16 peak)
  no_vllm     nothing imported vLLM (it is made unimportable here, as on the GPU image)

Memory on CUDA is the caching allocator's (max_memory_allocated over what was allocated before): the CUDA
context and the allocator's slack are not in it. On CPU (--tiny) memory is not measured: the memory
criteria apply on CUDA only; every other criterion applies in both modes. Exit status 0 iff every check
passed. The JSON is rewritten after each check, so a run cut short still leaves what it measured.
"""

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:            # (python tools/gpu_check.py as well as python -m tools.gpu_check)
    sys.path.insert(0, str(ROOT))

# Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (their public config.json); tiny: the CPU mode's
SHAPES = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1),
}
# the sizes of each mode: rows x seq tokens a batch (prompt tokens of each row), micro-batches of
# micro_tokens, the log-prob case lp_rows x lp_seq, the weight buckets
MODES = {
    "gpu": dict(models=["0.5B", "1.5B"], vocab=151_936, max_len=32768, rows=32, seq=1024, prompt=256,
                micro_tokens=16384, lp_rows=4, lp_seq=4096, bucket_bytes=64 << 20, steps=2),
    "tiny": dict(models=["tiny"], vocab=1024, max_len=256, rows=8, seq=32, prompt=8, micro_tokens=128,
                 lp_rows=2, lp_seq=64, bucket_bytes=32 << 10, steps=1),
}
# dense bfloat16 peak of one GPU, FLOP/s, by name (first match; the SXM parts last): MFU's denominator
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
             ("GH200", 989e12), ("A100", 312e12), ("L40S", 362e12), ("B200", 2250e12)]
MEMPLAN_EXACT = 0.01           # weights, gradients, AdamW moments: plan and tensors agree within 1%
MEMPLAN_PEAK = (0.9, 1.5)      # the plan's total / the measured peak: not under by > 10%, not over by > 50%
MIN_MFU = 0.05                 # below this something is wrong (a CPU fallback, a sync per kernel)


def forbid_vllm():
    """As on the GPU image: `import vllm` fails (so any trainer-side import of it shows as a failure)."""
    sys.modules["vllm"] = None


# ---------------------------------------------------------------------------------------------
# set-up


class Ctx:
    def __init__(self, mode: str, work: Path):
        import torch
        self.mode, self.m, self.work = mode, MODES[mode], work
        self.cuda = mode == "gpu"
        self.device = "cuda:0" if self.cuda else "cpu"
        self.dirs: dict[str, Path] = {}
        self.trained: dict[str, dict] = {}          # train_X's measurements, for memplan_X and throughput_X
        self.small = self.m["models"][0]
        self.torch = torch

    def model_dir(self, name: str) -> str:
        if name not in self.dirs:
            raise RuntimeError(f"no {name} model: the build check failed")
        return str(self.dirs[name])

    def group(self):
        import torch.distributed as dist
        return dist.group.WORLD

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def mem_start(self) -> int | None:
        """Start a peak measurement: the bytes allocated now (None on CPU: not measured)."""
        if not self.cuda:
            return None
        self.free()
        self.torch.cuda.reset_peak_memory_stats()
        return self.torch.cuda.memory_allocated()

    def mem_peak(self, base: int | None) -> int | None:
        return None if base is None else self.torch.cuda.max_memory_allocated() - base


def init_group(cuda: bool):
    """A process group of one (this process): NCCL on a GPU, gloo on CPU; no rendezvous, no network."""
    import torch
    import torch.distributed as dist
    if cuda:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)


def tokenizer():
    """A small character-level tokenizer (the model dirs need one: checkpoints copy it)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *"0123456789+-*/= "])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<pad>")


def batch(ctx: Ctx, seed: int, rows: int | None = None):
    """rows samples of seq tokens (prompt + response) with random ids, behaviour logprobs -log(V) (about what
    a random model gives), GRPO advantages over groups of 4."""
    import torch

    from buffer import Sample
    from losses import group_advantages
    m = ctx.m
    rows, n = rows or m["rows"], m["seq"] - m["prompt"]
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        ids = torch.randint(2, m["vocab"], (m["seq"],), generator=g).tolist()
        reward = float(torch.rand(1, generator=g) < .5)
        samples.append(Sample(f"t{i}", f"g{i // 4}", ids[:m["prompt"]], ids[m["prompt"]:],
                              [-math.log(m["vocab"])] * n, [1] * n, [0] * n, reward))
    adv = group_advantages(torch.tensor([s.reward for s in samples]), 4).tolist()
    return samples, adv


def train_config(ctx: Ctx, **kw):
    from trainer import TrainConfig
    return TrainConfig(**{"precision": "bf16", "grad_checkpointing": "on", "lr": 1e-4, "warmup_steps": 1,
                          "max_tokens_per_micro": ctx.m["micro_tokens"], **kw})


def sha(t) -> str:
    import torch
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def full_state(tr) -> dict:
    return {n: t.clone() for n, t in tr.iter_full_state()}


def grads(tr) -> dict:
    """The gradients the last optimizer step used (clipped; a step leaves them in .grad), full tensors."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float()
            for n, p in tr.model.named_parameters() if p.grad is not None}


def rel_diff(a: dict, b: dict) -> float:
    """||a - b|| / ||a|| over every tensor of two same-named sets."""
    assert a.keys() == b.keys(), "different tensors"
    num = sum((a[n].float() - b[n].float()).pow(2).sum().item() for n in a)
    den = sum(a[n].float().pow(2).sum().item() for n in a)
    return math.sqrt(num / den) if den else float("inf")


# ---------------------------------------------------------------------------------------------
# the checks: check(ctx, rec) fills rec with what it measured; an exception fails it (rec keeps the rest)


def check_build(ctx: Ctx, rec: dict):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = tokenizer()
    for name in ctx.m["models"]:
        t = time.perf_counter()
        cfg = Qwen2Config(vocab_size=ctx.m["vocab"], max_position_embeddings=ctx.m["max_len"], rope_theta=1e6,
                          rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=1,
                          pad_token_id=0, **SHAPES[name])
        torch.manual_seed(0)
        with torch.device(ctx.device):           # initialised where it lives: seconds on a GPU
            model = Qwen2ForCausalLM(cfg)
        out = ctx.work / f"qwen2-{name}"
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)   # bf16 on disk, as released
        tok.save_pretrained(out)
        rec[name] = {"params": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - t}
        del model
        ctx.dirs[name] = out
    rec["summary"] = ", ".join(f"{k} {v['params'] / 1e6:,.1f}M params" for k, v in rec.items())


def _ipc_worker(specs: list, layout, device: str, out: str):
    """An engine worker's side of the ipc transport (spawned): receive each sync, hash every tensor."""
    forbid_vllm()
    import torch

    from ext.colocate import IpcReceiver, connect
    from weight_sync import GroupSpec
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    slots, results = {}, []            # slots: the sender's buffers, opened once, kept across syncs
    for spec in specs:
        spec = GroupSpec(**spec)
        t = time.perf_counter()
        r = IpcReceiver(connect(spec), spec, 0, layout, torch.device(device), slots, "gpu_check worker")
        digests = {name: sha(tensor) for name, tensor in r.stream()}
        results.append({"digests": digests, "seconds": time.perf_counter() - t, "waited_s": r.waited})
    Path(out).write_text(json.dumps(results))


def check_ipc(ctx: Ctx, rec: dict):
    import multiprocessing
    from dataclasses import asdict

    import torch

    from trainer import Trainer
    from ext.colocate import BUFFERS, IpcSender
    from weight_sync import plan_buckets, weight_layout
    tr = Trainer(ctx.model_dir(ctx.small), train_config(ctx, precision="fp32"), None, ctx.device)
    named = tr.named_weights()
    layout = weight_layout(named, "bfloat16")
    bucket = ctx.m["bucket_bytes"]
    sizes = {n: t.numel() * 2 for n, t in named}
    largest = max(sizes, key=sizes.get)
    plan = plan_buckets(layout, bucket)
    rec.update(tensors=len(layout), bytes=sum(sizes.values()), buckets=len(plan), bucket_bytes=bucket,
               largest=largest, largest_bytes=sizes[largest])
    assert sizes[largest] > bucket, "no tensor larger than a bucket"
    assert len(plan) > BUFFERS, "too few buckets to reuse the buffers"
    want = {n: sha(t.to(torch.bfloat16)) for n, t in named}
    sender = IpcSender(device=ctx.device, timeout_s=180, bucket_bytes=bucket)
    specs = [sender.spec().with_gen(0, k) for k in (1, 2)]    # two syncs: the second reuses opened buffers
    out = ctx.work / "ipc.json"
    proc = multiprocessing.get_context("spawn").Process(
        target=_ipc_worker, args=([asdict(s) for s in specs], layout, ctx.device, str(out)))
    proc.start()
    try:
        times = []
        for spec in specs:
            ctx.sync()
            t = time.perf_counter()
            sender.send(spec, tr.iter_full_state(), layout)      # returns once the worker copied every bucket
            ctx.sync()
            times.append(time.perf_counter() - t)
        proc.join(180)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0, f"the worker exited with {proc.exitcode}"
    got = json.loads(out.read_text())
    rec.update(send_s=times, gb_per_s=rec["bytes"] / times[1] / 1e9, transport="CUDA IPC" if ctx.cuda
               else "shared memory", worker_s=[g["seconds"] for g in got])
    for k, g in enumerate(got):
        bad = [n for n in want if g["digests"].get(n) != want[n]]
        assert set(g["digests"]) == set(want) and not bad, f"sync {k + 1}: differs in {bad[:3]}"
    rec["bit_exact"] = True
    rec["summary"] = (f"{len(layout)} tensors, {rec['bytes'] / 2**20:,.0f} MiB bf16 in {len(plan)} buckets "
                      f"bit-exact ({largest} {sizes[largest] / 2**20:,.0f} MiB > bucket); "
                      f"{rec['gb_per_s']:.1f} GB/s (second sync)")


def check_fsdp(ctx: Ctx, rec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from model import causal_lm, token_logprobs
    from runlog import PROBE_TOLERANCE
    from trainer import Trainer
    path = ctx.model_dir(ctx.small)
    cfg = train_config(ctx)
    tr = Trainer(path, cfg, ctx.group(), ctx.device, fsdp=True)
    params = list(tr.model.parameters())
    rec["masters"] = sorted({str(p.dtype) for p in params})
    rec["sharded"] = all(hasattr(p, "full_tensor") for p in params)
    assert tr.fsdp and rec["sharded"] and rec["masters"] == ["torch.float32"], rec
    computed = []      # the dtype a decoder layer computes in (FSDP's mixed-precision policy: bf16)
    hook = causal_lm(tr.model).model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, args, out: computed.append(str(args[0].dtype)))
    ids = torch.randint(2, ctx.m["vocab"], (64,), generator=torch.Generator().manual_seed(1)).tolist()
    probe = torch.tensor(tr.probe_logprobs(ids))
    hook.remove()
    rec["compute_dtype"] = computed[0]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(ctx.device).eval()
    with torch.no_grad():
        x = torch.tensor([ids], device=ctx.device)
        want = token_logprobs(ref, x, torch.ones_like(x))[0, 1:].cpu()
    del ref
    rec["probe_max_diff"] = diff = (probe - want).abs().max().item()
    rec["probe_tolerance"] = PROBE_TOLERANCE["bf16"]
    assert computed[0] == "torch.bfloat16", f"computes in {computed[0]}"
    assert diff <= PROBE_TOLERANCE["bf16"], f"probe diff {diff:.3g} above bf16's {PROBE_TOLERANCE['bf16']}"
    first, second = batch(ctx, 1), batch(ctx, 2)
    tr.train_step(*first, version=0)
    out = ctx.work / "fsdp-run"
    t = time.perf_counter()
    tr.save_checkpoint(str(out), {"step": 1}, path)
    rec["save_s"] = time.perf_counter() - t
    ckpt = out / "checkpoint"
    back = Trainer(str(ckpt), cfg, ctx.group(), ctx.device, fsdp=True)
    back.load_optimizer(str(ckpt))
    back.num_steps = tr.num_steps
    before, resumed = full_state(tr), full_state(back)
    same = before.keys() == resumed.keys() and all(torch.equal(before[n], resumed[n]) for n in before)
    del resumed
    assert same, "the resumed weights differ from the saved ones"
    ma, mb = tr.train_step(*second, version=1), back.train_step(*second, version=1)
    a, b = full_state(tr), full_state(back)
    step = rel_diff({n: a[n] - before[n] for n in a}, {n: b[n] - before[n] for n in b})
    # a resume that lost AdamW's moments (or the step count, hence the LR) takes another step (relative
    # difference of order 1); the same step differs only by the kernels' nondeterminism
    rec.update(next_loss=[ma["loss"], mb["loss"]], next_step_rel_diff=step, lr=ma["lr"])
    assert math.isclose(ma["loss"], mb["loss"], rel_tol=1e-3, abs_tol=1e-5), rec["next_loss"]
    assert step < 0.05, f"the resumed step differs from the original's by {step:.3g} (relative)"
    rec["summary"] = (f"fp32 sharded masters, bf16 compute, probe diff {diff:.2g} (<= "
                      f"{rec['probe_tolerance']}), saved in {rec['save_s']:.1f}s, resumed: weights "
                      f"bit-exact, next step rel diff {step:.2g}")


def check_stream(ctx: Ctx, rec: dict):
    import torch

    from ext.stream_trainer import RanksStream
    from ranks import TrainerRanks
    from trainer import Trainer
    path = ctx.model_dir(ctx.small)
    cfg = train_config(ctx)
    whole = Trainer(path, cfg, ctx.group(), ctx.device, fsdp=True)
    streamed = Trainer(path, cfg, ctx.group(), ctx.device, fsdp=True)
    before = full_state(whole)
    samples, adv = batch(ctx, 3)
    mw = whole.train_step(samples, adv, version=0)
    stream = RanksStream(TrainerRanks(streamed, 1, ctx.group(), str(ctx.work), path, [1, 2]), lambda v: False)
    stream.begin_now(0)
    for g in range(0, len(samples), 4):                 # a group of 4 at a time, as they would arrive
        stream.add_now(samples[g:g + 4], adv[g:g + 4])
    ms, _ = stream.step_now(probe=False)
    grad = rel_diff(grads(whole), grads(streamed))
    a, b = full_state(whole), full_state(streamed)
    update = rel_diff({n: a[n] - before[n] for n in a}, {n: b[n] - before[n] for n in b})
    rec.update(backend=str(torch.distributed.get_backend(ctx.group())), loss=[mw["loss"], ms["loss"]],
               grad_norm=[mw["grad_norm"], ms["grad_norm"]], grad_rel_diff=grad, update_rel_diff=update)
    # exact in exact arithmetic (stream.py); bf16 compute over other micro-batch shapes rounds otherwise.
    # (The updates differ more: Adam's first step is about lr * sign(gradient), and near-zero gradients
    # flip sign under that rounding; recorded, not judged.)
    assert math.isclose(mw["loss"], ms["loss"], rel_tol=1e-2, abs_tol=1e-4), rec["loss"]
    assert math.isclose(mw["grad_norm"], ms["grad_norm"], rel_tol=2e-2), rec["grad_norm"]
    assert grad < 0.05, f"the streamed step's gradient differs from the whole batch's by {grad:.2g} (rel.)"
    rec["summary"] = (f"on a {rec['backend']} group of one: loss {ms['loss']:.4g} vs {mw['loss']:.4g}, "
                      f"grad norm {ms['grad_norm']:.4g} vs {mw['grad_norm']:.4g}, "
                      f"gradient rel diff {grad:.2g}")


def check_logprobs(ctx: Ctx, rec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    from ext import memplan
    from model import PolicyNet, token_logprobs
    path, m = ctx.model_dir(ctx.small), ctx.m
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(ctx.device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net = PolicyNet(model, chunk=1024, autocast=torch.bfloat16)     # the one-rank bf16 path
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, m["vocab"], (m["lp_rows"], m["lp_seq"]), generator=g).to(ctx.device)
    attn = torch.ones_like(ids)
    token_logprobs(net, ids[:1, :16], attn[:1, :16]).sum().backward()     # the gradients exist before both

    def full():
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits.float()[:, :-1], dim=-1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)

    def chunked():
        return token_logprobs(net, ids, attn)[:, 1:]

    values = {}
    for name, fn in (("chunked", chunked), ("full", full)):
        base = ctx.mem_start()
        try:
            lp = fn()
            lp.sum().backward()
        except torch.OutOfMemoryError:
            rec[name] = "out of memory"
            continue
        finally:
            model.zero_grad(set_to_none=False)
        peak = ctx.mem_peak(base)
        values[name] = lp.detach().float().cpu()
        del lp
        rec[name] = {"peak_bytes": peak}
    hf = model.config
    rec["tokens"], rec["vocab"] = m["lp_rows"] * m["lp_seq"], m["vocab"]
    rec["plan_logits_chunk_bytes"] = memplan.LOGIT_COPIES * 1024 * hf.vocab_size * 4
    assert "chunked" in values, "the chunked log-probs did not fit"
    if "full" in values:
        rec["max_abs_diff"] = diff = (values["full"] - values["chunked"]).abs().max().item()
        assert diff < 0.05, f"chunked and full log-probs differ by {diff:.3g}"
    if ctx.cuda and "full" in values:
        full_b, chunk_b = rec["full"]["peak_bytes"], rec["chunked"]["peak_bytes"]
        rec["ratio"] = full_b / chunk_b
        assert chunk_b < full_b, "the chunks took more memory than the full logits"
    peak = rec["chunked"]["peak_bytes"] if isinstance(rec["chunked"], dict) else None
    rec["summary"] = (f"{m['lp_rows']} x {m['lp_seq']} tokens, V {m['vocab']:,}: chunked "
                      + (f"{peak / 2**30:.2f} GiB" if peak is not None else "(memory: CUDA only)")
                      + (f", full {rec['full']['peak_bytes'] / 2**30:.2f} GiB ({rec['ratio']:.1f}x)"
                         if "ratio" in rec else f", full: {rec['full']}" if rec.get("full") == "out of memory"
                         else "")
                      + (f", max diff {rec['max_abs_diff']:.2g}" if "max_abs_diff" in rec else ""))


def model_flops(hf, rows: int, seq: int, selected: int) -> float:
    """A step's model FLOPs (PaLM's count, no recompute): 6 x the body's parameters per token, 6 x the LM
    head's per selected token (the head runs only there), 12 x layers x hidden x seq per token (attention)."""
    h, L, V = hf.hidden_size, hf.num_hidden_layers, hf.vocab_size
    attention = 2 * h * h * (1 + hf.num_key_value_heads / hf.num_attention_heads)    # q and o; k and v (GQA)
    layer = attention + 3 * h * hf.intermediate_size                                  # + the MLP's three
    tokens = rows * seq
    return 6 * L * layer * tokens + 6 * h * V * selected + 12 * L * h * seq * tokens


def peak_flops(name: str) -> float | None:
    return next((f for key, f in PEAK_BF16 if key in name), None)


def check_train(ctx: Ctx, rec: dict, name: str):
    import torch

    from trainer import Trainer
    m = ctx.m
    base = ctx.mem_start()
    tr = Trainer(ctx.model_dir(name), train_config(ctx, lr=1e-5), None, ctx.device)
    samples, adv = batch(ctx, 5)
    tr.train_step(samples, adv, version=0)        # the first step allocates AdamW's moments (after backward)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    ctx.sync()
    t = time.perf_counter()
    for _ in range(m["steps"]):
        tr.train_step(samples, adv, version=0)
    ctx.sync()
    elapsed = time.perf_counter() - t
    size = lambda ts: sum(getattr(x, "_local_tensor", x).nbytes for x in ts)    # noqa: E731
    measured = {"weights (fp32 masters)": size(tr.model.parameters()),
                "gradients": size(p.grad for p in tr.model.parameters() if p.grad is not None),
                "AdamW moments": size(x for st in tr.opt.state.values() for x in st.values()
                                      if torch.is_tensor(x) and x.dim() > 0),
                "peak": ctx.mem_peak(base)}
    tokens = m["steps"] * m["rows"] * m["seq"]
    ctx.trained[name] = {"hf": tr.model.config, "measured": measured, "seconds": elapsed, "tokens": tokens,
                         "selected": m["steps"] * m["rows"] * (m["seq"] - m["prompt"])}
    rec.update({k: v for k, v in measured.items()}, step_s=elapsed / m["steps"], tokens=tokens)
    rec["summary"] = f"{m['steps']} steps of {m['rows']} x {m['seq']} tokens in {elapsed:.2f}s"


def check_memplan(ctx: Ctx, rec: dict, name: str):
    from ext import memplan
    if name not in ctx.trained:
        raise RuntimeError(f"no measurement: train_{name} failed")
    got, m = ctx.trained[name], ctx.m
    hf = got["hf"]
    plan = memplan.trainer_bytes(memplan.param_counts(hf), hf, 1, bf16=True, tokens=m["micro_tokens"],
                                 context=m["seq"], checkpointing=True, chunk=1024, kl=False, lora=False)
    rec["plan"], rec["measured"] = plan, got["measured"]
    off = {k: got["measured"][k] / plan[k] for k in ("weights (fp32 masters)", "gradients", "AdamW moments")}
    rec["measured_over_plan"] = off
    bad = [k for k, r in off.items() if abs(r - 1) > MEMPLAN_EXACT]
    assert not bad, f"the plan's {bad} differ from the tensors: {off}"
    peak = got["measured"]["peak"]
    if peak is None:
        rec["summary"] = "weights, gradients, moments exact (peak: CUDA only)"
        return
    static = sum(got["measured"][k] for k in off)
    rec["plan_total"], rec["plan_over_peak"] = sum(plan.values()), sum(plan.values()) / peak
    rec["measured_rest"] = peak - static          # activations, logits, temporaries: the plan's other parts
    rec["plan_rest"] = sum(v for k, v in plan.items() if k not in off)
    lo, hi = MEMPLAN_PEAK
    rec["summary"] = (f"plan {rec['plan_total'] / 2**30:.2f} GiB vs peak {peak / 2**30:.2f} GiB "
                      f"({rec['plan_over_peak']:.2f}); beyond weights/grads/moments: plan "
                      f"{rec['plan_rest'] / 2**30:.2f}, measured {rec['measured_rest'] / 2**30:.2f} GiB")
    assert lo <= rec["plan_over_peak"] <= hi, (f"plan / peak {rec['plan_over_peak']:.2f} outside "
                                               f"{MEMPLAN_PEAK}")


def check_throughput(ctx: Ctx, rec: dict, name: str):
    if name not in ctx.trained:
        raise RuntimeError(f"no measurement: train_{name} failed")
    got = ctx.trained[name]
    m = ctx.m
    flops = model_flops(got["hf"], m["steps"] * m["rows"], m["seq"], got["selected"])
    rec["tokens_per_s"] = got["tokens"] / got["seconds"]
    rec["model_tflops_per_s"] = flops / got["seconds"] / 1e12
    device = ctx.torch.cuda.get_device_name() if ctx.cuda else platform.processor() or "cpu"
    peak = peak_flops(device) if ctx.cuda else None
    rec["peak_bf16_tflops"] = peak / 1e12 if peak else None
    rec["mfu"] = flops / got["seconds"] / peak if peak else None
    rec["summary"] = (f"{rec['tokens_per_s']:,.0f} tokens/s, {rec['model_tflops_per_s']:.1f} TFLOP/s"
                      + (f", MFU {rec['mfu']:.1%} of {device}'s {peak / 1e12:.0f}" if peak else ""))
    assert rec["tokens_per_s"] > 0
    if rec["mfu"] is not None:
        assert rec["mfu"] >= MIN_MFU, f"MFU {rec['mfu']:.1%} below {MIN_MFU:.0%}"


def check_no_vllm(ctx: Ctx, rec: dict):
    loaded = sorted(k for k, v in sys.modules.items() if k.split(".")[0] == "vllm" and v is not None)
    rec["summary"] = "vllm never imported" if not loaded else f"imported: {loaded[:5]}"
    assert not loaded


def checks(ctx: Ctx) -> list:
    out = [("build", check_build), ("ipc", check_ipc), ("fsdp", check_fsdp), ("stream", check_stream),
           ("logprobs", check_logprobs)]
    for name in ctx.m["models"]:
        out += [(f"train_{name}", lambda c, r, n=name: check_train(c, r, n)),
                (f"memplan_{name}", lambda c, r, n=name: check_memplan(c, r, n)),
                (f"throughput_{name}", lambda c, r, n=name: check_throughput(c, r, n))]
    return out + [("no_vllm", check_no_vllm)]


# ---------------------------------------------------------------------------------------------
# the run


def environment(ctx: Ctx) -> dict:
    import torch
    import transformers
    env = {"mode": ctx.mode, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "cuda": torch.version.cuda}
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, device_memory_gib=p.total_memory / 2**30, capability=f"{p.major}.{p.minor}")
    else:
        env["device"] = "cpu"
    return env


def run(ctx: Ctx, out: Path, budget_s: float, only: list[str] | None = None,
        todo: list | None = None) -> dict:
    """Every check in turn (todo: the list, default checks(ctx)); the JSON to `out` after each. A check that
    would start past budget_s is skipped (recorded so)."""
    t0 = time.monotonic()
    report = {"environment": environment(ctx), "sizes": ctx.m, "checks": {}}
    for name, fn in todo or checks(ctx):
        if only and name not in only:
            continue
        rec: dict = {}
        t = time.monotonic()
        if t - t0 > budget_s:
            rec.update(status="skipped", error=f"the {budget_s:.0f}s budget was spent")
        else:
            try:
                fn(ctx, rec)
                rec["status"] = "pass"
            except Exception as e:
                rec.update(status="fail", error=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc()[-3000:])
            rec["seconds"] = time.monotonic() - t
        ctx.free()
        report["checks"][name] = rec
        report["seconds"] = time.monotonic() - t0
        report["passed"] = all(r["status"] == "pass" for r in report["checks"].values())
        out.write_text(json.dumps(report, indent=1, default=str))
        line = rec.get("summary", "") if rec["status"] == "pass" else rec.get("error", "")
        print(f"{rec['status'].upper():7} {name:18} {rec.get('seconds', 0):6.1f}s  {line}", flush=True)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON report's path")
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny shape, seconds (the test suite's mode)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="checks that would start later are skipped")
    ap.add_argument("--only", nargs="+", help="run only these checks (build always runs; memplan_X and "
                                              "throughput_X read train_X's measurements)")
    ap.add_argument("--keep", action="store_true", help="keep the model dirs (else a temp dir, removed)")
    args = ap.parse_args(argv)
    forbid_vllm()
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()            # (the summary lines are the output; errors still show)
    hf_logging.disable_progress_bar()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device: run it on a GPU, or with --tiny on CPU")
    if args.tiny:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    init_group(not args.tiny)
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    ctx = Ctx("tiny" if args.tiny else "gpu", work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        report = run(ctx, out, args.budget_s, ["build", *args.only] if args.only else None)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        import torch.distributed as dist
        dist.destroy_process_group()
    n = len(report["checks"])
    passed = sum(r["status"] == "pass" for r in report["checks"].values())
    print(f"gpu_check: {passed}/{n} checks passed on {report['environment']['device']} in "
          f"{report['seconds']:.0f}s; report: {out}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
