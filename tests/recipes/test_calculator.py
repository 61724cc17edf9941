"""The calculator recipe (recipes/calculator): its shared logic by hand-computed values, a scripted tool-call
round trip through the real capture server on both wires, and a few training steps end to end on the tiny model
for the OpenAI and the Anthropic agent."""

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from molt.agents import load_agent
from molt.config import MoltConfig
from molt.config_validate import validate
from molt.testing.scripted import ScriptedEngine, live_capture_server
from molt.types import SamplingParams

RECIPE = Path(__file__).parents[2] / "recipes" / "calculator"
sys.path.insert(0, str(RECIPE))  # the helper imports by plain name, as it does next to the agent files
import calculator_task as ct

CHAIN = [3, 4, -2, 6]  # 3 + 4 = 7, - 2 = 5, + 6 = 11 (the additive label form of earlier datasets)
TERMS = ["3", "+ 4", "- 2", "+ 6"]


# ------------------------------------------------------------------------------------------------ the calculator
@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", 14),
        ("(7 - 2) ** 2", 25),
        ("7 / 2", 3.5),
        ("-3 + 1", -2),
        ("2^3", 8),
        ("17 // 5", 3),
        ("17 % 5", 2),
        (" 12 - 19 ", -7),
    ],
)
def test_calculate(expression, value):
    assert ct.calculate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "x + 1",
        "abs(-3)",
        "(1).real",
        "'a' * 3",
        "True + 1",
        "[1, 2]",
        "lambda: 1",
        "9 ** 99",
        "1 / 0",
        "10 ** 64 * 10 ** 64",
        "",
        "1 +",
        "1" * 201,
    ],
)
def test_calculate_refuses_anything_but_bounded_arithmetic(expression):
    with pytest.raises(ct.CalculatorError):
        ct.calculate(expression)


def test_run_tool_answers_mistakes_with_text():
    assert ct.run_tool("calculator", {"expression": "6 + 6"}) == "12"
    assert ct.run_tool("calculator", '{"expression": "7 / 2"}') == "3.5"  # SDK-style JSON arguments
    assert ct.run_tool("calculator", {"expression": "10 / 4 * 2"}) == "5"  # integral floats print as integers
    assert ct.run_tool("calculator", {"expression": "1 / 3"}) == "0.333333"
    assert ct.run_tool("search", {"q": "x"}).startswith("error: unknown tool")
    assert ct.run_tool("calculator", "not json").startswith("error:")
    assert ct.run_tool("calculator", {"expr": "1"}).startswith("error:")
    assert ct.run_tool("calculator", {"expression": "os.getcwd()"}).startswith("error:")


# ------------------------------------------------------------------------------------------------ task and grading
def test_chain_questions_and_summaries():
    assert ct.parse_chain("[3, 4, -2, 6]") == ct.parse_chain(CHAIN) == TERMS
    for bad in ("[3]", '["3", 4]', "7", None, '[3, "/ 2"]', '[3, "* x"]', "[3, true]"):
        with pytest.raises((ValueError, TypeError)):
            ct.parse_chain(bad)
    assert ct.running_values(TERMS) == [7, 5, 11]
    assert ct.questions(TERMS) == [
        "What is 3 + 4?",
        "Now subtract 2 from 7. What is the result?",
        "Now add 6 to 5. What is the result?",
    ]
    assert ct.summary(TERMS, 1) == "The result so far is 7."
    assert ct.summary(TERMS, 2) == "The result so far is 5."
    product = ct.parse_chain('[23, "* 41", "*7", "+ 386"]')
    assert product == ["23", "* 41", "* 7", "+ 386"]
    assert ct.running_values(product) == [943, 6601, 6987]  # 23 * 41 = 943; 943 * 7 = 6601; + 386 = 6987
    assert ct.questions(product)[1:] == [
        "Now multiply 943 by 7. What is the result?",
        "Now add 386 to 6601. What is the result?",
    ]
    assert ct.summary(product, 2) == "The result so far is 6601."


def test_the_data_needs_the_tool():
    # by path, under a name of its own: each recipe has a make_data.py, and a plain import would reuse the first
    spec = importlib.util.spec_from_file_location("calculator_make_data", RECIPE / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)

    train, test = make_data.rows(n_train=20, n_test=5, steps=3, seed=1)
    assert len({r["label"] for r in train + test}) == 25
    for row in train + test:
        terms = ct.parse_chain(row["label"])
        assert row["prompt"][0]["content"] == ct.questions(terms)[0]
        a, b = int(terms[0]), int(terms[1].split()[1])
        assert 12 <= a <= 99 and 12 <= b <= 99 and terms[2].startswith("* ") and terms[3].startswith("+ ")


