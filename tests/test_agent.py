"""--agent (ext/agent.py): OpenAI-client agents as envs, on the timed fake engine (scripted replies) with the
real openai client over the rank's real HTTP endpoint, and on a real vLLM engine with the tiny model.

Token in, token out: the trained sample must be exactly the ids the engine generated, stitched with the
ids of what the agent added between calls (never the reply's text tokenised again), for the tiny model's
template (append-only), a ChatML one with tools (a tool call's JSON re-rendered: the server keeps its
ids), and a history the agent rewrote (a new segment)."""

import asyncio
import json
import string
from pathlib import Path

import openai
import pytest

from buffer import Cmd, Command, LocalQueues, RolloutTask, SampleBuffer
from env_manager import EnvManager, RolloutConfig
from ext.agent import load_agent, parse_tool_calls, register
from proxy import LLMProxy
from rollout import ENVS, RANK_STATS
from task import Problem
from tools.fake_engine import FakeTimedEngine

ROOT = Path(__file__).resolve().parent.parent
MODEL = "policy"


@pytest.fixture(autouse=True)
def registries():
    """ENVS["agent"] and RANK_STATS["agent"], which register() fills, are as they were after each test
    (other tests build every env of ENVS)."""
    saved = dict(ENVS), dict(RANK_STATS)
    yield
    for registry, before in zip((ENVS, RANK_STATS), saved):
        registry.clear()
        registry.update(before)


@pytest.fixture(scope="module")
def tiny_tok():
    from tiny_model import build_tokenizer
    return build_tokenizer()


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a Qwen-style ChatML template with tools: a tool call is re-rendered as tojson of name and arguments
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer(merged: tuple[str, ...] = ()):
    """A character-level tokenizer over printable ASCII with ChatML's special tokens (EOS <|im_end|>), and
    the strings of `merged` as single tokens wherever they occur (as a BPE tokenizer's merges make them)."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    tk = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIALS + chars + list(merged))},
                                    unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("|".join([*map(re.escape, merged), "."])),
                                            behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, additional_special_tokens=["<|im_start|>"],
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML_TOOLS
    return tok


@pytest.fixture(scope="module")
def chatml_tok():
    return char_tokenizer()


def scripted(tok, script):
    """The fake engine's respond(prompt_ids): the reply (text, then the EOS) of the first (needle, reply)
    of `script` whose needle ends the decoded prompt's last turn; records every prompt it is given."""
    prompts = []

    def respond(ids):
        text = tok.decode(ids)
        prompts.append(list(ids))
        for needle, reply in script:
            if needle in text[-len(needle) - 40:]:
                return tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
        return tok.encode("?", add_special_tokens=False) + [tok.eos_token_id]
    respond.prompts = prompts
    return respond


def run_agent(tok, fn, respond, problems, cfg=None, env_step_timeout_s=5.0, holder=None, engine=None):
    """Each problem as one agent task on a fresh EnvManager over the fake engine (`engine`, or a new one
    answering with `respond`): (samples and failed samples in arrival order, the rank's stats, the
    endpoint)."""
    cfg = cfg or RolloutConfig(max_tokens=80, max_model_len=400, max_retries=0,
                               env_step_timeout_s=env_step_timeout_s)

    async def main():
        endpoint = register(fn, "test agent", MODEL)
        if holder is not None:
            holder["endpoint"] = endpoint
        proxy = LLMProxy(engine or FakeTimedEngine(t0=0.001, k=0.0, respond=respond, vocab_size=len(tok)),
                         rank=0, timeout_s=30)
        buf = SampleBuffer(LocalQueues(1), "agent test", timeout_s=60)
        mgr = EnvManager(proxy, buf, tok, rank=0, cfg=cfg)
        tasks = [RolloutTask(f"t{i}", f"g{i}", p, env="agent") for i, p in enumerate(problems)]
        await buf.put_tasks(tasks)
        run = asyncio.create_task(mgr.run())
        got = []
        while len({s.task_id for s in got if not (s.failed and s.meta.get("retrying"))}) < len(tasks):
            got.append(await buf.get_sample(timeout=60))
        await buf.send_command(0, Command(Cmd.STOP))
        stats = await asyncio.wait_for(run, 60)
        await endpoint.close_server()
        return got, stats, endpoint
    return asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# the tiny model's template: the calculator agent of examples/, token in, token out


