"""Real data and verifiers without engines: the verifier pool, prompts too long for the context,
the heartbeat, prompts in flight across a resume, dataset keys, reasoning-gym tasks, chat templates."""

import asyncio
import itertools
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from buffer import LocalQueues, SampleBuffer
from controller import AsyncController, ControllerConfig
from rollout import PromptFormat
from ext.eval import Evaluation
from ext.verifiers import RewardPool, reasoning_gym_maker
from task import Problem, load_dataset, load_reward


def test_a_verifier_workers_start_up_is_not_its_first_calls_time(tmp_path, monkeypatch):
    """A verifier that takes 2 s to import, under a 1 s timeout: the worker's start-up (spawn, imports) is
    waited for apart, so its first call scores and no timeout is counted; a verifier that cannot start
    fails the call naming it (before, both were timeouts that scored 0, again and again)."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(2.0)\n"
                                             "def exact(problem, response):\n"
                                             "    return float(response == problem.answer)\n")
    (tmp_path / "broken_import.py").write_text("raise ImportError('no such thing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))      # (the spawned workers get this process's sys.path)

    async def main(spec):
        pool = RewardPool(1, spec, timeout_s=1.0)
        try:
            return [await pool.score(Problem("p", "2"), r) for r in ("2", "3")], pool.timeouts
        finally:
            pool.shutdown()
    assert asyncio.run(main("slow_import:exact")) == ([1.0, 0.0], 0)
    with pytest.raises(RuntimeError, match="verifier worker \\(broken_import:f\\) died or did not start"):
        asyncio.run(main("broken_import:f"))


def test_reward_pool_kills_a_verifier_that_hangs_and_goes_on():
    async def main():
        pool = RewardPool(1, "reward_fixtures:slow_or_exact", timeout_s=1.5)
        try:
            assert await pool.score(Problem("p", "2"), "2") == 1.0        # (the first call starts the worker)
            t = time.monotonic()
            hung = await pool.score(Problem("p", "2"), "hang")
            waited = time.monotonic() - t
            after = [await pool.score(Problem("p", "2"), r) for r in ("2", "3")]
            with pytest.raises(RuntimeError, match=r"slow_or_exact raised ValueError: a verifier bug"):
                # (the sample fails, as an inline verifier's does)
                await pool.score(Problem("p", "2"), "raise")
            after.append(await pool.score(Problem("p", "2"), "2"))
            return hung, waited, after, pool.timeouts, pool.errors
        finally:
            pool.shutdown()
    hung, waited, after, timeouts, errors = asyncio.run(main())
    assert hung == 0.0 and 1.5 <= waited < 6 and timeouts == 1
    assert after == [1.0, 0.0, 1.0] and errors == 1       # a fresh worker serves the next calls


def score_after_a_cancel(workers: int, one_thread: bool) -> list[float]:
    """Sample A (0.5 s verifier) is cancelled after 0.2 s; then samples whose own rewards are
    10, 11, 12 are scored one after another. one_thread: the loop's default thread pool has one
    thread, and it is busy for the first second (what a rank's other to_thread calls do)."""
    async def main():
        pool = RewardPool(workers, "reward_fixtures:sleep_then", timeout_s=5)
        try:
            # start them
            await asyncio.gather(*[pool.score(Problem("warm", ""), "0|-1") for _ in range(workers)])
            if one_thread:
                asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
                busy = asyncio.create_task(asyncio.to_thread(time.sleep, 1.0))
            a = asyncio.create_task(pool.score(Problem("a", ""), "0.5|1"))
            await asyncio.sleep(0.2)
            a.cancel()
            got = [await pool.score(Problem(str(v), ""), f"0|{v}") for v in (10, 11, 12)]
            if one_thread:
                await busy
            return got
        finally:
            pool.shutdown()
    return asyncio.run(main())


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("one_thread", [False, True])
def test_a_cancelled_reward_call_never_hands_its_answer_to_the_next_call(workers, one_thread):
    assert score_after_a_cancel(workers, one_thread) == [10.0, 11.0, 12.0]


def test_reward_pool_stress_every_answer_belongs_to_its_own_call():
    """60 concurrent calls on 3 workers, 1 thread in the default pool: random verifier times, a third
    cancelled at random moments, a few past the timeout. Every call that completes gets its own value
    (its index) or 0.0 for a timeout, never another call's: the slow ones time out, and a fast one only
    when the machine is loaded enough to hold it past the timeout (counted as one); afterwards every worker
    still answers its own calls."""
    rng = random.Random(0)
    timeout_s = 0.6
    plan = [(i, 2.0 if i % 20 == 7 else rng.uniform(0, 0.15), rng.random() < 0.33, rng.uniform(0, 1.5))
            for i in range(60)]                     # (value, verifier seconds, cancel it?, cancel after s)

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))   # fewer threads than workers
        pool = RewardPool(3, "reward_fixtures:sleep_then", timeout_s=timeout_s)
        try:
            calls = [asyncio.create_task(pool.score(Problem(str(i), ""), f"{secs}|{i}"))
                     for i, secs, _, _ in plan]

            async def cancel_later(task, after):
                await asyncio.sleep(after)
                task.cancel()
            await asyncio.gather(*[cancel_later(calls[i], after) for i, _, cancel, after in plan if cancel])
            done = await asyncio.gather(*calls, return_exceptions=True)
            after = await asyncio.gather(*[pool.score(Problem("x", ""), f"0|{100 + k}") for k in range(6)])
            return done, after, pool.timeouts
        finally:
            pool.shutdown()
    done, after, timeouts = asyncio.run(main())
    completed = [(i, secs, got) for (i, secs, _, _), got in zip(plan, done)
                 if not isinstance(got, BaseException)]
    assert len(completed) >= 30
    for i, secs, got in completed:
        assert got == 0.0 if secs > timeout_s else got in (0.0, float(i)), (i, secs, got)
    slow = sum(secs > timeout_s for _, secs, _ in completed)
    assert 1 <= slow <= sum(got == 0.0 and i != 0 for i, _, got in completed) <= timeouts   # (call 0's is 0)
    assert after == [100.0 + k for k in range(6)]


