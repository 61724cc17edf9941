"""The calculator agent of `agent.py` on the stock `AsyncAnthropic` client: the same task, tool, compaction and
reward (all in `calculator_task.py`); only the wire differs. The system prompt goes in `system`, tools are
Anthropic tool schemas, calls arrive as `tool_use` blocks and results go back as `tool_result` blocks in a user
turn. The capture server converts both wires to one conversation, so the segments are the same as with OpenAI.
"""

from anthropic import AsyncAnthropic
from calculator_task import ANTHROPIC_TOOLS, CalculatorChatAgent, Reply

from molt.agents import ChatAgentRunner


def _block(b):
    """A response content block as a request block (only the fields the Messages API takes back)."""
    if b.type == "tool_use":
        return {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input}
    return {"type": "text", "text": b.text}


class AnthropicCalculatorAgent(CalculatorChatAgent):
    def asker(self, ctx):
        client = AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)

        async def ask(history):
            # the shared history keeps the system prompt as its first message (compaction preserves it there);
            # the Messages API takes it separately. No `temperature`: the installed SDK (anthropic 2.x) no longer
            # takes one, and the session samples at the rollout's temperature when a request names none.
            system = "\n".join(m["content"] for m in history if m["role"] == "system")
            response = await client.messages.create(
                model=ctx.model_name,
                system=system,
                messages=[m for m in history if m["role"] != "system"],
                tools=ANTHROPIC_TOOLS,
                max_tokens=ctx.sampling_params.max_tokens,
            )
            text = "".join(b.text for b in response.content if b.type == "text")
            calls = [(b.id, b.name, b.input) for b in response.content if b.type == "tool_use"]
            return Reply(text, calls, {"role": "assistant", "content": [_block(b) for b in response.content]})

        return ask

    @staticmethod
    def tool_results(results):
        return [
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call_id, "content": text}
                    for call_id, text in results
                ],
            }
        ]


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(AnthropicCalculatorAgent)
