"""tiny_model.py: the embedded default model, built locally, never downloaded.

    python tiny_model.py                  # build (or reuse) .cache/tiny-qwen2, print size and accuracy
    python tiny_model.py --force          # rebuild
    build_random(dir)                     # the same architecture and tokenizer, random weights, in seconds

What lives here: a small Qwen2-architecture causal LM (4 layers, hidden 128, 2 heads of head_dim
64) with a character-level tokenizer (CHARS), written as a Hugging Face model dir that vLLM and
transformers both load; float32 weights, so engine and trainer logprobs agree to ~1e-6. A short
supervised warm start on the default task (task.py) gives it some skill and is deliberately stopped
early so RL has room to grow. Deterministic given the seed; cached, rebuilt only when missing or
when the build settings change (a hash of them in build.json). Builds of one dir in several processes at
once do not clobber each other: each writes a private directory and moves it into place whole.

Design notes: DESIGN.md#tiny_modelpy
"""

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import task

SPECIALS = ["<pad>", "<eos>"]
# digits and arithmetic first; letters and punctuation so text environments can speak too
CHARS = list("0123456789+-*=") + list("abcdefghijklmnopqrstuvwxyz") + list(" .,:;!?()<>/'\n")
VOCAB = SPECIALS + CHARS
BYTE_NAMES = {" ": "\u0120", "\n": "\u010a"}    # byte-level BPE's names of the two characters that need one
VOCAB_SIZE = 64  # padded up: a multiple of 8 keeps kernels happy
assert len(VOCAB) <= VOCAB_SIZE


@dataclass
class TinyConfig:
    seed: int = 0                 # seeds weights and the warm-start data
    num_layers: int = 4
    hidden: int = 128
    num_heads: int = 2            # head_dim = hidden / num_heads = 64
    intermediate: int = 512
    max_len: int = 128            # max_position_embeddings, also the engine's max_model_len
    sft_steps: int = 1000         # warm-start optimizer steps: few enough to leave room for RL
    sft_batch: int = 64
    sft_lr: float = 1e-3
    digits: tuple = (1, 2, 3)     # operand digit counts of the default task
    tool_frac: float = 0.0        # share of warm-start examples that use a tool (ensure_tiny_model's tool)
    init_from: str = ""           # start from this built model's weights (a dir beside DEFAULT_DIR)


DEFAULT_DIR = Path(__file__).resolve().parent / ".cache" / "tiny-qwen2"

# A chat template so the chat path (rollout.PromptFormat) runs on the embedded model too. It renders a
# conversation as the plain text the model was warm-started on: every turn is just its text, no
# generation prompt, nothing closing a turn (the model writes its own <eos>); so "37+485=" stays
# "37+485=" and a game stays action<eos>observation, as without a template. Not part of the build
# hash: a cached build gets it (re)written in place.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_tokenizer():
    """Character-level tokenizer: every character is a token; decode concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the vocabulary names characters as byte-level BPE does (" " is "Ġ", "\n" is "Ċ", printable ASCII is
    # itself): transformers loads a qwen2 model dir's tokenizer as Qwen2Tokenizer, which maps text to those
    # names before the lookup, so under any other names it would drop every space and newline
    vocab = {BYTE_NAMES.get(tok, tok): i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        pre_tokenizers.Split(Regex("."), behavior="isolated")])
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token=None, unk_token="<pad>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def hf_config(cfg: TinyConfig):
    """The model's Hugging Face config (what memplan reads for a --dry-run before any build)."""
    from transformers import Qwen2Config
    return Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_len,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        torch_dtype="float32", rope_theta=10000.0,
    )


def build_model(cfg: TinyConfig):
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(cfg.seed)
    return Qwen2ForCausalLM(hf_config(cfg)).float()


def sft_segments(p: task.Problem) -> list[tuple[str, bool]]:
    """One warm-start transcript as (text, trained) segments, each trained one ending with <eos> (the
    model's turns): the prompt, then the answer."""
    return [(p.prompt, False), (p.answer, True)]


