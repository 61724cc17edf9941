"""`molt doctor --model REF`: will multi-turn capture of this model's chat template stay in one segment?

Design notes and decisions: docs/internals.md, section `molt/capture/doctor.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from molt.capture.render import ChatRenderer, canonical_messages, canonical_tools
from molt.capture.segments import Action, SegmentTracker
from molt.modeling import ModelSpec

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}},
}
SYSTEM = {"role": "system", "content": "You are a careful assistant."}
Q1, Q2 = {"role": "user", "content": "What is 3 + 4?"}, {"role": "user", "content": "And 5 + 6?"}

# name -> (tools, [(messages appended before this turn, assistant reply of this turn)])
CHECKS: dict[str, tuple[list | None, list[tuple[list[dict], dict]]]] = {
    "plain multi-turn": (
        None,
        [
            ([SYSTEM, Q1], {"role": "assistant", "content": "It is 7."}),
            ([Q2], {"role": "assistant", "content": "It is 11."}),
        ],
    ),
    "several messages at once": (
        None,
        [
            ([Q1], {"role": "assistant", "content": "7."}),
            (
                [Q2, {"role": "assistant", "content": "(an aside)"}, {"role": "user", "content": "Go on."}],
                {"role": "assistant", "content": "11."},
            ),
        ],
    ),
    "tool calls": (
        TOOLS,
        [
            ([SYSTEM, Q1], {"role": "assistant", "content": "", "tool_calls": [CALL]}),
            (
                [{"role": "tool", "tool_call_id": "call_1", "content": "7"}],
                {"role": "assistant", "content": "It is 7."},
            ),
            ([Q2], {"role": "assistant", "content": "It is 11."}),
        ],
    ),
    "reasoning blocks": (
        None,
        [
            ([Q1], {"role": "assistant", "content": "<think>3 plus 4</think>It is 7."}),
            ([Q2], {"role": "assistant", "content": "<think>5 plus 6</think>It is 11."}),
        ],
    ),
}


@dataclass
class Finding:
    check: str
    ok: bool
    detail: str


def play(renderer: ChatRenderer, eos_ids: list[int], tools: list | None, turns: list) -> list[str]:
    """Break reasons of each turn after the first ("" = continued the segment)."""
    tracker = SegmentTracker(renderer, eos_ids)
    tools = canonical_tools(tools)
    messages: list[dict] = []
    reasons = []
    for i, (appended, reply) in enumerate(turns):
        messages = messages + canonical_messages(appended)
        plan = tracker.plan(messages, tools, 1.0)
        if i:
            reasons.append("" if plan.branch is not None else plan.break_reason)
        replied = messages + canonical_messages([reply])
        text = renderer.render(replied, tools, False)
        prompt = renderer.render(messages, tools, True)  # (a continued plan may not hold it)
        # the reply's tokens as the model would sample them: its text up to the end of turn, then EOS
        sampled = renderer.encode(text[len(prompt) :].split(renderer.decode([eos_ids[0]]))[0]) + eos_ids[:1]
        tracker.commit(plan, [Action(sampled, [0.0] * len(sampled), [0] * len(sampled))], replied[-1:])
        messages = replied
    return reasons


def diagnose(renderer: ChatRenderer, eos_ids: list[int]) -> list[Finding]:
    findings = []
    for name, (tools, turns) in CHECKS.items():
        try:
            reasons = play(renderer, eos_ids, tools, turns)
        except ValueError as e:  # the template rejected the conversation
            findings.append(Finding(name, False, f"template error: {e}"))
            continue
        broken = [f"turn {i + 2}: {r}" for i, r in enumerate(reasons) if r]
        findings.append(
            Finding(name, not broken, "one segment" if not broken else "new segment at " + ", ".join(broken))
        )
    conversation = canonical_messages([SYSTEM, Q1])
    same = renderer.render(conversation, [], True) == renderer.render(conversation, None, True)
    findings.append(
        Finding(
            "tools=[] vs no tools",
            same,
            "render the same" if same else "render differently (capture treats tools=[] as no tools)",
        )
    )
    return findings


def doctor_main(args: Any) -> int:
    """Entry point for `molt doctor` (args: model). Prints one line per check; returns 0 (it is a report)."""
    from molt.models import resolve_model

    path = str(resolve_model(args.model))
    renderer = ChatRenderer.from_pretrained(path)
    print(f"molt doctor: chat template of {args.model}")
    for f in diagnose(renderer, list(ModelSpec.from_pretrained(path).eos_token_ids)):  # the engines' EOS ids
        print(f"  [{'ok' if f.ok else '!!'}] {f.check}: {f.detail}")
    print(
        "A new segment costs nothing in correctness (each segment is token-exact), but its context is "
        "re-encoded and trained separately; see DESIGN.md, 'Capture continuation rule'."
    )
    return 0
