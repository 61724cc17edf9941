"""Segment tracking: the capture continuation rule (DESIGN.md) for one session.

Design notes and decisions: docs/internals.md, section `molt/capture/segments.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from molt.capture.render import ChatRenderer, message_images
from molt.types import Segment, join_inputs


@dataclass(eq=False)
class _Branch:
    segment: Segment
    messages: list[dict[str, Any]] | None  # canonical, ending with the recorded reply; None after raw text
    tools: list[dict[str, Any]] | None
    prompt_text: str  # rendering (generation prompt included) of messages[:-1] ("" where only a window was)
    ended_turn: bool  # the reply's sampled tokens end with an end-of-turn (EOS) token


@dataclass
class Action:
    """The kept part of one sampled completion."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    # MoE: the completion's routed experts (prompt and action, `Completion.routed_experts`)
    routes: Any = None


@dataclass
class Plan:
    """What a request will extend (or start) and the exact prompt to send to the engine."""

    prompt_ids: Any  # numpy [n] int32: the branch's tokens and the new context (what the engine gets)
    context_ids: list[
        int
    ]  # tokens appended to the branch before the action (mask 0); the whole prompt if new
    branch: _Branch | None  # continued branch, None for a new segment
    break_reason: str
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    temperature: float
    prompt_text: str = ""
    rewrite: bool = field(default=False, repr=False)
    images: Any = None  # processor inputs of the images of prompt_ids (what the engine and the segment get)
    role: str = ""


class SegmentTracker:
    """The segments of one session. Not thread-safe: the session serializes `plan`/`commit`."""

    def __init__(self, renderer: ChatRenderer, eos_token_ids: list[int]):
        self.renderer = renderer
        self.eos_ids = set(eos_token_ids)
        self.eos_texts = [renderer.decode([i]) for i in eos_token_ids]
        self.branches: list[_Branch] = []
        self._last: _Branch | None = None  # branch used by the latest request
        # branches by their first message: a request can only extend branches that start like it does, and a
        # session of many conversations must not scan them all per request
        self._by_start: dict[tuple[str, str], list[_Branch]] = {}
        self.calls = 0  # requests committed: a turn's index (`Segment.turns`, `Result.turn_rewards`)

    def segments(self) -> list[Segment]:
        return [b.segment for b in self.branches]

    def plan(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        temperature: float,
        role: str = "",
    ) -> Plan:
        rewrite = False
        for branch in reversed(self._by_start.get((role, *_start(messages)), ())):
            known = branch.messages
            if (
                known is None
                or branch.tools != tools
                or branch.segment.temperature != temperature
                or len(messages) <= len(known)
                or messages[: len(known)] != known
            ):
                continue
            pieces = self.renderer.extension(messages, tools, len(known), branch.prompt_text)
            context = pieces and self._continuation(branch, *pieces[:2])
            if context is not None:
                ids, images = self.renderer.encode_images(context, message_images(messages[len(known) :]))
                return Plan(
                    joined_ids(branch.segment.token_ids, ids),
                    ids,
                    branch,
                    "",
                    messages,
                    tools,
                    temperature,
                    pieces[2],
                    images=join_inputs(branch.segment.images, images),
                    role=role,
                )
            rewrite = True
            break
        text_c = self.renderer.render(messages, tools, add_generation_prompt=True)
        ids, images = self.renderer.encode_images(text_c, message_images(messages))
        reason = self._break_reason(messages, tools, temperature, rewrite, role)
        return Plan(
            joined_ids(ids), ids, None, reason, messages, tools, temperature, text_c, rewrite, images, role
        )

    def plan_raw(self, text: str) -> Plan:
        if self._last is None:
            raise ValueError("raw-text continuation needs an earlier turn in this session")
        seg = self._last.segment
        ids = self.renderer.encode(text)
        return Plan(
            joined_ids(seg.token_ids, ids),
            ids,
            self._last,
            "",
            None,
            self._last.tools,
            seg.temperature,
            images=seg.images,
        )

    def commit(self, plan: Plan, actions: list[Action], replies: list[dict[str, Any]] | None) -> None:
        """Record the sampled choices of a planned request (choice 0 continues or starts; others branch)."""
        turn, self.calls = self.calls, self.calls + 1
        for i, action in enumerate(actions):
            ended = bool(action.token_ids) and action.token_ids[-1] in self.eos_ids
            messages = None if plan.messages is None or replies is None else plan.messages + [replies[i]]
            if i == 0 and plan.branch is not None:
                branch = plan.branch
                # the conversation goes on after others began: those ran beside it (a harness's subagents)
                for later in self.branches[self.branches.index(branch) + 1 :]:
                    if later.segment.break_reason in ("compaction", "tools_changed"):
                        later.segment.break_reason = "subagent"
                _extend(branch.segment, plan.context_ids, action, turn)
                branch.segment.images = plan.images
                branch.messages, branch.prompt_text, branch.ended_turn = messages, plan.prompt_text, ended
            else:
                segment = Segment(
                    [],
                    [],
                    [],
                    [],
                    break_reason=plan.break_reason if i == 0 else "branch",
                    temperature=plan.temperature,
                    images=plan.images,
                    role=plan.role,
                )
                _extend(segment, plan.prompt_ids, action, turn)
                branch = _Branch(segment, messages, plan.tools, plan.prompt_text, ended)
                self.branches.append(branch)
                if messages:
                    self._by_start.setdefault((plan.role, *_start(messages)), []).append(branch)
            if i == 0:
                self._last = branch

    # ------------------------------------------------------------------------------------------ internals
    def _continuation(self, branch: _Branch, reply: str, added: str) -> str | None:
        """Text of the context tokens that continue `branch`, from the template's text of its reply and of what
        follows (`ChatRenderer.extension`); None where no splice point is safe."""
        end, eos = max((reply.rfind(e), e) for e in self.eos_texts) if self.eos_texts else (-1, "")
        if end < 0:
            return None  # the template does not close turns with an EOS token: no safe splice point
        closer = reply[end + len(eos) :] if branch.ended_turn else reply[end:]
        return closer + added

    def _break_reason(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        temperature: float,
        rewrite: bool,
        role: str,
    ) -> str:
        last = self._last
        if last is None:
            return "start"
        if role != last.segment.role:
            return "role"  # another agent of the same rollout
        if rewrite:
            return "template_rewrite"
        if last.tools != tools:
            return "tools_changed"
        if last.segment.temperature != temperature:
            return "sampling_changed"
        if last.messages is not None and messages == last.messages[: len(messages)]:
            return "branch"
        return "compaction"


