"""envs.py: environments for rollout (env_manager.py runs one trajectory loop per env instance).

    class Env:
        async def reset(self, seed: int) -> str                              # first observation
        async def step(self, action: str) -> tuple[str, float, bool, dict]   # obs, reward, done, info

Async, so an env that waits (a sandbox, LatencyEnv's delay) yields the event loop while the engine
keeps decoding for other trajectories (the paper's environment-level asynchronous rollout).

Owns SingleTurnEnv (RLVR as the one-step case), the games GuessEnv ("guess": find 0..99 from
"higher"/"lower" hints) and ChainEnv ("chain": a running sum, one addition per turn), the tool env
CalcEnv ("calc": the task's problem, and calc(EXPR) runs model-written Python in sandbox.py), the
wrappers LatencyEnv (normal or lognormal delay per call) and FaultyEnv (raise or hang at given
rates), and ENVS: name -> factory(problem, seed, **kwargs) -> Env. All text uses only
tiny_model.CHARS, and every game is deterministic given the seed.

Simplifications: the games ignore the Problem and build their state from the seed; LatencyEnv clips
negative draws to 0 (mean=10, std=10 gives about 10.8 s); FaultyEnv also fails resets.

Design notes: DESIGN.md#envspy
"""

import asyncio
import math
import random
import re
from dataclasses import dataclass

import task
from config import opt
from sandbox import SandboxLimits, arun_python

# ---------------------------------------------------------------------------------------------
# single-turn RLVR


class SingleTurnEnv:
    """One step: the prompt, one answer, the verifier reward in [0, 1], done."""

    def __init__(self, problem: task.Problem, reward_fn=None):
        self.problem = problem
        # async (problem, response) -> float (task.RewardPool.score); None: inline
        self.reward_fn = reward_fn

    async def reset(self, seed: int) -> str:
        return self.problem.prompt

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.reward_fn is None:
            r = task.reward(self.problem, action)
        else:   # a slow verifier (math-verify) must not hold up the event loop, hence the engine
            r = await self.reward_fn(self.problem, action)
        return "", r, True, {}


# ---------------------------------------------------------------------------------------------
# multi-turn games


def _first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group()) if m else None


