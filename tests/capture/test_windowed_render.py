"""A turn's rendering from a window of the conversation (`ChatRenderer.extension`): token for token what rendering
the whole conversation gives, with the same segment splits, on the tiny models' real chat templates and SmolLM2's;
templates whose earlier turns change with later ones are found once and rendered whole."""

import random

import pytest

from molt.capture.render import ChatRenderer
from molt.capture.segments import Action, SegmentTracker
from molt.capture.tools import tool_call
from molt.testing.models import CHATML_TOOLS_TEMPLATE, QWEN3_THINK_TEMPLATE, VLM_TEMPLATE, build_tokenizer

# SmolLM2-135M-Instruct's chat_template.jinja, as shipped
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml_tools": (CHATML_TOOLS_TEMPLATE, True),
    "qwen3_think": (QWEN3_THINK_TEMPLATE, False),
    "vlm": (VLM_TEMPLATE, True),
    "smollm2": (SMOLLM2_TEMPLATE, True),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "search files",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}},
                "required": ["pattern"],
            },
        },
    }
]
WORDS = [
    "the",
    "file",
    "path",
    "src",
    "main",
    "error",
    "line",
    "test",
    "function",
    "return",
    "value",
    "fix",
    "bug",
]


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))


def agent_session(rng, tools, turns):
    """(messages of a request, the reply recorded for it): user turns, replies with reasoning or tool calls,
    the calls' results as the next request."""
    messages = [{"role": "system", "content": words(rng, 30)}] if rng.random() < 0.7 else []
    for _ in range(turns):
        calls = messages[-1].get("tool_calls") if messages else None
        messages += (
            [{"role": "tool", "content": words(rng, 20), "tool_call_id": c["id"]} for c in calls]
            if calls
            else [{"role": "user", "content": words(rng, 40)}]
        )
        kind = rng.choice(["text", "think", "call"] if tools else ["text", "think"])
        reply = {"role": "assistant", "content": words(rng, 15)}
        if kind == "think":
            reply["content"] = f"<think>{words(rng, 10)}</think>{reply['content']}"
        elif kind == "call":
            reply["content"] = rng.choice(["", words(rng, 5), f"<think>{words(rng, 5)}</think>"])
            reply["tool_calls"] = [
                tool_call(f"c{len(messages)}-{i}", "grep", {"pattern": words(rng, 2)})
                for i in range(rng.randint(1, 2))
            ]
        yield list(messages), reply
        messages.append(reply)


def sampled(renderer, messages, reply, tools, eos_id):
    """The tokens a model would have sampled for `reply`: the template's own text of it, then EOS."""
    prompt = renderer.render(messages, tools, True)
    text = renderer.render(messages + [reply], tools, False)[len(prompt) :]
    return renderer.encode(text.split("<|im_end|>")[0]) + [eos_id]


@pytest.mark.parametrize("name", TEMPLATES)
def test_windowed_rendering_equals_whole_rendering_token_for_token(name):
    template, stable = TEMPLATES[name]
    windowed = ChatRenderer(build_tokenizer(template=template))
    whole = ChatRenderer(build_tokenizer(template=template))
    whole.__dict__["prefix_stable"] = False  # (the cached property) render every conversation whole
    assert windowed.prefix_stable is stable
    eos = windowed.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for seed in range(4):
        rng = random.Random(seed)
        tools = TOOLS if name != "smollm2" and seed % 2 else None
        trackers = [SegmentTracker(r, [eos]) for r in (windowed, whole)]
        for messages, reply in agent_session(rng, tools, 25):
            plans = [t.plan(messages, tools, 1.0) for t in trackers]
            assert plans[0].prompt_ids.tolist() == plans[1].prompt_ids.tolist()
            assert (plans[0].branch is None, plans[0].break_reason) == (
                plans[1].branch is None,
                plans[1].break_reason,
            )
            assert windowed.decode(plans[0].prompt_ids.tolist()) == windowed.render(messages, tools, True)
            ids = sampled(windowed, messages, reply, tools, eos)
            for tracker, plan in zip(trackers, plans):
                tracker.commit(plan, [Action(ids, [0.0] * len(ids), [0] * len(ids))], [reply])
        segments = [t.segments() for t in trackers]
        assert [s.token_ids.tolist() for s in segments[0]] == [s.token_ids.tolist() for s in segments[1]]
        assert (
            len(segments[0]) == 1 or name == "qwen3_think"
        )  # its think stripping is a rewrite, found both ways


def test_a_turn_renders_a_window_not_the_history():
    """Rendering work per turn does not grow with the conversation: a turn renders its new messages, the reply
    they follow, the one or two before it and the first message."""
    renderer = ChatRenderer(build_tokenizer(template=CHATML_TOOLS_TEMPLATE))
    assert renderer.prefix_stable
    rendered, render = [], renderer.render
    renderer.render = lambda messages, *args, **kw: (
        rendered.append(len(messages)) or render(messages, *args, **kw)
    )
    eos = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tracker = SegmentTracker(renderer, [eos])
    for turn, (messages, reply) in enumerate(agent_session(random.Random(0), TOOLS, 40)):
        rendered.clear()
        plan = tracker.plan(messages, TOOLS, 1.0)
        assert turn == 0 or plan.branch is not None
        assert turn < 3 or max(rendered) <= 4 + len(messages) - len(tracker.branches[0].messages), rendered
        ids = [eos]  # what was sampled does not matter here
        tracker.commit(plan, [Action(ids, [0.0], [0])], [reply])
    assert len(messages) > 40
