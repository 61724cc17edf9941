"""An agent written on the OpenAI Agents SDK (`openai-agents`, the `agents` package), trained unchanged: the SDK's
own `Agent`, `function_tool` and `Runner` with its default model class, `OpenAIResponsesModel`, pointed at the
rollout's capture session. Molt sees only the SDK's `POST /v1/responses` requests and records them token-exact.

The task: "What is 61 * 65?", a product of two two-digit numbers that a 135M model cannot work out in its head,
with a `multiply` function tool. The reward is 1.0 when the last number of the run's final output is the product,
so it measures tool use. The SDK runs the loop: the model writes a call, the SDK runs the tool and sends its
result back as a `function_call_output` item, the model answers; `max_turns` bounds the model calls.

How a small model finds the tool (as in recipes/calculator): SmolLM2-135M-Instruct's chat template renders neither
`tools` nor structured tool calls, so the instructions describe the call in the Hermes
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` form that the capture server parses into a Responses
`function_call` item, and the input opens with one worked example: a question, the call written in that form,
its result (a `function_call_output` item) and the answer.

Failures of the model's making end the rollout with reward 0 and a count in `info`, never an agent error: a call
the SDK rejects (a tool that does not exist, arguments that do not fit `multiply`'s schema: `ModelBehaviorError`,
`model_errors`; 30% of the base model's held-out rollouts), too many turns (`MaxTurnsExceeded`). A tool error the
SDK hands back to the model as text counts in `tool_errors`.
`OpenAIChatCompletionsModel` in `model_class` runs the same agent on the chat-completions wire.

The SDK's function tools are strict (`strict: true`), which the capture server honours since the run above was
measured: each reply is sampled under the Hermes reply grammar (text, or calls whose arguments follow
`multiply`'s schema; docs/harnesses.md), so schema failures no longer occur and the recorded log-probs are of the
masked distribution (docs/algo.md); the figures in docs/ predate that.
"""

import json
import re

import agents
from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result

agents.set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI's servers

INSTRUCTIONS = (
    'You can use a multiply tool. To use it, reply <tool_call>{"name": "multiply", "arguments": '
    '{"a": ..., "b": ...}}</tool_call> and read the result. Answer with just the number.'
)
EXAMPLE = (23, 41)  # the worked example's operands; make_data.py leaves this product out of the data
NUMBER = re.compile(r"-?\d+")


@agents.function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def example_items() -> list[dict]:
    """The worked example as Responses input items: question, the call in Hermes form, its result, the answer."""
    a, b = EXAMPLE
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    return [
        {"role": "user", "content": f"What is {a} * {b}?"},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"type": "function_call_output", "call_id": "call_example", "output": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def grade(text: str | None, value: int) -> float:
    """1.0 when the last number in the final output equals `value`."""
    found = NUMBER.findall((text or "").replace(",", ""))
    return float(bool(found) and int(found[-1]) == value)


class MultiplyAgent(ChatAgent):
    model_class = agents.OpenAIResponsesModel  # the SDK's default; OpenAIChatCompletionsModel works as well
    max_turns = 3  # model calls per rollout: a call, the answer, one spare

    async def run(self, ctx) -> Result:
        params = ctx.sampling_params
        async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            agent = agents.Agent(
                name="multiplier",
                instructions=INSTRUCTIONS,
                tools=[multiply],
                model=self.model_class(model=ctx.model_name, openai_client=client),
                model_settings=agents.ModelSettings(
                    temperature=params.temperature, max_tokens=params.max_tokens
                ),
            )
            try:
                result = await agents.Runner.run(
                    agent, example_items() + ctx.messages, max_turns=self.max_turns
                )
            except (agents.MaxTurnsExceeded, agents.ModelBehaviorError) as e:
                return Result(
                    reward=0.0,
                    info={
                        "tool_calls": 0.0,
                        "tool_errors": 0.0,
                        "model_errors": 1.0,
                        "max_turns_exceeded": float(isinstance(e, agents.MaxTurnsExceeded)),
                    },
                )
        outputs = [i.output for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]
        return Result(
            reward=grade(result.final_output, int(ctx.label)),
            info={
                "tool_calls": float(len(outputs)),
                "model_errors": 0.0,
                "max_turns_exceeded": 0.0,
                "tool_errors": float(sum(not isinstance(o, int) for o in outputs)),
            },
        )


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(MultiplyAgent)