def test_the_calc_agent_of_examples_trains_on_exactly_the_engines_ids(tiny_tok):
    agent = load_agent(str(ROOT / "examples" / "calc_agent.py") + ":agent")
    respond = scripted(tiny_tok, [(" =42 answer:", "42"), ("40+2=", "calc(40+2)")])
    got, stats, _ = run_agent(tiny_tok, agent, respond, [Problem("40+2=", "42")])
    [s] = got
    assert not s.failed and s.reward == 1.0 and s.num_turns == 2
    enc = lambda t: tiny_tok.encode(t, add_special_tokens=False)      # noqa: E731
    eos = tiny_tok.eos_token_id
    # prompt, the engine's reply (mask 1, its EOS too), the agent's observation (mask 0), the engine's answer
    assert s.prompt_ids == enc("40+2=")
    assert s.response_ids == enc("calc(40+2)") + [eos] + enc(" =42 answer:") + enc("42") + [eos]
    assert s.loss_mask == [1] * 11 + [0] * 12 + [1] * 3
    assert respond.prompts == [s.prompt_ids, s.prompt_ids + s.response_ids[:23]]   # what the engine saw
    assert len(s.versions) == sum(s.loss_mask) and all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask)
                                                       if m == 0)
    agent_stats = stats["agent"]
    assert agent_stats["appended"] == 1 and "kept" not in agent_stats and "restart" not in agent_stats
    assert agent_stats["replies"] == 2 and agent_stats["calls"] == 2


# ---------------------------------------------------------------------------------------------
# a ChatML template with tools: tool calls both ways, and the three ways a call joins its trajectory

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_tool_calls_come_back_as_openai_tool_calls_and_the_server_keeps_its_ids(chatml_tok):
    seen = {}

    async def agent(client, model, problem):
        msgs = [{"role": "user", "content": problem["prompt"]}]
        r = await client.chat.completions.create(model=model, messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        seen["finish"], seen["calls"], seen["content"] = r.choices[0].finish_reason, m.tool_calls, m.content
        call = m.tool_calls[0]
        value = sum(json.loads(call.function.arguments).values())
        msgs += [m.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(value)}]
        r = await client.chat.completions.create(model=model, messages=msgs, tools=TOOLS)
        return float(r.choices[0].message.content.strip() == problem["answer"])

    # the model writes its JSON without spaces; the template re-renders it with them: not append-only
    call = '<tool_call>\n{"name":"add","arguments":{"a":40,"b":2}}\n</tool_call>'
    respond = scripted(chatml_tok, [("</tool_response><|im_end|>\n<|im_start|>assistant\n", "42"),
                                    ("40+2?<|im_end|>\n<|im_start|>assistant\n", call)])
    got, stats, _ = run_agent(chatml_tok, agent, respond, [Problem("40+2?", "42")])
    [s] = got
    assert seen["finish"] == "tool_calls" and seen["content"] is None
    assert seen["calls"][0].function.name == "add" and json.loads(seen["calls"][0].function.arguments) == {
        "a": 40, "b": 2}
    assert not s.failed and s.reward == 1.0 and s.num_turns == 2
    enc = lambda t: chatml_tok.encode(t, add_special_tokens=False)      # noqa: E731
    eos = chatml_tok.eos_token_id
    reply1 = enc(call) + [eos]
    # the model's own tool-call ids stay; what follows is the template's text after the reply, the tool
    # message and the next generation prompt
    added = enc("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n")
    assert s.response_ids == reply1 + added + enc("42") + [eos]
    assert s.loss_mask == [1] * len(reply1) + [0] * len(added) + [1] * 3
    assert "<tools>" in chatml_tok.decode(s.prompt_ids)                  # the tools reached the template
    assert stats["agent"]["kept"] == 1 and stats["agent"].get("appended", 0) == 0


