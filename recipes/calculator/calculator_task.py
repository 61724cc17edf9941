"""What the calculator agents share, whatever SDK they speak: the task, the tool, grading, compaction and the
episode loop. `agent.py` (AsyncOpenAI) and `anthropic_agent.py` (AsyncAnthropic) only adapt their wire to it.

The task is a chain of arithmetic steps. A label is the chain's signed numbers, e.g. [3, 4, -2, 6]:
"What is 3 + 4?" (the dataset prompt), "Now subtract 2. What is the result?", "Now add 6. What is the result?".
The true running values are 7, 5, 11; each step is right when the last number of the step's final reply equals
its running value, and the reward is the fraction of steps right.

The helper has a distinctive module name because agent folders go on `sys.path`: a plain `helpers.py` could
shadow another recipe's.
"""
from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from molt.agents import ChatAgent, Result

# ----------------------------------------------------------------------------------------------- the tool
TOOL_NAME = "calculator"
TOOL_DESCRIPTION = "Evaluate an arithmetic expression such as 12 + 7."
TOOL_PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
OPENAI_TOOLS = [{"type": "function",
                 "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_PARAMETERS}}]
ANTHROPIC_TOOLS = [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_PARAMETERS}]

# Many small models' chat templates (SmolLM2-135M-Instruct's among them) ignore `tools`, so the model would never
# learn the tool exists. The system prompt therefore also shows the call in the Hermes format, which the capture
# server's tool parser reads back into a structured tool call whenever the request carries `tools`.
# Short on purpose: a 135M model loses the question in a long prompt, and it rambles unless asked for the number
# alone (the reward reads the last number of the reply).
SYSTEM_PROMPT = (
    'To compute, you may reply <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call> '
    "and read the result. Answer each question with just the number."
)

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15  # results beyond this are refused: arithmetic answers here are small
MAX_EXPONENT = 64  # 9 ** 10**9 would hang the worker: exponents are bounded before computing


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or cannot be computed."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression, computed by walking its syntax tree (never `eval`): only number
    literals, + - * / // % ** and parentheses; names, calls, attributes, strings and the rest are refused."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, str, complex
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is too large")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, TypeError, ValueError) as e:  # e.g. a negative number to a fractional power
            raise CalculatorError(str(e)) from None
    raise CalculatorError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def _checked(x: Any) -> int | float:
    if isinstance(x, complex) or not math.isfinite(x) or abs(x) > MAX_MAGNITUDE:
        raise CalculatorError("the result is out of range")
    return x


def format_number(x: float) -> str:
    """7, 2.5, 0.333333: integral floats print without a fraction, so the model sees the number it should say."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def run_tool(name: str, arguments: Any) -> str:
    """The text a tool call returns to the model. Mistakes (unknown tool, bad arguments, a refused expression)
    come back as an error text: they are the model's to see and learn from, never a crashed rollout."""
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}; the only tool is {TOOL_NAME!r}"
    if isinstance(arguments, str):  # an SDK hands arguments over as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "error: the arguments are not JSON"
    if not isinstance(arguments, dict) or "expression" not in arguments:
        return 'error: call it with {"expression": "..."}'
    try:
        return format_number(calculate(str(arguments["expression"])))
    except CalculatorError as e:
        return f"error: {e}"


# ----------------------------------------------------------------------------------------------- the task
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_chain(label: Any) -> list[int]:
    """The chain's signed numbers from a label: a list, or its JSON text."""
    numbers = json.loads(label) if isinstance(label, str) else label
    if not isinstance(numbers, list) or len(numbers) < 2 or not all(isinstance(n, int) for n in numbers):
        raise ValueError(f"a calculator label is a list of at least two integers, got {label!r}")
    return numbers


def running_values(numbers: list[int]) -> list[int]:
    """The answer of each step: [3, 4, -2, 6] -> [7, 5, 11]."""
    values, total = [], numbers[0]
    for n in numbers[1:]:
        total += n
        values.append(total)
    return values


def _op(n: int) -> str:
    return f"+ {n}" if n >= 0 else f"- {-n}"


def questions(numbers: list[int]) -> list[str]:
    """The user turn of each step: [3, 4, -2, 6] -> "What is 3 + 4?", "Now subtract 2. ...", "Now add 6. ..."."""
    out = [f"What is {numbers[0]} {_op(numbers[1])}?"]
    for n in numbers[2:]:
        out.append(f"Now {'add' if n >= 0 else 'subtract'} {abs(n)}. What is the result?")
    return out


def summary(numbers: list[int], steps_done: int) -> str:
    """One line standing for the first `steps_done` steps: "So far: 3 + 4 = 7, then - 2 = 5."

    It states the true running values, not the model's answers: the agent keeps the task's state, so a wrong
    early answer does not make every later step ungradable (each step keeps its own learning signal)."""
    values = running_values(numbers)
    parts = [f"{numbers[0]} {_op(numbers[1])} = {values[0]}"]
    parts += [f"then {_op(n)} = {v}" for n, v in zip(numbers[2:steps_done + 1], values[1:steps_done])]
    return "So far: " + ", ".join(parts) + "."


