"""Shared fixtures: the tiny model dir (built once, cached in .cache/) and a real vLLM proxy that
lives on its own event loop thread for a whole test module (engine start costs ~25 s)."""

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# vLLM's engine core and worker processes import proxy.WeightLoaderExtension by name
os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")


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


@pytest.fixture(scope="module")
def vllm_proxy(tiny_model_dir):
    """(LoopThread, LLMProxy) over a real vLLM CPU engine with the tiny model."""
    from proxy import LLMProxy
    lt = LoopThread()
    proxy = lt.run(LLMProxy.start_vllm(str(tiny_model_dir), rank=0, timeout_s=120))
    yield lt, proxy
    proxy.shutdown()
    lt.close()
