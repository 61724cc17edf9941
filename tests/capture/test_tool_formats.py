"""Tool-call formats per model family (molt/capture/tools.py), checked against the families' published chat
templates (templates/*.jinja, the text as the models ship it): the parser is chosen from the template, a reply
in the family's format parses into the calls written here by hand, and the parsed calls, resent by the client,
render with the same template to exactly the tokens the model sampled (one segment)."""

import json
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from tokenizers import AddedToken

from molt.capture.render import ChatRenderer, canonical_messages
from molt.capture.tools import choose_tool_parser, get_tool_parser
from molt.testing.models import build_tokenizer
from molt.testing.scripted import ScriptedEngine, live_capture_server

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}, "precision": {"type": "integer"}},
                "required": ["expression"],
            },
        },
    }
]
CALC = {"expression": "12 * 7"}
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
MISTRAL = [
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]

# template file: (parser chosen, (eos, bos, special tokens), scripted reply, content and calls expected, by hand)
FAMILIES = {
    "qwen3.jinja": (
        "hermes",
        ("<|im_end|>", None, []),
        (
            '<think>\nI need the calculator.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "12 * 7"}}\n</tool_call>'
        ),
        "<think>\nI need the calculator.\n</think>",
        [("calculator", CALC)],
    ),
    "qwen3_coder.jinja": (
        "qwen3_coder",
        ("<|im_end|>", None, []),
        (
            "I will compute it.\n\n<tool_call>\n<function=calculator>\n<parameter=expression>\n12 * 7\n"
            "</parameter>\n<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>"
        ),
        "I will compute it.",
        [("calculator", {**CALC, "precision": 2})],
    ),
    "llama3.2.jinja": (
        "llama3_json",
        ("<|eot_id|>", "<|begin_of_text|>", LLAMA),
        '{"name": "calculator", "parameters": {"expression": "12 * 7"}}',
        "",
        [("calculator", CALC)],
    ),
    "mistral_nemo.jinja": (
        "mistral",
        ("</s>", "<s>", MISTRAL),
        (
            '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12 * 7"}, "id": '
            '"a1b2c3d4e"}, {"name": "calculator", "arguments": {"expression": "2 + 2"}, "id": "f5g6h7i8j"}]'
        ),
        "",
        [("calculator", CALC), ("calculator", {"expression": "2 + 2"})],
    ),
    "ministral3.jinja": (
        "mistral_v11",
        ("</s>", "<s>", [*MISTRAL, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]"]),
        'Let me compute.[TOOL_CALLS]calculator[ARGS]{"expression": "12 * 7"}',
        "Let me compute.",
        [("calculator", CALC)],
    ),
}


def family_tokenizer(name):
    """The tiny BPE tokenizer with the family's template, end-of-turn token and special tokens (the tool-call
    markers among them, as the families' own tokenizers mark them)."""
    _, (eos, bos, specials), *_ = FAMILIES[name]
    tok = build_tokenizer(template=(TEMPLATES / name).read_text())
    tok.add_special_tokens(
        {
            "eos_token": eos,
            **({"bos_token": bos} if bos else {}),
            "additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in specials],
        }
    )
    return tok


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", list(FAMILIES))
async def test_reply_parses_and_renders_back_token_exact(name, stream):
    parser, _, reply, content, calls = FAMILIES[name]
    tok = family_tokenizer(name)
    engine = ScriptedEngine(tok, [reply, "The answer is 84."], max_model_len=8192, token_delay=0.0005)
    async with live_capture_server(engine, tok) as server:
        assert server.parser is get_tool_parser(parser)  # chosen from the template ("auto")
        session = await server.open_session()
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        messages = [{"role": "user", "content": "What is 12 * 7?"}]
        if stream:
            async with api.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as events:
                first = await events.get_final_completion()
        else:
            first = await api.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and (message.content or "") == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == calls
        messages += [
            message,
            *({"role": "tool", "tool_call_id": c.id, "content": "84"} for c in message.tool_calls),
        ]
        await api.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        (segment,) = await session.close()
        assert session.stats["malformed_tool_calls"] == 0 and not session.stats.get("stream_mismatch")
    # the spliced prompt of turn 2 (turn 1's prompt, the sampled reply, the template's text after it) is what the
    # template renders for the whole conversation, tokenized afresh: the parsed calls render back exactly
    text = ChatRenderer(tok).render(
        canonical_messages([m if isinstance(m, dict) else m.model_dump() for m in messages]), TOOLS, True
    )
    assert tok.decode(engine.calls[1]["prompt_ids"]) == text
    assert engine.calls[1]["prompt_ids"] == tok.encode(text, add_special_tokens=False)
    sampled = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    start = len(engine.calls[0]["prompt_ids"])
    assert segment.token_ids[start : start + len(sampled)].tolist() == sampled
    assert segment.token_ids.tolist()[: len(engine.calls[1]["prompt_ids"])] == engine.calls[1]["prompt_ids"]


@pytest.mark.parametrize(
    "parser, text, content, calls, malformed",
    [
        (
            "hermes",
            (
                'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", '
                '"arguments": {}}\n</tool_call>'
            ),
            "Sure.",
            [("a", {"x": 1}), ("b", {})],
            0,
        ),
        (
            "hermes",
            (
                '<tool_call>{"name": "a", "arguments": {oops</tool_call><tool_call>{"name": "b", "arguments": {}}'
                "</tool_call><tool_call>"
            ),
            '<tool_call>{"name": "a", "arguments": {oops</tool_call><tool_call>',
            [("b", {})],
            2,
        ),
        (
            "qwen3_coder",
            (
                "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=body>\ndef f():\n"
                "    return 1 < 2\n\n</parameter>\n<parameter=n>\n3\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n"
                '<parameter=opts>\n{"k": [1, 2]}\n</parameter>\n</function>\n</tool_call>'
            ),
            "",
            [
                (
                    "write",
                    {
                        "path": "a.py",
                        "body": "def f():\n    return 1 < 2\n",
                        "n": 3,
                        "flag": "true",
                        "opts": {"k": [1, 2]},
                    },
                )
            ],
            0,
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=w>\n<parameter=p>\na.py\n</parameter>\n",
            "<tool_call>\n<function=w>\n<parameter=p>\na.py\n</parameter>\n",
            [],
            1,
        ),
        ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}', "", [("a", {"x": 1})], 0),
        # two calls: the template renders one a turn (and refuses more), so they are not read as calls
        (
            "llama3_json",
            '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}',
            '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}',
            [],
            1,
        ),
        ("llama3_json", '{"answer": 4}', '{"answer": 4}', [], 1),
        ("llama3_json", '{"name": "a", "parameters": {"x": ', '{"name": "a", "parameters": {"x": ', [], 1),
        ("llama3_json", "It is {probably} 7.", "It is {probably} 7.", [], 0),
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}, "id": "abcdefghi"}]',
            "",
            [("a", {"x": 1})],
            0,
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}',
            '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}',
            [],
            1,
        ),
        (
            "mistral_v11",
            'Ok.[TOOL_CALLS]a[ARGS]{"x": {"y": 1}}[TOOL_CALLS]b[CALL_ID]abc123def[ARGS]{}',
            "Ok.",
            [("a", {"x": {"y": 1}}), ("b", {})],
            0,
        ),
        (
            "mistral_v11",
            '[TOOL_CALLS]a[ARGS]{"x": oops}[TOOL_CALLS]b[ARGS]{}',
            '[TOOL_CALLS]a[ARGS]{"x": oops}',
            [("b", {})],
            1,
        ),
    ],
)
def test_formats_parse_and_count_malformed_calls(parser, text, content, calls, malformed):
    parsed = get_tool_parser(parser)(text)
    assert parsed.content == content and parsed.malformed == malformed
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.calls] == calls


