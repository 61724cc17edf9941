"""The tiny checkpoints load through the real from_pretrained path and their templates behave."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {
        "role": "assistant",
        "content": "<think>add</think>\nCalling.",
        "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}],
    },
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "<think>done</think>\nIt is 4."},
    {"role": "user", "content": "thanks"},
]


def test_dense_round_trip(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    again = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("What is 3 + 4?")])
    torch.testing.assert_close(model(ids).logits, again(ids).logits)  # weights were really saved
    text = 'Any text {"json": [1, 2]} \u00e9\u4e2d round-trips'
    assert tok.decode(tok.encode(text)) == text


def test_moe_round_trip(tiny_moe_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir)
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert model(torch.tensor([[5, 6, 7]])).logits.shape[-1] == model.config.vocab_size


def test_tool_template_renders_calls_and_tool_turns(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = tok.apply_chat_template(CONV, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "calc"' in text.split("</tools>")[0]  # tool schema in the system block
    assert (
        'Calling.\n<tool_call>\n{"name": "calc", "arguments": {"x": "2+2"}}\n</tool_call><|im_end|>' in text
    )
    assert "<|im_start|>tool\n4<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
    # markers are single tokens, as in Qwen vocabularies
    assert len(tok.encode("<tool_call>")) == 1 and len(tok.encode("</think>")) == 1


def test_think_template_drops_earlier_reasoning(tiny_think_dir):
    tok = AutoTokenizer.from_pretrained(tiny_think_dir)
    before = tok.apply_chat_template(CONV[:4], tokenize=False)
    after = tok.apply_chat_template(CONV, tokenize=False)
    assert "<think>done</think>" in before  # the last turn keeps its reasoning ...
    assert "<think>" not in after  # ... until a new user turn arrives: history is rewritten
    assert not after.startswith(before)