def test_plain_chat_turns_append_and_a_rewritten_history_starts_a_new_segment(chatml_tok):
    async def agent(client, model, problem):
        msgs = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model=model, messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "again"}]
        r = await client.chat.completions.create(model=model, messages=msgs)      # appended
        # the agent summarises: its history is rewritten, so this call starts a new segment
        msgs = [{"role": "user", "content": "summary: said hello twice"}]
        r = await client.chat.completions.create(model=model, messages=msgs)
        return float(r.choices[0].message.content == "done")

    respond = scripted(chatml_tok, [("hi<|im_end|>\n<|im_start|>assistant\n", "hello"),
                                    ("again<|im_end|>\n<|im_start|>assistant\n", "hello again"),
                                    ("twice<|im_end|>\n<|im_start|>assistant\n", "done")])
    got, stats, _ = run_agent(chatml_tok, agent, respond, [Problem("", "")])
    [s] = got
    enc = lambda t: chatml_tok.encode(t, add_special_tokens=False)      # noqa: E731
    assert s.reward == 1.0 and s.num_turns == 3
    # the sample is the last segment: its own prompt, one reply; the model tokens before it are not trained
    assert s.prompt_ids == enc("<|im_start|>user\nsummary: said hello twice<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert s.response_ids == enc("done") + [chatml_tok.eos_token_id] and s.loss_mask == [1] * 5
    assert s.meta["restarts"] == 1 and s.meta["tokens_dropped"] == 6 + 12
    assert stats["agent"]["appended"] == 1 and stats["agent"]["restart"] == 1
    # the appended call: the engine saw the first call's ids + its reply + only the new turn's text
    first = enc("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert respond.prompts[1] == first + enc("hello") + [chatml_tok.eos_token_id] + enc(
        "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")


def test_parse_tool_calls_keeps_text_that_is_not_a_call():
    content, calls = parse_tool_calls('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}'
                                      '</tool_call>')
    assert content == "Let me add." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_stop_strings_cut_the_reply_and_the_trajectory_and_streaming_answers_in_one_chunk(tiny_tok):
    seen = {}

    async def agent(client, model, problem):
        r = await client.completions.create(model=model, prompt=problem["prompt"], stop=["+"])
        seen["text"], seen["finish"] = r.choices[0].text, r.choices[0].finish_reason
        stream = await client.chat.completions.create(model=model, stream=True,
                                                      messages=[{"role": "user", "content": "x"}])
        seen["chunks"] = [c async for c in stream]
        return 1.0

    respond = scripted(tiny_tok, [("1=", "12+34"), ("x", "ok")])
    got, stats, _ = run_agent(tiny_tok, agent, respond, [Problem("1=", "")])
    [s] = got
    assert seen["text"] == "12" and seen["finish"] == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in seen["chunks"] if c.choices)
    assert text == "ok" and seen["chunks"][-2].choices[0].finish_reason == "stop"
    # the second call's prompt does not extend the first: a new segment (counted); the sample is "x" + "ok"
    assert s.response_ids == tiny_tok.encode("ok", add_special_tokens=False) + [tiny_tok.eos_token_id]
    assert s.meta["tokens_dropped"] == 2          # "12": the text returned; the stop string's "+" was cut


# ---------------------------------------------------------------------------------------------
# a ReAct agent (stop=["Observation:"]): the engine sees and the sample trains exactly what the agent sent


def enc_with(tok):
    return lambda text: tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("merged", [(), ("\nObs",)], ids=["chars", "a token across the cut"])
