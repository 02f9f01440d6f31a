"""Multi-turn envs end to end on a real vLLM CPU engine with the tiny model (the session's, conftest's
vllm_proxy; one run of chain, guess and calc trajectories serves the first two tests).

Every trajectory is replayed against a fresh env: its observation tokens must be exactly what the
env said (mask 0, logprob 0), its reward what the env gave, and the behaviour logprob of every
action token must equal a transformers forward pass over prompt + response within 1e-4.

Token in, token out: every engine call and every observation's ids are recorded as they happen, and
the trained sample (and the trainer's collated batch) must be exactly those ids, no re-tokenisation.
The calc tool's token in, token out runs on the plain-torch engine (ext/torch_engine.py): its subject is
the env manager's ids, not vLLM, and its model (warm-started to call the calculator) needs no engine start."""

import asyncio
import contextlib
import itertools
from dataclasses import dataclass

import pytest
import torch

from buffer import Cmd, Command, LocalQueues, RolloutTask, SampleBuffer
from conftest import LoopThread
from env_manager import EnvManager, RolloutConfig, env_seed
from ext.calc import CALL
from rollout import ENVS
from task import Problem, make_problems
from trainer import collate, token_logprobs

pytestmark = pytest.mark.engine
TOL = 1e-4


def segments(mask):
    """[(is_action, start, end)] runs of equal mask values."""
    out, i = [], 0
    for k, run in itertools.groupby(mask):
        n = len(list(run))
        out.append((k == 1, i, i + n))
        i += n
    return out


async def replay(env, seed, tok, s):
    """Re-run the env with the sample's actions; return (observations, reward) it produces."""
    first = await env.reset(seed)
    assert tok.decode(s.prompt_ids) == first
    obs, total = [], 0.0
    for is_action, a, b in segments(s.loss_mask):
        if is_action:
            o, r, done, _ = await env.step(tok.decode(s.response_ids[a:b], skip_special_tokens=True))
            total += r
            obs.append(o)
    return obs, total


def run_tasks(lt, proxy, tok, cfg, tasks, recorder=None):
    """Run `tasks` through an EnvManager over `proxy` until each has sent its sample (recording its
    engine calls and observations into `recorder`, if given). Returns (samples, the manager's stats)."""
    async def main():
        buf = SampleBuffer(LocalQueues(1), "engine test", timeout_s=120)
        mgr = EnvManager(proxy, buf, tok, rank=0, cfg=cfg)
        with recorder.attach(proxy, mgr.fmt) if recorder else contextlib.nullcontext():
            for t in tasks:
                await buf.put_tasks([t])
            run = asyncio.create_task(mgr.run())
            samples = [await buf.get_sample() for _ in tasks]
            await buf.send_command(0, Command(Cmd.STOP))
            return samples, await asyncio.wait_for(run, 60)
    return lt.run(main(), timeout=300)


def test_multi_turn_envs_end_to_end(vllm_proxy, hf, chain_guess_calc):
    lt, proxy = vllm_proxy
    model, tok = hf
    cfg, tasks, samples, stats, _ = chain_guess_calc
    assert stats["samples_sent"] == len(tasks) and stats["samples_failed"] == 0 and stats["in_flight"] == 0
    samples = [s for s in samples if not s.task_id.startswith("calc")]      # (calc: the next test's)
    assert any(s.num_turns > 1 for s in samples)
    # the model's EOS ends a turn and is trained on: it sits in response_ids with mask 1
    assert any(t == tok.eos_token_id and m == 1 for s in samples for t, m in zip(s.response_ids, s.loss_mask))
    for s in samples:
        assert not s.failed and s.num_tokens <= cfg.max_model_len
        assert len(s.response_ids) == len(s.logprobs) == len(s.loss_mask)
        assert len(s.versions) == sum(s.loss_mask) and set(s.versions) == {proxy.version}
        assert s.loss_mask[0] == 1 and s.loss_mask[-1] == 1          # starts and ends with an action
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if m == 0)
        # observation tokens are exactly the env's text, and the reward is the env's
        env = ENVS[s.task_id.rstrip("0123456789")](None, 0)
        obs, reward = lt.run(replay(env, env_seed(s.group_id), tok, s))
        got_obs = [tok.decode(s.response_ids[a:b])
                   for is_action, a, b in segments(s.loss_mask) if not is_action]
        assert got_obs == obs[:len(got_obs)] and len(got_obs) == s.num_turns - 1
        assert s.reward == pytest.approx(min(1.0, reward))
        # behaviour logprobs on action tokens == transformers on the same float32 weights
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            ref = token_logprobs(model, ids, torch.ones_like(ids))[0, len(s.prompt_ids):].tolist()
        diffs = [abs(a - b) for a, b, m in zip(s.logprobs, ref, s.loss_mask) if m == 1]
        assert max(diffs) < TOL, (s.task_id, max(diffs))


