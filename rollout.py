"""rollout.py: one sample's rollout, the paper's environment-level loop; environments; a rollout rank's
settings.

    sample = await run_trajectory(proxy, new_env, fmt, RolloutConfig(...), task)   # -> Sample, or None

    class Env:                    # what an environment is (ENVS: name -> factory(problem, seed, reward_fn))
        async def reset(self, seed: int) -> str                              # first observation
        async def step(self, action: str) -> tuple[str, float, bool, dict]   # obs, reward, done, info
        def sampling(self, s: Sampling) -> Sampling                          # optional: shape a turn's
    class DrivingEnv:             # or one that drives its own turns (ext/agent.py: OpenAI-client agents)
        async def run(self, proxy, fmt, cfg, task, traj, tag, meta, deadline) -> Sample   # rollout_once's

run_trajectory runs reset -> (generate -> step)* -> reward for one sample of a RolloutTask over an
LLMProxy, retrying after env failures; it knows nothing of slots, queues or commands (env_manager.py
runs many of them on a rank). Envs are async, so one that waits (a sandbox, a slow tool) yields the
event loop while the engine keeps decoding for other trajectories (environment-level asynchronous
rollout). Every env call is bounded by a deadline (FixedDeadline: --env-step-timeout-s; ext/deadlines.py
adapts it). A trajectory's tokens: prompt_ids, then actions and observations in response_ids, loss_mask
1 on action tokens only, one version per action token (the version that sampled it, from the proxy).
PromptFormat turns env text into tokens, through the tokenizer's chat template if it has one.
The core's env is SingleTurnEnv (RLVR: one answer, the verifier's reward); ext/ registers more in ENVS.
Deviations (the env seed per group, staleness from the first token, ...): DESIGN.md#a-trajectory
"""

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import numbers
from dataclasses import dataclass, field

import task
from buffer import RolloutTask, Sample, now
from config import check, opt
from proxy import Sampling


