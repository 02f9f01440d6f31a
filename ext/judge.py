"""ext/judge.py: an LLM judge as the reward. A judge model, served by engines of its own, reads each response
and gives its verdict; env-level async hides its latency the way it hides a slow verifier's.

    bash run.sh --judge .cache/tiny-judge --judge-gpus 1 --reward none       # the judge alone, no verifier
    bash run.sh --judge .cache/tiny-judge --judge-gpus 1 --judge-weight 0.5  # half judge, half verifier
    python -m ext.judge --build                                               # build the tiny judge

Where it runs: --judge-gpus K more ranks of the same torchrun job (ext/served.py: a vLLM engine each, never a
weight sync, one shared request queue; what a dead one costs). With --judge-gpus 0 and --judge the same dir
as --teacher, the judge's requests go to the teacher's ranks: one engine serves both (its scoring and its
verdicts batch together). The judge is the rollout ranks' scorer (Extension.scorer): it is called in the env's
reward step, so its latency is part of the trajectory (env-level async runs other trajectories meanwhile) and
the env deadline bounds it: a verdict later than that (--env-step-timeout-s, or ext/deadlines.py's adaptive
one) fails the sample, which is tried again as any env failure.

The verdict: --judge-template renders (prompt, response, answer) as a conversation; sections start with a line
`[system]`, `[user]` or `[assistant]`, and {prompt}, {response}, {answer} are replaced in one pass (a response
that contains "{answer}" stays as it is). The conversation goes through the judge's chat template, and the
texts put in it are tokenized with its special tokens read as plain text: a response that writes the chat
template's role markers (say "<|im_end|><|im_start|>system") cannot end its section early and speak as the
instructions. Then, by --judge-rule:

    yes     p(yes) / (p(yes) + p(no)) of the first token of --judge-yes and of --judge-no right after the
            rendered conversation (two prompt log-prob requests; nothing generated)
    score   the judge's greedy reply (--judge-max-tokens): its first word "yes" -> 1, "no" -> 0, or a number
            in [0, 1]; anything else is unparsed: reward 0, counted (judge_unparsed)

Refused at start-up, by name, before any engine starts (fit_errors): a template with characters the judge's
tokenizer has no token for, and a judge whose context cannot hold the longest request the run can send it:
the template with the longest prompt and answer (every row of --data, else 1,000 drawn problems), a response
of --max-tokens and the verdict's tokens. What the flags alone show is refused when they are parsed (run.sh's
--print-world-size, before torchrun starts), the rest on rank 0 before the ranks start their engines.

reward = --judge-weight x verdict + (1 - --judge-weight) x the verifier's (--reward) reward; at weight 1 the
verifier is not called. Held-out evaluation (ext/eval.py) scores with the verifier, never the judge (--reward
none: the task's own check), so held-out reward stays comparable between judged and verified runs.

Recorded per step: judge_unparsed (the step's trained samples whose verdict did not parse), time_judge (mean
seconds a trained sample's verdict took) and judge_share (the mean share of a trajectory's time, from its
env's reset to its verdict, spent waiting for the verdict); with --judge-audit, reward_verifier too (the
verifier's mean reward of the same samples, a record, not trained on: the judge's reward rising while it does
not is the student learning the judge's blind spots; the verifier is called on the rollout rank's event loop,
as at --judge-weight < 1, so a slow one, math-verify on --data, slows the rank).

The embedded judge (.cache/tiny-judge, `python -m ext.judge --build`, run.sh builds it when --judge names it;
the tests use half its build, `--build --test`: TEST_JUDGE):
a model of the student's shape and character tokenizer trained from scratch on verdicts against the reference
answer, "37+485=522\n37+485=523?" -> "no" (wrong answers mostly near misses and changed digits, as the
student's are). Its template (judge_template.txt in its dir, the default for it) is that one line. The
response sits where a repeat of the reference would, and a right answer's response is trained as text too:
the judge learns to predict the repeat, and a digit it did not predict is a wrong answer. Trained on the
verdict alone it learned whether a sum looks plausible instead, which the student's near misses usually do
(39-71% agreement with the verifier on the student's answers, against 94% this way; results/judge.md). Its
blind spot: of the wrong answers it passes (61 of 632), most have a wrong tens digit under a right last
digit ("170" for 180), and the student trained on its verdicts finds them (results/README.md). The
character tokenizer has no role markers, so for this toy judge the template's structure separates nothing;
the rule above is what keeps a real judge's instructions apart.
"""