# ---------------------------------------------------------------------------------------------
# token in, token out: the trained ids are the engine's ids and the observations' ids


@dataclass
class Call:
    """One engine call as the proxy saw it, copied when it returned."""
    prompt_ids: list[int]         # the ids the engine was given
    token_ids: list[int]          # the ids it generated
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


@dataclass
class Obs:
    """One PromptFormat.next call: the env's text, the last token it was given, the ids it returned."""
    text: str
    last_token: int | None
    ids: list[int]


class Recorder:
    """Records every engine call (LLMProxy.generate) and every observation's ids (PromptFormat.next)
    of an EnvManager's trajectories, keyed by the engine request id env_manager gives a turn,
    r{rank}-{task}-{index}-a{attempt}-t{turn}. The observation after turn t is filed under turn t's
    request: the latest engine call of the same asyncio task (one task runs one trajectory)."""

    def __init__(self):
        self.calls: dict[str, Call] = {}
        self.obs: dict[str, Obs] = {}
        self.latest: dict[asyncio.Task, str] = {}      # asyncio task -> its latest engine request id

    @contextlib.contextmanager
    def attach(self, proxy, fmt):
        """Wrap proxy.generate and fmt.next on these instances; restore them on exit."""
        generate, fmt_next = proxy.generate, fmt.next

        async def recorded_generate(prompt_token_ids, sampling, request_id=None):
            assert request_id is not None, "env_manager names every request"
            prompt = list(prompt_token_ids)
            self.latest[asyncio.current_task()] = request_id
            c = await generate(prompt_token_ids, sampling, request_id=request_id)
            self.calls[request_id] = Call(prompt, list(c.token_ids), list(c.logprobs), list(c.versions),
                                          c.finish_reason)
            return c

        def recorded_next(text, last_token):
            ids = fmt_next(text, last_token)
            self.obs[self.latest[asyncio.current_task()]] = Obs(text, last_token, list(ids))
            return ids

        proxy.generate, fmt.next = recorded_generate, recorded_next
        try:
            yield self
        finally:
            del proxy.generate, fmt.next            # the class's methods again

    def trajectory(self, s) -> tuple[list[Call], list[Obs | None]]:
        """The sample's engine calls in turn order, and the observation recorded after each (None: none)."""
        prefix = f"r{s.rank}-{s.task_id}-{s.meta['sample_index']}-a{s.meta['attempt']}-t"
        rids = sorted((r for r in self.calls if r.startswith(prefix)), key=lambda r: int(r[len(prefix):]))
        assert rids == [f"{prefix}{t}" for t in range(len(rids))], rids
        return [self.calls[r] for r in rids], [self.obs.get(r) for r in rids]


