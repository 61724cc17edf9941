"""`molt sft`: supervised fine-tuning on chats with the RL trainer (`molt.trainer.Actor`: FSDP2, the chunked
log-prob path, packing, optimizers, DCP checkpoints, Hugging Face export) and `molt train`'s run directory.

Rows (`data.input_key`: OpenAI chat messages, tool calls included; `data.tools_key`: tool schemas) are rendered
by the chat template; the loss (policy loss `sft`) is the cross entropy of the assistant's tokens, token-mean
over the step. A step takes `train.batch_size` chats of a seeded shuffle per epoch (`train.max_steps` 0:
`train.num_episodes` epochs); `eval.dataset` gives the held-out loss at step 0, every `eval.steps` and at the
end. Under torchrun each rank takes every world-th chat of a step; rank 0 writes.
Checkpoints and stopping are `molt train`'s (`molt.runtime.checkpoints.RunControl`): by steps, by time, after the
last step and on SIGINT/SIGTERM (the ranks agree on both with one all-reduce a step), and a rerun resumes.
Decisions: an assistant turn spans from the end of the conversation before it, rendered with the generation
prompt, to the end of the conversation up to it: its end-of-turn tokens are trained, its header is not. A
template that rewrites earlier turns (dropping old reasoning) is refused. Chats are cut at `data.max_len`.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from molt.types import Experience


def encode_chat(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None
) -> tuple[list[int], list[int]]:
    """(token ids, 1 on the assistant's tokens) of one chat, rendered by the tokenizer's chat template."""
    from molt.capture.render import canonical_messages, canonical_tools

    msgs, tools = canonical_messages(messages), canonical_tools(tools)

    def render(k: int, gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs[:k], tools=tools, tokenize=False, add_generation_prompt=gen)

    text, spans = render(len(msgs), False), []
    for k, m in enumerate(msgs):
        if m["role"] == "assistant":
            head, turn = render(k, True), render(k + 1, False)
            if not (turn.startswith(head) and text.startswith(turn)):
                raise ValueError(
                    "the chat template renders a prefix of the conversation differently from the "
                    f"whole (turn {k}); SFT needs templates that only append"
                )
            spans.append((len(head), len(turn)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]


def chat_experiences(rows: list[dict], tokenizer: Any, max_len: int | None, what: str) -> list[Experience]:
    out = []
    for n, row in enumerate(rows):
        if "messages" not in row:
            raise ValueError(f"{what}: row {n} is not a list of chat messages (data.input_key)")
        try:
            ids, mask = encode_chat(tokenizer, row["messages"], row.get("tools"))
        except ValueError as e:
            raise ValueError(f"{what}: row {n}: {e}") from None
        ids, mask = ids[:max_len], mask[:max_len]
        out.append(
            Experience(
                f"{what}-{n}",
                "",
                0,
                0.0,
                len(ids),
                sum(mask),
                0,
                token_ids=ids,
                action_mask=mask,
                behavior_logprobs=[0.0] * sum(mask),
                advantages=0.0,
            )
        )
    return out


def run_sft(cfg: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from molt.config_resolve import override, resolve, save_config, to_dict
    from molt.models import resolve_model
    from molt.runtime.checkpoints import RunControl, resume_point, truncate_after
    from molt.runtime.data import run_prompts
    from molt.runtime.metrics import MetricsLogger
    from molt.trainer import Actor

    t0, out = time.perf_counter(), Path(cfg.ckpt.output_dir)
    model_path = str(resolve_model(cfg.actor.model_name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows, eval_rows = run_prompts(cfg)
    train = chat_experiences(rows, tokenizer, cfg.data.max_len, "data.prompt_dataset")
    held = chat_experiences(eval_rows, tokenizer, cfg.data.max_len, "eval.dataset")
    cfg = resolve(cfg, len(train), sft=True)  # the schedule's length, policy loss sft (molt.config_resolve)
    size, steps = cfg.train.batch_size, cfg.train.max_steps
    actor = Actor(override(cfg, {"actor.model_name_or_path": model_path}))
    rank0, control = actor.rank == 0, RunControl(cfg.ckpt)
    rng, order = random.Random(cfg.train.seed), []
    while len(order) < steps * size:  # one seeded shuffle per epoch: a resume finds the same order
        order += rng.sample(range(len(train)), len(train))
    resume = resume_point(out, control.root, cfg.ckpt.resume)
    if resume is not None:
        actor.load(str(resume / "trainer"))
    step = actor.step
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        truncate_after(out / "metrics.jsonl", step)
    log = (
        MetricsLogger(
            out,
            steps,
            tensorboard_dir=cfg.logger.tensorboard_dir,
            wandb=to_dict(cfg.logger.wandb),
            config=to_dict(cfg),
            start_step=step,
        )
        if rank0
        else None
    )
    shard = lambda exps: exps[actor.rank :: actor.world]  # this rank's share

    def eval_loss() -> float:
        part = shard(held)
        nll = -sum(
            float(row[e.action_mask].sum(dtype=float)) for e, row in zip(part, actor.compute_logprobs(part))
        )
        t = actor.reduce_metrics({}, 0.0, {"nll": nll, "n": float(sum(e.num_actions for e in part))})
        return t["nll"] / t["n"]

    evals = [eval_loss()] if held and step == 0 else []
    if evals and log:
        log.log(0, {"eval/loss": evals[0]}, advance=False)
    control.saved()  # the time between checkpoints counts from here
    with control.signals():
        while step < steps and control.stopping is None:
            t = time.perf_counter()
            m = actor.train_step(shard([train[i] for i in order[step * size : (step + 1) * size]]))
            step += 1
            metrics = {
                "train/loss": m["policy_loss"],
                "actor_grad_norm": m["actor_grad_norm"],
                "actor_lr": m["actor_lr"],
                "train/tokens": m["actor_window_tokens"],
                "train/skipped_steps": m["train/skipped_steps"],
                "timing/step_total": time.perf_counter() - t,
            }
            control.skipped(actor.skipped_in_a_row, cfg.train.max_skipped_steps)  # every rank skips alike
            if held and (step == steps or cfg.eval.steps > 0 and step % cfg.eval.steps == 0):
                evals.append(eval_loss())
                metrics["eval/loss"] = evals[-1]
            log and log.log(step, metrics)
            # every rank decides alike: a signal may reach one rank only, clocks differ
            agreed = actor.reduce_metrics(
                {},
                0.0,
                {
                    "due": float(control.due(step, last=step == steps)),
                    "stop": float(control.stopping is not None),
                },
            )
            if agreed["stop"] and control.stopping is None:
                control.stop(RuntimeError("another rank was stopped"))
            if agreed["due"] or agreed["stop"]:
                actor.save(str(control.step_dir(step) / "trainer"))
                control.checkpointed(step, {"metrics": metrics} if rank0 else None)
    if log:
        log.close()
    control.finish(step)
    if cfg.ckpt.export_hf:
        actor.export_hf(str(out / "policy"))
    summary = {
        "base_eval_loss": evals[0] if evals else None,
        "final_eval_loss": evals[-1] if evals else None,
        "steps": step,
        "train_chats": len(train),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if rank0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
