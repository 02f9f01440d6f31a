"""examples/calc_agent.py: the calculator env (--env calc) as an ordinary OpenAI-client agent.

    bash run.sh --agent examples/calc_agent.py:agent --model .cache/tiny-qwen2-calc --max-tokens 16

Only the openai package: nothing of the project is imported, so the same function runs against any
OpenAI-compatible server. The protocol is ext/calc.py's: the model's reply may be calc(EXPR); the agent
computes EXPR (integer arithmetic, here in Python's ast instead of the sandbox) and answers with
" =VALUE answer:"; the first reply that is not a call (or the reply after MAX_CALLS calls) is the answer,
rewarded 1 if it is exactly the problem's answer.
"""

import ast
import operator
import re

import openai

MAX_CALLS = 2
CALL = re.compile(r"\s*calc\((.*)\)\s*", re.DOTALL)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
       ast.Mod: operator.mod}


def calculate(expr: str) -> str | None:
    """The value of an integer expression (+ - * // %), or None if it is not one (or too large)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not integer arithmetic: {ast.dump(node)[:40]}")
    try:
        v = value(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    return str(v) if abs(v) < 10 ** 40 else None


async def agent(client: openai.AsyncOpenAI, model: str, problem: dict) -> float:
    messages = [{"role": "user", "content": problem["prompt"]}]
    for calls in range(MAX_CALLS + 1):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=16)
        text = reply.choices[0].message.content or ""
        call = CALL.fullmatch(text)
        if call is None or calls == MAX_CALLS:
            return 1.0 if text.strip() == problem["answer"] else 0.0
        value = calculate(call.group(1))
        observation = f" ={value} answer:" if value is not None else " error, answer:"
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": observation}]
    return 0.0