def encode_sft_batch(tokenizer, transcripts: list[list[tuple]]):
    """The transcripts as token ids, loss only on the model's turns (with their <eos>) and on segments
    (text, True, False): trained text with no <eos> after it. Returns input_ids, labels [B, T]."""
    seqs, labels = [], []
    for segs in transcripts:
        ids, lab = [], []
        for text, trained, *rest in segs:
            eos = rest[0] if rest else trained
            t = tokenizer.encode(text) + ([tokenizer.eos_token_id] if eos else [])
            ids += t
            lab += t if trained else [-100] * len(t)
        seqs.append(ids)
        labels.append(lab)
    width = max(len(s) for s in seqs)
    input_ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    label_ids = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return input_ids, label_ids


@torch.no_grad()
def sample_accuracy(model, tokenizer, problems: list[task.Problem], greedy: bool, seed: int = 0,
                    max_new_tokens: int = 8) -> float:
    """Accuracy of the model's completions (temperature 1 sampling, or greedy) on the problems.

    Left-padded batched decoding with a plain loop; the default task's answers are a few tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out = [[] for _ in problems]
    done = torch.zeros(len(problems), dtype=torch.bool)
    for _ in range(max_new_tokens):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1, :]
        nxt = (logits.argmax(-1) if greedy
               else torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0])
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                if t == tokenizer.eos_token_id:
                    done[i] = True
                else:
                    out[i].append(t)
        if done.all():
            break
        ids = torch.cat([ids, nxt[:, None]], 1)
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
    texts = [tokenizer.decode(o) for o in out]
    return sum(task.reward(p, t) for p, t in zip(problems, texts)) / len(problems)


def build_random(out_dir: str | Path, seed: int = 0, log=print) -> Path:
    """The embedded model's architecture and tokenizer with random weights (no warm start), built (or reused)
    in out_dir in a few seconds: a model for tests of the code around a model, not of what it learned."""
    return ensure_tiny_model(out_dir, TinyConfig(seed=seed, sft_steps=0), log=log)


def _build_hash(cfg: TinyConfig) -> str:
    d = asdict(cfg)
    for added_later in ("tool_frac", "init_from"):     # (unset: a build keeps the hash it always had)
        if not d[added_later]:
            del d[added_later]
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def _built(out_dir: Path, cfg: TinyConfig) -> bool:
    """out_dir holds a complete build of cfg (build.json is written last, in the private dir)."""
    try:
        return json.loads((out_dir / "build.json").read_text()).get("hash") == _build_hash(cfg)
    except FileNotFoundError:                # (none, or moved aside by another builder just now)
        return False


def _move_into_place(tmp: Path, out_dir: Path, cfg: TinyConfig, force: bool):
    """The complete build in tmp becomes out_dir, whole (a rename). A complete build of the same settings that
    another process moved there meanwhile is kept, and tmp dropped (unless force); a stale one is moved aside
    to a private name first, then removed."""
    while force or not _built(out_dir, cfg):
        try:
            os.rename(tmp, out_dir)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):      # (else: out_dir is there, not empty)
                raise
        old = out_dir.with_name(f"{out_dir.name}.old.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with contextlib.suppress(FileNotFoundError):                # (another builder moved it first)
            os.rename(out_dir, old)
            shutil.rmtree(old)
        force = False                                        # (what was there is gone: ours or a new one)
    shutil.rmtree(tmp, ignore_errors=True)                   # (another builder's, of the same settings)


def ensure_tiny_model(out_dir: str | Path = DEFAULT_DIR, cfg: TinyConfig | None = None,
                      force: bool = False, log=print, tool=None) -> Path:
    """Return a built model dir, building it first when missing or stale. Safe against crashes and against
    other processes building the same dir: the build is written in a private directory (this process's) and
    renamed into place when complete; a builder that finds a complete build there when it is done keeps that
    one. tool(problem) -> segments: the transcript of a warm-start example that uses a tool (cfg.tool_frac of
    them; ext/calc.py)."""
    cfg = cfg or TinyConfig()
    out_dir = Path(out_dir)
    if not force and _built(out_dir, cfg):
        # the tokenizer and its chat template are not part of the hash: a cached build gets today's, each file
        # replaced whole, from a dir of this process's own
        tokenizer, template = build_tokenizer(), out_dir / "chat_template.jinja"
        saved = json.loads((out_dir / "tokenizer.json").read_text())
        if not template.exists() or template.read_text() != CHAT_TEMPLATE or saved != json.loads(
                tokenizer.backend_tokenizer.to_str()):
            tmp = out_dir.with_name(f"{out_dir.name}.tokenizer.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tokenizer.save_pretrained(tmp)
            for f in tmp.iterdir():
                os.replace(f, out_dir / f.name)
            tmp.rmdir()
        return out_dir

    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic reductions
    tokenizer = build_tokenizer()
    model = build_model(cfg)
    if cfg.init_from:
        from transformers import AutoModelForCausalLM
        start = AutoModelForCausalLM.from_pretrained(out_dir.parent / cfg.init_from)
        model.load_state_dict(start.state_dict())
    num_params = sum(p.numel() for p in model.parameters())
    log(f"tiny model: building {num_params / 1e6:.2f}M params, {cfg.sft_steps} warm-start steps -> {out_dir}")

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    data = task.make_problems(cfg.sft_steps * cfg.sft_batch, seed=cfg.seed + 1, digits=cfg.digits)
    rng = random.Random(cfg.seed + 3)
    data = [tool(p) if cfg.tool_frac > 0 and rng.random() < cfg.tool_frac else sft_segments(p) for p in data]
    model.train()
    for step in range(cfg.sft_steps):
        lr = cfg.sft_lr * min(1.0, (step + 1) / 30)  # short warmup
        for group in opt.param_groups:
            group["lr"] = lr
        input_ids, labels = encode_sft_batch(tokenizer, data[step * cfg.sft_batch:(step + 1) * cfg.sft_batch])
        loss = model(input_ids=input_ids, attention_mask=(input_ids != 0).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == cfg.sft_steps - 1:
            log(f"  warm-start step {step:4d}/{cfg.sft_steps} loss {loss.item():.3f}")
    model.eval()

    # (random weights: no accuracy to measure)
    eval_set = task.make_problems(256, seed=cfg.seed + 2, digits=cfg.digits) if cfg.sft_steps else []
    acc_sampled = sample_accuracy(model, tokenizer, eval_set, greedy=False) if eval_set else None
    acc_greedy = sample_accuracy(model, tokenizer, eval_set, greedy=True) if eval_set else None
    build_s = time.time() - t0

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"{out_dir.name}.build.{os.getpid()}.{secrets.token_hex(4)}.tmp")   # (private)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    meta = {"hash": _build_hash(cfg), "config": asdict(cfg), "num_params": num_params,
            "build_s": round(build_s, 1), "acc_sampled": acc_sampled, "acc_greedy": acc_greedy}
    (tmp / "build.json").write_text(json.dumps(meta, indent=2))       # (last: the build is complete)
    _move_into_place(tmp, out_dir, cfg, force)
    torch.set_num_threads(threads)
    log(f"tiny model: {num_params / 1e6:.2f}M params, built in {build_s:.0f}s"
        + (f", starting accuracy {acc_sampled:.0%} sampled (T=1), {acc_greedy:.0%} greedy" if eval_set else
           ", random weights"))
    return out_dir


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(DEFAULT_DIR), help="where to write the model dir")
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=TinyConfig.sft_steps)
    ap.add_argument("--quiet", action="store_true", help="print nothing when the cached model is reused")
    # a bigger model of the same kind, e.g. the weight-sync benchmark's 103M one (tools/bench_weight_sync.py):
    # --hidden 1024 --layers 8 --heads 16 --intermediate 2816 --sft-steps 0 (random weights)
    ap.add_argument("--hidden", type=int, default=TinyConfig.hidden)
    ap.add_argument("--layers", type=int, default=TinyConfig.num_layers)
    ap.add_argument("--heads", type=int, default=TinyConfig.num_heads, help="keep hidden / heads = 64")
    ap.add_argument("--intermediate", type=int, default=TinyConfig.intermediate)
    args = ap.parse_args()
    cfg = TinyConfig(seed=args.seed, sft_steps=args.sft_steps, hidden=args.hidden, num_layers=args.layers,
                     num_heads=args.heads, intermediate=args.intermediate)
    path = ensure_tiny_model(args.out_dir, cfg, force=args.force)
    if not args.quiet:
        print(json.dumps(json.loads((path / "build.json").read_text()), indent=2))