import asyncio
import contextvars
import functools
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from config import Extension, check, extension, opt
from ext.served import check_model_dir, client, drawn_problems, run_rank, served_context, stop

NAME = "judge"               # its served ranks' queues (ext/served.py)
ROOT = Path(__file__).resolve().parent.parent
TINY_JUDGE = ROOT / ".cache" / "tiny-judge"
TEST_JUDGE = ROOT / ".cache" / "tiny-judge-test"     # the tests' judge: half the embedded judge's build
TEMPLATE_FILE = "judge_template.txt"         # in a judge's dir: its default template
DEFAULT_TEMPLATE = """[system]
You grade answers to problems. Read the problem, the reference answer and a response, then reply with one
word: yes if the response's final answer is correct, no if it is not.
[user]
Problem:
{prompt}

Reference answer:
{answer}
[user]
Response:
{response}
[user]
Is the response's final answer correct? Reply yes or no.
"""
ROLES = ("system", "user", "assistant")
# what the reward step learned about the sample it scored, for its sample finisher (the same asyncio task):
# when the env was reset, whether the verdict parsed, the judge's seconds
VERDICT: contextvars.ContextVar[dict] = contextvars.ContextVar("judge_verdict")


@dataclass
class JudgeConfig:
    judge: str = opt("", "an LLM judge as the reward: a model dir whose verdict on each response is its "
                         "reward (--judge-rule, --judge-weight); empty = off")
    judge_gpus: int = opt(0, "ranks after the rollout ranks that serve --judge (a vLLM engine each); 0 with "
                             "--judge the same dir as --teacher: the teacher's ranks serve it")
    judge_template: str = opt("", "a text file: the conversation the judge reads ([system]/[user]/"
                                  "[assistant] sections; {prompt}, {response}, {answer}); default: the "
                                  f"judge dir's {TEMPLATE_FILE}, else a built-in one that asks for yes or no")
    judge_rule: str = opt("yes", "yes: the probability of --judge-yes against --judge-no; score: the greedy "
                                 "reply's yes/no or number in [0, 1] (unparsed: 0, counted)")
    judge_yes: str = opt("yes", "the verdict word for a correct response (its first token is read)")
    judge_no: str = opt("no", "the verdict word for a wrong response")
    judge_max_tokens: int = opt(8, "--judge-rule score: the judge's reply budget (greedy)")
    judge_weight: float = opt(1.0, "reward = this x the verdict + (1 - this) x the verifier's reward")
    judge_timeout_s: float = opt(20.0, "a verdict that takes longer fails the sample (and it is tried "
                                       "again); the env deadline bounds it too")
    judge_audit: bool = opt(False, "also score each trained sample with the verifier, as a record only "
                                   "(reward_verifier in metrics.jsonl beside reward_trained_mean, the same "
                                   "samples' reward): the judge's reward rising while the verifier's does "
                                   "not is the student learning the judge's blind spots")

    def __post_init__(self):
        check(self, at_least=dict(judge_gpus=0, judge_weight=0, judge_max_tokens=1),
              at_most=dict(judge_weight=1), above=dict(judge_timeout_s=0),
              one_of=dict(judge_rule=("yes", "score")))
        if self.judge_gpus and not self.judge:
            raise ValueError(f"--judge-gpus {self.judge_gpus} without --judge: ranks need a judge to serve")


# ---------------------------------------------------------------------------------------------
# the template and the verdict


def read_template(path: str, where: str) -> list[tuple[str, str]]:
    """A template file as [(role, text with placeholders)] ("<default>": DEFAULT_TEMPLATE), refused by name
    when it has no section, a role not in ROLES, or no {response}."""
    return read_template_text(Path(path).read_text() if path != "<default>" else DEFAULT_TEMPLATE, where)


