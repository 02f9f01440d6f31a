"""rollout.py: one sample's rollout, the paper's environment-level loop, and a rollout rank's settings.

    sample = await run_trajectory(proxy, new_env, fmt, RolloutConfig(...), task)   # -> Sample, or None

run_trajectory runs reset -> (generate -> step)* -> reward for one sample of a RolloutTask over an
LLMProxy, retrying after env failures; it knows nothing of slots, queues or commands (env_manager.py
runs many of them on a rank). Every env call is bounded by an EnvDeadline (deadline.py): a few times
the recent calls' latency quantile, not a fixed one. A trajectory's tokens: prompt_ids, then actions
and observations in response_ids, loss_mask 1 on action tokens only, one version per action token
(the version that sampled it, from the proxy).
Deviations (the env seed per group, staleness from the first token, ...): DESIGN.md#env_managerpy.
"""

import asyncio
import dataclasses
import hashlib
from dataclasses import dataclass, field

from buffer import RolloutTask, Sample
from config import flag, opt
from deadline import EnvDeadline
from envs import PromptFormat
from proxy import Sampling, now


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
                                          "(--env-timeout-factor > 0): its ceiling")
    # the adaptive env deadline (EnvDeadline): clamp(quantile(recent latencies) * factor, floor, ceiling)
    env_timeout_quantile: float = opt(0.99, "adaptive env deadline: this quantile of the recent env calls' "
                                            "latencies, times --env-timeout-factor")
    env_timeout_factor: float = opt(3.0, "adaptive env deadline: the recent latency quantile times this, "
                                         "within [--env-timeout-floor-s, --env-step-timeout-s]; 0 = off: "
                                         "every env call gets --env-step-timeout-s")
    # 5 s: with 1 s, a 40-step --env calc run on 2 busy cores timed out 104 env calls (then retried)
    env_timeout_floor_s: float = opt(5.0, "adaptive env deadline: never under this, seconds")
    max_retries: int = opt(2, "a failed trajectory is rerun with a fresh env up to this many times")
    reward: str = opt("", "verifier module:function (problem, response) -> float in [0, 1]; default: the "
                          "task's")
    reward_workers: int = opt(-1, "verifier processes per rollout rank; 0 = on its event loop; -1 = 0 for "
                                  "the embedded addition check, else 1")
    reward_timeout_s: float = opt(10.0, "a verifier call slower than this scores 0 (its process is "
                                        "replaced); with --reward-timeout-factor > 0: the adaptive timeout's "
                                        "ceiling")
    reward_timeout_factor: float = opt(0.0, "adaptive verifier timeout (RollPacker): a call gets min(max("
                                            "--reward-timeout-min-s, this x the slowest correct answer so "
                                            "far), --reward-timeout-s), then scores 0; 0 = off (needs "
                                            "--reward-workers >= 1)")
    reward_timeout_min_s: float = opt(1.0, "adaptive verifier timeout: never under this, seconds")
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
        def bad(name, rule):
            return ValueError(f"{flag(name)} (RolloutConfig.{name}) must be {rule}, "
                              f"got {getattr(self, name)!r}")
        for name in ("max_concurrency", "max_turns", "stream_interval"):
            if getattr(self, name) < 1:
                raise bad(name, ">= 1")
        for name in ("max_tokens", "max_model_len", "max_retries"):
            if getattr(self, name) < 0:
                raise bad(name, ">= 0 (0 = from the model)" if name.startswith("max_") else ">= 0")
        if self.reward_workers < -1:
            raise bad("reward_workers", ">= -1 (-1 = auto)")
        for name in ("temperature", "env_step_timeout_s", "env_timeout_floor_s", "poll_s", "stop_timeout_s",
                     "reward_timeout_s", "kv_cache_gib"):
            if getattr(self, name) <= 0:
                raise bad(name, "> 0")
        if not 0 < self.env_timeout_quantile <= 1:
            raise bad("env_timeout_quantile", "in (0, 1]")
        if self.env_timeout_factor < 0:
            raise bad("env_timeout_factor", ">= 0 (0 = a fixed env_step_timeout_s)")
        if self.reward_timeout_factor < 0:
            raise bad("reward_timeout_factor", ">= 0 (0 = a fixed reward_timeout_s)")
        if self.reward_timeout_min_s <= 0:
            raise bad("reward_timeout_min_s", "> 0")
        if not 0 <= self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "in [0, 1] (0 = auto)")
        if self.suspend_mode not in ("keep", "abort"):
            raise bad("suspend_mode", "'keep' or 'abort'")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise bad("dtype", "auto, float32, bfloat16 or float16")

    def resolved(self, model_dir: str, device: str, embedded: bool, custom_reward: bool,
                 env: str = "") -> "RolloutConfig":
        """The settings that default to the model's (context), the task's (reply length, reward workers)
        and the device's (dtype)."""
        from transformers import AutoConfig
        return dataclasses.replace(
            self,
            max_model_len=self.max_model_len or AutoConfig.from_pretrained(model_dir).max_position_embeddings,
            # the embedded model's answers are a few characters; its calc(123+456) call is 13 and an <eos>
            max_tokens=self.max_tokens or ((16 if env == "calc" else 8) if embedded else 1024),
            dtype=(self.dtype if self.dtype != "auto"
                   else ("bfloat16" if device.startswith("cuda") else "float32")),
            reward_workers=self.reward_workers if self.reward_workers >= 0 else (1 if custom_reward else 0))


def inline_reward(fn):
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
        return self.versions[0] if self.versions else self.start_version

    def add(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None):
        """Append action tokens (with logprobs and versions) or observation tokens (without)."""
        self.response_ids += ids
        if versions is None:
            self.logprobs += [0.0] * len(ids)
            self.loss_mask += [0] * len(ids)
        else:
            self.logprobs += logprobs
            self.loss_mask += [1] * len(ids)
            self.versions += versions