@pytest.mark.fast
def test_reward_spec_is_checked():
    assert load_reward("reward_fixtures:slow_or_exact")(Problem("p", "7"), "7") == 1.0
    with pytest.raises(ValueError, match="--reward"):
        load_reward("no_such_module:f")
    with pytest.raises(ValueError, match="--reward"):
        load_reward("reward_fixtures:nope")


def controller(**kw):
    problems = iter([Problem("x" * 50, "1"), Problem("short", "2"), Problem("y" * 80, "3"),
                     Problem("ok", "4")]
                    + [Problem(f"p{i}", str(i)) for i in range(100)])
    logged = []
    max_model_len = kw.pop("max_model_len", 20)
    cfg = ControllerConfig(**{"batch_groups": 2, "group_size": 2, "async_ratio": 0, "redundant": 0, **kw})
    c = AsyncController(cfg, SampleBuffer(LocalQueues(1), "test", timeout_s=5), problems, 1,
                        prompt_len=lambda p: len(p.prompt), max_model_len=max_model_len, log=logged.append)
    return c, logged


@pytest.mark.fast
def test_prompts_that_cannot_fit_the_context_are_refused_at_admission_and_counted():
    async def main():
        c, logged = controller()
        await c.admit()
        tasks = c.buffer.transport.get_many_nowait("tasks", 100)
        return c, logged, tasks
    c, logged, tasks = asyncio.run(main())
    assert {t.problem.prompt for t in tasks} == {"short", "ok"}          # 50 and 80 characters > 20 tokens
    assert c.prompts_rejected == 2 and c.groups_drawn == 4
    assert len(logged) == 2 and "refused a prompt of 50 tokens" in logged[0] and "context is 20" in logged[0]