def read_template_text(text: str, where: str = "the template") -> list[tuple[str, str]]:
    sections, role = [], None
    for line in text.splitlines(keepends=True):
        m = re.fullmatch(r"\[(\w+)\]\s*", line)
        if m:
            if m.group(1) not in ROLES:
                raise ValueError(f"{where}: section [{m.group(1)}]: a role is one of {', '.join(ROLES)}")
            role = m.group(1)
            sections.append([role, ""])
        elif role is None:
            if line.strip():
                raise ValueError(f"{where}: text before the first section line ([system], [user], ...)")
        else:
            sections[-1][1] += line
    if not sections:
        raise ValueError(f"{where}: no section: start one with a line [user]")
    if not any("{response}" in t for _, t in sections):
        raise ValueError(f"{where}: no {{response}} in it: the judge would never see the response")
    return [(r, t.rstrip("\n")) for r, t in sections]


def fill(sections: list[tuple[str, str]], prompt: str, response: str, answer: str) -> list[dict]:
    """The conversation: every placeholder replaced in one pass (what is put in is never read again)."""
    values = {"prompt": prompt, "response": response, "answer": answer}
    return [{"role": r, "content": re.sub(r"\{(prompt|response|answer)\}", lambda m: values[m.group(1)], t)}
            for r, t in sections]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation through the judge's chat template, as token ids: the template's own text with its
    special tokens, each message's text with special tokens read as plain text (so a message cannot write a
    role marker). Without a chat template: the messages' texts one after another."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(m["content"] for m in messages)
    ids, at = [], 0
    for m in messages:
        start = text.find(m["content"], at)
        if start < 0:
            raise ValueError(f"the judge's chat template changed a message's text "
                             f"({m['content'][:40]!r}...): cannot keep it apart from the template's markers")
        ids += markup(tokenizer, text[at:start]) + plain(tokenizer, m["content"])
        at = start + len(m["content"])
    return ids + markup(tokenizer, text[at:])


def markup(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def plain(tokenizer, text: str) -> list[int]:
    """Text whose special-token strings stay text (tokenizers' split_special_tokens)."""
    if not text:
        return []
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    special = set(tokenizer.all_special_ids) & set(ids)
    if special:          # (a tokenizer that ignores split_special_tokens: refuse rather than be steered)
        raise ValueError(f"the judge's tokenizer read special tokens {sorted(special)} in a text")
    return ids


def parse_verdict(reply: str, yes: str = "yes", no: str = "no") -> float | None:
    """--judge-rule score: the reply's first word: yes -> 1, no -> 0, a number in [0, 1] -> it; else None."""
    m = re.match(r"\s*([A-Za-z]+|\d*\.?\d+)", reply)
    if not m:
        return None
    word = m.group(1).lower()
    if word == yes.lower():
        return 1.0
    if word == no.lower():
        return 0.0
    try:
        x = float(word)
    except ValueError:
        return None
    return x if 0 <= x <= 1 else None


def yes_probability(logp_yes: float, logp_no: float) -> float:
    """p(yes) / (p(yes) + p(no)), from the two tokens' log-probs."""
    return 1 / (1 + math.exp(logp_no - logp_yes))


# ---------------------------------------------------------------------------------------------
# what the judge must be able to read: checked at start-up, before any engine starts


@functools.lru_cache(maxsize=4)
def judge_tokenizer(path: str):
    """The judge's tokenizer (once a process: a config is checked each time it is rebuilt)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def unknown_chars(tokenizer, sections: list[tuple[str, str]]) -> str:
    """The characters of the template's own text (its placeholders left out) that the tokenizer cannot hold:
    it reads them as its unknown token or drops them without a word (the embedded model's character
    tokenizer, as transformers loads it from the model dir, drops them): its tokens do not give them back."""
    text = re.sub(r"\{(prompt|response|answer)\}", "", "".join(t for _, t in sections))
    encode = functools.partial(tokenizer, add_special_tokens=False, split_special_tokens=True)
    if tokenizer.decode(encode(text)["input_ids"]) == text:
        return ""
    unk = getattr(tokenizer, "unk_token_id", None)

    def lost(c: str) -> bool:
        ids = encode(c)["input_ids"]
        return not ids or unk in ids or tokenizer.decode(ids) != c
    return "".join(sorted({c for c in text if not c.isspace() and lost(c)}))


def longest_request(tokenizer, sections, problems, response_tokens: int, candidates: int = 16):
    """(tokens, problem) of the longest conversation the judge can be sent: the template rendered with a
    problem's prompt and answer and an empty response, plus response_tokens for each {response} in it (no
    problems: the template with empty placeholders; problem None). The problems are ranked by their prompt's
    and answer's own tokens, counted as often as the template names them; the `candidates` first are
    rendered, since a rendering's merges at the seams may shift the count by a token or two."""
    text = "".join(t for _, t in sections)
    per = {k: text.count("{" + k + "}") for k in ("prompt", "answer", "response")}
    if problems:
        encode = functools.partial(tokenizer, add_special_tokens=False, split_special_tokens=True)
        prompts, answers = (encode([getattr(p, k) for p in problems])["input_ids"] for k in ("prompt",
                                                                                              "answer"))
        sizes = [per["prompt"] * len(a) + per["answer"] * len(b) for a, b in zip(prompts, answers)]
        ranked = sorted(range(len(problems)), key=sizes.__getitem__, reverse=True)[:candidates]
        top = [problems[i] for i in ranked]
    else:
        top = [None]
    n, longest = max((len(render(tokenizer, fill(sections, p.prompt, "", p.answer) if p else
                                 fill(sections, "", "", ""))), i) for i, p in enumerate(top))
    return n + per["response"] * response_tokens, top[longest]