async def run_trajectory(proxy, new_env, fmt: PromptFormat, cfg: RolloutConfig, task: RolloutTask,
                         index: int = 0, *, on_attempt=None, on_failure=None,
                         deadline: EnvDeadline | None = None) -> Sample | None:
    """One sample of `task`, retried after env failures. Each attempt builds its env with new_env()
    and runs rollout_once. A failed attempt becomes a failed Sample given to `await on_failure(s)`
    (meta["retrying"] says whether another attempt follows). Returns the Sample, or None when the
    last attempt failed too. `on_attempt(index, traj)` sees each attempt's live Trajectory. Env
    calls are bounded by `deadline` (the manager's, shared), default a fixed cfg.env_step_timeout_s."""
    deadline = deadline or EnvDeadline(cfg.env_step_timeout_s)
    for attempt in range(cfg.max_retries + 1):
        traj = Trajectory(start_version=proxy.version)
        if on_attempt is not None:
            on_attempt(index, traj)
        try:
            return await rollout_once(proxy, new_env(), fmt, cfg, task, traj, tag=f"{index}-a{attempt}",
                                      meta={"attempt": attempt, "sample_index": index}, deadline=deadline)
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
                       tag: str = "0", meta: dict | None = None,
                       deadline: EnvDeadline | None = None) -> Sample:
    """reset -> (generate -> step)* -> Sample, filling `traj` as it goes. Raises EnvFailure when an
    env call raises or outlives `deadline` (default: a fixed cfg.env_step_timeout_s), Aborted when
    someone else aborted the engine request."""
    where = f"rollout rank {proxy.rank}: env {task.env or 'single-turn'!r}"
    deadline = deadline or EnvDeadline(cfg.env_step_timeout_s)

    async def env_call(coro, phase: str):   # any env failure, timeouts included, becomes EnvFailure
        kind = phase.split()[0]                      # "reset" or "step"
        limit_s, t0 = deadline.current_s[kind], now()    # (event-loop time: virtual in tests and the sim)
        try:
            async with asyncio.timeout(limit_s):     # no extra task, unlike wait_for
                out = await coro
        except TimeoutError:
            deadline.record(kind, limit_s)           # (at least limit_s: see EnvDeadline)
            raise EnvFailure(f"{where} {phase} (task {task.task_id}) took longer than "
                             f"{round(limit_s, 3):g}s", timeout=True) from None
        except Exception as e:    # CancelledError is not an Exception: aborts pass through
            raise EnvFailure(f"{where} {phase} (task {task.task_id}) raised {e!r}") from e
        deadline.record(kind, now() - t0)            # (a call that raised says nothing of the latency)
        return out

    obs = await env_call(env.reset(env_seed(task.group_id)), "reset")
    traj.prompt_ids = fmt.first(obs)
    cap = cfg.max_model_len
    if len(traj.prompt_ids) >= cap:
        raise EnvFailure(f"rollout rank {proxy.rank}: task {task.task_id}: prompt of {len(traj.prompt_ids)} "
                         f"tokens leaves no room under max_model_len={cap}")
    for turn in range(cfg.max_turns):
        room = cap - len(traj.prompt_ids) - len(traj.response_ids)
        temperature = cfg.temperature if task.eval_temperature is None else task.eval_temperature
        if task.problem.target_len > 0:      # benchmark: exactly target_len tokens per turn
            sampling = Sampling(min(task.problem.target_len, room), temperature, ignore_eos=True,
                                stream_interval=cfg.stream_interval)
        else:
            sampling = Sampling(min(cfg.max_tokens, room), temperature, stream_interval=cfg.stream_interval)
        traj.request_id = f"r{proxy.rank}-{task.task_id}-{tag}-t{turn}"
        c = await proxy.generate(traj.prompt_ids + traj.response_ids, sampling, request_id=traj.request_id)
        traj.request_id = None
        if c.finish_reason == "abort":
            raise Aborted(f"rollout rank {proxy.rank}: task {task.task_id} turn {turn} aborted")
        ids = c.token_ids
        if task.problem.target_len > 0:    # benchmark: the answer ends at its first EOS; what follows is
            end = next((k + 1 for k, t in enumerate(ids) if t in fmt.eos_ids), len(ids))   # length only
            traj.add(ids[:end], c.logprobs[:end], c.versions[:end])
            traj.add(ids[end:])            # generated and trained through, out of the loss
            ids = ids[:end]
        else:
            traj.add(ids, c.logprobs, c.versions)
        text = fmt.decode(ids)             # EOS: trained on, not shown to the env
        obs, r, done, _ = await env_call(env.step(text), f"step {turn}")
        traj.reward += r
        traj.num_turns += 1
        if done:
            traj.finish_reason = c.finish_reason
            break
        obs_ids = fmt.next(obs, c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids else None)
        if (turn == cfg.max_turns - 1
                or len(traj.prompt_ids) + len(traj.response_ids) + len(obs_ids) + 1 > cap):
            break                  # no turn left, or no room for the observation and one more action token
        traj.add(obs_ids)
    return Sample(task.task_id, task.group_id, traj.prompt_ids, traj.response_ids, traj.logprobs,
                  traj.loss_mask, traj.versions, min(1.0, max(0.0, traj.reward)),
                  finish_reason=traj.finish_reason,
                  rank=proxy.rank, num_turns=traj.num_turns, admit_version=task.admit_version,
                  meta={**(meta or {}), "eval": task.eval_temperature is not None})