@pytest.mark.parametrize(
    "text, value, score",
    [
        ("The answer is 7.", 7, 1.0),
        ("7 or 8", 7, 0.0),
        ("It is 1,000", 1000, 1.0),
        ("-2", -2, 1.0),
        ("7.0", 7, 1.0),
        ("seven", 7, 0.0),
        ("", 7, 0.0),
        (None, 7, 0.0),
    ],
)
def test_grade_reads_the_last_number(text, value, score):
    assert ct.grade(text, value) == score


def test_compaction_keeps_the_preamble_and_summarizes():
    pre = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A"},
    ]
    history = pre + [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}]
    # 2 messages after the 3 kept + the next question = 3 <= 4: appended as is
    grown, compacted = ct.next_turn(history, 3, TERMS, 1, max_history_messages=4)
    assert not compacted
    assert grown == history + [{"role": "user", "content": "Now subtract 2 from 7. What is the result?"}]
    grown.append({"role": "assistant", "content": "5"})
    # 4 messages + the next question = 5 > 4: compacted into one user turn after the preamble
    compacted_history, compacted = ct.next_turn(grown, 3, TERMS, 2, max_history_messages=4)
    assert compacted
    assert compacted_history == pre + [
        {"role": "user", "content": "The result so far is 5. Now add 6 to 5. What is the result?"}
    ]
    assert ct.compact([{"role": "user", "content": "a"}], 0, "b") == [{"role": "user", "content": "b"}]


async def test_play_runs_tools_grades_each_step_and_compacts():
    """A fake model: calls the calculator on the first step, answers the second wrong and the third right."""
    seen = []
    replies = iter(
        [
            ct.Reply(
                "",
                [("c1", "calculator", {"expression": "3 + 4"})],
                {"role": "assistant", "content": "", "tc": 1},
            ),
            ct.Reply("It is 7", [], {"role": "assistant", "content": "It is 7"}),
            ct.Reply("6", [], {"role": "assistant", "content": "6"}),
            ct.Reply("11", [], {"role": "assistant", "content": "11"}),
        ]
    )

    async def ask(history):
        seen.append(list(history))
        return next(replies)

    def tool_results(results):
        return [{"role": "tool", "tool_call_id": i, "content": r} for i, r in results]

    start = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 3 + 4?"}]
    out = await ct.play(ask, tool_results, start, TERMS, max_history_messages=4, max_tool_rounds=2)
    assert out.correct == [1.0, 0.0, 1.0] and out.reward == pytest.approx(2 / 3)
    assert (out.tool_calls, out.tool_errors, out.compactions, out.model_calls) == (1, 0, 1, 4)
    # a step's third of the reward on the call that answered it: calls 1 (right), 2 (wrong), 3 (right)
    assert out.turn_rewards == pytest.approx([0.0, 1 / 3, 0.0, 1 / 3])
    assert out.info()["valid_call_rate"] == pytest.approx(1 / 3)  # one step of three made a call that ran
    assert seen[1][-1] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "7",
    }  # the tool's result went back
    # step 2: the history had 4 messages (question, call, result, answer), so it was compacted first
    assert seen[2] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "The result so far is 7. Now subtract 2 from 7. What is the result?"},
    ]
    assert seen[3][-1] == {"role": "user", "content": "Now add 6 to 5. What is the result?"}


async def test_play_bounds_tool_rounds():
    async def ask(history):  # a model that never stops calling tools
        return ct.Reply(
            "", [("c", "calculator", {"expression": "1 + 1"})], {"role": "assistant", "content": ""}
        )

    def tool_results(results):
        return [{"role": "tool", "tool_call_id": i, "content": r} for i, r in results]

    out = await ct.play(
        ask, tool_results, [{"role": "user", "content": "What is 3 + 4?"}], TERMS, keep=0, max_tool_rounds=1
    )
    assert (
        out.model_calls == 6 and out.tool_calls == 6 and out.reward == 0.0 and out.turn_rewards == [0.0] * 6
    )
    assert out.info()["valid_call_rate"] == 1.0 and out.info()["tool_errors"] == 0