def fit_errors(part: "JudgeConfig", template: str, problems=(), max_tokens: int = 0, drawn: str = "",
               context: int | None = None) -> tuple[list[str], int]:
    """(why the judge cannot read what it will be sent, one line each naming its flags (empty: it can), the
    longest request's tokens). The reasons: the template has characters the judge's tokenizer has no token
    for (unknown_chars); the longest request (longest_request over the problems `drawn` names, a response of
    max_tokens, then the verdict's tokens: one for --judge-rule yes, --judge-max-tokens for score) is longer
    than the judge's context (ext.served.served_context), so every sample would fail.

    A response is counted as max_tokens tokens of the judge's tokenizer: exact when it is the student's (the
    embedded judge's case), a close estimate for another tokenizer of the same kind. The judge reads the
    action the env's reward step scores: one model turn (the last, in a multi-turn env of this project)."""
    tok, errors = judge_tokenizer(part.judge), []
    sections = read_template(template, f"--judge-template {template}")
    name = template if template != "<default>" else "<default> (the built-in template)"
    missing = unknown_chars(tok, sections)
    if missing:
        errors.append(f"--judge-template {name}: the judge's tokenizer (--judge {part.judge}) has no token "
                      f"for {missing!r}: the judge would never read them; write it in characters it has")
    context = context or served_context(part.judge)
    verdict = 1 if part.judge_rule == "yes" else part.judge_max_tokens
    n, problem = longest_request(tok, sections, problems, max_tokens)
    if n + verdict > context:
        what = (f"with the longest prompt and answer of {drawn} ({problem.prompt[:40]!r} -> "
                f"{problem.answer[:20]!r})" if problem is not None else "alone (its placeholders empty)")
        errors.append(f"--judge {part.judge}: its context ({context} tokens) cannot hold the longest request "
                      f"({n + verdict} tokens): --judge-template {name} rendered {what}"
                      + (f", a response of --max-tokens {max_tokens}" if max_tokens else "")
                      + f" and the verdict's {verdict} token(s) (--judge-rule {part.judge_rule}"
                      + (", --judge-max-tokens" if part.judge_rule == "score" else "")
                      + "); a judge with a longer context, a shorter template or fewer --max-tokens")
    return errors, n + verdict


# ---------------------------------------------------------------------------------------------
# a rollout rank's side: the scorer, and the finisher that records what the reward step learned