@pytest.mark.fast
def test_a_prompt_with_a_character_the_tokenizer_lacks_is_refused_naming_it():
    """The tiny tokenizer has a token for each character it knows and reads any other as <pad>: a prompt
    with one is refused at admission, logged with the character, and the stream goes on; an env whose
    observation holds one fails its trajectory (a failed sample naming the env and the character)."""
    from rollout import PromptFormat
    from tiny_model import build_tokenizer
    fmt = PromptFormat(build_tokenizer())
    with pytest.raises(ValueError, match="no token for 'é'"):
        fmt.first("1+1=é")
    assert fmt.first("1+1=") == build_tokenizer().encode("1+1=")

    async def main():
        logged = []
        problems = iter([Problem("2+2=é", "4"), Problem("1+1=", "2")] * 4)
        c = AsyncController(ControllerConfig(batch_groups=1, group_size=2, async_ratio=0, redundant=0),
                            SampleBuffer(LocalQueues(1), "test", timeout_s=5), problems, 1,
                            prompt_len=lambda p: len(fmt.first(p.prompt)), max_model_len=64,
                            log=logged.append)
        await c.admit()
        return c, logged, [t.problem.prompt for t in c.buffer.transport.get_many_nowait("tasks", 10)]
    c, logged, prompts = asyncio.run(main())
    assert prompts == ["1+1=", "1+1="] and c.prompts_rejected == 1
    assert "no token for 'é'" in logged[0] and "'2+2=é'" in logged[0]

    class Accented:                  # a multi-turn env whose first observation the tokenizer cannot read
        async def reset(self, seed):
            return "café?"

    async def trajectory():
        from buffer import RolloutTask
        from proxy import LLMProxy
        from rollout import RolloutConfig, run_trajectory
        from tools.fake_engine import FakeTimedEngine
        failed = []

        async def on_failure(s):
            failed.append(s)
        proxy = LLMProxy(FakeTimedEngine(t0=0.0, k=0.0))
        cfg = RolloutConfig(max_tokens=4, max_model_len=64, max_retries=0)
        task = RolloutTask("t0.0", "g0", Problem("", ""), env="accented")
        s = await run_trajectory(proxy, Accented, fmt, cfg, task, on_failure=on_failure)
        proxy.shutdown()
        return s, failed
    s, failed = asyncio.run(trajectory())
    assert s is None and "env 'accented': the tokenizer has no token for 'é'" in failed[0].meta["error"]


@pytest.mark.fast
def test_a_character_the_tokenizer_loaded_from_the_model_dir_drops_is_refused_naming_it(tmp_path):
    """As transformers loads it from the model dir (Qwen2Tokenizer, byte-level), the embedded tokenizer drops
    a character it has no token for without a word ("You" reads as "ou"): PromptFormat names it all the
    same, once per character, and lets the characters it reads through."""
    from transformers import AutoTokenizer

    from rollout import PromptFormat
    from tiny_model import TinyConfig, build_tokenizer, hf_config
    build_tokenizer().save_pretrained(tmp_path)
    hf_config(TinyConfig()).save_pretrained(tmp_path)           # (a qwen2 dir: loaded as Qwen2Tokenizer)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("You") == tok.encode("ou")                 # (what makes the check necessary)
    fmt = PromptFormat(tok)
    with pytest.raises(ValueError, match="no token for 'Y'"):
        fmt.first("You")
    with pytest.raises(ValueError, match="no token for 'Y'"):
        fmt.next("You 2", None)
    assert fmt.first("12+3=") == tok.encode("12+3=") and fmt.next("ou 2", None) == tok.encode("ou 2")


def test_heartbeat_while_a_step_collects():
    async def main():
        c, logged = controller(heartbeat_s=0.2, timeout_s=0.9)
        with pytest.raises(TimeoutError):
            await c.collect()                    # nothing ever arrives
        return logged
    logged = [line for line in asyncio.run(main()) if "collecting" in line]
    assert len(logged) >= 3 and "0/2 groups ready" in logged[0] and "tasks queued" in logged[0]