@dataclass
class RolloutConfig:
    """A rollout rank's settings: its engine's and its env manager's. 0 / -1 / "auto" = from the model, the
    task or the device: resolved() fills them in before an EnvManager starts."""
    max_concurrency: int = opt(64, "trajectories in flight per rollout rank (also the engine's batch size)")
    max_tokens: int = opt(0, "response tokens per model turn; 0 = 8 for the embedded model (16 with --env "
                                 "calc), else 1024")
    max_model_len: int = opt(0, "engine context = the cap on prompt + whole trajectory, tokens; 0 = the "
                                "model's own")
    max_turns: int = opt(8, "multi-turn: model turns per trajectory, at most")
    temperature: float = opt(1.0, "sampling temperature of the training samples; the engines report, and the "
                                  "trainer computes, log-probs of softmax(logits / this)")
    chat_template: bool = opt(True, "prompts and observations through the tokenizer's chat template, if it "
                                    "has one")
    suspend_mode: str = opt("keep", "weight update under running requests: keep | abort (resubmit)")
    env_step_timeout_s: float = opt(30.0, "an env reset/step (or reward) slower than this fails the "
                                          "trajectory, seconds; with the adaptive deadline on "
                                          "(--env-timeout-factor > 0, ext/deadlines.py): its ceiling")
    max_retries: int = opt(2, "a failed trajectory is rerun with a fresh env up to this many times")
    reward: str = opt("", "verifier module:function (problem, response) -> a finite float (a penalty may be "
                          "negative); none: no verifier (every answer 0: distillation alone); default: the "
                          "task's")
    dtype: str = opt("auto", "engine weights: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | "
                             "float16")
    kv_cache_gib: float = opt(1.0, "CPU: each engine's KV cache, GiB")
    gpu_memory_utilization: float = opt(0.0, "GPU: the share of a rollout GPU's memory its engine may take; "
                                             "0 = auto: 0.85, under --colocate what is free at the engine's "
                                             "start less the trainer's headroom (memplan.py)")
    enforce_eager: bool = opt(False, "GPU: run the engine eagerly (no CUDA graphs; faster start-up, slower "
                                     "decoding); on CPU engines always run eagerly")
    poll_s: float = opt(0.01, "the env manager's control loop period (commands, task queue), seconds")
    stream_interval: int = opt(16, "the engine delivers a request's tokens in outputs of this many (1 = "
                                   "every token: Python per token on the rollout rank)")
    stop_timeout_s: float = opt(60.0, "on stop or abort, wait this long for cancelled trajectories to unwind")

    def __post_init__(self):
        check(self, at_least=dict(max_concurrency=1, max_turns=1, stream_interval=1, max_tokens=0,
                                  max_model_len=0, max_retries=0, gpu_memory_utilization=0),
              above=dict(temperature=0, env_step_timeout_s=0, poll_s=0, stop_timeout_s=0, kv_cache_gib=0),
              at_most=dict(gpu_memory_utilization=1),
              one_of=dict(suspend_mode=("keep", "abort"), dtype=("auto", "float32", "bfloat16", "float16")))

    def resolved(self, model_dir: str, device: str, embedded: bool) -> "RolloutConfig":
        """The settings that default to the model's (context, reply length) and the device's (dtype)."""
        from transformers import AutoConfig
        context = self.max_model_len or AutoConfig.from_pretrained(model_dir).max_position_embeddings
        dtype = self.dtype if self.dtype != "auto" else "bfloat16" if device.startswith("cuda") else "float32"
        reply = self.max_tokens or (8 if embedded else 1024)      # (the embedded model's: a few chars)
        return dataclasses.replace(self, max_model_len=context, max_tokens=reply, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# environments: name -> factory(problem, seed, reward_fn=None) -> Env; RolloutTask.env picks one


class SingleTurnEnv:
    """One step: the prompt, one answer, the verifier's reward, done."""

    def __init__(self, problem: task.Problem, reward_fn=None):
        self.problem = problem
        self.reward_fn = reward_fn    # async (problem, response) -> float (ext/verifiers.py); None: inline

    async def reset(self, seed: int) -> str:
        return self.problem.prompt

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        return "", await score(self.problem, action, self.reward_fn), True, {}


async def score(problem: task.Problem, response: str, reward_fn=None) -> float:
    """The verifier's reward: reward_fn's (a slow verifier must not hold up the event loop, hence the
    engine), or the task's own, inline."""
    return task.reward(problem, response) if reward_fn is None else await reward_fn(problem, response)


ENVS = {"": lambda problem, seed, reward_fn=None: SingleTurnEnv(problem, reward_fn)}
RANK_STATS = {}     # name -> () -> dict: an env's own counters, in its rollout rank's stats (ext/agent.py)


class FixedDeadline:
    """Every env call may take `seconds` (--env-step-timeout-s); ext/deadlines.py's adapts."""

    def __init__(self, seconds: float):
        self.current_s = {"reset": seconds, "step": seconds}

    def record(self, kind: str, latency_s: float):
        """A call of `kind` ended after latency_s seconds (an adaptive deadline learns from it)."""


# ---------------------------------------------------------------------------------------------
# env text -> model tokens: plain, or through the tokenizer's chat template


def model_eos_ids(tokenizer) -> set[int]:
    """Every token the engine stops on: the tokenizer's EOS and the ids in the model dir's
    generation_config.json (vLLM stops on all of them)."""
    eos = None
    if model_dir := getattr(tokenizer, "name_or_path", ""):     # (a tokenizer built in memory has none)
        from transformers import GenerationConfig
        with contextlib.suppress(OSError, ValueError):          # no generation config: the tokenizer's only
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    return {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}


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
        # a character the tokenizer has no token for becomes its unknown token, or nothing, without a word:
        # checked (known()) wherever env text is encoded
        self.unk = getattr(tokenizer, "unk_token_id", None)
        self.readable: set[str] = set()           # characters known() found the tokenizer reads
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
            ids = self._first[text] = self.known(text, (
                self.tok.encode(text) if not self.chat else
                list(self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))))
        return list(ids)

    def known(self, text: str, ids: list[int]) -> list[int]:
        """ids, the tokens of text; a ValueError naming the characters the tokenizer has no token for: it
        reads them as its unknown token, or drops them without a word (a byte-level tokenizer over a
        vocabulary without them: the embedded model's, loaded from its dir). Each character is tried once."""
        def unreadable(c):       # (a lone whitespace character may encode to nothing where it is normalised)
            t = self.tok.encode(c, add_special_tokens=False)
            return (self.unk is not None and self.unk in t) or (not t and not c.isspace())
        if missing := sorted(c for c in set(text) - self.readable if unreadable(c)):
            raise ValueError(f"the tokenizer has no token for {''.join(missing)!r} (it would read as "
                             f"{self.tok.unk_token!r} or nothing) in {text[:80]!r}")
        self.readable.update(text)
        return ids

    def next(self, text: str, last_token: int | None) -> list[int]:
        """The tokens after the model's turn, whose last token was last_token (None: none, or a
        turn cut by the budget), up to the next generation prompt."""
        if not self.chat:
            return self.known(text, self.tok.encode(text, add_special_tokens=False))
        close = self.close_turn
        if last_token in self.eos_ids:
            eos_text = self.tok.decode([last_token])
            if close.startswith(eos_text):
                close = close[len(eos_text):]                         # the model wrote this EOS itself
        return self.known(text, self.tok.encode(close + self.user_pre + text + self.user_post,
                                                add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        # (the tokenizer's own _decode: decode() first converts the list element by element in Python)
        return self._decode(ids, skip_special_tokens=True)


def inline_reward(fn):
    """A plain verifier (problem, response) -> float as the async reward_fn envs call (--reward, no pool)."""
    async def call(problem, response):
        return float(fn(problem, response))
    return call


def env_seed(group_id: str) -> int:
    """Stable across processes and runs (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(group_id.encode()).digest()[:4], "little")


class EnvFailure(Exception):
    """An env call raised or timed out: the trajectory fails and is retried."""

    def __init__(self, msg: str, timeout: bool = False):
        super().__init__(msg)
        self.timeout = timeout


def encoded(encode, where: str, text: str, *args) -> list[int]:
    """The env's text as tokens (PromptFormat's first or next); one the tokenizer cannot read fails the
    trajectory (EnvFailure), naming the env and the characters."""
    try:
        return encode(text, *args)
    except ValueError as e:
        raise EnvFailure(f"{where}: {e}") from None


def finite_reward(reward, where: str) -> float:
    """A reward as the env or verifier gave it, any finite number (a penalty may be negative: it is never
    clipped; a bool is 0 or 1); NaN, infinity or a non-number fails the trajectory (EnvFailure), naming where
    it came from."""
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvFailure(f"{where} gave reward {reward!r}: not a finite number")
    return float(reward)


class Aborted(Exception):
    """The engine request was aborted by someone else (the manager's own aborts cancel the task
    first): the trajectory ends quietly, no sample."""


# ---------------------------------------------------------------------------------------------
# one trajectory: the environment-level loop


@dataclass
class Trajectory:
    """A trajectory as it grows (becomes a Sample when it ends); its owner reads request_id (to
    abort it) and oldest_version (to judge staleness) while it runs."""
    start_version: int
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str = "length"
    request_id: str | None = None      # the engine request in flight, if any

    @property
    def oldest_version(self) -> int:
        """The policy version of its oldest token (none yet: the version it started under), as
        buffer.Sample's (versions only grow along a trajectory: its first token's)."""
        return self.versions[0] if self.versions else self.start_version

    def add(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None):
        """Append action tokens (with logprobs and versions) or observation tokens (without)."""
        action = versions is not None
        self.response_ids += ids
        self.logprobs += logprobs if action else [0.0] * len(ids)
        self.loss_mask += [int(action)] * len(ids)
        self.versions += versions if action else []


async def run_trajectory(proxy, new_env, fmt: PromptFormat, cfg: RolloutConfig, task: RolloutTask,
                         index: int = 0, *, on_attempt=None, on_failure=None,
                         deadline: FixedDeadline | None = None, finish=None) -> Sample | None:
    """One sample of `task`, retried after env failures. Each attempt builds its env with new_env()
    and runs rollout_once. A failed attempt becomes a failed Sample given to `await on_failure(s)`
    (meta["retrying"] says whether another attempt follows). Returns the Sample, or None when the
    last attempt failed too. `on_attempt(index, traj)` sees each attempt's live Trajectory. Env
    calls are bounded by `deadline` (the manager's, shared), default a fixed cfg.env_step_timeout_s.
    `await finish(sample)` completes each sample before it is returned (an extension's: a teacher's
    log-probs); an EnvFailure there fails the attempt like the env's own."""
    deadline = deadline or FixedDeadline(cfg.env_step_timeout_s)
    for attempt in range(cfg.max_retries + 1):
        traj = Trajectory(start_version=proxy.version)
        if on_attempt is not None:
            on_attempt(index, traj)
        try:
            s = await rollout_once(proxy, new_env(), fmt, cfg, task, traj, tag=f"{index}-a{attempt}",
                                   meta={"attempt": attempt, "sample_index": index}, deadline=deadline)
            if finish is not None:
                await finish(s)
            return s
        except EnvFailure as e:
            if on_failure is not None:
                await on_failure(Sample(
                    task.task_id, task.group_id, traj.prompt_ids, [], [], [], [], 0.0, finish_reason="failed",
                    rank=proxy.rank, num_turns=traj.num_turns, admit_version=task.admit_version, failed=True,
                    meta={"error": str(e), "timeout": e.timeout, "attempt": attempt,
                          "eval": task.eval_temperature is not None,
                          "retrying": attempt < cfg.max_retries, "sample_index": index}))
    return None


async def rollout_once(proxy, env, fmt: PromptFormat, cfg: RolloutConfig, task: RolloutTask, traj: Trajectory,
                       tag: str, meta: dict, deadline: FixedDeadline) -> Sample:
    """reset -> (generate -> step)* -> Sample, filling `traj` as it goes (tag: the attempt's, in its request
    ids; meta: the Sample's). Raises EnvFailure when an env call raises or outlives `deadline`, Aborted when
    someone else aborted the engine request."""
    where = f"rollout rank {proxy.rank}: env {task.env or task.problem.env or 'single-turn'!r}"

    async def env_call(coro, phase: str):   # any env failure, timeouts included, becomes EnvFailure
        kind = phase.split()[0]                      # "reset" or "step"
        limit_s, t0 = deadline.current_s[kind], now()    # (event-loop time: virtual in tests and the sim)
        try:
            async with asyncio.timeout(limit_s):     # no extra task, unlike wait_for
                out = await coro
        except TimeoutError:
            deadline.record(kind, limit_s)           # (at least limit_s: ext/deadlines.py)
            raise EnvFailure(f"{where} {phase} (task {task.task_id}) took longer than "
                             f"{round(limit_s, 3):g}s", timeout=True) from None
        except Exception as e:    # CancelledError is not an Exception: aborts pass through
            raise EnvFailure(f"{where} {phase} (task {task.task_id}) raised {e!r}") from e
        deadline.record(kind, now() - t0)            # (a call that raised says nothing of the latency)
        return out

    if hasattr(env, "run"):        # an env that drives its own turns (ext/agent.py): it makes the Sample
        return await env.run(proxy, fmt, cfg, task, traj, tag, meta, deadline)
    obs = await env_call(env.reset(env_seed(task.group_id)), "reset")
    traj.prompt_ids = encoded(fmt.first, where, obs)
    cap = cfg.max_model_len
    if len(traj.prompt_ids) >= cap:
        raise EnvFailure(f"rollout rank {proxy.rank}: task {task.task_id}: prompt of {len(traj.prompt_ids)} "
                         f"tokens leaves no room under max_model_len={cap}")
    for turn in range(cfg.max_turns):
        room = cap - len(traj.prompt_ids) - len(traj.response_ids)
        temperature = cfg.temperature if task.eval_temperature is None else task.eval_temperature
        sampling = Sampling(min(cfg.max_tokens, room), temperature, stream_interval=cfg.stream_interval)
        if hasattr(env, "sampling"):       # an env that shapes its turns (ext/longtail.py: exact lengths),
            sampling = env.sampling(sampling)                               # within the context's room
            sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room))
        traj.request_id = f"r{proxy.rank}-{task.task_id}-{tag}-t{turn}"
        c = await proxy.generate(traj.prompt_ids + traj.response_ids, sampling, request_id=traj.request_id)
        traj.request_id = None
        if c.finish_reason == "abort":
            raise Aborted(f"rollout rank {proxy.rank}: task {task.task_id} turn {turn} aborted")
        ids, end = c.token_ids, len(c.token_ids)
        if sampling.ignore_eos:   # generated past its EOS: the action ends at its first EOS, and the tokens
            end = next((k + 1 for k, t in enumerate(ids) if t in fmt.eos_ids), end)   # after it are trained
        traj.add(ids[:end], c.logprobs[:end], c.versions[:end])                       # through, out of the
        traj.add(ids[end:])                                                           # loss
        text = fmt.decode(ids[:end])             # EOS: trained on, not shown to the env
        obs, r, done, _ = await env_call(env.step(text), f"step {turn}")
        traj.reward += finite_reward(r, f"{where} step {turn} (task {task.task_id})")
        traj.num_turns += 1
        if done:
            traj.finish_reason = c.finish_reason
            break
        obs_ids = encoded(fmt.next, where, obs, c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids
                          else None)
        if (turn == cfg.max_turns - 1
                or len(traj.prompt_ids) + len(traj.response_ids) + len(obs_ids) + 1 > cap):
            break                  # no turn left, or no room for the observation and one more action token
        traj.add(obs_ids)
    return Sample(task.task_id, task.group_id, traj.prompt_ids, traj.response_ids, traj.logprobs,
                  traj.loss_mask, traj.versions, traj.reward,
                  finish_reason=traj.finish_reason,
                  rank=proxy.rank, num_turns=traj.num_turns, admit_version=task.admit_version,
                  meta={**meta, "eval": task.eval_temperature is not None})