class JudgeScorer:
    """The rollout rank's scorer (Extension.scorer): async score(problem, response) -> reward."""

    def __init__(self, transport, rank: int, part: JudgeConfig, template_path: str, verifier,
                 startup_s: float, name: str, num_ranks: int):
        from transformers import AutoTokenizer
        self.rank, self.judges = rank, client(transport, rank, name, num_ranks, startup_s)
        from rollout import inline_reward
        self.part, self.verifier = part, verifier
        self.held_out = inline_reward(verifier)         # (held-out evaluation: env_manager.EnvManager)
        self.tokenizer = AutoTokenizer.from_pretrained(part.judge)
        self.sections = read_template(template_path, f"--judge-template {template_path}")
        self.yes_no = [plain(self.tokenizer, w)[0] for w in (part.judge_yes, part.judge_no)]
        if self.yes_no[0] == self.yes_no[1]:
            raise ValueError(f"--judge-yes {part.judge_yes!r} and --judge-no {part.judge_no!r} start with "
                             f"the same token of the judge's tokenizer: their probabilities cannot be told "
                             f"apart")
        self.unparsed = self.calls = 0

    async def verdict(self, problem, response: str) -> tuple[float, bool]:
        """(the judge's verdict in [0, 1], whether it parsed)."""
        ids = render(self.tokenizer, fill(self.sections, problem.prompt, response, problem.answer))
        where, limit = f"rollout rank {self.rank}: the judge's verdict", self.part.judge_timeout_s
        if self.part.judge_rule == "yes":
            lps = await asyncio.gather(*[self.judges.ask("score", ids + [t], None, limit, where,
                                                         "--judge-timeout-s") for t in self.yes_no])
            return yes_probability(lps[0][-1], lps[1][-1]), True
        reply = await self.judges.ask("generate", ids, self.part.judge_max_tokens, limit, where,
                                      "--judge-timeout-s")
        v = parse_verdict(self.tokenizer.decode(reply, skip_special_tokens=True), self.part.judge_yes,
                          self.part.judge_no)
        return (0.0, False) if v is None else (v, True)

    async def score(self, problem, response: str) -> float:
        t0, w = time.monotonic(), self.part.judge_weight
        v, parsed = await self.verdict(problem, response)
        self.calls += 1
        self.unparsed += not parsed
        seconds = time.monotonic() - t0                 # (the verdict's alone, without the verifier's call)
        truth = self.verifier(problem, response) if w < 1 or self.part.judge_audit else None
        state = VERDICT.get(None)
        if state is not None:
            state.update(parsed=parsed, seconds=seconds)
            if self.part.judge_audit:
                state["verifier"] = truth
        return w * v + (1 - w) * truth if w < 1 else v

    def stats(self) -> dict:
        return {"judge_calls": self.calls, "judge_unparsed": self.unparsed}

    def shutdown(self):
        pass


class JudgedEnv:
    """Every env on a judged rank (Extension.env_wrapper): its reset starts the sample's record (VERDICT),
    so its finisher knows the trajectory's time."""

    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    async def reset(self, seed: int):
        VERDICT.set({"t0": time.monotonic()})
        return await self.env.reset(seed)

    async def step(self, action: str):
        return await self.env.step(action)


async def finish(s):
    """(the sample finisher) What the reward step learned, into the sample: its verdict's parse, seconds and
    share of the trajectory's time."""
    state = VERDICT.get(None)
    if not state or "seconds" not in state:
        return
    s.meta.update(judge_unparsed=not state["parsed"], judge_s=state["seconds"],
                  judge_share=state["seconds"] / max(time.monotonic() - state["t0"], 1e-9))
    if "verifier" in state:                         # (--judge-audit)
        s.meta["judge_verifier"] = state["verifier"]


def judge_metrics(batch) -> dict:
    judged = [s for s in batch if "judge_s" in s.meta]
    if not judged:
        return {}
    audited = [s.meta["judge_verifier"] for s in judged if "judge_verifier" in s.meta]
    return {"judge_unparsed": sum(s.meta["judge_unparsed"] for s in judged),
            "time_judge": sum(s.meta["judge_s"] for s in judged) / len(judged),
            "judge_share": sum(s.meta["judge_share"] for s in judged) / len(judged),
            **({"reward_verifier": sum(audited) / len(audited)} if audited else {})}


