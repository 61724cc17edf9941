"""A tool-using, history-compacting `ChatAgent` on the stock `AsyncOpenAI` client.

Each rollout is a chain of three arithmetic steps ("What is 23 * 41?", "Now multiply 943 by 7. What is the
result?", "Now add 386 to 6601. What is the result?"). The model may call a `calculator` tool; the agent runs it and sends the
result back as a `tool` message, and the model answers. Before a step, when the history has grown past
`max_history_messages`, the agent compacts it: the system prompt stays, the earlier turns become one user turn
"The result so far is 6601." followed by the next question. The capture server sees the rewritten
history and starts a new segment (break reason `compaction`), so a rollout trains as several segments that
share its reward: the fraction of steps answered right.

Tools and small templates: SmolLM2-135M-Instruct's chat template does not render `tools`, so the tool
definitions alone would be invisible to it. The system prompt (`calculator_task.SYSTEM_PROMPT`) therefore
describes the call in the `<tool_call>{"name": ..., "arguments": ...}</tool_call>` form that the capture
server's Hermes parser turns into structured tool calls; the request still carries `tools`, which is what
switches that parsing on (and what a template with tool support renders).

Task, tool, grading, compaction and the episode loop live in `calculator_task.py`, shared with
`anthropic_agent.py` (the same agent on `AsyncAnthropic`).
"""

from calculator_task import OPENAI_TOOLS, CalculatorChatAgent, Reply
from openai import AsyncOpenAI

from molt.agents import ChatAgentRunner


class CalculatorAgent(CalculatorChatAgent):
    def asker(self, ctx):
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)

        async def ask(history):
            response = await client.chat.completions.create(
                model=ctx.model_name,
                messages=history,
                tools=OPENAI_TOOLS,
                max_tokens=ctx.sampling_params.max_tokens,
                temperature=ctx.sampling_params.temperature,
            )
            msg = response.choices[0].message
            calls = msg.tool_calls or []
            message = {"role": "assistant", "content": msg.content or ""}
            if calls:  # echoed back as received, so the next request extends the recorded conversation
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in calls
                ]
            return Reply(
                msg.content or "", [(c.id, c.function.name, c.function.arguments) for c in calls], message
            )

        return ask

    @staticmethod
    def tool_results(results):
        return [{"role": "tool", "tool_call_id": call_id, "content": text} for call_id, text in results]


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(CalculatorAgent)
