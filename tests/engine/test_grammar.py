"""Constrained decoding in the embedded engine (`SamplingParams.json_schema`), checked against an independent
replay: a fresh llguidance matcher walks each reply (its byte-per-token mask, not the engine's bitmask) and a
plain forward gives the masked distribution the log-probs must come from (molt.engine.sampling docstring)."""

import asyncio
import json

import jsonschema
import pytest
import torch
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer
from test_hf import PROMPTS, load, progress

from molt.engine.base import RequestError
from molt.engine.hf import HFEngine
from molt.types import FinishReason, SamplingParams, json_grammar

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "pick", "n", "note"],
    "properties": {
        "ok": {"type": "boolean"},
        "pick": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 6},
    },
}
LONG = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 24, "maxItems": 24}  # no early end


@pytest.fixture
async def engine(tiny_llama_dir):  # its own: a test refits it
    eng = HFEngine(str(tiny_llama_dir))
    yield eng
    await eng.close()


@torch.no_grad()
def replay(model, tokenizer, eos, schema, prompt, out, temperature):
    """(the reply's masked log-probs by a forward and a fresh matcher, its full ones); asserts the matcher accepts
    every token and ends complete."""
    lltok = from_tokenizer(tokenizer, n_vocab=model.config.vocab_size, eos_token=eos)
    matcher = LLMatcher(lltok, json_grammar(schema))
    logits = (
        model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float() / temperature
    )
    masked = []
    for row, token in zip(logits, out.token_ids):
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[: len(row)] > 0
        masked.append(torch.log_softmax(row.masked_fill(~allowed, -float("inf")), -1)[token])
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_stopped() and not matcher.is_error()
    full = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    return torch.stack(masked), full


@pytest.mark.parametrize("temperature", [1.0, 0.0])
async def test_replies_follow_the_schema_and_record_the_masked_distribution(
    engine, tokenizer, tiny_llama_dir, temperature
):
    model, eos = load(tiny_llama_dir), engine.eos_token_ids
    params = [
        SamplingParams(
            max_tokens=120, temperature=temperature, seed=s, grammar=json_grammar(SCHEMA), top_logprobs=3
        )
        for s in range(4)
    ]
    outs = await asyncio.gather(*(engine.generate(PROMPTS[3 + i], p) for i, p in enumerate(params)))
    for i, out in enumerate(outs):
        assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] in eos
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids[:-1])), SCHEMA)
        masked, full = replay(model, tokenizer, eos, SCHEMA, PROMPTS[3 + i], out, temperature or 1.0)
        assert torch.tensor(out.logprobs).sub(masked).abs().max() <= 1e-4
        assert (full < masked - 1e-3).any()  # the grammar really removed mass: the record is not the full one
        for top, lp in zip(
            out.top_logprobs, out.logprobs
        ):  # alternatives the grammar allows only, masked too
            assert 1 <= len(top) <= 3 and all(a >= lp - 1e-6 for _, a in top[:1])
    assert len({tuple(o.token_ids) for o in outs}) > 1 or temperature == 0  # random replies, still all valid


async def test_only_constrained_rows_change(engine):
    """A seeded unconstrained request samples the same tokens beside constrained ones as alone."""
    plain = SamplingParams(max_tokens=24, seed=7)
    solo = await engine.generate(PROMPTS[5], plain)
    batched, *_ = await asyncio.gather(
        engine.generate(PROMPTS[5], plain),
        *(
            engine.generate(
                PROMPTS[6 + i], SamplingParams(max_tokens=60, seed=i, grammar=json_grammar(SCHEMA))
            )
            for i in range(3)
        ),
    )
    assert batched.token_ids == solo.token_ids


async def test_a_refit_in_the_middle_keeps_the_matcher(engine, tokenizer, tiny_llama_dir, tmp_path):
    """Keep mode: the request prefills again with its tokens under new weights and its matcher goes on from them."""
    from molt.testing.models import build_tiny_llama

    new_model, old_model = load(build_tiny_llama(tmp_path / "v1", seed=1)), load(tiny_llama_dir)
    task = asyncio.create_task(
        engine.generate(
            PROMPTS[2], SamplingParams(max_tokens=200, seed=5, grammar=json_grammar(LONG)), request_id="c"
        )
    )
    await progress(engine, "c", 8)
    await engine.pause()
    k = len(engine._active["c"].tokens)
    await engine.update_weights(
        [(n, t) for n, t in new_model.state_dict().items() if n != "lm_head.weight"], 1
    )
    await engine.resume()
    out = await task
    assert out.finish_reason is FinishReason.STOP and out.versions.count(0) == k < len(out.token_ids)
    jsonschema.validate(json.loads(tokenizer.decode(out.token_ids[:-1])), LONG)
    eos = engine.eos_token_ids
    old, _ = replay(old_model, tokenizer, eos, LONG, PROMPTS[2], out, 1.0)
    new, _ = replay(new_model, tokenizer, eos, LONG, PROMPTS[2], out, 1.0)
    lp = torch.tensor(out.logprobs)
    assert lp[:k].sub(old[:k]).abs().max() <= 1e-4 and lp[k:].sub(new[k:]).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(grammar='start: %json{"type": "nonsense"}'), "grammar: .*Invalid type: nonsense"),
        (SamplingParams(grammar="start: /((/"), "grammar: .*regex parse error"),
        (SamplingParams(grammar="start: undefined_rule"), "grammar: .*undefined_rule"),
    ],
)
async def test_bad_grammars_are_request_errors(engine, params, message):
    with pytest.raises(ValueError, match=message):
        params.validate()
    with pytest.raises(RequestError, match=message):
        await engine.generate(PROMPTS[1], params)


async def test_min_tokens_holds_while_the_grammar_allows_more(engine, tokenizer):
    """`min_tokens` beside a grammar, as vLLM 0.32 does it: stop tokens stay suppressed while the grammar allows
    anything else and come back once it allows only them, so a grammar that is finished before min_tokens ends
    the reply there (without the fix every token was masked: garbage after the grammar's end, up to max_tokens)."""
    eos = engine.eos_token_ids
    short = SamplingParams(max_tokens=30, min_tokens=30, seed=1, grammar=json_grammar({"enum": ["ab"]}))
    loose = SamplingParams(max_tokens=30, min_tokens=12, seed=2, grammar="start: /[a-z ]*/")
    done, free = await asyncio.gather(engine.generate(PROMPTS[1], short), engine.generate(PROMPTS[2], loose))
    assert done.finish_reason is FinishReason.STOP and done.token_ids[-1] in eos
    assert tokenizer.decode(done.token_ids[:-1]) == '"ab"'
    assert len(free.token_ids) >= 12 and not set(free.token_ids[:12]) & set(eos)
