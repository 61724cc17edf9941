"""KL estimators k1, k2, k3: hand values, gradients, placement rules, and unbiasedness by sampling."""

import math

import pytest
import torch

from molt.algo import kl_divergence

LN2 = math.log(2.0)


def test_hand_values_and_mask():
    # log_r = log 0.5 - log 0.25 = ln 2 on the action token; the other token is padding with garbage
    lp = torch.tensor([[math.log(0.5), float("nan")]])
    ref = torch.tensor([[math.log(0.25), -float("inf")]])
    mask = torch.tensor([[1, 0]])
    expected = {"k1": LN2, "k2": 0.5 * LN2**2, "k3": 0.5 - 1 + LN2}
    for name, value in expected.items():
        kl, metrics = kl_divergence(lp, ref, mask, name, placement="reward")
        assert kl.tolist() == [pytest.approx([value, 0.0])]
        assert float(metrics["kl/mean"]) == pytest.approx(value)


def test_loss_gradients_by_hand():
    lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    kl, _ = kl_divergence(lp, ref, torch.ones(1, 1), "k3")
    kl.sum().backward()
    assert lp.grad.item() == pytest.approx(1 - 0.5)  # d/dlp (exp(-log_r) - 1 + log_r) = 1 - ref/pi
    lp.grad = None
    kl, _ = kl_divergence(lp, ref, torch.ones(1, 1), "k2")
    kl.sum().backward()
    assert lp.grad.item() == pytest.approx(LN2)  # d/dlp log_r^2 / 2 = log_r


def test_placement_rules():
    lp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="k1"):
        kl_divergence(lp, torch.zeros(1, 2), torch.ones(1, 2), "k1", placement="loss")
    with pytest.raises(ValueError, match="placement"):
        kl_divergence(lp, torch.zeros(1, 2), torch.ones(1, 2), "k3", placement="advantage")
    with pytest.raises(ValueError, match="unknown kl estimator"):
        kl_divergence(lp, torch.zeros(1, 2), torch.ones(1, 2), "k4")
    reward_kl, _ = kl_divergence(lp, torch.zeros(1, 2), torch.ones(1, 2), "k1", placement="reward")
    assert not reward_kl.requires_grad


def test_k3_clamps_extreme_ratios():
    kl, _ = kl_divergence(torch.tensor([[-200.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), "k3")
    assert torch.isfinite(kl).all() and kl.item() == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_k1_and_k3_are_unbiased_for_the_true_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    true_kl = float((p * (p / q).log()).sum())
    tokens = torch.multinomial(p, 200_000, replacement=True, generator=g)[None]
    mask = torch.ones_like(tokens)
    for name in ("k1", "k3"):
        kl, _ = kl_divergence(p.log()[tokens], q.log()[tokens], mask, name, placement="reward")
        assert kl.mean().item() == pytest.approx(true_kl, abs=5e-3)


def test_adaptive_coefficient_by_hand():
    from molt.algo import adaptive_kl_coef

    # KL 0.15 against target 0.1: error 0.5 clipped to 0.2; 1000 of 10000 rollouts -> x (1 + 0.2 * 0.1)
    assert adaptive_kl_coef(0.01, 0.15, 0.1, 10000, 1000) == pytest.approx(0.01 * 1.02)
    assert adaptive_kl_coef(0.01, 0.09, 0.1, 100, 10) == pytest.approx(0.01 * (1 - 0.1 * 0.1))
    with pytest.raises(ValueError, match="algo.kl.target"):
        adaptive_kl_coef(0.01, 0.1, 0.0, 100, 10)