class GuessEnv:
    """Guess the secret number in 0..99; the observation says "higher", "lower" or "correct"."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay        # reward per extra guess: 1, 0.9, 0.81, ...
        self.secret = 0
        self.guesses = 0

    async def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randrange(100)
        self.guesses = 0
        return "guess my number, 0 to 99:\n"

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.guesses += 1
        g = _first_int(action)
        if g is None:
            return " say a number:\n", 0.0, False, {"valid": False}
        if g == self.secret:
            return " correct!\n", self.decay ** (self.guesses - 1), True, {"valid": True}
        return (" higher:\n" if g < self.secret else " lower:\n"), 0.0, False, {"valid": True}


class ChainEnv:
    """A running sum over `steps` additions, one per turn; reward = fraction answered correctly."""

    def __init__(self, steps: int = 3, max_operand: int = 20):
        if steps < 1:
            raise ValueError(f"ChainEnv.steps must be >= 1, got {steps}")
        self.steps = steps
        self.max_operand = max_operand   # operands drawn from 0..max_operand-1
        self.terms: list[int] = []
        self.i = 0                       # next step to answer, 0-based

    async def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.terms = [rng.randrange(self.max_operand) for _ in range(self.steps + 1)]
        self.i = 0
        return f"{self.terms[0]}+{self.terms[1]}="

    def _partial(self, step: int) -> int:
        return sum(self.terms[: step + 2])

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        want = self._partial(self.i)
        ok = _first_int(action) == want
        r = (1.0 if ok else 0.0) / self.steps
        self.i += 1
        if self.i == self.steps:
            return "", r, True, {"correct": ok}
        hint = " ok\n" if ok else f" no, {want}\n"   # tell the true partial sum so the chain goes on
        return f"{hint}+{self.terms[self.i + 1]}=", r, False, {"correct": ok}


# ---------------------------------------------------------------------------------------------
# a tool environment: the default task with a calculator whose input the model writes


CALL = re.compile(r"\s*calc\((.*)\)\s*", re.DOTALL)   # a tool call: the whole action is calc(EXPR)


def calc_observation(value: str | None) -> str:
    """What the model sees after a call: the value, then a cue to answer ("answer:"; a bare "=VALUE" would
    read as the default task's finished answer, after which the warm-started model stops)."""
    return f" ={value} answer:" if value is not None else " error, answer:"


class CalcEnv:
    """The problem's prompt; the model answers, or first writes calc(EXPR): EXPR (model-written Python)
    runs in the sandbox (sandbox.py: its own process, no network, limits, a wall-clock kill) and its
    value comes back as the next observation (calc_observation). The first action that is not a call
    is the answer, scored by the task's verifier."""

    def __init__(self, problem: task.Problem, reward_fn=None, max_calls: int = 2, limits=None):
        self.problem, self.reward_fn, self.max_calls = problem, reward_fn, max_calls
        self.limits = limits or SandboxLimits()
        self.calls = 0

    async def reset(self, seed: int) -> str:
        self.calls = 0
        return self.problem.prompt

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        call = CALL.fullmatch(action)
        if call and self.calls < self.max_calls:
            self.calls += 1
            res = await arun_python(call.group(1), self.limits, mode="eval")
            value = res.output.strip()
            ok = res.ok and re.fullmatch(r"-?\d{1,40}", value) is not None   # text the tiny model can read
            info = {"tool": res.kind, "tool_s": res.wall_s}
            return calc_observation(value if ok else None), 0.0, False, info
        if self.reward_fn is None:
            r = task.reward(self.problem, action)
        else:
            r = await self.reward_fn(self.problem, action)
        return "", r, True, {"tool_calls": self.calls}


# ---------------------------------------------------------------------------------------------
# wrappers used by the experiments (env_manager's env_wrappers)


class LatencyEnv:
    """Adds a delay before every reset and step (seconds): normal(mean_s, std_s) clipped at 0, or with
    sigma > 0 a heavy-tailed lognormal of median mean_s (as sandboxes, simulators and web pages are)."""

    def __init__(self, env, mean_s: float, std_s: float, rng: random.Random, sigma: float = 0.0):
        if mean_s < 0 or std_s < 0 or sigma < 0:
            raise ValueError(f"LatencyEnv: mean_s, std_s and sigma must be >= 0, got {mean_s}, {std_s}, "
                             f"{sigma}")
        self.env, self.mean_s, self.std_s, self.rng, self.sigma = env, mean_s, std_s, rng, sigma

    async def _delay(self):
        if self.sigma:
            await asyncio.sleep(self.mean_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0)))
        else:
            await asyncio.sleep(max(0.0, self.rng.gauss(self.mean_s, self.std_s)))

    async def reset(self, seed: int) -> str:
        await self._delay()
        return await self.env.reset(seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        await self._delay()
        return await self.env.step(action)


class EnvFault(RuntimeError):
    """An injected environment failure (FaultyEnv)."""


class FaultyEnv:
    """Per call (reset or step): raises EnvFault with probability fail_rate, hangs forever with
    probability hang_rate, else passes through."""

    def __init__(self, env, fail_rate: float, hang_rate: float, rng: random.Random):
        if fail_rate < 0 or hang_rate < 0 or fail_rate + hang_rate > 1:
            raise ValueError(f"FaultyEnv: need rates >= 0 with fail_rate + hang_rate <= 1, "
                             f"got fail_rate={fail_rate}, hang_rate={hang_rate}")
        self.env, self.fail_rate, self.hang_rate, self.rng = env, fail_rate, hang_rate, rng

    async def _maybe_fail(self, phase: str):
        u = self.rng.random()
        if u < self.fail_rate:
            raise EnvFault(f"injected env failure during {phase}")
        if u < self.fail_rate + self.hang_rate:
            await asyncio.Event().wait()   # never set: only the caller's timeout ends this

    async def reset(self, seed: int) -> str:
        await self._maybe_fail("reset")
        return await self.env.reset(seed)

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        await self._maybe_fail("step")
        return await self.env.step(action)


@dataclass
class FaultConfig:
    """Testing the failure paths: every env wrapped with injected latency, failures and hangs."""
    env_fail_rate: float = opt(0.0, "testing: inject env failures, the chance an env call raises")
    env_hang_rate: float = opt(0.0, "testing: inject env hangs, the chance an env call never returns")
    env_latency_s: float = opt(0.0, "testing: inject env latency, normal(mean=this, std=this) per call, "
                                    "seconds")
    env_latency_sigma: float = opt(0.0, "> 0: the injected latency is lognormal instead, median "
                                        "--env-latency-s and this sigma (heavy-tailed)")

    def __post_init__(self):
        if not (0 <= self.env_fail_rate and 0 <= self.env_hang_rate
                and self.env_fail_rate + self.env_hang_rate <= 1):
            raise ValueError(f"--env-fail-rate {self.env_fail_rate} and --env-hang-rate "
                             f"{self.env_hang_rate}: need rates >= 0 that sum to <= 1")
        if self.env_latency_s < 0 or self.env_latency_sigma < 0:
            raise ValueError(f"--env-latency-s and --env-latency-sigma must be >= 0, got "
                             f"{self.env_latency_s}, {self.env_latency_sigma}")

    def wrapper(self, seed: int):
        """(env) -> env wrapping every env of a rollout rank (EnvManager's env_wrappers); None: nothing
        injected."""
        if not (self.env_latency_s or self.env_fail_rate or self.env_hang_rate):
            return None
        rng = random.Random(seed)

        def wrap(env):
            if self.env_latency_s:
                env = LatencyEnv(env, self.env_latency_s, self.env_latency_s, rng, self.env_latency_sigma)
            if self.env_fail_rate or self.env_hang_rate:
                env = FaultyEnv(env, self.env_fail_rate, self.env_hang_rate, rng)
            return env
        return wrap


# ---------------------------------------------------------------------------------------------
# observations -> tokens: plain, or through the tokenizer's chat template


def model_eos_ids(tokenizer) -> set[int]:
    """Every token the engine stops on: the tokenizer's EOS and the ids in the model dir's
    generation_config.json (vLLM stops on all of them)."""
    ids = {tokenizer.eos_token_id} - {None}
    model_dir = getattr(tokenizer, "name_or_path", "")
    if not model_dir:                       # a tokenizer built in memory: no model dir to read
        return ids
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):           # no generation config: the tokenizer's EOS only
        return ids
    return ids | (set(eos if isinstance(eos, list) else [eos]) - {None})


