"""What the calculator agents share, whatever SDK they speak: the task, the tool, grading, compaction and the
episode loop. `agent.py` (AsyncOpenAI) and `anthropic_agent.py` (AsyncAnthropic) only adapt their wire to it.

The task is a chain of arithmetic steps that a 135M model cannot do in its head: a label such as
[23, "* 41", "* 7"] asks "What is 23 * 41?" (the dataset prompt), then "Now multiply 943 by 7. What is the
result?". The true running values are 943, 6601; each step is right when the last number of the step's final
reply equals its running value, and the reward is the fraction of steps right. Without the calculator the base
model gets almost none right, so the reward is a measure of tool use.

Credit per step: each step's share of the reward is also the turn reward (`Result.turn_rewards`) of the model
call that answered it, so a step's tokens are credited with the return from that step on, not with the steps
before it (docs/algo.md, "Per-turn rewards"). With the rollout's reward on every token instead, a step answered
right in a rollout whose other steps went wrong is pushed down with them; the demo learned less in 14 steps
(docs/benchmarks.md, "The agentic demo and the seed of each model call").

How a small model finds the tool (the recipe's choice): the conversation opens with the system prompt and one
worked example, a question answered by a calculator call, its result and the answer, exactly as the model's own
turns will look. SmolLM2's chat template does not render `tools` or structured tool calls, so the example's call
is written in the assistant's text in the Hermes form that the capture server parses; the tool result is a real
tool message (an OpenAI `tool` message, an Anthropic `tool_result` block). With it, about 1 reply in 8 of the
base model is a well-formed call; without it none is. `tool_choice` stays "auto": forcing a call ("required")
would make every call valid from the start and leave nothing to learn about when and how to call. Compaction
keeps the system prompt and the example, so later segments still show it.

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
TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_PARAMETERS},
    }
]
ANTHROPIC_TOOLS = [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_PARAMETERS}]

# Many small models' chat templates (SmolLM2-135M-Instruct's among them) ignore `tools`, so the model would never
# learn the tool exists. The system prompt therefore also shows the call in the Hermes format, which the capture
# server's tool parser reads back into a structured tool call whenever the request carries `tools`.
# Short on purpose: a 135M model loses the question in a long prompt, and it rambles unless asked for the number
# alone (the reward reads the last number of the reply).
SYSTEM_PROMPT = (
    'You can use a calculator. To use it, reply <tool_call>{"name": "calculator", "arguments": {"expression": '
    '"..."}}</tool_call> and read the result. Answer with just the number.'
)

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
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
_TERM = re.compile(r"^([+\-*])\s*(\d+)$")
_VERB = {"+": "add {n} to {v}", "-": "subtract {n} from {v}", "*": "multiply {v} by {n}"}


def parse_chain(label: Any) -> list[str]:
    """The chain's terms from a label (a list, or its JSON text): a first number, then operations such as
    "* 41", "+ 7", "- 2". A plain integer n after the first stands for "+ n" or "- |n|", so the additive chains
    of earlier datasets ([3, 4, -2, 6]) still load. -> ["23", "* 41", "* 7"]"""
    items = json.loads(label) if isinstance(label, str) else label
    if not isinstance(items, list) or len(items) < 2 or not isinstance(items[0], int):
        raise ValueError(f"a calculator label is a list: a first integer, then operations; got {label!r}")
    terms = [str(items[0])]
    for item in items[1:]:
        term = (f"+ {item}" if item >= 0 else f"- {-item}") if isinstance(item, int) else str(item).strip()
        match = _TERM.match(term)
        if not match or isinstance(item, bool):
            raise ValueError(f"a calculator operation is an integer or '+ n', '- n', '* n'; got {item!r}")
        terms.append(f"{match.group(1)} {match.group(2)}")
    return terms


def running_values(terms: list[str]) -> list[int]:
    """The answer of each step: ["3", "+ 4", "- 2", "* 6"] -> [7, 5, 30] (each operation applies to the result)."""
    values, total = [], int(terms[0])
    for term in terms[1:]:
        total = int(calculate(f"{total} {term}"))
        values.append(total)
    return values


def questions(terms: list[str]) -> list[str]:
    """The user turn of each step: "What is 23 * 41?", "Now multiply 943 by 7. What is the result?", ...

    A later question names the running value it applies to (the agent keeps the task's state). Asked as "multiply
    the result by 7", the 135M model learned to call the calculator within ten steps but then copied the first
    question's expression on every later step and never left that habit (step accuracy stuck at 1/3); with both
    operands in the question, each step is a call it can learn."""
    values = running_values(terms)
    out = [f"What is {terms[0]} {terms[1]}?"]
    for term, previous in zip(terms[2:], values):
        op, n = term.split()
        out.append(f"Now {_VERB[op].format(n=n, v=previous)}. What is the result?")
    return out


def summary(terms: list[str], steps_done: int) -> str:
    """One line standing for the first `steps_done` steps: "The result so far is 6601."

    It states the true running value, not the model's answer: the agent keeps the task's state, so a wrong early
    answer does not make every later step ungradable (each step keeps its own learning signal). The earlier
    expressions are left out on purpose: a small model copies the first expression it sees into its call."""
    return f"The result so far is {running_values(terms)[steps_done - 1]}."


def grade(text: str | None, value: float) -> float:
    """1.0 when the last number in the reply equals `value`, else 0.0."""
    found = NUMBER.findall((text or "").replace(",", ""))
    return float(bool(found) and abs(float(found[-1]) - value) < 1e-6)


# ----------------------------------------------------------------------------------------------- compaction
def needs_compaction(history: list[dict[str, Any]], keep: int, max_history_messages: int) -> bool:
    """Whether adding one more user turn would take the history past the limit; the first `keep` messages (the
    system prompt and the worked example) are not counted. Counted in messages, not tokens, so it triggers the
    same way whatever the model writes."""
    return len(history) - keep + 1 > max_history_messages


def compact(history: list[dict[str, Any]], keep: int, text: str) -> list[dict[str, Any]]:
    """The first `keep` messages, then one user turn `text` in place of everything else."""
    return history[:keep] + [{"role": "user", "content": text}]


def next_turn(
    history: list[dict[str, Any]], keep: int, terms: list[str], step: int, max_history_messages: int
) -> tuple[list[dict[str, Any]], bool]:
    """(history with the user turn of `step` (>= 1) added, whether it was compacted first). A compacted history
    is the kept preamble and one user turn: the summary of the steps done, then the new question (one turn, so
    roles keep alternating for templates and APIs that require it)."""
    question = questions(terms)[step]
    if needs_compaction(history, keep, max_history_messages):
        return compact(history, keep, f"{summary(terms, step)} {question}"), True
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
    valid_call_steps: int = 0  # steps in which at least one call ran without error
    compactions: int = 0
    model_calls: int = 0
    # per model call: a step's share of the reward on the call that answered it, 0 on calls that asked the tool
    turn_rewards: list[float] = field(default_factory=list)

    @property
    def reward(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0

    def info(self) -> dict[str, float]:
        steps = max(1, len(self.correct))
        return {
            "step_accuracy": self.reward,
            "steps_correct": float(sum(self.correct)),
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(self.tool_errors),
            "valid_call_rate": self.valid_call_steps / steps,
            "compactions": float(self.compactions),
            "model_calls": float(self.model_calls),
        }


Ask = Callable[[list[dict[str, Any]]], Awaitable[Reply]]  # history -> the model's reply
ToolResults = Callable[[list[tuple[str, str]]], list[dict[str, Any]]]  # [(call id, result)] -> messages


async def play(
    ask: Ask,
    tool_results: ToolResults,
    history: list[dict[str, Any]],
    terms: list[str],
    *,
    keep: int = 1,
    max_history_messages: int = 4,
    max_tool_rounds: int = 2,
) -> Outcome:
    """Run every step of the chain. `history` holds the first question already (the dataset prompt) after a
    preamble of `keep` messages that compaction keeps. Within a step the model may call the calculator up to
    `max_tool_rounds` times before it must answer; the step is graded on its last reply. Before each later step
    the history is compacted when it is too long."""
    out, values = Outcome(), running_values(terms)
    for step, value in enumerate(values):
        if step:
            history, compacted = next_turn(history, keep, terms, step, max_history_messages)
            out.compactions += compacted
        ran = False
        for _ in range(max_tool_rounds + 1):
            reply = await ask(history)
            out.model_calls += 1
            history = history + [reply.message]
            if not reply.calls:
                break
            results = [(call_id, run_tool(name, args)) for call_id, name, args in reply.calls]
            out.tool_calls += len(results)
            errors = sum(r.startswith("error:") for _, r in results)
            out.tool_errors += errors
            ran |= errors < len(results)
            # every call gets its result, even past the last round, so the history stays valid for any API
            history = history + tool_results(results)
        out.valid_call_steps += ran
        out.correct.append(grade(reply.text, value))
        # the step's calls that asked the tool get 0, the one that answered it the step's share
        out.turn_rewards += [0.0] * (out.model_calls - len(out.turn_rewards) - 1)
        out.turn_rewards.append(out.correct[-1] / len(values))
    return out


# ----------------------------------------------------------------------------------------------- the agent
EXAMPLE = ("What is 23 * 41?", "23 * 41", "943")  # the worked example: question, expression, result


def example_call(expression: str) -> str:
    """A calculator call as the model writes it (the Hermes form the capture server parses)."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


class CalculatorChatAgent(ChatAgent):
    """The agent, less its wire: a subclass says how to ask the model (`asker`) and how tool results are sent
    back (`tool_results`) in its SDK's message format. Class attributes are the agent's knobs."""

    max_history_messages = 4  # compact before a step when the history (preamble excluded) would pass this
    max_tool_rounds = 2  # calculator results the model may get per step before it has to answer
    worked_example = True  # open the conversation with EXAMPLE (see the module docstring)
    # each step's share of the reward as the turn reward of the call that answered it (module docstring)
    step_credit = True

    def asker(self, ctx) -> Ask:
        raise NotImplementedError

    @staticmethod
    def tool_results(results: list[tuple[str, str]]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def preamble(self) -> list[dict[str, Any]]:
        """The system prompt and, if enabled, the worked example: what compaction keeps."""
        out = [{"role": "system", "content": SYSTEM_PROMPT}]
        if self.worked_example:
            question, expression, result = EXAMPLE
            out += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": example_call(expression)},
                *self.tool_results([("call_example", result)]),
                {"role": "assistant", "content": result},
            ]
        return out

    async def run(self, ctx) -> Result:
        terms = parse_chain(ctx.label)
        task = [
            dict(m) for m in ctx.messages if m.get("role") != "system"
        ]  # the first question, from the row
        history = self.preamble() + task
        out = await play(
            self.asker(ctx),
            self.tool_results,
            history,
            terms,
            keep=len(history) - len(task),
            max_history_messages=self.max_history_messages,
            max_tool_rounds=self.max_tool_rounds,
        )
        turn_rewards = out.turn_rewards if self.step_credit else None
        return Result(reward=out.reward, info=out.info(), turn_rewards=turn_rewards)