@extension
class Judge(Extension):
    name, Config = "judge", JudgeConfig

    @classmethod
    def wanted(cls, part) -> bool:
        return bool(part.judge)

    @classmethod
    def configure(cls, cfg, part):
        built = {TINY_JUDGE: "python -m ext.judge --build", TEST_JUDGE: "python -m ext.judge --build --test"}
        check_model_dir("--judge", part.judge, built.get(Path(part.judge).resolve(), ""))
        teacher = cfg.ext["distill"].teacher if "distill" in cfg.ext else ""
        if not part.judge_gpus and not (teacher and Path(teacher).resolve() == Path(part.judge).resolve()):
            raise ValueError(f"--judge {part.judge} needs --judge-gpus K (ranks to serve it), or --teacher "
                             f"the same dir (its ranks serve both)")
        # what can be known from the flags alone: the template against the judge's tokenizer and context
        # (startup_lines checks the whole request: the prompts, --max-tokens resolved)
        errors, _ = fit_errors(part, cls.template(part), max_tokens=cfg.rollout.max_tokens)
        if errors:
            raise ValueError("\n".join(errors))
        if cfg.ext["verifiers"].reward_workers > 0:
            raise ValueError("--judge with --reward-workers: the judge is the rollout ranks' scorer and "
                             "calls the verifier itself; leave --reward-workers at its default")

    @staticmethod
    def template(part) -> str:
        if part.judge_template:
            if not Path(part.judge_template).is_file():
                raise ValueError(f"--judge-template {part.judge_template}: no such file")
            return part.judge_template
        own = Path(part.judge) / TEMPLATE_FILE
        return str(own) if own.is_file() else "<default>"

    def served(self) -> tuple[str, int]:
        """The queue name and ranks that serve the judge: its own, or the teacher's."""
        if self.part.judge_gpus:
            return NAME, self.part.judge_gpus
        return "teacher", self.cfg.ext["distill"].teacher_gpus

    def extra_ranks(self) -> int:
        return self.part.judge_gpus

    def run_extra_rank(self, index: int, device: str, engine_core: str, buffer_addr: tuple, state):
        run_rank(self.cfg, self.part.judge, NAME, index, device, engine_core, buffer_addr)

    def startup_lines(self, model_dir: str, device: str):
        """(rank 0, before the engines start) The judge must hold the longest request the run can send it:
        the template with --data's longest row (or the longest of 1,000 drawn problems) and --max-tokens."""
        problems, drawn = drawn_problems(self.cfg)
        template, context = self.template(self.part), served_context(self.part.judge)
        errors, n = fit_errors(self.part, template, problems, self.cfg.rollout.max_tokens, drawn, context)
        if errors:
            raise SystemExit("\n".join(errors))
        name, k = self.served()
        return (f"judge: {self.part.judge} on {k} {name} rank(s), rule {self.part.judge_rule}, weight "
                f"{self.part.judge_weight}, template {template}; its longest request {n} of {context} tokens")

    def scorer(self, index: int, buffer):
        from task import load_reward
        name, k = self.served()
        reward = self.cfg.rollout.reward
        return JudgeScorer(buffer.transport, index, self.part, self.template(self.part),
                           load_reward("" if reward == "none" else reward),
                           self.cfg.controller.startup_timeout_s, name, k)

    def env_wrapper(self, index: int):
        return JudgedEnv

    def sample_finisher(self, index: int, buffer):
        return finish

    def on_controller(self, ctrl, state):
        self.ctrl = ctrl

    async def after_step(self, ctrl, step: int, final: bool) -> dict:
        return judge_metrics(ctrl.batch)

    def step_line(self, row: dict) -> str | None:
        if "time_judge" not in row:
            return None
        return (f"judge {row['time_judge']:.2f}s ({row['judge_share']:.0%}) unparsed {row['judge_unparsed']}"
                + (f" verifier {row['reward_verifier']:.3f}" if "reward_verifier" in row else ""))

    def on_finish(self):
        if self.part.judge_gpus:
            stop(self.ctrl, NAME, self.part.judge_gpus)


