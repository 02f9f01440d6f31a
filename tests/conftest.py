"""Shared fixtures: the tiny model dir (built once, cached in .cache/) and a real vLLM proxy that
lives on its own event loop thread, shared by the test modules that use it (engine start costs ~25 s)."""

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# vLLM's worker processes import weight_sync.WeightSyncWorker by name
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")

import ext  # noqa: E402  (every ext/ file registered, as in a run)
ext.load()


def run_virtual(coro):
    """Run a coroutine on an event loop whose clock jumps ahead whenever every task sleeps (looptime):
    the fake engine's and the envs' asyncio.sleep calls cost no real time."""
    import looptime
    loop = looptime.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.fixture(scope="session")
def hf(tiny_model_dir):
    """(transformers model, tokenizer) of the tiny model, float32, for reference logprobs."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """The embedded model's architecture and tokenizer with random weights, built in seconds (the quick tier's
    model: for tests of the code around a model, not of what it learned)."""
    import tiny_model
    return tiny_model.build_random(tmp_path_factory.mktemp("random") / "tiny-random", log=lambda *a: None)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    import tiny_model
    return tiny_model.ensure_tiny_model()


class LoopThread:
    """An event loop in a daemon thread; run(coro) blocks with a timeout."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, awaitable, timeout: float = 300):
        async def wrapped():  # accepts coroutines and futures (asyncio.gather) alike
            return await awaitable
        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# the engine of vllm_proxy: one for the session, shut down right after the last test that uses it
SHARED_ENGINE: dict = {}         # "last": that test (set at collection); "engine": (LoopThread, LLMProxy)


def close_shared_engine():
    if "engine" in SHARED_ENGINE:
        lt, proxy = SHARED_ENGINE.pop("engine")
        proxy.shutdown()
        lt.close()


# The models only a few tests need, built from scratch on one core: the distillation tests' teacher (~30 s)
# and the judge tests' judge (~200 s). Each is built by a process of its own, started at collection when a
# selected test needs it and run at low priority while the other tests run (most of them keep one core
# busy, not two); the fixture waits for its build, then reuses it (tiny_model.ensure_tiny_model: cached).
# A background build that failed is built again by the fixture, in the foreground, where its error shows.
BUILDS = {"distill_teacher": "import conftest; conftest.build_test_teacher()",
          "judge_dir": "import ext.judge; ext.judge.ensure_tiny_judge(log=lambda *a: None, test=True)"}
BACKGROUND: dict = {}            # fixture name -> the Popen building its model


def build_test_teacher() -> Path:
    """The distillation tests' teacher (.cache/tiny-teacher-test): the student's architecture, another seed,
    a shorter warm start (cheap to build, cached): what the student's teacher_kl can fall towards."""
    import tiny_model
    return tiny_model.ensure_tiny_model(ROOT / ".cache" / "tiny-teacher-test",
                                        tiny_model.TinyConfig(seed=2, sft_steps=300), log=lambda *a: None)


def start_builds(items):
    import subprocess
    wanted = {name for i in items for name in BUILDS if name in getattr(i, "fixturenames", ())}
    if os.environ.get("JUDGE_DIR"):              # (test_judge.py's judge_dir: another judge, not the tests')
        wanted.discard("judge_dir")
    for name in sorted(wanted):
        BACKGROUND[name] = subprocess.Popen(
            [sys.executable, "-c", BUILDS[name]], cwd=ROOT / "tests", stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
            preexec_fn=lambda: os.nice(10))


def wait_for_build(name: str, timeout_s: float = 1200):
    """Block until the background build of fixture `name`'s model (if any) has ended."""
    import subprocess
    p = BACKGROUND.pop(name, None)
    if p is not None:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            raise RuntimeError(f"conftest: the background build for fixture {name} did not end in "
                               f"{timeout_s:.0f} s")


def pytest_sessionfinish(session):
    for p in BACKGROUND.values():     # (a session that ended before a fixture waited for its build)
        p.kill()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    start_builds(items)
    users = [i for i in items if "vllm_proxy" in getattr(i, "fixturenames", ())]
    SHARED_ENGINE["last"] = users[-1] if users else None
    for item in items:        # (a JUnit report's properties: tools/suite_times.py tells the tiers apart)
        item.user_properties.append(("markers", ",".join(sorted({m.name for m in item.iter_markers()}))))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if item is SHARED_ENGINE.get("last"):
        close_shared_engine()


@pytest.fixture(scope="session")
def vllm_proxy(tiny_model_dir):
    """(LoopThread, LLMProxy) over a real vLLM CPU engine with the tiny model, one for the session (engine
    start costs ~20 s): test_engine.py's and test_envs_engine.py's tests share it, so each test leaves its
    weights as it found them (test_engine.py's updates end by restoring them; the versions count on), and
    it is shut down right after the last test that uses it (an idle engine's worker still spins a little)."""
    from proxy import LLMProxy
    if "engine" not in SHARED_ENGINE:
        lt = LoopThread()
        SHARED_ENGINE["engine"] = lt, lt.run(LLMProxy.start_vllm(str(tiny_model_dir), rank=0, timeout_s=120))
    yield SHARED_ENGINE["engine"]
    close_shared_engine()


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> dict:
    """A small model dir that looks like a real one, built here (nothing downloaded): a byte-level
    BPE tokenizer trained on the data below, a ChatML chat template (<|im_start|>, <|im_end|> as EOS),
    a Qwen2 config with max_position_embeddings 1024, random float32 weights; and a JSONL of math
    questions whose prompts are 300-500 tokens. Returns {"dir", "data", "prompt_tokens"}."""
    import json
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("chat-model")
    rng = random.Random(0)

    def question():
        nums = [rng.randrange(10, 1000) for _ in range(rng.randrange(110, 160))]
        return ("Add up all of the following numbers and answer with the total only, as a single number: "
                + ", ".join(map(str, nums)) + "."), str(sum(nums))
    rows = [question() for _ in range(40)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([q for q, _ in rows] * 3, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    vocab = (len(tok) + 63) // 64 * 64
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)).float()
    model.generation_config.eos_token_id = tok.eos_token_id
    d = root / "model"
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    lengths = [len(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False)) for q, _ in rows]
    return {"dir": d, "data": data, "prompt_tokens": (min(lengths), max(lengths))}
