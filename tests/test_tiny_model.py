"""tiny_model.py: the embedded model's tokenizer, as the code that serves and trains the model loads it."""

import json
import shutil

import tiny_model


def test_the_tokenizer_transformers_loads_reads_every_character_as_the_build_does(tiny_model_dir, tmp_path):
    """AutoTokenizer loads a qwen2 dir's tokenizer as Qwen2Tokenizer (byte-level names: " " is "Ġ"): every
    character of CHARS, space and newline included, is one token, the build's own id, and decodes back. A
    cached build whose tokenizer names them plainly (which dropped them) gets its tokenizer rewritten."""
    from transformers import AutoTokenizer
    text = "".join(tiny_model.CHARS)
    ids = [tiny_model.VOCAB.index(c) for c in text]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.encode(text) == tiny_model.build_tokenizer().encode(text) == ids
    assert tok.decode(ids) == text
    old = tmp_path / "old"
    shutil.copytree(tiny_model_dir, old)
    saved = json.loads((old / "tokenizer.json").read_text())
    names = {v: k for k, v in tiny_model.BYTE_NAMES.items()}
    saved["model"]["vocab"] = {names.get(k, k): i for k, i in saved["model"]["vocab"].items()}
    (old / "tokenizer.json").write_text(json.dumps(saved))
    assert AutoTokenizer.from_pretrained(old).encode("1 2\n3") == [3, 4, 5]                 # (dropped)
    tiny_model.ensure_tiny_model(old, tiny_model.TinyConfig())          # (the build.json's hash: no rebuild)
    assert AutoTokenizer.from_pretrained(old).encode(text) == ids
    assert not list(tmp_path.glob("*.tmp"))


# a builder that, once it has written its weights, waits until the other builder has written its own: the
# worst moment for two builds of one dir (each then moves its build into place, the other's written already)
BUILD_AT_ONCE = """
import sys, time
from pathlib import Path
from transformers import PreTrainedModel
import tiny_model
out, me, other = (Path(a) for a in sys.argv[1:4])
save = PreTrainedModel.save_pretrained
def save_then_wait(*args, **kwargs):
    save(*args, **kwargs)
    me.touch()
    deadline = time.monotonic() + 120
    while not other.exists():
        if time.monotonic() > deadline:
            sys.exit(f"{me.name}: the other builder did not write its weights within 120 s")
        time.sleep(0.005)
PreTrainedModel.save_pretrained = save_then_wait
cfg = tiny_model.TinyConfig(num_layers=1, hidden=64, num_heads=1, intermediate=64, sft_steps=2, sft_batch=4)
tiny_model.ensure_tiny_model(out, cfg, log=lambda *a: None)
print(tiny_model._build_hash(cfg))
"""


def test_two_builds_of_one_dir_at_once_leave_one_complete_build(tmp_path):
    """Two processes build the same (very small) model into one dir at the same moment: both succeed, the dir
    holds one complete build (its build.json's hash, weights and tokenizer that load), and no private build
    dir is left behind."""
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer
    root = Path(tiny_model.__file__).parent
    out = tmp_path / "model"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_AT_ONCE, str(out), str(tmp_path / me),
                               str(tmp_path / other)], cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for me, other in (("a", "b"), ("b", "a"))]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
    built = json.loads((out / "build.json").read_text())
    assert built["hash"] == results[0][0].split()[-1] == results[1][0].split()[-1]
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    assert AutoTokenizer.from_pretrained(out).encode("1+2=") == [tiny_model.VOCAB.index(c) for c in "1+2="]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "model"]       # (no private dir left)


def test_a_random_init_model_has_the_embedded_architecture_and_tokenizer(tmp_path, tiny_model_dir):
    """build_random: the embedded model's config and tokenizer, weights untrained (no warm start), in a dir of
    one's own; a second call reuses it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    path = tiny_model.build_random(tmp_path / "random", log=lambda *a: None)
    got, want = (AutoConfig.from_pretrained(d).to_dict() for d in (path, tiny_model_dir))
    same = {"transformers_version": "", "_name_or_path": ""}
    assert {**got, **same} == {**want, **same}
    text = "".join(tiny_model.CHARS)
    assert (AutoTokenizer.from_pretrained(path).encode(text)
            == AutoTokenizer.from_pretrained(tiny_model_dir).encode(text))
    meta = json.loads((path / "build.json").read_text())
    assert meta["config"]["sft_steps"] == 0 and meta["acc_greedy"] is None
    random_w = AutoModelForCausalLM.from_pretrained(path).state_dict()
    trained_w = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert random_w.keys() == trained_w.keys() and not torch_equal(random_w, trained_w)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.build_random(tmp_path / "random", log=lambda *a: None) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime                    # (reused)


def torch_equal(a: dict, b: dict) -> bool:
    import torch
    return all(torch.equal(a[k], b[k]) for k in a)