# ---------------------------------------------------------------------------------------------
# the embedded judge


def wrong_answer(rng: random.Random, answer: str) -> str:
    """A plausible wrong answer, mostly as the student errs: a near miss or a changed digit; else a dropped or
    repeated digit, another number, nothing."""
    n, kind = int(answer), rng.choices(range(6), weights=(8, 6, 2, 2, 1, 1))[0]
    if kind == 0:
        step = rng.choice([1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 20, 100])
        out = str(max(0, n + rng.choice([-1, 1]) * step))
    elif kind == 1:
        i = rng.randrange(len(answer))
        out = answer[:i] + str(rng.randrange(10)) + answer[i + 1:]
    elif kind == 2 and len(answer) > 1:
        i = rng.randrange(len(answer))
        out = answer[:i] + answer[i + 1:]
    elif kind == 3:
        i = rng.randrange(len(answer))
        out = answer[:i] + answer[i] + answer[i:]
    elif kind == 4:
        out = str(rng.randrange(10 ** len(answer)))
    else:
        out = ""
    return out if out != answer else answer + str(rng.randrange(10))


# the tiny judge's conversation, one turn: the problem and its reference answer, then the problem and the
# response ("37+485=522\n37+485=523?"). The response sits where a copy of the answer would, so comparing them
# is what a language model does anyway, predicting a repeat from its first occurrence (an induction head)
TINY_TEMPLATE = "[user]\n{prompt}{answer}\n{prompt}{response}?\n"


def judge_examples(seed: int = 0):
    """The tiny judge's warm-start verdicts: tool(problem) -> segments for tiny_model.ensure_tiny_model, half
    right answers ("yes"), half wrong ones ("no"), rendered by TINY_TEMPLATE. A right answer's response is
    trained as text too (predicting the repeat of the reference): without that the judge learns from the
    verdict alone whether a sum looks plausible, and passes most of the student's near misses."""
    rng = random.Random(seed)
    sections = read_template_text(TINY_TEMPLATE)

    def example(p):
        right = rng.random() < 0.5
        shown = p.answer if right else wrong_answer(rng, p.answer)
        text = "".join(m["content"] for m in fill(sections, p.prompt, shown, p.answer))
        if not right:
            return [(text, False), ("no", True)]
        at = text.rindex(shown + "?")
        return [(text[:at], False), (shown, True, False), (text[at + len(shown):], False), ("yes", True)]
    return example


# The tests' judge (TEST_JUDGE): the embedded judge's build stopped at half its steps (the same seed and
# examples: the first 1,000 of its 2,000 batches), half the build's time. It agrees with the verifier on 89.0%
# of the student's answers, the full build on 93.9% (`python -m tools.judge_study --agreement-only --judge
# DIR`, 1,000 pairs). What the tests need of it is a verdict that varies with the response, which RL can climb
# (tests/test_judge.py's torchrun run).
STEPS, TEST_STEPS = 2000, 1000


def ensure_tiny_judge(log=print, test: bool = False) -> Path:
    """Build (or reuse) .cache/tiny-judge: a model of the embedded student's shape and tokenizer trained from
    scratch on verdicts alone (2,000 steps); test: the tests' judge instead (TEST_JUDGE)."""
    import tiny_model
    cfg = tiny_model.TinyConfig(seed=5, sft_steps=TEST_STEPS if test else STEPS, tool_frac=1.0)
    path = tiny_model.ensure_tiny_model(TEST_JUDGE if test else TINY_JUDGE, cfg, log=log,
                                        tool=judge_examples(5))
    if not (path / TEMPLATE_FILE).exists() or (path / TEMPLATE_FILE).read_text() != TINY_TEMPLATE:
        (path / TEMPLATE_FILE).write_text(TINY_TEMPLATE)
    return path


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="build (or reuse) .cache/tiny-judge")
    ap.add_argument("--test", action="store_true",
                    help="with --build: the tests' judge instead, .cache/tiny-judge-test")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    if args.build:
        ensure_tiny_judge(log=(lambda *a: None) if args.quiet else print, test=args.test)