FIRST_CACHE = 4096    # prompts whose tokens PromptFormat.first keeps (a few steps' worth of groups)


class PromptFormat:
    """How env text becomes model tokens (env_manager, and the controller's length check).

    Plain: the first observation is tokenizer.encode(text), a later one encode(text) without special
    tokens. With a chat template (the tokenizer has one, and use_template): the first observation is
    a user message followed by the assistant's generation prompt; a later one closes the model's
    turn (what the template puts after an assistant message, less the EOS the model generated
    itself), then adds a user message and a new generation prompt. The pieces are read off the
    template once, by rendering a conversation with marker strings, so any template whose rendering
    of a longer conversation extends that of a shorter one works (the usual case: ChatML, Llama).

    The engine stops on any of the model's EOS tokens (eos_ids: the tokenizer's and the generation
    config's list; Qwen2.5-Instruct's has <|im_end|> and <|endoftext|>). Only the EOS the model
    wrote is taken off the turn's closing text: ended on <|endoftext|>, the turn still gets its
    <|im_end|>.
    """

    def __init__(self, tokenizer, use_template: bool = True, eos_ids: set[int] | None = None):
        self.tok = tokenizer
        self._decode = getattr(tokenizer, "_decode", tokenizer.decode)
        self._first: dict[str, list[int]] = {}    # prompt text -> its tokens (first())
        self.eos_ids = model_eos_ids(tokenizer) if eos_ids is None else set(eos_ids)
        self.chat = use_template and bool(getattr(tokenizer, "chat_template", None))
        if self.chat:
            x, y, o = "\x01X\x01", "\x01Y\x01", "\x01O\x01"
            one = [{"role": "user", "content": x}, {"role": "assistant", "content": y}]
            a = tokenizer.apply_chat_template(one, tokenize=False)
            b = tokenizer.apply_chat_template(one + [{"role": "user", "content": o}], tokenize=False,
                                              add_generation_prompt=True)
            if not b.startswith(a) or y not in a or o not in b:
                raise ValueError("the tokenizer's chat template renders a longer conversation differently "
                                 "from a shorter one; pass --no-chat-template")
            self.close_turn = a[a.index(y) + len(y):]               # e.g. "<|im_end|>\n"
            # e.g. "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
            self.user_pre, self.user_post = b[len(a):].split(o)

    def first(self, text: str) -> list[int]:
        """The prompt's tokens. Cached: a group's samples (and every retry) render the same prompt, and
        rendering a chat template costs ~40 us a sample (a copy is returned: callers extend it)."""
        ids = self._first.get(text)
        if ids is None:
            if len(self._first) >= FIRST_CACHE:
                self._first.clear()
            ids = self._first[text] = (
                self.tok.encode(text) if not self.chat else
                list(self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False)))
        return list(ids)

    def next(self, text: str, last_token: int | None) -> list[int]:
        """The tokens after the model's turn, whose last token was last_token (None: none, or a
        turn cut by the budget), up to the next generation prompt."""
        if not self.chat:
            return self.tok.encode(text, add_special_tokens=False)
        close = self.close_turn
        if last_token in self.eos_ids:
            eos_text = self.tok.decode([last_token])
            if close.startswith(eos_text):
                close = close[len(eos_text):]                         # the model wrote this EOS itself
        return self.tok.encode(close + self.user_pre + text + self.user_post, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        # (the tokenizer's own _decode: decode() first converts the list element by element in Python)
        return self._decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# name -> factory(problem, seed, **kwargs); RolloutTask.env picks one. Unknown kwargs are ignored,
# so env_manager can pass the same kwargs (reward_fn) to every factory.

ENVS = {
    "": lambda problem, seed, reward_fn=None, **kw: SingleTurnEnv(problem, reward_fn),
    "guess": lambda problem, seed, **kw: GuessEnv(),
    "chain": lambda problem, seed, **kw: ChainEnv(),
    "calc": lambda problem, seed, reward_fn=None, **kw: CalcEnv(problem, reward_fn),
}