# ------------------------------------------------------------------------------------------------ scripted round trip
def _scripted_model(tokenizer):
    """A model that calls the calculator for each step, then answers with the tool's result: reward 1.0 only if
    every call and result round-trips through the wire and the capture server."""
    expressions = iter(["3 + 4", "7 - 2", "5 + 6"])

    def reply(prompt_ids, params):
        prompt = tokenizer.decode(prompt_ids)
        last_turn = prompt.rsplit("<|im_start|>", 2)[-2]  # the turn before the generation prompt
        if last_turn.startswith("tool\n"):
            return "The result is " + last_turn[len("tool\n") :].split("<|im_end|>")[0]
        call = {"name": "calculator", "arguments": {"expression": next(expressions)}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    return reply


@pytest.mark.parametrize("file", ["agent.py", "anthropic_agent.py"])
async def test_scripted_tool_calls_round_trip(tokenizer, file):
    engine = ScriptedEngine(tokenizer, _scripted_model(tokenizer), max_model_len=4096)
    row = {"messages": [{"role": "user", "content": "What is 3 + 4?"}], "label": json.dumps(CHAIN)}
    async with live_capture_server(engine, tokenizer) as server:
        traj = await load_agent(RECIPE / file).run(
            row, sessions=server, rollout_id="r", group_id="g", sampling_params=SamplingParams(max_tokens=64)
        )
    assert traj.ok, traj.error
    assert traj.reward == 1.0 and traj.info["tool_calls"] == 3 and traj.info["compactions"] == 2
    # each step (question or summary, call, result, answer) fills the history to its limit of 4 messages, so
    # steps 2 and 3 start compacted
    assert [s.break_reason for s in traj.segments] == ["start", "compaction", "compaction"]
    # each step's answer (calls 1, 3, 5) carries its third of the reward, in the segment of its step
    assert traj.turn_rewards == pytest.approx({0: 0.0, 1: 1 / 3, 2: 0.0, 3: 1 / 3, 4: 0.0, 5: 1 / 3})
    assert [[call for call, _ in s.turns] for s in traj.segments] == [[0, 1], [2, 3], [4, 5]]
    texts = [tokenizer.decode(s.token_ids) for s in traj.segments]
    example = (
        f"<|im_start|>user\n{ct.EXAMPLE[0]}<|im_end|>\n<|im_start|>assistant\n{ct.example_call(ct.EXAMPLE[1])}"
        f"<|im_end|>\n<|im_start|>tool\n{ct.EXAMPLE[2]}<|im_end|>\n<|im_start|>assistant\n{ct.EXAMPLE[2]}<|im_end|>"
    )
    for text, value in zip(texts, [7, 5, 11]):
        assert f"<|im_start|>tool\n{value}<|im_end|>" in text and text.endswith(
            f"The result is {value}<|im_end|>"
        )
        assert example in text  # the worked example opens every segment: compaction keeps it
        # the example's call and answer, then the model's call and answer, continued in one segment
        assert text.count("<|im_start|>assistant") == 4
    assert "The result so far is 5. Now add 6 to 5. What is the result?" in texts[2]


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("file", ["agent.py", "anthropic_agent.py"])
def test_trains_with_several_segments_per_rollout(tiny_llama_dir, tmp_path, ray_local, file):
    from molt.runtime.loop import run_training

    cfg = MoltConfig()
    cfg.actor.model_name_or_path = str(tiny_llama_dir)
    cfg.train.agent_path = str(RECIPE / file)
    cfg.data.prompt_dataset = str(RECIPE / "data" / "train.jsonl")
    cfg.train.max_steps, cfg.train.max_staleness = 2, 1
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 2, 2, 8
    cfg.rollout.timeout_s = 60.0
    cfg.rollout.engine_process = False  # in the worker: 5 s less start-up (tests/runtime/test_train_e2e.py)
    cfg.ckpt.output_dir = str(tmp_path / "run")
    summary = asyncio.run(run_training(validate(cfg)))
    assert summary["steps"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # the tiny model writes garbage, but compaction counts messages, so it always happens
        assert m["rollout/segments_per_rollout"] > 1, m
        assert m["rollout/break/compaction"] >= m["rollout/count"], m
        assert m.get("rollout/failed/agent_error", 0) == 0, m
        assert 0.0 <= m["rollout/reward_mean"] <= 1.0
