"""The public agent contract (`Result`, `ChatContext`, `ChatAgent`, `Env`, `Runner`) and the Protocols through
which runners reach the capture room (`SessionProvider`, `CaptureSession`, `Turn`).

The Protocols are the room boundary: `molt.agents` never imports `molt.capture`; `molt.runtime` hands a
runner an object that satisfies `SessionProvider` (the capture server does). Both runners use the same
capture session: `ChatAgentRunner` gives the agent the session's URLs, `StepEnvRunner` calls `session.chat`
in-process, so Env and SDK agents share one chat-rendering and token-capture path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from molt.types import SamplingParams, Segment, Trajectory


@dataclass
class Result:
    """What an agent or an environment step returns (fields and defaults of the public contract)."""

    # float, or a tensor/list whose first element is the reward; None is an error; {role: reward}: one per role
    reward: Any = 0.0
    observation: str = ""  # next-turn observation (Env, multi-turn)
    terminated: bool = True  # the episode ended naturally (a plain Env is single-turn)
    truncated: bool = False  # cut off by a limit
    info: dict[str, Any] = field(default_factory=dict)  # scalar diagnostics (numbers or 1-element tensors)
    score: Any = None  # for dynamic filtering and dashboards; falls back to reward
    images: Any = None  # next-turn images (Env): paths, URLs, bytes or PIL images (`runners.image_part`)
    sampling_params: SamplingParams | Mapping[str, Any] | None = None  # override for the following turns
    # rewards of single turns, credited to their own tokens (docs/algo.md, "Per-turn rewards"): a ChatAgent's,
    # one per model call in the order they were answered; an Env step's, the first for the turn it just read
    turn_rewards: list[Any] | None = None


@dataclass
class ChatContext:
    """Everything a `ChatAgent` needs for one rollout (field names of the public contract)."""

    messages: list[dict[str, Any]]  # the dataset row as OpenAI chat messages
    tools: list[dict[str, Any]] | None  # OpenAI-format tool definitions, or None
    prompt: str  # text of the last user turn
    label: Any
    images: Any
    base_url: str  # http://host:port/s/{session_id}/v1, for AsyncOpenAI
    session_url: str  # the same without /v1, for AsyncAnthropic (its SDK appends /v1/messages)
    model_name: str
    api_key: str
    session_id: str
    sampling_params: SamplingParams  # a copy: temperature, top_p, top_k, max_tokens (may be None), min_tokens
    max_length: int  # context window in tokens (prompt + completion)

    def session(self, role: str) -> ChatContext:
        """This context as agent `role` (one of multiagent.roles) sees the rollout: the same capture session under
        URLs that name the role, so whatever a client or a harness sends through them is that role's, with no
        header or model name to set. An undeclared role is refused (400) at its first request."""
        named = f"/s/{self.session_id}+{role}"
        return replace(
            self,
            base_url=self.base_url.replace(f"/s/{self.session_id}", named),
            session_url=self.session_url.replace(f"/s/{self.session_id}", named),
            model_name=role,
        )


class ChatAgent:
    """An agent that drives its own loop through a stock SDK. A fresh instance per rollout."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


class Env:
    """A Gym-style environment; the framework generates. A fresh instance per episode, no constructor args."""

    async def reset(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Gets {"observation": prompt, "label": label, "images": the row's or None}; may return a state whose
        "observation" is the first input."""
        return None

    async def step(self, state: dict[str, Any]) -> Result:
        """Gets exactly observation_text, action_text (special tokens kept), label, sampling_params (a copy)."""
        raise NotImplementedError


# ----------------------------------------------------------------------------------------- room boundary
@runtime_checkable
class Turn(Protocol):
    """One generated assistant turn as the in-process session returns it."""

    message: dict[str, Any]  # the assistant chat message to append to continue the conversation
    prompt_ids: list[int]  # the exact context the engine saw
    action_ids: list[int]  # the sampled tokens kept (stop token included when one was sampled)
    finish_reason: str  # "stop", "length" or "tool_calls"


@runtime_checkable
class CaptureSession(Protocol):
    """One rollout's capture session. Its HTTP endpoints live under `base_url`; `chat`/`extend` are the same
    capture path called in-process (no HTTP), used by `StepEnvRunner`."""

    session_id: str
    base_url: str
    session_url: str
    api_key: str
    model_name: str
    max_model_len: int
    stats: dict[str, int]  # counters for dashboards (requests, cache_hits, malformed_tool_calls, ...)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        tools: list[dict[str, Any]] | None = None,
        role: str = "",
    ) -> Turn: ...

    async def extend(self, text: str, params: SamplingParams) -> Turn:
        """Raw-text mode: append `text`'s tokens (no chat template) to the newest segment and generate."""
        ...

    def decode(self, token_ids: list[int]) -> str:  # special tokens kept
        ...

    async def close(self) -> list[Segment]:
        """End the session (later requests get 404, in-flight ones are aborted); return its segments."""
        ...


@runtime_checkable
class SessionProvider(Protocol):
    """Opens capture sessions (the capture server of a rollout worker implements this)."""

    async def open_session(self, rollout_id: str, sampling_params: SamplingParams) -> CaptureSession: ...


class Runner:
    """Runs one rollout of a dataset row and returns its `Trajectory`; never raises for agent mistakes.

    `row`: {"messages": [...OpenAI messages] or "prompt": str, "label": Any, "tools": [...] | None,
    "images": Any}. `run` is the entry point the runtime calls; `ChatAgentRunner` and `StepEnvRunner` are the two
    implementations, and a custom Runner subclass may implement `run` itself.
    """

    async def run(
        self,
        row: Mapping[str, Any],
        *,
        sessions: SessionProvider,
        rollout_id: str,
        group_id: str = "",
        sampling_params: SamplingParams | None = None,
    ) -> Trajectory:
        raise NotImplementedError