@pytest.mark.fast
def test_prompts_in_flight_at_a_checkpoint_are_admitted_again_after_resume():
    """A checkpoint keeps the prompts admitted but not trained; a resumed controller admits them
    first (before drawing new ones from the stream at the saved position)."""
    from buffer import Sample

    async def main():
        c, _ = controller(max_model_len=0)
        await c.admit()                                          # 2 groups (batch 2, ratio 0)
        tasks = c.buffer.transport.get_many_nowait("tasks", 100)
        g0 = [t for t in tasks if t.group_id == "g0"]
        for t, r in zip(g0, (0.0, 1.0)):                        # g0 completes and is trained; g1 does not
            c.assembler.add(Sample(t.task_id, "g0", [1], [2], [-1.0], [1], [0], r), 0)
        for g in c.assembler.take(1, 0):
            c.problem_of.pop(g[0].group_id)
        saved = [p.prompt for p in c.in_flight_problems()]
        c2, _ = controller(max_model_len=0)
        c2.problems = iter([Problem(f"new{i}", "0") for i in range(100)])
        c2.readmit.extend(c.in_flight_problems())
        await c2.admit()
        again = [t.problem.prompt for t in c2.buffer.transport.get_many_nowait("tasks", 100)]
        return saved, again
    saved, again = asyncio.run(main())
    assert saved == ["short"]                                    # g1's prompt (g0's was trained)
    assert again[:2] == ["short", "short"] and again[2] == "new0"


@pytest.mark.fast
def test_dataset_keys(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"q": "1+1?", "sol": "2", "prompt": "other"}) + "\n")
    [p] = load_dataset(str(f), prompt_key="q", answer_key="sol")
    assert (p.prompt, p.answer) == ("1+1?", "2")
    with pytest.raises(ValueError, match="line 1.*'nope'"):
        load_dataset(str(f), prompt_key="nope")


@pytest.mark.fast
def test_reasoning_gym_task_is_scored_by_its_own_verifier():
    import random

    import task
    make = reasoning_gym_maker("basic_arithmetic", seed=3)
    problems = [make(random.Random(i)) for i in range(5)]
    assert all(p.kind == "rg:basic_arithmetic" and p.prompt for p in problems)
    assert [task.reward(p, p.answer) for p in problems] == [1.0] * 5
    assert task.reward(problems[0], "not a number") == 0.0
    with pytest.raises(ValueError, match="--task"):
        reasoning_gym_maker("no_such_task", seed=0)





@pytest.mark.fast
def test_prompt_format_follows_a_chat_template(chat_model):
    """Multi-turn through a ChatML template: the tokens of prompt + action + observations equal
    the template's rendering of the whole conversation (less what the model did not generate)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_model["dir"])
    fmt = PromptFormat(tok)
    assert fmt.chat and fmt.eos_ids == {tok.eos_token_id}
    first = fmt.first("What is 2+2?")
    action = tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]       # the model ends its turn
    obs = fmt.next("Right. Now 3+3?", tok.eos_token_id)
    whole = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"},
                                     {"role": "assistant", "content": "4"},
                                     {"role": "user", "content": "Right. Now 3+3?"}], tokenize=True,
                                    add_generation_prompt=True, return_dict=False)
    assert first + action + obs == list(whole)
    cut = fmt.next("More?", None)                        # an action cut by the budget: the template closes it
    assert tok.decode(cut).startswith("<|im_end|>")
    assert PromptFormat(tok, use_template=False).first("hi") == tok.encode("hi")


@pytest.mark.fast
def test_a_model_with_two_eos_tokens_gets_a_well_formed_next_turn_whichever_it_stops_on(chat_model, tmp_path):
    """Qwen2.5-Instruct's generation config stops on <|im_end|> and on <|endoftext|>: both are EOS.
    Stopped on <|im_end|>, the template's own close, the next turn does not repeat it; stopped on
    <|endoftext|>, the turn still gets its <|im_end|> (else the conversation never closes the turn)."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig
    d = tmp_path / "two-eos"
    shutil.copytree(chat_model["dir"], d)
    tok = AutoTokenizer.from_pretrained(d)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    GenerationConfig(eos_token_id=[im_end, endoftext]).save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    fmt = PromptFormat(tok)
    assert fmt.eos_ids == {im_end, endoftext}
    first = fmt.first("What is 2+2?")
    whole = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"},
                                     {"role": "assistant", "content": "4"},
                                     {"role": "user", "content": "Right. Now 3+3?"}], tokenize=False,
                                    add_generation_prompt=True)
    four = tok.encode("4", add_special_tokens=False)
    on_im_end = tok.decode(first + four + [im_end] + fmt.next("Right. Now 3+3?", im_end))
    on_endoftext = tok.decode(first + four + [endoftext] + fmt.next("Right. Now 3+3?", endoftext))
    assert on_im_end == whole
    assert on_endoftext == whole.replace("4<|im_end|>", "4<|endoftext|><|im_end|>")
    assert on_endoftext.count("<|im_end|>") == whole.count("<|im_end|>")    # every turn closed once


