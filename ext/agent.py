"""ext/agent.py: train any agent written against the OpenAI client (--agent module:function).

    torchrun ... train.py --agent examples/calc_agent.py:agent --model .cache/tiny-qwen2-calc
    async def agent(client: openai.AsyncOpenAI, model: str, problem: dict) -> float   # the reward

Every sample is one call of the function (problem: the task's fields, at least prompt and answer) with a
client whose API key names that trajectory. The rank's endpoint serves /v1/chat/completions,
/v1/completions and /v1/models from its LLMProxy (Turns, below), so behaviour logprobs, per-token
versions, keep/abort, the async ratio, redundancy (--env-redundancy), retries and timeouts are those of
any env. It listens on 127.0.0.1 (client.base_url, for any HTTP client the agent makes itself); the client
handed to the agent reaches the same handler in-process, through an httpx transport (measured: loopback
HTTP costs a connection per call in flight, and httpx's pool scans them all on every request). The
function's own time between its calls is bounded by --env-step-timeout-s; one that raises, hangs or
returns no number gives a failed sample (counted, retried up to --max-retries); a bad request gets an
OpenAI-style HTTP error (a table of cases: tests/test_agent.py); the run goes on.

Token in, token out. The server keeps the ids it generated and stitches each trajectory from its calls;
the model's text is never tokenised again. A chat call's messages are rendered with the tokenizer's chat
template (with `tools`, where the template takes them) and compared with what the trajectory holds:
- appended: the rendering extends the last call's rendering + the reply's text: the new text is tokenised
  and appended (mask 0), after the EOS the model wrote (as rollout.PromptFormat.next does);
- kept: the text does not extend it (a template that re-renders history: a tool call's JSON re-serialised,
  reasoning dropped from earlier turns), but the messages extend the last call's messages + a reply: the
  server keeps its own ids for all of that and appends only the new messages' rendering;
- restart: neither (the agent rewrote its history): a new segment, trained as the sample in place of what
  came before (Turns). The rank's stats (rollout_stats.json, "agent") count each outcome.
A completions call stitches the same way on its prompt text; a prompt of token ids is used as given.

Tool calls: with `tools` in the request, the reply's <tool_call>{"name": ..., "arguments": ...}</tool_call>
blocks (Qwen's / Hermes' format) come back as OpenAI tool_calls (finish_reason "tool_calls").

Stop strings: the reply's text is cut before the first stop string, and the trajectory keeps only the
model's tokens of the text returned; the stop string's tokens and all after it are dropped. A token that
straddles the cut is dropped too, and the part of the returned text it covered is tokenised with the
agent's next text (mask 0). Why not keep the stop string's tokens: the agent never sees them and builds
its next prompt from the text it got. A ReAct agent (stop=["Observation:"]) writes "Observation: 4"
itself, so kept tokens would put "Observation:" twice into what the engine sees next and into what is
trained, a context the agent never sent. Cut this way, the engine's context and the trained sample are
exactly the text the agent sent, with the model's own tokens where it returned the model's text, whatever
the agent does with the stop string.

A call the agent cancels (its own timeout, asyncio.wait_for) changes nothing: its engine request is
aborted (closing the stream aborts it, as for any cancelled request), and the trajectory takes a call's
new tokens only once the engine has answered it, so a retry of the same prompt is stitched onto the same
state. Over real HTTP the same holds: a client that disconnects cancels its handler.

Deliberate limits: n = 1; the run's --temperature (or the evaluation's) is used, whatever the request says
(the trainer's log-probs assume it); stream=True answers in one chunk once the reply is done; one call at a
time per trajectory; a call past --max-turns is refused.
"""

import asyncio
import collections
import dataclasses
import importlib
import importlib.util
import inspect
import json
import numbers
import re
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from buffer import RolloutTask, Sample
from config import Extension, extension, opt
from buffer import now
from proxy import Completion, Sampling
from rollout import (ENVS, RANK_STATS, Aborted, EnvFailure, FixedDeadline, PromptFormat, RolloutConfig,
                     Trajectory, finite_reward)

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
ENDED_KEPT = 4096           # keys of ended trajectories remembered, to say "ended" rather than "unknown"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class AgentConfig:
    agent: str = opt("", "an OpenAI-client agent as the env: module:function or path/file.py:function, "
                         "async (client, model, problem: dict) -> a finite reward (ext/agent.py)")
    agent_port: int = opt(0, "--agent: each rollout rank's endpoint port (127.0.0.1); 0 = a free one")


