"""Start-up: its own bound (--startup-timeout-s) on each of its waits, exported to vLLM; a rollout rank's
engine starts without waiting for the trainers; the queue server reachable from other nodes. No engine
starts here (a stand-in start); the two-node run with a real engine: tests/test_multinode.py."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from buffer import Ack, LocalQueues, ManagerQueues, Phase, SampleBuffer
from controller import AsyncController, ControllerConfig
from task import Problem
from tools.jobs import free_port_pair

ROOT = Path(__file__).resolve().parent.parent


class LateEngine:
    """A stand-in VLLMEngine whose start blocks until released; records its shutdown."""

    def __init__(self):
        self.shut = threading.Event()

    def shutdown(self):
        self.shut.set()


@pytest.mark.fast
def test_engine_start_timeout_names_the_flag_and_the_late_engine_is_shut_down(monkeypatch):
    """The start runs on: at the timeout the rank fails at once (its event loop ends without waiting
    for the start's thread), naming the rank and the flag; the engine that comes up later is shut down,
    not leaked."""
    from vllm_engine import VLLMEngine
    release, engine, started = threading.Event(), LateEngine(), threading.Event()

    def start(model_dir, **kw):
        started.set()
        assert release.wait(60), "the test never released the start"
        return engine
    monkeypatch.setattr(VLLMEngine, "start", staticmethod(start))
    outcome = {}

    def rank():      # a rank's main: asyncio.run, which (with asyncio.to_thread) waits for its pool's threads
        try:
            asyncio.run(VLLMEngine.start_async("/model", 1, "rollout rank 3 (global 7)"))
        except Exception as e:
            outcome["error"] = e
    try:
        t = threading.Thread(target=rank)
        t.start()
        t.join(30)
        assert not t.is_alive(), "the rank's event loop waited for the engine's start past its timeout"
        assert started.is_set()
        assert isinstance(outcome.get("error"), TimeoutError)
        assert str(outcome["error"]) == ("rollout rank 3 (global 7): the vLLM engine did not start within 1s "
                                         "(--startup-timeout-s)")
        assert not engine.shut.is_set()
    finally:
        release.set()                               # the start completes now, after the rank gave up
    assert engine.shut.wait(30), "the engine that came up after the timeout was not shut down"


@pytest.mark.fast
def test_engine_start_error_is_the_engines_own(monkeypatch):
    """A start that fails by itself (vLLM's own ready timeout is a TimeoutError too) is not relabelled."""
    from vllm_engine import VLLMEngine

    def start(model_dir, **kw):
        raise TimeoutError("Timed out waiting for engine core processes to start")
    monkeypatch.setattr(VLLMEngine, "start", staticmethod(start))
    with pytest.raises(TimeoutError, match="^Timed out waiting for engine core"):
        asyncio.run(VLLMEngine.start_async("/model", 30, "rollout rank 0"))


def test_the_flag_reaches_vllm_before_its_engine_client_reads_it():
    """vLLM reads VLLM_ENGINE_READY_TIMEOUT_S once, when its engine client module is imported: train.py
    sets it (a minute above --startup-timeout-s) before anything imports that module."""
    code = ("import sys, train; from config import parse_cli\n"
            "assert 'vllm.v1.engine.core_client' not in sys.modules, 'imported before the export'\n"
            "train.export_startup_timeout(parse_cli(train.Config, ['--startup-timeout-s', '3000'])"
            ".controller.startup_timeout_s)\n"
            "from vllm.v1.engine import core_client\n"
            "print(core_client.VLLM_ENGINE_READY_TIMEOUT_S)\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENGINE_READY_TIMEOUT_S"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "3060"


@pytest.mark.fast
def test_startup_timeout_flag_is_checked():
    with pytest.raises(ValueError, match="--startup-timeout-s must be > 0"):
        ControllerConfig(startup_timeout_s=0)


@pytest.mark.fast
def test_ready_is_awaited_for_the_startup_timeout_not_the_step_timeout():
    """The engines' READY may take as long as a cold start: --startup-timeout-s bounds it (a missing rank
    is named with the flag), not --timeout-s."""
    import looptime

    async def main(loop):
        cfg = ControllerConfig(batch_groups=1, group_size=2, redundant=0, timeout_s=5, startup_timeout_s=50)
        problems = iter(lambda: Problem("1+1=", "2"), None)
        c = AsyncController(cfg, SampleBuffer(LocalQueues(2), "trainer rank 0"), problems, 2)
        await c.buffer.put_ack(Ack(0, Phase.READY, engine={"busy_s": 0.0, "idle_s": 0.0}))
        t0 = loop.time()
        with pytest.raises(TimeoutError, match=r"rollout rank\(s\) \[1\] did not ack ready within 50s "
                                               r"\(--startup-timeout-s\)"):
            await c.wait_ready()
        return loop.time() - t0
    loop = looptime.new_event_loop()
    try:
        waited = loop.run_until_complete(main(loop))
    finally:
        loop.close()
    assert 50 <= waited < 55                  # virtual seconds: the startup bound, not --timeout-s's 5


@pytest.mark.fast
def test_a_rollout_rank_starts_its_engine_before_it_connects_to_the_queue_server(tmp_path, monkeypatch):
    """The engine's start does not wait for trainer rank 0, which serves the queues only once its model is
    built: engine start and trainer build overlap. The connect then waits up to --startup-timeout-s."""
    import train
    from config import Extensions, parse_cli
    from tiny_model import build_tokenizer
    from vllm_engine import VLLMEngine
    build_tokenizer().save_pretrained(tmp_path)             # all run_rollout reads from the model dir here
    seen = []

    class Engine:
        def shutdown(self):
            seen.append("engine shut down")

    async def start_async(model_dir, timeout_s, who, **kw):
        seen.append(("engine start", timeout_s))
        return Engine()

    class Reached(Exception):
        pass

    def connect(host, port, authkey, num_ranks, timeout_s, who):
        seen.append(("connect", timeout_s, who))
        raise Reached
    monkeypatch.setattr(VLLMEngine, "start_async", staticmethod(start_async))
    monkeypatch.setattr(ManagerQueues, "connect", staticmethod(connect))
    cfg = parse_cli(train.Config, ["--startup-timeout-s", "1234", "--max-events", "0"])
    with pytest.raises(Reached):
        train.run_rollout(cfg, Extensions.start(cfg), 1, "cpu", str(tmp_path), None, ("127.0.0.1", 1, b"k"))
    assert seen == [("engine start", 1234), ("connect", 1234, "rollout rank 0 (global 1)"),
                    "engine shut down"]


def loopback_alias_works() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.1.1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not loopback_alias_works(), reason="needs the loopback alias 127.0.1.1")
@pytest.mark.parametrize("bind", [None, ""])
def test_the_queue_server_across_nodes_listens_on_every_interface(bind):
    """Node 0 resolves its own name to 127.0.1.1 (Ubuntu's /etc/hosts), the other nodes to an address that
    reaches it (here 127.0.0.1). Bound to the name's address, the server refuses them; bound to every
    interface (train.py across nodes), they connect, with the authkey still checked."""
    port = free_port_pair() + 1
    server = ManagerQueues.serve("127.0.1.1", port, b"key", 1, bind=bind)
    try:
        if bind is None:
            with pytest.raises(TimeoutError, match=r"node 1's rank: could not reach the queue server at "
                                                   r"127.0.0.1:\d+ within 1s \(.*Connection refused"):
                ManagerQueues.connect("127.0.0.1", port, b"key", 1, timeout_s=1, who="node 1's rank")
            return
        client = ManagerQueues.connect("127.0.0.1", port, b"key", 1, timeout_s=10)
        asyncio.run(server.put_many("tasks", ["a task"]))
        assert client.get_many_nowait("tasks", 5) == ["a task"]
        with pytest.raises(Exception, match="digest"):       # the authkey still guards it
            ManagerQueues.connect("127.0.0.1", port, b"wrong", 1, timeout_s=2)
    finally:
        server.shutdown()


@pytest.mark.fast
def test_the_queue_server_binds_every_interface_only_across_nodes(monkeypatch):
    from buffer import queue_bind
    for world, local, bind in (("2", "1", ""), ("40", "8", ""), ("2", "2", None), ("3", None, None)):
        monkeypatch.setenv("WORLD_SIZE", world)
        if local is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert queue_bind() == bind, (world, local)


@pytest.mark.fast
def test_connect_gives_up_at_its_timeout():
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="rollout rank 2: could not reach the queue server"):
        ManagerQueues.connect("127.0.0.1", free_port_pair(), b"k", 1, timeout_s=1, who="rollout rank 2")
    assert time.monotonic() - t < 10