def test_a_completion_cut_at_a_stop_string_leaves_the_stop_string_to_the_agent(merged):
    """The model writes an observation of its own; the stop string cuts it off and the agent writes the
    real one, "Observation: 4", after the text it got. The engine's next prompt must be that text, not
    the stop string twice. With a token "\nObs" the cut falls inside a model token: that token goes, and
    the "\n" it held comes back with the agent's text (mask 0)."""
    tok = char_tokenizer(merged)
    enc = enc_with(tok)
    got_back = []

    async def agent(client, model, problem):
        prompt = problem["prompt"]
        for _ in range(3):
            r = await client.completions.create(model=model, prompt=prompt, stop=["Observation:"])
            text = r.choices[0].text
            got_back.append((text, r.choices[0].finish_reason))
            if not text.startswith("Action:"):
                return float(text == "Answer: 4")
            prompt += text + "Observation: 4\n"
        return 0.0

    respond = scripted(tok, [("Observation: 4\n", "Answer: 4"),
                             ("Q: 2+2\n", "Action: calc\nObservation: 5\nAnswer: 5")])
    got, stats, _ = run_agent(tok, agent, respond, [Problem("Q: 2+2\n", "4")])
    [s] = got
    assert got_back == [("Action: calc\n", "stop"), ("Answer: 4", "stop")]
    sent = "Q: 2+2\nAction: calc\nObservation: 4\n"           # the agent's second prompt
    assert len(respond.prompts) == 2 and tok.decode(respond.prompts[1]) == sent
    assert not s.failed and s.reward == 1.0 and s.num_turns == 2 and s.meta["restarts"] == 0
    # the model's tokens of the text returned (mask 1), the rest of the agent's text (mask 0), the answer
    model, added = ("Action: calc\n", "Observation: 4\n") if not merged else ("Action: calc",
                                                                                 "\nObservation: 4\n")
    assert s.prompt_ids == enc("Q: 2+2\n")
    assert s.response_ids == enc(model) + enc(added) + enc("Answer: 4") + [tok.eos_token_id]
    assert s.loss_mask == [1] * len(model) + [0] * len(enc(added)) + [1] * 10
    assert s.logprobs == [-1.0 if m else 0.0 for m in s.loss_mask]     # (the fake engine's, and 0.0)
    assert len(s.versions) == sum(s.loss_mask)
    # what the engine saw is what is trained, and the model's tokens are the engine's own (not re-encoded)
    assert respond.prompts[1] == (s.prompt_ids + s.response_ids)[:len(respond.prompts[1])]
    assert stats["agent"]["appended"] == 1