def check_tokens_in_tokens_out(s, calls: list[Call], obs: list[Obs | None]):
    """The sample is exactly the recorded engine outputs and observation ids, interleaved; the engine
    saw exactly what is trained on; loss mask, logprobs and versions are the engine's on its tokens."""
    assert not s.failed and len(calls) == s.num_turns >= 1
    assert calls[0].prompt_ids == s.prompt_ids                # the prompt trained on is the one sampled from
    ids, mask, logprobs, versions = [], [], [], []
    for t, c in enumerate(calls):
        # the engine's input for turn t is exactly prompt + the response trained on, up to here
        assert c.prompt_ids == s.prompt_ids + s.response_ids[:len(ids)], (s.task_id, t)
        assert c.prompt_ids == s.prompt_ids + ids, (s.task_id, t)
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) > 0
        ids += c.token_ids
        mask += [1] * len(c.token_ids)
        logprobs += c.logprobs
        versions += c.versions
        if t < len(calls) - 1:                                # an observation came between turns t and t+1
            o = obs[t]
            assert o is not None and len(o.ids) > 0, (s.task_id, t)
            assert o.last_token == (c.token_ids[-1] if c.finish_reason == "stop" else None)
            ids += o.ids
            mask += [0] * len(o.ids)
            logprobs += [0.0] * len(o.ids)
    assert s.response_ids == ids, s.task_id                   # ids, not text: nothing re-tokenised
    assert s.loss_mask == mask, s.task_id                     # 1 on the engine's tokens only
    assert s.logprobs == logprobs, s.task_id                  # the engine's, bit for bit; 0.0 elsewhere
    assert s.versions == versions, s.task_id


def check_collate(s, calls: list[Call]):
    """trainer.collate([s]): input ids = prompt + response; the loss mask is 1 exactly on the columns
    of the engine's tokens (column p: the token at position p, scored given the tokens before it, as
    token_logprobs does), where old_logp holds the engine's logprobs (float32), and 0 elsewhere."""
    t = collate([s], "cpu")
    assert set(t) == {"input_ids", "attn", "old_logp", "mask", "fields"}
    assert set(t["fields"]) == {"version", *s.token_fields}
    n = s.num_tokens
    assert t["input_ids"].shape == t["mask"].shape == t["old_logp"].shape == t["attn"].shape == (1, n)
    assert t["input_ids"][0].tolist() == s.prompt_ids + s.response_ids
    assert t["attn"][0].tolist() == [1] * n
    # the absolute positions of the engine's tokens: a turn's tokens follow the ids it was given
    cols = [p for c in calls for p in range(len(c.prompt_ids), len(c.prompt_ids) + len(c.token_ids))]
    assert cols[-1] == n - 1
    assert torch.nonzero(t["mask"][0]).flatten().tolist() == cols
    assert t["input_ids"][0, cols].tolist() == [i for c in calls for i in c.token_ids]
    want = torch.zeros(n)
    want[cols] = torch.tensor([lp for c in calls for lp in c.logprobs], dtype=torch.float32)
    assert torch.equal(t["old_logp"][0], want)
    want[cols] = torch.tensor([v for c in calls for v in c.versions], dtype=torch.float32)
    assert torch.equal(t["fields"]["version"][0], want)          # each model token's policy version


def failures(samples) -> list[str]:
    return [f"{s.task_id}: {s.meta.get('error')}" for s in samples if s.failed]


def check_trajectories(rec: Recorder, samples) -> int:
    """Both checks on every sample; returns how many observations were spliced in, in all."""
    for s in samples:
        calls, obs = rec.trajectory(s)
        check_tokens_in_tokens_out(s, calls, obs)
        check_collate(s, calls)
    return sum(s.num_turns - 1 for s in samples)


@pytest.fixture(scope="module")
def chain_guess_calc(vllm_proxy, hf):
    """One run of 3 chain, 3 guess and 3 calc trajectories on the session's engine, every engine call and
    observation recorded: (cfg, tasks, samples, the manager's stats, the Recorder)."""
    lt, proxy = vllm_proxy
    _, tok = hf
    cfg = RolloutConfig(max_tokens=6, max_turns=4, max_model_len=120)
    problems = make_problems(3, seed=7)
    tasks = [RolloutTask(f"{env}{i}", f"{env}-group{i}", problems[i] if env == "calc" else Problem("", ""),
                         env=env) for env in ("chain", "guess", "calc") for i in range(3)]
    rec = Recorder()
    samples, stats = run_tasks(lt, proxy, tok, cfg, tasks, rec)
    return cfg, tasks, samples, stats, rec


