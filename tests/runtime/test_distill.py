"""On-policy distillation (`--algo.advantage.estimator on_policy_distill`): the configuration it forces, the
tokenizer check, and a real run (Ray workers with the built-in agent, FSDP2 trainer, the teacher as the reference
model) in which the student's reverse KL to a different teacher on held-out prompts falls step by step."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from molt.cli import load_config
from molt.config import MoltConfig
from molt.config_resolve import resolve
from molt.config_validate import validate

DATA = Path(__file__).parents[2] / "recipes" / "math" / "data"


def tuned(base_dir, path, steps: int) -> Path:
    """`base_dir` after `steps` steps of plain supervised training (transformers and torch only) on the answers
    "The sum is N." to the training prompts. A student and a teacher tuned for 10 and 40 steps differ
    measurably (a reverse KL of about 1 nat per generated token) while the student still samples the teacher's
    modes now and then, which is what on-policy distillation builds on (from a random student, which samples a
    388-token vocabulary uniformly, the per-token signal finds nothing in a few CPU steps)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    lm = AutoModelForCausalLM.from_pretrained(base_dir)
    rows = [json.loads(line) for line in (DATA / "single_train.jsonl").open()]
    chats = [
        tok.apply_chat_template(
            [*r["prompt"], {"role": "assistant", "content": f"The sum is {r['label']}."}], tokenize=False
        )
        for r in rows
    ]
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(steps):
        batch = [
            tok.encode(chats[i], add_special_tokens=False) for i in torch.randint(len(chats), (8,)).tolist()
        ]
        width = max(map(len, batch))
        ids = torch.tensor([b + [tok.pad_token_id] * (width - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (width - len(b)) for b in batch])
        lm(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


@torch.no_grad()
def heldout_reverse_kl(
    student_dir, teacher_dir, prompts: list[str], samples: int = 16, max_new: int = 12
) -> float:
    """Mean over generated tokens of the exact KL(student || teacher) of the next-token distributions, along
    completions the student samples (temperature 1, fixed seed) for each held-out prompt: the reverse KL the
    distillation minimizes, measured independently of the trainer (plain transformers forwards)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(student_dir)
    student, teacher = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (student_dir, teacher_dir))
    torch.manual_seed(0)
    total, count = 0.0, 0
    for prompt in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        out = student.generate(
            ids,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=max_new,
            num_return_sequences=samples,
            pad_token_id=tok.pad_token_id,
        )
        n = ids.shape[1]
        logp_s = torch.log_softmax(student(out).logits[:, n - 1 : -1].float(), -1)
        logp_t = torch.log_softmax(teacher(out).logits[:, n - 1 : -1].float(), -1)
        kl = (logp_s.exp() * (logp_s - logp_t)).sum(-1)  # [samples, generated]
        gen = out[:, n:]
        ended = (gen == tok.eos_token_id).long().cumsum(1)
        mask = (ended == 0) | ((ended == 1) & (gen == tok.eos_token_id))  # up to and including the first EOS
        total += float(kl[mask].sum())
        count += int(mask.sum())
    return total / count


def test_distill_config_is_forced_and_checked(tmp_path):
    data = str(DATA / "single_train.jsonl")
    with pytest.raises(ValueError, match="ref.model_name_or_path"):
        load_config(["--algo.advantage.estimator", "on_policy_distill", "--data.prompt_dataset", data])
    cfg = load_config(
        [
            "--algo.advantage.estimator",
            "on_policy_distill",
            "--ref.model_name_or_path",
            "t",
            "--data.prompt_dataset",
            data,
        ]
    )  # no agent file: the built-in agent
    run = resolve(cfg)  # the settings distillation implies are derived ones
    kl = run.algo.kl
    assert (kl.use_loss, kl.estimator, kl.init_coef, run.algo.advantage.no_whiten) == (False, "k1", 1.0, True)
    with pytest.raises(ValueError, match="train.agent_path is required"):
        load_config(["--data.prompt_dataset", data])  # other estimators still need an agent


def test_a_teacher_with_another_tokenizer_is_refused(tiny_llama_dir, tmp_path):
    from molt.runtime.loop import _same_tokenizer
    from molt.testing.models import build_tokenizer

    _same_tokenizer(str(tiny_llama_dir), str(tuned(tiny_llama_dir, tmp_path / "same", steps=1)))
    other = Path(shutil.copytree(tiny_llama_dir, tmp_path / "other"))
    build_tokenizer(vocab_size=320).save_pretrained(other)
    with pytest.raises(ValueError, match="teacher's tokenizer .* differs"):
        _same_tokenizer(str(tiny_llama_dir), str(other))


def test_builtin_agent_generates_one_turn(tiny_llama_dir):
    from molt.agents import StepEnvRunner, load_agent

    runner = load_agent("")
    assert isinstance(runner, StepEnvRunner) and runner.max_turns == 1


@pytest.mark.slow
def test_distillation_lowers_heldout_reverse_kl(tiny_llama_dir, tmp_path, ray_local):
    from molt.runtime.loop import run_training

    student, teacher = (
        tuned(tiny_llama_dir, tmp_path / name, steps) for name, steps in (("s", 10), ("t", 40))
    )
    out = tmp_path / "run"
    cfg = MoltConfig()
    cfg.actor.model_name_or_path, cfg.ref.model_name_or_path = str(student), str(teacher)
    cfg.actor.adam.lr, cfg.actor.lr_scheduler = 1e-3, "cosine"
    cfg.algo.advantage.estimator = "on_policy_distill"
    cfg.data.prompt_dataset = str(DATA / "single_train.jsonl")
    cfg.train.max_steps, cfg.train.max_staleness = 32, 1  # asynchronous: one policy version of lag allowed
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 4, 8, 12
    cfg.ckpt.output_dir, cfg.ckpt.save_steps, cfg.ckpt.save_hf, cfg.ckpt.max_num = str(out), 8, True, 0
    asyncio.run(run_training(validate(cfg)))

    prompts = [json.loads(line)["prompt"][0]["content"] for line in (DATA / "single_test.jsonl").open()]
    steps = (0, 8, 16, 24, 32)
    kls = [
        heldout_reverse_kl(out / "checkpoints" / f"step_{s}" / "hf" if s else student, teacher, prompts)
        for s in steps
    ]
    train_kl = [m["kl/mean"] for m in map(json.loads, (out / "metrics.jsonl").open())]
    print("held-out reverse KL per token at steps", steps, [round(k, 3) for k in kls])
    print("training KL (k1 of the sampled tokens) per step:", [round(k, 3) for k in train_kl])
    assert all(k < kls[0] for k in kls[1:]), kls  # every checkpoint is closer to the teacher than the start
    # and the last two are closer than the first checkpoint and than 0.85x the start. Measured (32 steps, alone
    # and beside a busy core): 1.095 -> 0.995/0.987, 0.793/0.764, 0.840/0.842, 0.836/0.842; at 16 steps the end
    # (0.86-0.98) sat inside the run-to-run spread of the asynchronous sampling
    assert max(kls[3:]) < min(kls[1], 0.85 * kls[0]), kls