def _start(messages: list[dict[str, Any]]) -> tuple[str, str]:
    return (messages[0]["role"], str(messages[0]["content"])) if messages else ("", "")


def joined_ids(*parts: Any) -> Any:
    """Token ids as one int32 array: a turn's prompt is the segment's array and its new tokens, joined at C speed
    (not a Python list of the whole history: the engine process gets the array's bytes, `molt.engine.process`)."""
    return np.concatenate([np.asarray(p, np.int32) for p in parts])


def _extend(segment: Segment, context: Any, action: Action, turn: int) -> None:
    n, k = len(context), len(action.token_ids)
    segment.turns.append((turn, k))
    segment.token_ids = joined_ids(segment.token_ids, context, action.token_ids)
    segment.action_mask = np.concatenate([segment.action_mask, np.arange(n + k) >= n])
    segment.behavior_logprobs = np.concatenate(
        [segment.behavior_logprobs, np.asarray(action.logprobs, np.float32)]
    )
    segment.versions = np.concatenate([segment.versions, np.asarray(action.versions, np.int32)])
    # routes aligned with token_ids (0 where never run); rows already there keep theirs
    if action.routes is not None:
        routes = np.zeros((len(segment.token_ids), *action.routes.shape[1:]), action.routes.dtype)
        routes[: len(action.routes)] = action.routes[: len(routes)]
        if segment.routed_experts is not None:
            routes[: len(segment.routed_experts) - 1] = segment.routed_experts[:-1]
        segment.routed_experts = routes