def test_tokens_in_tokens_out(vllm_proxy, chain_guess_calc):
    """For chain, guess and calc trajectories on the real engine, the ids trained on are exactly the
    ids the engine generated and the ids PromptFormat made of each observation, interleaved; each
    turn's engine input is exactly prompt + response so far; the loss mask is 1 on the engine's tokens
    only, with the engine's logprobs there and 0.0 elsewhere; trainer.collate keeps all of it."""
    _, proxy = vllm_proxy
    _, tasks, samples, stats, rec = chain_guess_calc
    assert stats["samples_sent"] == len(tasks) and stats["samples_failed"] == 0, failures(samples)
    assert proxy.generate.__func__ is type(proxy).generate        # the recorder let go of the proxy
    assert check_trajectories(rec, samples) > 0                   # some observations were spliced in
    assert any(s.num_turns > 1 for s in samples if s.task_id.startswith("chain"))
    assert any(s.num_turns > 1 for s in samples if s.task_id.startswith("guess"))


def test_an_openai_client_agent_on_the_real_engine_is_token_in_token_out(vllm_proxy, hf):
    """--agent (ext/agent.py): an agent written against the real openai client, served by the rank's
    endpoint over the real engine. Each trained sample is exactly the engine's calls stitched: every
    call's input is prompt + response so far, the engine's tokens are the mask-1 ones with its logprobs
    (equal to transformers' within 1e-4), and what the agent added between calls is mask 0; the tiny
    model's template is append-only, so no call restarts its trajectory."""
    from ext.agent import register
    lt, proxy = vllm_proxy
    model, tok = hf
    cfg = RolloutConfig(max_tokens=6, max_turns=4, max_model_len=120)

    async def agent(client, model_name, problem):
        messages = [{"role": "user", "content": problem["prompt"]}]
        for turn in range(3):
            r = await client.chat.completions.create(model=model_name, messages=messages, max_tokens=4 + turn)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f" then {turn}:"}]
        return float(r.choices[0].finish_reason in ("stop", "length"))

    endpoint = register(agent, "engine test agent", "policy")
    rec = Recorder()
    tasks = [RolloutTask(f"agent{i}", f"agent-group{i}", p, env="agent")
             for i, p in enumerate(make_problems(4, seed=3))]
    try:
        samples, stats = run_tasks(lt, proxy, tok, cfg, tasks, rec)
    finally:                              # (other tests build every env of ENVS)
        lt.run(endpoint.close_server())     # (and its counters leave RANK_STATS)
        ENVS.pop("agent", None)
    assert stats["samples_sent"] == len(tasks) and stats["samples_failed"] == 0, failures(samples)
    assert stats["agent"]["appended"] == 2 * len(tasks) and "restart" not in stats["agent"]
    for s in samples:
        calls, _ = rec.trajectory(s)
        assert len(calls) == s.num_turns == 3 and s.reward == 1.0
        pos = 0
        for k, c in enumerate(calls):
            assert c.prompt_ids == s.prompt_ids + s.response_ids[:pos]          # what the engine was given
            n = len(c.token_ids)
            assert s.response_ids[pos:pos + n] == c.token_ids and s.loss_mask[pos:pos + n] == [1] * n
            assert s.logprobs[pos:pos + n] == c.logprobs
            pos += n
            end = len(calls[k + 1].prompt_ids) - len(s.prompt_ids) if k + 1 < len(calls) else pos
            assert s.loss_mask[pos:end] == [0] * (end - pos) and (end > pos) == (k + 1 < len(calls))
            assert tok.decode(s.response_ids[pos:end]) == (f" then {k}:" if end > pos else "")
            pos = end
        assert pos == len(s.response_ids)
        check_collate(s, calls)
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            ref = token_logprobs(model, ids, torch.ones_like(ids))[0, len(s.prompt_ids):].tolist()
        assert max(abs(a - b) for a, b, m in zip(s.logprobs, ref, s.loss_mask) if m == 1) < TOL