def test_mistral_ids_are_the_models_or_nine_alphanumerics():
    (kept,) = get_tool_parser("mistral")(
        '[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abcdefghi"}]'
    ).calls
    (made,) = get_tool_parser("mistral_v11")("[TOOL_CALLS]a[ARGS]{}").calls
    assert kept["id"] == "abcdefghi" and len(made["id"]) == 9 and made["id"].isalnum()


def test_detection_rule_and_override():
    assert choose_tool_parser("auto", "{{ messages }}") is get_tool_parser(
        "hermes"
    )  # no known format: as before
    assert choose_tool_parser("auto", "<|python_tag|>") is get_tool_parser("llama3_json")
    assert choose_tool_parser("llama3_json", (TEMPLATES / "qwen3.jinja").read_text()) is get_tool_parser(
        "llama3_json"
    )
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        choose_tool_parser("nope", "")


def test_config_names_the_field_for_an_unknown_parser():
    from molt.config import MoltConfig
    from molt.config_validate import validate

    cfg = MoltConfig()
    cfg.rollout.tool_parser = "nope"
    with pytest.raises(ValueError, match=r"rollout.tool_parser: unknown tool parser 'nope'"):
        validate(cfg, check_files=False)


# the response template transformers' `serve` falls back to for Qwen2/Qwen3 (transformers/cli/serving/utils.py)
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>)", "content": "text"},
    },
}


def test_the_models_own_parser_is_preferred():
    tok = family_tokenizer("qwen3.jinja")
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    parser = choose_tool_parser("auto", tok.chat_template, tok)
    assert parser is not get_tool_parser("hermes") and parser.markers == ("<tool_call>", "</tool_call>")
    # an unclosed block: the model's parser reads it (hermes would not), the reasoning stays in the content
    parsed = parser('<think>\nhm\n</think>\n\n<tool_call>\n{"name": "a", "arguments": {"x": "1"}}')
    assert parsed.content == "<think>\nhm\n</think>" and parsed.malformed == 0
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.calls] == [("a", {"x": "1"})]
    # a call it cannot read: the template format's parser keeps it as text and counts it
    bad = '<tool_call>{"name": "a", "arguments": {oops</tool_call>'
    assert (parser(bad).content, parser(bad).malformed) == (bad, 1)
    assert choose_tool_parser("hermes", tok.chat_template, tok) is get_tool_parser(
        "hermes"
    )  # named: no preference


async def test_the_models_own_parser_with_a_list_of_openings():
    """transformers' response_template allows the tool_calls field's `open` to be a list of literals: a reply
    with a call is read (it was a 500) and the content is the text before the first opening."""
    tok = build_tokenizer()
    tok.response_template = {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {
                "open": ["<tool_call>", "<call>"],
                "close": "</tool_call>",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
        },
    }
    reply = 'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'
    async with live_capture_server(ScriptedEngine(tok, [reply]), tok) as server:
        r = await AsyncOpenAI(
            base_url=(s := await server.open_session()).base_url, api_key=s.api_key
        ).chat.completions.create(model="m", messages=[{"role": "user", "content": "Add."}], tools=TOOLS)
    message = r.choices[0].message
    assert message.content == "Sure." and [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"expression": "1"}
    ]