@pytest.mark.fast
def test_an_evaluation_round_is_scored_apart_from_training():
    """Evaluation samples travel with the training samples but are never trained: greedy and mean@k
    come from them, a retried failure waits for its retry, a final failure scores 0."""
    from buffer import Sample

    async def main():
        c, _ = controller(max_model_len=0)
        ev = Evaluation(c)
        await ev.start([Problem("a", "1"), Problem("b", "2")], k=2)
        tasks = c.buffer.transport.get_many_nowait("tasks", 100)
        assert sorted(t.eval_temperature for t in tasks) == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
        right = {"eval0.0.greedy": 1.0, "eval0.0.t0": 1.0, "eval0.0.t1": 0.0, "eval0.1.greedy": 0.0,
                 "eval0.1.t0": 1.0}
        for t in tasks:
            if t.task_id == "eval0.1.t1":      # fails once (retried), then for good
                for retrying in (True, False):
                    await ev.tap(Sample(t.task_id, t.group_id, [1], [], [], [], [], 0.0, failed=True,
                                        meta={"eval": True, "retrying": retrying}))
                continue
            assert ev.result() == {}
            await ev.tap(Sample(t.task_id, t.group_id, [1], [2], [-1.0], [1], [0], right[t.task_id],
                                meta={"eval": True}))
        return ev.result(), ev.result(), c.assembler.num_ready() + len(c.assembler.pending)
    done, again, trained = asyncio.run(main())
    assert (done == {"eval_version": 0, "eval_greedy": 0.5, "eval_mean_at_2": 0.5}
            and again == {} and trained == 0)


@pytest.mark.fast
def test_reward_deadline_is_lambda_times_the_slowest_correct_answer_within_min_and_max():
    from ext.deadlines import RewardDeadline
    d = RewardDeadline(10.0, factor=2.0, floor_s=1.0)
    assert d.current_s == 10.0                        # no correct answer yet: T_max
    d.record(3.0, 0.0)                                # a wrong answer says nothing of a right one's time
    assert d.current_s == 10.0
    d.record(0.2, 1.0)
    assert d.current_s == 1.0                         # 2 x 0.2 = 0.4: T_min
    d.record(2.0, 1.0)
    d.record(0.5, 1.0)                                # faster than the anchor: the anchor stays the slowest
    assert d.current_s == 4.0
    d.record(7.0, 1.0)
    assert d.current_s == 10.0                        # 14: T_max
    assert RewardDeadline(10.0, factor=0.0, floor_s=1.0).current_s == 10.0


def test_adaptive_reward_timeout_cuts_a_call_that_outlives_the_slowest_correct_one():
    """Verifier calls in real worker processes: before any correct answer a call may take up to
    --reward-timeout-s (a wrong 1 s answer completes); after a correct one of ~0.2 s, the deadline is
    lambda x that (within T_min, T_max), and a 3 s call is cut there: it scores 0 and is counted."""
    async def main():
        pool = RewardPool(1, "reward_fixtures:sleep_then", timeout_s=20.0, timeout_factor=2.0,
                          timeout_min_s=0.3)
        try:
            slow_wrong = await pool.score(Problem("a", ""), "1|0")
            fast_right = await pool.score(Problem("b", ""), "0.2|1")
            deadline, anchor = pool.deadline.current_s, pool.deadline.anchor_s
            t = time.monotonic()
            cut = await pool.score(Problem("c", ""), "3|1")
            waited = time.monotonic() - t
            after = await pool.score(Problem("d", ""), "0|1")        # a fresh worker serves the next call
            return slow_wrong, fast_right, deadline, anchor, cut, waited, after, pool.timeouts
        finally:
            pool.shutdown()
    slow_wrong, fast_right, deadline, anchor, cut, waited, after, timeouts = asyncio.run(main())
    assert (slow_wrong, fast_right) == (0.0, 1.0)
    assert 0.2 <= anchor < 1.0 and deadline == pytest.approx(max(0.3, 2 * anchor))
    assert cut == 0.0 and timeouts == 1 and waited < 2.5
    assert after == 1.0