def tool_model(base_dir, out_dir, steps: int = 150, seed: int = 0):
    """The embedded model warm-started a little further on ext/calc.py's transcripts for half the problems
    (the calc model's recipe from the default model's weights, ~25 s of one core: this test needs calls to
    the calculator, not skill; --env calc's own model, CALC, trains 2,000 steps from scratch). One torch
    thread, as tiny_model.py builds (two threads on two busy cores spin: many times the CPU). Of the test's 24
    trajectories 9, 7 and 10 called the calculator on the plain-torch engine's seeds 0, 1, 2 (11 on vLLM's
    seed 0); after 90 steps 4, 2, 3."""
    import random

    import task
    import tiny_model
    from ext.calc import sft_segments
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = PreTrainedTokenizerFast.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    opt, rng = torch.optim.AdamW(model.parameters(), lr=1e-3), random.Random(seed)
    data = task.make_problems(steps * 32, seed=seed + 5)
    model.train()
    try:
        for step in range(steps):
            batch = [sft_segments(p) if rng.random() < 0.5 else tiny_model.sft_segments(p)
                     for p in data[step * 32:(step + 1) * 32]]
            input_ids, labels = tiny_model.encode_sft_batch(tok, batch)
            loss = model(input_ids=input_ids, attention_mask=(input_ids != 0).long(), labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def calc_proxy(tiny_model_dir, tmp_path_factory):
    """(LoopThread, LLMProxy, tokenizer) over the plain-torch engine (ext/torch_engine.py: vLLM's batch size,
    float32) with a model that calls the calculator for part of its first actions (tool_model)."""
    from ext.torch_engine import TorchEngine
    from proxy import LLMProxy
    from transformers import PreTrainedTokenizerFast
    model_dir = tool_model(tiny_model_dir, tmp_path_factory.mktemp("calc-model"))
    lt = LoopThread()
    proxy = LLMProxy(TorchEngine.from_dir(model_dir, max_num_seqs=64, seed=0), rank=0, timeout_s=120)
    yield lt, proxy, PreTrainedTokenizerFast.from_pretrained(model_dir)

    async def stop():             # (on lt's loop, where the engine's scheduler task runs)
        proxy.shutdown()
    lt.run(stop())
    lt.close()


def test_tokens_in_tokens_out_calc_tool_calls(calc_proxy):
    """The same on calc trajectories whose model does call the calculator: some turn is a tool call, and
    the calculator's answer (as PromptFormat tokenised it) sits between two engine turns, mask 0."""
    lt, proxy, tok = calc_proxy
    # a call is calc(EXPR) and its EOS: "calc(123+456)" is 13 tokens of the character tokenizer. A fixed
    # env deadline (EnvManager's default): this test is about tokens, not deadlines (a loaded machine can
    # slow a sandbox call)
    cfg = RolloutConfig(max_tokens=16, max_turns=3, max_model_len=128)
    tasks = [RolloutTask(f"calc{i}", f"calc-group{i}", p, env="calc")
             for i, p in enumerate(make_problems(24, seed=11))]
    rec = Recorder()
    samples, stats = run_tasks(lt, proxy, tok, cfg, tasks, rec)
    assert stats["samples_sent"] == len(tasks) and stats["samples_failed"] == 0, failures(samples)
    assert check_trajectories(rec, samples) > 0
    tool = [s for s in samples if s.num_turns > 1]
    assert tool, "no calc trajectory called the calculator"
    for s in tool:                         # every turn but the last was a tool call (the env ran it)
        calls, _ = rec.trajectory(s)
        assert all(CALL.fullmatch(tok.decode(c.token_ids, skip_special_tokens=True)) for c in calls[:-1])