def grade(text: str | None, value: float) -> float:
    """1.0 when the last number in the reply equals `value`, else 0.0."""
    found = NUMBER.findall((text or "").replace(",", ""))
    return float(bool(found) and abs(float(found[-1]) - value) < 1e-6)


# ----------------------------------------------------------------------------------------------- compaction
def needs_compaction(history: list[dict[str, Any]], max_history_messages: int) -> bool:
    """Whether adding one more user turn would take the history (system messages not counted) past the limit.
    Counted in messages, not tokens, so it triggers the same way whatever the model writes."""
    return sum(m.get("role") != "system" for m in history) + 1 > max_history_messages


def compact(history: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The system messages, then one user turn `text` in place of everything else."""
    return [m for m in history if m.get("role") == "system"] + [{"role": "user", "content": text}]


def next_turn(history: list[dict[str, Any]], numbers: list[int], step: int,
              max_history_messages: int) -> tuple[list[dict[str, Any]], bool]:
    """(history with the user turn of `step` (>= 1) added, whether it was compacted first). A compacted history
    is the system prompt and one user turn: the summary of the steps done, then the new question (one turn, so
    roles keep alternating for templates and APIs that require it)."""
    question = questions(numbers)[step]
    if needs_compaction(history, max_history_messages):
        return compact(history, f"{summary(numbers, step)} {question}"), True
    return history + [{"role": "user", "content": question}], False


# ----------------------------------------------------------------------------------------------- the episode
@dataclass
class Reply:
    """One model reply, wire-independent: its text, its tool calls as (id, name, arguments), and the assistant
    message to append to the history in the agent's own wire format."""

    text: str
    calls: list[tuple[str, str, Any]]
    message: dict[str, Any]


@dataclass
class Outcome:
    correct: list[float] = field(default_factory=list)  # per step
    tool_calls: int = 0
    tool_errors: int = 0
    compactions: int = 0
    model_calls: int = 0

    @property
    def reward(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0

    def info(self) -> dict[str, float]:
        return {"steps_correct": float(sum(self.correct)), "tool_calls": float(self.tool_calls),
                "tool_errors": float(self.tool_errors), "compactions": float(self.compactions),
                "model_calls": float(self.model_calls)}


Ask = Callable[[list[dict[str, Any]]], Awaitable[Reply]]  # history -> the model's reply
ToolResults = Callable[[list[tuple[str, str]]], list[dict[str, Any]]]  # [(call id, result)] -> messages


async def play(ask: Ask, tool_results: ToolResults, history: list[dict[str, Any]], numbers: list[int], *,
               max_history_messages: int = 4, max_tool_rounds: int = 2) -> Outcome:
    """Run every step of the chain. `history` holds the first question already (the dataset prompt). Within a
    step the model may call the calculator up to `max_tool_rounds` times before it must answer; the step is
    graded on its last reply. Before each later step the history is compacted when it is too long."""
    out, values = Outcome(), running_values(numbers)
    for step, value in enumerate(values):
        if step:
            history, compacted = next_turn(history, numbers, step, max_history_messages)
            out.compactions += compacted
        for _ in range(max_tool_rounds + 1):
            reply = await ask(history)
            out.model_calls += 1
            history = history + [reply.message]
            if not reply.calls:
                break
            results = [(call_id, run_tool(name, args)) for call_id, name, args in reply.calls]
            out.tool_calls += len(results)
            out.tool_errors += sum(r.startswith("error:") for _, r in results)
            # every call gets its result, even past the last round, so the history stays valid for any API
            history = history + tool_results(results)
        out.correct.append(grade(reply.text, value))
    return out


# ----------------------------------------------------------------------------------------------- the agent
class CalculatorChatAgent(ChatAgent):
    """The agent, less its wire: a subclass says how to ask the model (`asker`) and how tool results are sent
    back (`tool_results`) in its SDK's message format. Class attributes are the agent's knobs."""

    max_history_messages = 4  # compact before a step when the history (system prompt excluded) would pass this
    max_tool_rounds = 2  # calculator results the model may get per step before it has to answer

    def asker(self, ctx) -> Ask:
        raise NotImplementedError

    @staticmethod
    def tool_results(results: list[tuple[str, str]]) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def run(self, ctx) -> Result:
        numbers = parse_chain(ctx.label)
        history = [dict(m) for m in ctx.messages]  # the first question, from the dataset row
        if not any(m.get("role") == "system" for m in history):
            history.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        out = await play(self.asker(ctx), self.tool_results, history, numbers,
                         max_history_messages=self.max_history_messages, max_tool_rounds=self.max_tool_rounds)
        return Result(reward=out.reward, info=out.info())