def load_agent(spec: str):
    """--agent module:function | path/file.py:function -> the async function, or ValueError naming it."""
    where, sep, name = spec.rpartition(":")
    if not (sep and where and name):
        raise ValueError(f"--agent {spec!r}: expected module:function or path/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"no file {where}")
            mod_spec = importlib.util.spec_from_file_location(f"agent_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_spec.name] = module
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as e:
        raise ValueError(f"--agent {spec!r}: cannot load {where} ({e})") from None
    fn = getattr(module, name, None)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"--agent {spec!r}: {name} is not an async function in {where} (expected async def "
                         f"{name}(client, model, problem) -> float)")
    return fn


class HTTPError(Exception):
    """An OpenAI-style error answer: status, message, code."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


def text_of(content) -> str:
    """A message's content as text: a string, None, or a list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def for_template(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates expect them: text content, a tool call's arguments as a dict."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise HTTPError(400, f"messages: every message needs a role, got {str(m)[:100]!r}")
        m = {**m, "content": text_of(m.get("content"))}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply in Qwen's / Hermes' format; a block that is not JSON stays text."""
    calls, kept = [], []
    last = 0
    for m in TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
            name, args = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": f"call_{secrets.token_hex(6)}", "type": "function",
                      "function": {"name": str(name),
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return (content or None) if calls else content, calls


class Session:
    """One trajectory's side of the endpoint: its Turns and what stitching needs of its last call."""

    def __init__(self, turns):
        self.turns, self.fmt = turns, turns.fmt
        self.seen: str | None = None  # the last call's prompt text + its reply's text (None: not text)
        self.tail = ""                # the reply's text that its kept tokens do not hold (a cut token's)
        self.messages: list[dict] | None = None     # the last chat call's messages
        self.pending: list[dict] | None = None      # this call's, until it has its reply

    def stitch(self, text: str) -> list[int] | None:
        """The ids for a prompt whose text is `text`: the trajectory's + the new text's, if it extends the
        last call's text; else None."""
        if self.seen is None or not self.turns.traj.num_turns or not text.startswith(self.seen):
            return None
        return self.turns.ids + self.fmt.tok.encode(self.tail + self.after_eos(text[len(self.seen):]),
                                                    add_special_tokens=False)

    def after_eos(self, text: str) -> str:
        """Text that follows the last reply, less the EOS at its start if the model wrote that EOS itself
        (it is in the ids already), as rollout.PromptFormat.next does. (A reply cut by a stop string
        has no EOS: Turns.keep.)"""
        last = self.turns.last_token
        eos = self.fmt.tok.decode([last]) if last is not None else None
        return text[len(eos):] if eos and text.startswith(eos) else text

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        kw = {"tools": tools} if tools else {}
        try:
            return self.fmt.tok.apply_chat_template(for_template(messages), tokenize=False,
                                                    add_generation_prompt=generation_prompt, **kw)
        except HTTPError:
            raise
        except Exception as e:        # the template's own error (a role it does not know, ...)
            raise HTTPError(400, f"messages: the chat template cannot render them ({e})") from None

    def chat_ids(self, messages: list[dict], tools) -> tuple[list[int], str, str]:
        """A chat call's prompt: (ids, its rendered text, how: appended | kept | new), as above."""
        full = self.render(messages, tools, True)
        self.pending = messages
        ids = self.stitch(full)
        if ids is not None:
            return ids, full, "appended"
        prev = self.messages
        if (prev is not None and self.turns.traj.num_turns and len(messages) > len(prev)
                and messages[:len(prev)] == prev and messages[len(prev)].get("role") == "assistant"):
            base = self.render(messages[:len(prev) + 1], tools, False)
            if full.startswith(base):
                close = self.after_eos(self.fmt.close_turn)    # what the template puts after a reply
                new = self.fmt.tok.encode(self.tail + close + full[len(base):], add_special_tokens=False)
                return self.turns.ids + new, full, "kept"
        return self.fmt.tok.encode(full, add_special_tokens=False), full, "new"

    def prompt_ids(self, prompt) -> tuple[list[int], str | None, str]:
        """A completions call's prompt: text (stitched like a chat call's rendering) or token ids (as given);
        (ids, the text or None, how)."""
        self.pending = None
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]                  # a batch of one
        if isinstance(prompt, str) and prompt:
            ids = self.stitch(prompt)
            if ids is not None:
                return ids, prompt, "appended"
            return self.fmt.tok.encode(prompt, add_special_tokens=False), prompt, "new"
        vocab = len(self.fmt.tok)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            return list(prompt), None, "token ids"
        raise HTTPError(400, f"prompt: one non-empty string or list of token ids in [0, {vocab}) is "
                             f"required, got {str(prompt)[:100]!r}")

    def reply(self, token_ids: list[int], prompt_text: str | None, stop: list[str]) -> tuple[str, str | None]:
        """After the call: the reply's text, cut before the first stop string, and the finish reason the cut
        sets (None: the engine's). A cut reply keeps in the trajectory only the model's tokens of the text
        returned (module docstring: the agent's next prompt is built from that text, not from the stop
        string); `tail` is the returned text that a token straddling the cut held, added before the
        agent's next text."""
        text, finish = self.fmt.decode(token_ids), None
        self.tail = ""
        hits = [text.index(s) for s in stop if isinstance(s, str) and s and s in text]
        if hits:
            text, finish = text[:min(hits)], "stop"
            k = self.tokens_of(token_ids, text)
            self.turns.keep(k)
            self.tail = text[len(self.fmt.decode(token_ids[:k])):]
        self.seen = None if prompt_text is None else prompt_text + text
        self.messages = self.pending
        return text, finish

    def tokens_of(self, token_ids: list[int], text: str) -> int:
        """How many of token_ids, at most, decode to a prefix of `text` (the reply's text, cut): a binary
        search on the decoded length (decoding every prefix in turn costs O(n^2)), then back while the
        decoded text is not a prefix of `text` (a decoder's partial character). 0 at worst."""
        lo, hi = 0, len(token_ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(self.fmt.decode(token_ids[:mid])) <= len(text) else (lo, mid - 1)
        while lo and not text.startswith(self.fmt.decode(token_ids[:lo])):
            lo -= 1
        return lo


def error_body(status: int, message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def sse(out: dict, chat: bool) -> bytes:
    """stream=True: the whole reply in one chunk, then the finish chunk, the usage and [DONE] (server-sent
    events; the reply is complete before anything is sent)."""
    choice = out["choices"][0]
    if chat:
        delta = {"role": "assistant", "content": choice["message"]["content"]}
        if "tool_calls" in choice["message"]:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
        obj, first, last = "chat.completion.chunk", {"delta": delta}, {"delta": {}}
    else:
        obj, first, last = "text_completion", {"text": choice["text"]}, {"text": ""}
    base = {"id": out["id"], "object": obj, "created": out["created"], "model": out["model"]}
    chunks = [{**base, "choices": [{"index": 0, **part, "finish_reason": finish, "logprobs": None}]}
              for part, finish in ((first, None), (last, choice["finish_reason"]))]
    chunks.append({**base, "choices": [], "usage": out["usage"]})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


class Endpoint:
    """The OpenAI-compatible endpoint of one rollout rank (process). `handle` answers a request (path, API
    key, body) without any transport; an aiohttp server on 127.0.0.1 serves it over HTTP to any client
    (client.base_url), and the clients given to the agent reach it in-process through an httpx transport
    (no socket: loopback HTTP/1.1 costs a connection per call in flight, and httpx's pool scans them all
    on every request). Started by the first trajectory that needs it; the API key names the trajectory."""

    def __init__(self, model: str, port: int):
        self.model, self.port = model, port
        self.sessions: dict[str, Session] = {}
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.counters = collections.Counter()
        self.started: asyncio.Future | None = None
        self.http = None                # the agents' httpx client (in-process transport), shared
        self.runner = None

    def stats(self) -> dict:
        return {**self.counters, "handler_cpu_s": round(self.counters["handler_cpu_s"], 4)}

    async def base_url(self) -> str:
        """The base URL, once the server listens (one start however many trajectories ask at once)."""
        if self.started is None:
            self.started = asyncio.get_running_loop().create_future()
            try:
                self.started.set_result(await self._serve())
            except Exception as e:
                self.started.set_exception(e)
        return await asyncio.shield(self.started)

    async def _serve(self) -> str:
        import httpx
        from aiohttp import web
        endpoint = self

        async def route(request):
            status, out = await self.handle(request.path, request.headers.get("Authorization", ""),
                                            await request.read())
            if isinstance(out, bytes):
                return web.Response(body=out, status=status, content_type="text/event-stream")
            return web.json_response(out, status=status)
        app = web.Application(client_max_size=64 << 20)
        for path in ROUTES:
            app.router.add_route("GET" if path == "/v1/models" else "POST", path, route)
        # a client that disconnects (its own timeout) cancels its handler, and so its engine request
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        try:
            await site.start()
        except OSError as e:
            raise RuntimeError(f"--agent-port {self.port}: cannot listen on 127.0.0.1 ({e})") from None

        class InProcess(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request):
                auth = request.headers.get("authorization", "")
                status, out = await endpoint.handle(request.url.path, auth, await request.aread())
                if isinstance(out, bytes):
                    return httpx.Response(status, content=out, headers={"content-type": "text/event-stream"})
                return httpx.Response(status, json=out)

        class Shared(httpx.AsyncClient):      # an agent closing its client (async with client: ...) must
            async def aclose(self):           # not close the others'
                pass
        self.http = Shared(transport=InProcess(), timeout=None)
        RANK_STATS["agent"] = self.stats
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"

    async def close_server(self):
        """Stop serving, and its counters leave the rank's stats (tests; a rank's server ends with its
        process)."""
        if self.runner is not None:
            await self.runner.cleanup()
        if RANK_STATS.get("agent") == self.stats:
            del RANK_STATS["agent"]

    def open(self, turns) -> str:
        key = f"traj-{secrets.token_hex(12)}"
        self.sessions[key] = Session(turns)
        return key

    def close(self, key: str):
        self.sessions.pop(key, None)
        self.ended[key] = None
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    async def handle(self, path: str, auth: str, body: bytes) -> tuple[int, dict | bytes]:
        """(status, JSON object or server-sent events) for a request to `path` with this Authorization."""
        clock = [time.process_time()]       # this handler's own CPU, the engine's wait left out (_answer)
        self.counters["calls"] += 1
        try:
            path = path.rstrip("/")
            if path == "/v1/models":
                return 200, {"object": "list", "data": [{"id": self.model, "object": "model",
                                                         "owned_by": "train.py"}]}
            if path not in ROUTES:
                raise HTTPError(404, f"no route {path}: this endpoint serves {', '.join(ROUTES)}",
                                "not_found")
            key = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
            return 200, await self._answer(self._session(key), body, path == "/v1/chat/completions", clock)
        except HTTPError as e:
            self.counters[f"http_{e.status}"] += 1
            return e.status, error_body(e.status, str(e), e.code)
        except Exception as e:        # a bug of ours: said, not hidden in a connection error
            self.counters["http_500"] += 1
            return 500, error_body(500, f"the endpoint failed: {e!r}", "internal_error")
        finally:
            self.counters["handler_cpu_s"] += time.process_time() - clock[0]

    def _session(self, key: str) -> Session:
        if key in self.sessions:
            return self.sessions[key]
        if key in self.ended:
            raise HTTPError(409, f"trajectory {key} has ended: its sample is made; a new task gets a new "
                                 f"client", "trajectory_ended")
        raise HTTPError(401, "no running trajectory has this API key (each agent call gets a client whose "
                             "key names its trajectory)", "invalid_api_key")

    async def _answer(self, session: Session, raw: bytes, chat: bool, clock: list[float]) -> dict | bytes:
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise HTTPError(400, f"the request body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        if body.get("model") != self.model:
            raise HTTPError(404, f"model {body.get('model')!r} does not exist: this endpoint serves "
                                 f"{self.model!r}", "model_not_found")
        if body.get("n", 1) != 1:
            raise HTTPError(400, f"n: only 1 is supported (one trajectory, one reply), got {body.get('n')!r}")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise HTTPError(400, f"max_tokens: a positive integer, got {max_tokens!r}")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        tools = body.get("tools") or None
        if chat:
            if not session.fmt.chat:
                raise HTTPError(400, "this model's tokenizer has no chat template (or the run passed "
                                     "--no-chat-template): use /v1/completions", "no_chat_template")
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HTTPError(400, "messages: a non-empty list of messages is required")
            ids, prompt_text, how = session.chat_ids(messages, tools)
        else:
            ids, prompt_text, how = session.prompt_ids(body.get("prompt"))
        restarts = session.turns.restarts
        self.counters["handler_cpu_s"] += time.process_time() - clock[0]
        try:
            c = await session.turns.generate(ids, max_tokens)
        except ValueError as e:
            raise HTTPError(400, str(e), "context_length_exceeded" if "no room" in str(e) else
                            "trajectory_refused") from None
        except Aborted:
            raise HTTPError(409, "trajectory aborted (the rollout rank dropped it: stale, or on request)",
                            "trajectory_aborted") from None
        except Exception as e:
            raise HTTPError(503, f"the engine failed under this call ({e})", "engine_failed") from None
        finally:
            clock[0] = time.process_time()
        if session.turns.traj.num_turns > 1:    # how this call's prompt joined the trajectory
            self.counters["restart" if session.turns.restarts > restarts else how] += 1
        text, cut = session.reply(c.token_ids, prompt_text, stop)
        finish = cut or c.finish_reason
        n = session.turns.last_len
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
        head = {"created": int(time.time()), "model": self.model, "usage": usage}
        if chat:
            content, calls = parse_tool_calls(text) if tools else (text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"], finish = calls, "tool_calls"
            out = {"id": f"chatcmpl-{c.request_id}", "object": "chat.completion", **head,
                   "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}
        else:
            out = {"id": f"cmpl-{c.request_id}", "object": "text_completion", **head,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        self.counters["replies"] += 1
        return sse(out, chat) if body.get("stream") else out


# ---------------------------------------------------------------------------------------------
# a trajectory that the agent drives: Turns, and the rollout seam (rollout.rollout_once: env.run)


class Turns:
    """The engine as the agent's calls reach it (through the endpoint's Session). Token in, token out:
    every call gives the whole context as token ids. A call whose ids extend the trajectory so far
    (prompt + response) appends the extension as observation tokens (mask 0); the first call's ids are
    the prompt. A call that does not extend it starts a new segment: the trajectory restarts from these
    ids, so the sample is the last segment and the model tokens before it are not trained (`restarts`,
    `tokens_dropped`). A call changes the trajectory only once the engine has answered it: one that
    fails or is cancelled leaves it as it was. One call at a time per trajectory. The agent's own time
    between its calls is bounded by the step deadline; the engine's time is not."""

    def __init__(self, proxy, cfg: RolloutConfig, fmt: PromptFormat, task: RolloutTask, traj: Trajectory,
                 tag: str, timeout: asyncio.Timeout, limit_s: float):
        self.proxy, self.cfg, self.fmt, self.task, self.traj, self.tag = proxy, cfg, fmt, task, traj, tag
        self.timeout, self.limit_s = timeout, limit_s
        self.restarts = self.tokens_dropped = 0
        self.busy = self.aborted = self.ended = False
        self.failure: Exception | None = None   # the engine's error under a call (the rank's, not the env's)
        self.last_token: int | None = None      # the last call's last token if it stopped on it, else None
        self.last_len = 0                       # the last call's reply, tokens

    @property
    def ids(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids

    async def generate(self, ids: list[int], max_tokens: int = 0) -> Completion:
        """Generate after `ids` (at most max_tokens, 0 = --max-tokens; and what the context leaves). Raises
        ValueError (the call is refused, nothing changes) for a call after the trajectory ended, beside
        another call, past --max-turns or without room; Aborted when the request was aborted."""
        traj, cfg, where = self.traj, self.cfg, f"rollout rank {self.proxy.rank}: task {self.task.task_id}"
        if self.ended or self.aborted:
            raise ValueError(f"{where}: the trajectory has ended")
        if self.busy:
            raise ValueError(f"{where}: a call of this trajectory is still running (one at a time)")
        if traj.num_turns >= cfg.max_turns:
            raise ValueError(f"{where}: the trajectory has had its --max-turns {cfg.max_turns} model turns")
        if len(ids) >= cfg.max_model_len:
            raise ValueError(f"{where}: prompt of {len(ids)} tokens leaves no room under "
                             f"max_model_len={cfg.max_model_len}")
        n = len(traj.prompt_ids) + len(traj.response_ids)
        extends = bool(traj.prompt_ids) and len(ids) >= n and ids[:n] == self.ids
        temperature = cfg.temperature if self.task.eval_temperature is None else self.task.eval_temperature
        sampling = Sampling(min(max_tokens or cfg.max_tokens, cfg.max_model_len - len(ids)), temperature,
                            stream_interval=cfg.stream_interval)
        traj.request_id = f"r{self.proxy.rank}-{self.task.task_id}-{self.tag}-t{traj.num_turns}"
        self.busy = True
        self.timeout.reschedule(None)           # the engine's time is not the env's
        try:
            c = await self.proxy.generate(ids, sampling, request_id=traj.request_id)
        except Exception as e:
            self.failure = e
            raise
        finally:
            traj.request_id, self.busy = None, False
            self.timeout.reschedule(now() + self.limit_s)
        if c.finish_reason == "abort":
            self.aborted = True
            raise Aborted(f"{where} turn {traj.num_turns} aborted")
        # Only now, with the engine's answer, does the call change the trajectory: a call that failed or
        # was cancelled (the agent's own timeout; its engine request is aborted as the stream closes)
        # leaves it as it was, so the agent's retry of the same prompt joins it as the first try would.
        if extends:
            traj.add(list(ids[n:]))
        else:
            if traj.prompt_ids:                 # a new segment: what came before is not trained
                self.restarts += 1
                self.tokens_dropped += sum(traj.loss_mask)
            traj.prompt_ids, traj.response_ids, traj.logprobs, traj.loss_mask, traj.versions = (
                list(ids), [], [], [], [])
        traj.add(c.token_ids, c.logprobs, c.versions)
        traj.num_turns += 1
        traj.finish_reason = c.finish_reason
        self.last_token = c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids else None
        self.last_len = len(c.token_ids)
        return c

    def keep(self, k: int):
        """Keep only the first k (0 or more) tokens of the last reply (a stop string cut it there): the
        rest go, its EOS with them, so what follows is the agent's text after a reply with no EOS."""
        t, cut = self.traj, self.last_len - k
        if cut > 0:
            del t.response_ids[-cut:], t.logprobs[-cut:], t.loss_mask[-cut:], t.versions[-cut:]
            self.last_len = k
        self.last_token, t.finish_reason = None, "stop"


async def drive(proxy, fmt, cfg, task, traj, tag, meta, deadline, play) -> Sample:
    """rollout_once for an env that drives its own turns: `reward = await play(turns)`. Raises Aborted if a
    turn was aborted, EnvFailure if play raised or outlived the deadline between its calls (or made no
    call), the engine's error if one came under a call; else the trajectory's Sample."""
    where = f"rollout rank {proxy.rank}: env {task.env!r}"
    limit_s = deadline.current_s["step"]
    error = None
    timeout = asyncio.timeout_at(now() + limit_s)
    turns = Turns(proxy, cfg, fmt, task, traj, tag, timeout, limit_s)
    try:
        async with timeout:
            reward = await play(turns)
    except Exception as e:    # (the deadline's TimeoutError too; CancelledError is not one: aborts pass)
        error = e
    finally:
        turns.ended = True
    if turns.failure is not None:               # the engine's (EngineError: ext/recovery.py's to handle)
        raise turns.failure from None
    if turns.aborted:
        raise Aborted(f"{where}: task {task.task_id} aborted")
    if timeout.expired():
        raise EnvFailure(f"{where} run (task {task.task_id}) spent longer than {round(limit_s, 3):g}s "
                         f"between model calls", timeout=True) from None
    if error is not None:
        raise EnvFailure(f"{where} run (task {task.task_id}) raised {error!r}") from error
    if not traj.num_turns:
        raise EnvFailure(f"{where} run (task {task.task_id}) returned without calling the model")
    return Sample(task.task_id, task.group_id, traj.prompt_ids, traj.response_ids, traj.logprobs,
                  traj.loss_mask, traj.versions, finite_reward(reward, f"{where} run (task {task.task_id})"),
                  finish_reason=traj.finish_reason,
                  rank=proxy.rank, num_turns=traj.num_turns, admit_version=task.admit_version,
                  meta={**(meta or {}), "eval": task.eval_temperature is not None, "restarts": turns.restarts,
                        "tokens_dropped": turns.tokens_dropped})


# ---------------------------------------------------------------------------------------------
# the env and the extension


class AgentEnv:
    """--agent's env (rollout.rollout_once runs it through run(turns)): one call of the agent function."""

    def __init__(self, fn, name: str, endpoint: Endpoint, problem):
        self.fn, self.name, self.endpoint, self.problem = fn, name, endpoint, problem

    async def run(self, proxy, fmt, cfg, task, traj, tag, meta, deadline) -> Sample:
        return await drive(proxy, fmt, cfg, task, traj, tag, meta, deadline, self.play)

    async def play(self, turns) -> float:
        import openai
        base_url = await self.endpoint.base_url()
        key = self.endpoint.open(turns)
        try:
            client = openai.AsyncOpenAI(base_url=base_url, api_key=key, http_client=self.endpoint.http,
                                        max_retries=0)
            reward = await self.fn(client, self.endpoint.model, dataclasses.asdict(self.problem))
        finally:
            self.endpoint.close(key)
        if not isinstance(reward, numbers.Real):      # (a bool is 0 or 1)
            raise TypeError(f"--agent {self.name}: returned {reward!r}, not a float reward")
        return float(reward)


def register(fn, name: str, model: str, port: int = 0) -> Endpoint:
    """ENVS["agent"]: the agent function `fn` (named `name` in errors) as the env, served by a new endpoint
    (this process's: one per rollout rank) under the model name `model`."""
    endpoint = Endpoint(model, port)
    ENVS["agent"] = lambda problem, seed, reward_fn=None: AgentEnv(fn, name, endpoint, problem)
    return endpoint


@extension
class Agent(Extension):
    """--agent: the env is an OpenAI-client agent function, served by an endpoint on every rollout rank."""
    name = "agent"
    Config = AgentConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return bool(part.agent)

    @classmethod
    def configure(cls, cfg, part):
        if cfg.controller.env not in ("", "agent"):
            raise ValueError(f"--agent runs the agent as the env: drop --env {cfg.controller.env}")
        load_agent(part.agent)                  # (raises naming --agent)

    def __init__(self, cfg, part):
        super().__init__(cfg, part)
        self.fn = load_agent(part.agent)
        self.model = Path(cfg.model).name if cfg.model else "tiny-qwen2"     # the name agents ask for
        register(self.fn, part.agent, self.model)     # (the trainer's --env check; on_proxy's is the one)

    def resolve(self, cfg):
        return dataclasses.replace(cfg, controller=dataclasses.replace(cfg.controller, env="agent"))

    def on_proxy(self, proxy, index: int, t_start: float):
        port = self.part.agent_port + index if self.part.agent_port else 0
        register(self.fn, self.part.agent, self.model, port)
