"""ext/calc.py and ext/faults.py: the calculator tool env (its calls run in the sandbox), and the lognormal
latency wrapper."""

import asyncio
import random
import statistics

import pytest

import tiny_model
from ext.calc import CalcEnv, SandboxLimits, calc_observation, sft_segments
from ext.faults import FaultConfig, LatencyEnv
from task import Problem

pytestmark = pytest.mark.fast

FAST = SandboxLimits(cpu_s=1, wall_s=2)


def play(env, actions):
    async def main():
        out = [await env.reset(0)]
        for a in actions:
            out.append(await env.step(a))
        return out
    return asyncio.run(main())


def test_a_tool_call_returns_its_value_and_the_answer_is_scored():
    first, call, answer = play(CalcEnv(Problem("37+485=", "522"), limits=FAST), ["calc(37+485)", "522"])
    assert first == "37+485="
    assert call[:3] == (calc_observation("522"), 0.0, False) and call[3]["tool"] == "ok"
    assert answer[1:3] == (1.0, True) and answer[3]["tool_calls"] == 1
    _, wrong = play(CalcEnv(Problem("37+485=", "522"), limits=FAST), ["521"])    # no call: a plain answer
    assert wrong[1:3] == (0.0, True)


@pytest.mark.parametrize("code", ["open('/etc/passwd').read()", "__import__('socket').socket()", "1/0",
                                  "'not a number'", "[x for x in iter(int, 1)]"])
def test_a_call_that_fails_or_is_refused_says_error_and_the_run_goes_on(code):
    _, call, answer = play(CalcEnv(Problem("1+1=", "2"), limits=FAST), [f"calc({code})", "2"])
    assert call[0] == calc_observation(None) and not call[2]
    assert call[3]["tool"] != "ok" or code == "'not a number'"      # (that one runs, but is no number)
    assert call[3]["tool_s"] < FAST.wall_s + 3                     # the endless one is killed at wall_s
    assert answer[1:3] == (1.0, True)


def test_calls_beyond_max_calls_are_answers():
    env = CalcEnv(Problem("1+1=", "2"), max_calls=1, limits=FAST)
    _, first, second = play(env, ["calc(1+1)", "calc(1+1)"])
    assert not first[2] and second[1:3] == (0.0, True)


def test_the_warm_start_transcript_is_what_the_env_says():
    """The calc model's tool transcripts use the env's protocol: replayed, the env gives their observation."""
    p = Problem("315+835=", "1150")
    segs = sft_segments(p)
    assert [trained for _, trained in segs] == [False, True, False, True]
    first, call, answer = play(CalcEnv(p, limits=FAST), [segs[1][0], segs[3][0]])
    assert first == segs[0][0] and call[0] == segs[2][0] and answer[1] == 1.0
    assert tiny_model.sft_segments(p) == [(p.prompt, False), (p.answer, True)]


def test_lognormal_latency_has_the_median_asked_for_and_a_heavy_tail(monkeypatch):
    delays = []

    async def record(s):
        delays.append(s)
    monkeypatch.setattr(asyncio, "sleep", record)

    class Nothing:
        async def step(self, action):
            return "", 0.0, False, {}
    env = LatencyEnv(Nothing(), 0.5, 0.0, random.Random(0), sigma=1.0)

    async def main():
        for _ in range(4000):
            await env.step("")
    asyncio.run(main())
    assert statistics.median(delays) == pytest.approx(0.5, rel=0.1)
    assert max(delays) > 10 * 0.5 and min(delays) > 0                  # heavy tail, never negative
    assert FaultConfig(env_latency_s=0.5, env_latency_sigma=1.0).wrapper(0) is not None
    with pytest.raises(ValueError, match="--env-latency-sigma"):
        FaultConfig(env_latency_sigma=-1)
