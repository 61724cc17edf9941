"""`molt sft` (molt.runtime.sft): assistant-only masking token by token on a multi-turn chat with tool calls, the
loss against a plain transformers cross entropy, and a tiny run that lowers the held-out loss, writes the run
directory, resumes from its checkpoint and exports a checkpoint `from_pretrained` loads."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from molt.runtime.sft import chat_experiences, encode_chat

RECIPE = Path(__file__).parents[2] / "recipes" / "sft"
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
CHAT = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 17 + 25?"},
    {
        "role": "assistant",
        "content": "Let me add.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "assistant", "content": "It is 42."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


def _make_data(out, **kw):
    spec = importlib.util.spec_from_file_location("sft_make_data", RECIPE / "make_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write(out, **kw)


def test_assistant_tokens_only_token_by_token(tokenizer):
    ids, mask = encode_chat(tokenizer, CHAT, [ADD])
    text = tokenizer.decode(ids)
    assert text == tokenizer.apply_chat_template(
        CHAT, tools=[ADD], tokenize=False
    )  # the template's rendering
    # what each token must be, written out: the assistant's turns (tool call and end of turn included) are 1,
    # everything else (system, tools block, user and tool turns, the assistant headers) is 0
    turns = [
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call><|im_end|>\n',
        "It is 42.<|im_end|>\n",
        "You are welcome.<|im_end|>\n",
    ]
    expected, pos = [], 0
    for turn in turns:
        start = text.index(turn, pos)
        expected.append((start, start + len(turn)))
        pos = start + len(turn)
    chars = 0
    for tok_id, m in zip(ids, mask):
        piece = tokenizer.decode([tok_id])
        inside = any(a <= chars and chars + len(piece) <= b for a, b in expected)
        outside = all(chars + len(piece) <= a or chars >= b for a, b in expected)
        assert inside or outside, f"token {piece!r} straddles a turn boundary"
        assert m == int(inside), (piece, chars)
        chars += len(piece)
    assert chars == len(text) and sum(mask) > 0
    assert all(m == 0 for t, m in zip(ids, mask) if tokenizer.decode([t]) in ("<|im_start|>", "assistant"))


def test_templates_that_rewrite_earlier_turns_are_refused(tiny_think_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_think_dir)
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>x</think>b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(ValueError, match="data.prompt_dataset: row 0: .*renders a prefix"):
        chat_experiences([{"messages": chat}], tok, None, "data.prompt_dataset")


def test_loss_is_the_cross_entropy_of_the_assistant_tokens(tiny_llama_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from molt.trainer import Actor

    exps = chat_experiences([{"messages": CHAT, "tools": [ADD]}] * 2, tokenizer, None, "x")
    ids = torch.tensor([exps[0].token_ids], dtype=torch.long)
    labels = torch.where(torch.tensor([exps[0].action_mask]).bool(), ids, -100)
    expected = float(AutoModelForCausalLM.from_pretrained(tiny_llama_dir)(ids, labels=labels).loss)
    actor = Actor.from_pretrained(
        tiny_llama_dir,
        **{"fsdp.device": "cpu", "actor.policy_loss": "sft", "algo.advantage.is_correction_level": "off"},
    )
    assert actor.train_step(exps)["policy_loss"] == pytest.approx(expected, rel=1e-5)


def test_sft_run_lowers_heldout_loss_and_resumes(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from molt.cli import load_config
    from molt.runtime.sft import run_sft

    train, test = _make_data(tmp_path / "data", n=96, tools=True)
    out = tmp_path / "run"

    def cfg(steps):
        return load_config(
            [
                "--actor.model_name_or_path",
                str(tiny_llama_dir),
                "--actor.adam.lr",
                "3e-3",
                "--data.prompt_dataset",
                str(train),
                "--data.input_key",
                "messages",
                "--eval.dataset",
                str(test),
                "--eval.steps",
                "3",
                "--train.batch_size",
                "8",
                "--train.max_steps",
                str(steps),
                "--fsdp.packing_samples",
                "--ckpt.output_dir",
                str(out),
                "--ckpt.save_steps",
                "3",
            ],
            prog="molt sft",
            sft=True,
        )

    first = run_sft(cfg(6))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    print("held-out loss at steps 0, 3, 6:", evals)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6] and len(evals) == 3
    assert evals[0] > evals[1] > evals[2] and evals[2] < 0.8 * evals[0]
    assert first["base_eval_loss"] == evals[0] and first["final_eval_loss"] == evals[2]
    assert (out / "checkpoints" / "step_6" / "state.json").is_file() and (out / "config.yaml").is_file()
    assert AutoModelForCausalLM.from_pretrained(out / "policy").config.vocab_size > 0

    second = run_sft(cfg(8))  # resumes from step 6, trains steps 7 and 8
    assert second["steps"] == 8
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").open())][-2:] == [7, 8]


def test_sft_needs_a_batch_size():
    from molt.cli import load_config

    with pytest.raises(ValueError, match="train.batch_size"):
        load_config(["--data.prompt_dataset", "x.jsonl"], prog="molt sft", sft=True, check_files=False)


@pytest.mark.slow
def test_molt_train_starts_from_the_sft_export(tiny_llama_dir, tmp_path, ray_local):
    """The SFT export is a policy `molt train` loads (engine, capture, trainer) and trains further."""
    import asyncio

    from molt.cli import load_config
    from molt.runtime.loop import run_training
    from molt.runtime.sft import run_sft

    train, _ = _make_data(tmp_path / "data", n=48)
    run_sft(
        load_config(
            [
                "--actor.model_name_or_path",
                str(tiny_llama_dir),
                "--data.prompt_dataset",
                str(train),
                "--data.input_key",
                "messages",
                "--train.batch_size",
                "8",
                "--train.max_steps",
                "2",
                "--ckpt.output_dir",
                str(tmp_path / "sft"),
            ],
            prog="molt sft",
            sft=True,
        )
    )
    agent = Path(__file__).parent / "agents" / "letters_env.py"
    data = Path(__file__).parents[2] / "recipes" / "math" / "data" / "single_train.jsonl"
    cfg = load_config(
        [
            "--actor.model_name_or_path",
            str(tmp_path / "sft" / "policy"),
            "--train.agent_path",
            str(agent),
            "--data.prompt_dataset",
            str(data),
            "--train.max_steps",
            "2",
            "--rollout.n_samples_per_prompt",
            "4",
            "--rollout.max_new_tokens",
            "8",
            "--ckpt.output_dir",
            str(tmp_path / "rl"),
        ]
    )
    assert asyncio.run(run_training(cfg))["steps"] == 2


def test_sft_checkpoints_at_the_end_and_on_sigterm_and_resumes(tiny_llama_dir, tmp_path):
    """`molt sft` shares `molt train`'s loop skeleton (issue 32, item 12): a checkpoint after the last step without
    ckpt.save_steps; SIGTERM stops it after the step in progress with a checkpoint and exit 143; the same command
    resumes. Before, SIGTERM killed it with nothing saved since the last save_steps multiple, and a run without
    save_steps left no checkpoint at all."""
    import os
    import signal
    import subprocess
    import sys
    import time

    train, _ = _make_data(tmp_path / "data", n=48)
    out = tmp_path / "run"

    def args(steps):
        return [
            sys.executable,
            "-m",
            "molt.cli",
            "sft",
            "--actor.model_name_or_path",
            str(tiny_llama_dir),
            "--data.prompt_dataset",
            str(train),
            "--data.input_key",
            "messages",
            "--train.batch_size",
            "4",
            "--train.max_steps",
            str(steps),
            "--ckpt.output_dir",
            str(out),
            "--ckpt.no-export-hf",
        ]

    def steps():
        path = out / "metrics.jsonl"
        return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen(args(400), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    while len(steps()) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = steps()[-1]
    assert "stopped by SIGTERM; step" in err and 2 <= stopped < 400
    assert (out / "checkpoints" / f"step_{stopped}" / "state.json").is_file()
    done = subprocess.run(
        args(stopped + 2), check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert steps()[-2:] == [stopped + 1, stopped + 2]  # resumed, not restarted
    assert (out / "checkpoints" / f"step_{stopped + 2}" / "state.json").is_file()  # the final checkpoint
