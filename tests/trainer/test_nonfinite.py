"""A non-finite loss or gradient norm skips the optimizer step on every rank: parameters, optimizer state
(AdamW's step count and moments, Muon's momentum buffers) and the LR schedule stay bit-identical, the skip is
counted (`train/skipped_steps`), the NaN is reported as a value, and the next finite step trains. The NaN loss
comes from the trainer's test-only fault hook (`MOLT_FAULT_NAN_LOSS`), which leaves the gradients finite, so
only the loss check can catch it; the inf gradient leaves the loss finite."""

import math
import socket

import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import BASE, inf_gradient, make_window, nonfinite_worker, same_state, trainer_state


@pytest.mark.parametrize("optim", ["adam", "muon"])
def test_a_nan_loss_skips_the_step_and_the_next_one_trains(tiny_llama_dir, monkeypatch, optim):
    from molt.trainer import Actor

    monkeypatch.setenv("MOLT_FAULT_NAN_LOSS", "2")
    actor = Actor.from_pretrained(tiny_llama_dir, **{"actor.optim": optim}, **BASE)
    assert actor.train_step(make_window(tiny_llama_dir, seed=1))["train/skipped_steps"] == 0.0
    before = trainer_state(actor)
    assert any(k.endswith(("exp_avg", "momentum_buffer")) for k in before)  # there is optimizer state to keep
    m = actor.train_step(make_window(tiny_llama_dir, seed=2))
    assert same_state(trainer_state(actor), before)
    assert (
        m["train/skipped_steps"] == 1.0
        and math.isnan(m["policy_loss"])
        and math.isfinite(m["actor_grad_norm"])
    )
    assert actor.skipped_in_a_row == 1 and actor.step == 1
    m = actor.train_step(make_window(tiny_llama_dir, seed=3))
    assert m["train/skipped_steps"] == 0.0 and math.isfinite(m["policy_loss"])
    assert actor.skipped_in_a_row == 0 and actor.step == 2 and not same_state(trainer_state(actor), before)


def test_an_inf_gradient_skips_the_step(tiny_llama_dir):
    from molt.trainer import Actor

    actor = Actor.from_pretrained(tiny_llama_dir, **BASE)
    actor.train_step(make_window(tiny_llama_dir, seed=1))
    before = trainer_state(actor)
    hook = inf_gradient(actor)
    m = actor.train_step(make_window(tiny_llama_dir, seed=2))
    hook.remove()
    assert same_state(trainer_state(actor), before)
    assert (
        m["train/skipped_steps"] == 1.0
        and m["actor_grad_norm"] == math.inf
        and math.isfinite(m["policy_loss"])
    )
    assert (
        actor.train_step(make_window(tiny_llama_dir, seed=3))["train/skipped_steps"] == 0.0
    )  # grads were dropped
    assert not same_state(trainer_state(actor), before)


def test_a_nan_value_loss_skips_the_critic_step(tiny_llama_dir):
    from molt.trainer import Critic

    critic = Critic.from_pretrained(tiny_llama_dir, **BASE)
    window = make_window(tiny_llama_dir, seed=1)
    returns = [[1.0 if m else 0.0 for m in e.action_mask] for e in window]
    old = critic.compute_values(window)
    critic.train_step(window, returns, old)
    before = trainer_state(critic)
    returns[3][-1] = math.nan  # an action token's return
    m = critic.train_step(window, returns, old)
    assert same_state(trainer_state(critic), before)
    assert m["train/skipped_steps"] == 1.0 and math.isnan(m["critic_loss"]) and critic.skipped_in_a_row == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_both_ranks_skip_when_one_rank_is_not_finite(tiny_llama_dir, tmp_path):
    mp.spawn(
        nonfinite_worker, args=(2, _free_port(), str(tiny_llama_dir), str(tmp_path)), nprocs=2, join=True
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r["nan_kept"] and r["inf_kept"] and r["moved"] and r["step"] == 2
        assert [m["train/skipped_steps"] for m in r["metrics"]] == [0.0, 1.0, 1.0, 0.0]
        assert math.isnan(r["metrics"][1]["policy_loss"]) and r["metrics"][2]["actor_grad_norm"] == math.inf
    for step in range(4):  # one decision from the same global values
        assert ranks[0]["metrics"][step]["actor_grad_norm"] == pytest.approx(
            ranks[1]["metrics"][step]["actor_grad_norm"], nan_ok=True
        )