def test_a_chat_reply_cut_at_a_stop_string_leaves_the_stop_string_to_the_agent(chatml_tok):
    """The same for chat: the agent puts the text it got back as the assistant's message and the real
    observation as the user's; the engine's next prompt is exactly the template's rendering of them."""
    enc = enc_with(chatml_tok)
    got_back = []
    sent = []

    async def agent(client, model, problem):
        msgs = [{"role": "user", "content": problem["prompt"]}]
        for _ in range(3):
            sent.append(chatml_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
            r = await client.chat.completions.create(model=model, messages=msgs, stop=["Observation:"])
            text = r.choices[0].message.content
            got_back.append((text, r.choices[0].finish_reason))
            if not text.startswith("Action:"):
                return float(text == "Answer: 4")
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Observation: 4"}]
        return 0.0

    respond = scripted(chatml_tok, [("Observation: 4<|im_end|>\n<|im_start|>assistant\n", "Answer: 4"),
                                    ("Q: 2+2<|im_end|>\n<|im_start|>assistant\n",
                                     "Action: calc\nObservation: 5\nAnswer: 5")])
    got, stats, _ = run_agent(chatml_tok, agent, respond, [Problem("Q: 2+2", "4")])
    [s] = got
    assert got_back == [("Action: calc\n", "stop"), ("Answer: 4", "stop")]
    assert respond.prompts == [enc(sent[0]), enc(sent[1])]        # exactly what the agent's messages render
    assert not s.failed and s.reward == 1.0 and s.num_turns == 2 and s.meta["restarts"] == 0
    # the reply was cut, so no EOS of the model's: the template's <|im_end|> comes with the agent's text
    added = enc("<|im_end|>\n<|im_start|>user\nObservation: 4<|im_end|>\n<|im_start|>assistant\n")
    assert s.prompt_ids == enc(sent[0])
    assert s.response_ids == enc("Action: calc\n") + added + enc("Answer: 4") + [chatml_tok.eos_token_id]
    assert s.loss_mask == [1] * 13 + [0] * len(added) + [1] * 10
    assert s.logprobs == [-1.0 if m else 0.0 for m in s.loss_mask] and len(s.versions) == 23
    assert respond.prompts[1] == (s.prompt_ids + s.response_ids)[:len(respond.prompts[1])]
    assert stats["agent"]["appended"] == 1


# ---------------------------------------------------------------------------------------------
# an agent's own timeout: the call it cancels leaves nothing behind, in the trajectory or the engine


@pytest.mark.parametrize("over_http", [False, True], ids=["in-process", "http"])
def test_a_call_the_agent_cancels_and_retries_is_in_the_trajectory_once(chatml_tok, over_http):
    """The agent wraps its second call in asyncio.wait_for and its timeout fires while the engine holds
    the request (the engine is paused at that request, so the timeout always fires first); the agent then
    retries the same prompt. The cancelled request must leave the engine, and the retry's prompt (and the
    sample) must hold the observation once: the cancelled call must not have changed the trajectory."""
    enc = enc_with(chatml_tok)
    holding = asyncio.Event()          # the engine has the second call's request, paused
    seen = {}

    def respond(ids):
        prompts.append(list(ids))
        if len(prompts) == 2:
            engine.paused = True       # (the engine steps no request until resumed)
            holding.set()
        return enc("A2" if len(prompts) > 1 else "A1") + [chatml_tok.eos_token_id]
    prompts: list[list[int]] = []
    engine = FakeTimedEngine(t0=0.001, k=0.0, respond=respond, vocab_size=len(chatml_tok))

    async def agent(client, model, problem):
        if over_http:      # the same trajectory through the rank's HTTP server: a timeout disconnects
            client = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        r = await client.completions.create(model=model, prompt="Q\n")
        prompt = "Q\n" + r.choices[0].text + "obs\n"
        call = asyncio.ensure_future(client.completions.create(model=model, prompt=prompt))
        await holding.wait()
        try:                           # the agent's timeout fires now, while the engine holds the call
            await asyncio.wait_for(call, timeout=0)
        except TimeoutError:
            seen["timed out"] = True
        try:                           # (over HTTP the server sees the disconnect a moment later)
            async with asyncio.timeout(3):
                while engine.running:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise AssertionError("the cancelled call's request is still in the engine") from None
        await engine.resume()
        r = await client.completions.create(model=model, prompt=prompt)
        return float(r.choices[0].text == "A2")

    got, stats, _ = run_agent(chatml_tok, agent, None, [Problem("", "")], engine=engine)
    [s] = got
    assert not s.failed, s.meta["error"]
    assert seen == {"timed out": True} and s.reward == 1.0
    eos = chatml_tok.eos_token_id
    first = enc("Q\n") + enc("A1") + [eos] + enc("obs\n")         # "Q\nA1<|im_end|>obs\n"
    assert [chatml_tok.decode(p) for p in prompts[1:]] == [chatml_tok.decode(first)] * 2
    assert prompts == [enc("Q\n"), first, first]
    assert s.prompt_ids == enc("Q\n") and s.num_turns == 2 and s.meta["restarts"] == 0
    assert s.response_ids == enc("A1") + [eos] + enc("obs\n") + enc("A2") + [eos]
    assert s.loss_mask == [1] * 3 + [0] * 4 + [1] * 3 and len(s.versions) == 6
    assert not engine.running and stats["in_flight"] == 0


# ---------------------------------------------------------------------------------------------
# bad input: a clear HTTP error or a failed sample counted, nothing lost, the run goes on


def test_bad_requests_and_bad_agents_get_clear_errors_or_failed_samples_and_the_run_goes_on(tiny_tok):
    errors = {}
    keys = {}

    async def call(name, coro):
        try:
            await coro
        except openai.APIStatusError as e:
            errors[name] = (e.status_code, e.message)

    async def bad_requests(client, model, problem):
        await call("unknown model", client.completions.create(model="gpt-4", prompt="1+1="))
        await call("over-long prompt", client.completions.create(model=model, prompt="1+1=" * 200))
        await call("n=2", client.completions.create(model=model, prompt="1+1=", n=2))
        await call("bad prompt", client.completions.create(model=model, prompt=[[1, 2], [3]]))
        await call("token id out of range", client.completions.create(model=model, prompt=[1, 999]))
        await call("no key", openai.AsyncOpenAI(base_url=client.base_url, api_key="nope", max_retries=0)
                   .completions.create(model=model, prompt="1+1="))
        # the same trajectory over real HTTP (the server at client.base_url), then in-process again
        over_http = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        keys["models"] = [m.id for m in (await over_http.models.list()).data]
        keys["http"] = (await over_http.completions.create(model=model, prompt="1+1=")).choices[0].text
        r = await client.completions.create(model=model, prompt="1+1=")
        keys["ended"] = client
        return float(r.choices[0].text == "2")

    async def raises(client, model, problem):
        await client.completions.create(model=model, prompt="1+1=")
        raise RuntimeError("the agent's own bug")

    async def hangs(client, model, problem):
        await client.completions.create(model=model, prompt="1+1=")
        await asyncio.sleep(3600)

    async def no_call(client, model, problem):
        return 1.0

    async def not_a_float(client, model, problem):
        await client.completions.create(model=model, prompt="1+1=")
        return "yes"

    async def after_end(client, model, problem):
        while "ended" not in keys or keys["ended"].api_key in holder["endpoint"].sessions:
            await asyncio.sleep(0.01)       # (until the bad requests' trajectory has ended)
        await call("after its trajectory ended", keys["ended"].completions.create(model=model, prompt="1+1="))
        r = await client.completions.create(model=model, prompt="1+1=")
        return float(r.choices[0].text == "2")

    agents = {"bad requests": bad_requests, "raises": raises, "hangs": hangs, "no call": no_call,
              "not a float": not_a_float, "after end": after_end}

    async def dispatch(client, model, problem):
        return await agents[problem["prompt"]](client, model, problem)

    respond = scripted(tiny_tok, [("1+1=", "2")])
    holder = {}
    got, stats, endpoint = run_agent(tiny_tok, dispatch, respond, [Problem(k, "") for k in agents],
                                     env_step_timeout_s=2.0, holder=holder)
    by_task = {s.task_id: s for s in got}
    ok = {k: not by_task[f"t{i}"].failed for i, k in enumerate(agents)}
    assert ok == {"bad requests": True, "raises": False, "hangs": False, "no call": False,
                  "not a float": False, "after end": True}
    assert by_task["t0"].reward == 1.0 and by_task["t5"].reward == 1.0
    failed = {k: by_task[f"t{i}"].meta["error"] for i, k in enumerate(agents) if not ok[k]}
    assert "the agent's own bug" in failed["raises"]
    assert "longer than 2s between model calls" in failed["hangs"] and by_task["t2"].meta["timeout"]
    assert "without calling the model" in failed["no call"]
    assert "not a float reward" in failed["not a float"]
    expected = {"unknown model": (404, "model 'gpt-4' does not exist"),
                "over-long prompt": (400, "leaves no room under max_model_len=400"),
                "n=2": (400, "n: only 1 is supported"),
                "bad prompt": (400, "prompt: one non-empty string or list of token ids"),
                "token id out of range": (400, "prompt: one non-empty string or list of token ids"),
                "no key": (401, "no running trajectory has this API key"),
                "after its trajectory ended": (409, "has ended")}
    assert set(errors) == set(expected) and keys["models"] == [MODEL] and keys["http"] == "2"
    for name, (status, text) in expected.items():
        assert errors[name][0] == status and text in errors[name][1], (name, errors[name])
    assert stats["samples_failed"] == 4 and stats["samples_sent"] == 2 and stats["in_flight"] == 0
    assert not endpoint.sessions                                         # every trajectory closed


def test_an_aborted_trajectory_sends_nothing_and_leaves_no_session(tiny_tok):
    """The controller aborts a group while its agent waits for a reply: no sample, the session is gone."""
    async def agent(client, model, problem):
        await client.completions.create(model=model, prompt="1+1=", max_tokens=30)
        return 1.0

    async def main():
        endpoint = register(agent, "test agent", MODEL)
        engine = FakeTimedEngine(t0=0.05, k=0.0, respond=lambda ids: [5] * 30, vocab_size=len(tiny_tok))
        proxy = LLMProxy(engine, rank=0, timeout_s=30)
        buf = SampleBuffer(LocalQueues(1), "agent test", timeout_s=60)
        mgr = EnvManager(proxy, buf, tiny_tok, rank=0, cfg=RolloutConfig(max_tokens=32, max_model_len=100))
        await buf.put_tasks([RolloutTask("t0", "g0", Problem("1+1=", "2"), env="agent")])
        run = asyncio.create_task(mgr.run())
        async with asyncio.timeout(60):          # (the request reaches the engine, then the abort ends it)
            while not engine.running:
                await asyncio.sleep(0.01)
            await buf.send_command(0, Command(Cmd.ABORT_GROUPS, group_ids=["g0"]))
            while endpoint.sessions:
                await asyncio.sleep(0.01)
        await buf.send_command(0, Command(Cmd.STOP))
        stats = await asyncio.wait_for(run, 60)
        left = buf.transport.get_many_nowait("samples", 100)
        await endpoint.close_server()
        return stats, left
    stats, left = asyncio.run(main())
    assert left == [] and stats["in_flight"] == 0 and stats["samples_sent"] == 0
    assert "agent" in stats and "agent" not in RANK_STATS      # the closed endpoint's counters left with it


def test_agent_flag_errors_name_the_flag(tmp_path):
    for spec, text in [("nocolon", "expected module:function"), ("no_such_module_xyz:f", "cannot load"),
                       (f"{ROOT / 'examples' / 'calc_agent.py'}:nope", "is not an async function"),
                       (f"{tmp_path / 'missing.py'}:agent", "no file")]:
        with pytest.raises(ValueError, match="--agent") as e:
            load_agent(spec)
        assert text in str(e.value)


# ---------------------------------------------------------------------------------------------
# train.py --agent under torchrun


def test_train_py_trains_an_openai_client_agent_under_torchrun(tmp_path, tiny_model_dir):
    """The example agent as a run's env (1 trainer + 1 rollout rank on the plain-torch engine, --engine
    torch: the agent's endpoint and the env manager are the subject, not vLLM; the embedded model, built
    first by the fixture: on a fresh clone this is the suite's first run, and the build must not eat its
    timeout): every step trains a full batch within the async ratio, the engines hold the trainer's weights
    after every sync, the redundant trajectories (--env-redundancy) are aborted through the endpoint with
    nothing lost, and the rank's endpoint counted its calls."""
    from tools.jobs import run_to_end, torchrun_cmd
    out = tmp_path / "agent"
    cmd = torchrun_cmd("--out-dir", str(out), "--engine", "torch", "--agent", "examples/calc_agent.py:agent",
                       "--steps", "3",
                       "--batch-groups", "4", "--group-size", "4", "--env-redundancy", "2",
                       "--max-concurrency", "16", "--timeout-s", "180", "--check-sync-every", "1",
                       "--save-every", "0")
    rows = run_to_end(cmd, out, "the --agent run", 900)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["num_samples"] == 16 and r["staleness_max"] <= 2 and 0.0 <= r["reward_mean"] <= 1.0
        assert r["sync_probe_max_diff"] is not None and r["sync_probe_max_diff"] < 1e-4
    log = out.with_suffix(".log").read_text()
    assert "Traceback" not in log
    stats = json.loads((out / "rollout_stats.json").read_text())
    [rank] = stats["rollout_ranks"]
    assert rank["agent"]["replies"] >= 3 * 16 and rank["samples_failed"] == 0 and rank["in_flight"] == 0
    assert stats["controller"]["failed_samples_received"] == 0
