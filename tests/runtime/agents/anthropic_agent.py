"""Test ChatAgent: the same agent on the stock AsyncAnthropic client (session_url, /v1/messages)."""

from sdk_agent import SDKAgent

from molt.agents import ChatAgentRunner


class AnthropicAgent(SDKAgent):
    wire = "anthropic"


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(AnthropicAgent)
