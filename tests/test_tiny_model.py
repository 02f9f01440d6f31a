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
