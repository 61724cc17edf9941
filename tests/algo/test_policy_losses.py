"""Policy losses (ppo, gspo, cispo), the composed policy_loss, and the clipped value loss."""

import math

import pytest
import torch

from molt.algo import POLICY_LOSSES, PolicyLossParams, policy_loss, value_loss, window_normalize

LOG = math.log


def ppo_case():
    # ratios 1.5, 0.5, 0.5, 1.5 against advantages 1, 1, -1, -1; last column is padding with garbage
    old = torch.zeros(1, 5)
    old[0, 4] = -1e4
    lp = torch.tensor([[LOG(1.5), LOG(0.5), LOG(0.5), LOG(1.5), 50.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return lp, old, adv, mask


def test_ppo_asymmetric_clip_by_hand():
    lp, old, adv, mask = ppo_case()
    loss, m = policy_loss("ppo", lp, old, adv, mask, params=PolicyLossParams(eps_low=0.2, eps_high=0.28))
    # -min(1.5, 1.28) = -1.28 (clipped); -min(0.5, 0.8) = -0.5; -min(-0.5, -0.8) = 0.8 (clipped); 1.5
    assert loss.tolist() == [pytest.approx([-1.28, -0.5, 0.8, 1.5, 0.0])]
    assert float(m["policy/clip_frac"]) == 0.5
    assert float(m["policy/ratio_mean"]) == pytest.approx(1.0)
    loss.sum().backward()
    # d/dlp of -A r is -A r where the unclipped branch is active, 0 where clipped, 0 on padding
    assert lp.grad.tolist() == [pytest.approx([0.0, -0.5, 0.0, 1.5, 0.0])]


def test_ppo_dual_clip_by_hand():
    lp, old, adv, mask = ppo_case()
    loss, m = policy_loss("ppo", lp, old, adv, mask, params=PolicyLossParams(dual_clip=1.3))
    # A < 0 tokens are bounded by -1.3 A = 1.3: 0.8 stays, 1.5 -> 1.3
    assert loss.tolist() == [pytest.approx([-1.2, -0.5, 0.8, 1.3, 0.0])]
    assert float(m["policy/dual_clip_frac"]) == 0.25
    loss.sum().backward()
    assert lp.grad.tolist() == [pytest.approx([0.0, -0.5, 0.0, 0.0, 0.0])]


def reference_ppo_grad(lp, old, adv, mask, eps_low, eps_high, dual, count):
    """Independent float64 gradient of sum(ppo loss) / count, derived by hand token by token."""
    grad = torch.zeros_like(lp, dtype=torch.float64)
    for idx in mask.nonzero().tolist():
        i, t = idx
        r, a = math.exp(float(lp[i, t]) - float(old[i, t])), float(adv[i, t])
        unclipped, clipped = -a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high)
        value, g = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
        if dual is not None and a < 0 and value > -dual * a:
            g = 0.0
        grad[i, t] = g / count
    return grad


def test_ppo_gradient_matches_independent_float64_reference_and_finite_differences():
    g = torch.Generator().manual_seed(1)
    n, t = 4, 7
    old = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    log_r = 0.6 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, t, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) < 0.7
    params = PolicyLossParams(eps_low=0.2, eps_high=0.3, dual_clip=2.0)
    r = log_r.exp()
    # keep away from the kinks of the clip and the dual clip, where the gradient is not defined
    near = ((r - 0.8).abs() < 1e-3) | ((r - 1.3).abs() < 1e-3) | ((r - 2.0).abs() < 1e-3)
    mask &= ~near
    count = int(mask.sum())
    lp64 = (old + log_r).requires_grad_()

    def window_loss(lp):
        tok, _ = policy_loss("ppo", lp, old, adv, mask, params=params)
        return window_normalize(tok, mask, count)[0]

    assert torch.autograd.gradcheck(window_loss, (lp64,), eps=1e-7, atol=1e-8)
    lp32 = lp64.detach().float().requires_grad_()
    tok, _ = policy_loss("ppo", lp32, old.float(), adv.float(), mask, params=params)
    window_normalize(tok, mask, count)[0].backward()
    ref = reference_ppo_grad(lp64.detach(), old, adv, mask, 0.2, 0.3, 2.0, count)
    torch.testing.assert_close(lp32.grad.double(), ref, atol=1e-6, rtol=1e-5)


def test_gspo_sequence_ratio_by_hand():
    # one sequence, log ratios 0.1 and 0.3 -> s = exp(0.2) = 1.2214
    old = torch.zeros(2, 3)
    lp = torch.tensor([[0.1, 0.3, 9.0], [0.1, 0.3, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    loss, m = policy_loss("gspo", lp, old, adv, mask)
    s = math.exp(0.2)
    assert loss.tolist() == [pytest.approx([-1.2, -1.2, 0.0]), pytest.approx([s, s, 0.0])]
    assert float(m["policy/clip_frac"]) == 0.5
    loss.sum().backward()
    # row 0 clipped: no gradient. row 1: sum = 2 s, ds/dlp_t = s / 2 -> each token gets s
    assert lp.grad.tolist() == [pytest.approx([0.0, 0.0, 0.0]), pytest.approx([s, s, 0.0])]


def test_gspo_packed_rows_match_unpacked():
    lp = torch.tensor([[0.1, 0.3, -0.2, 0.05, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    adv = torch.tensor([[1.0, 1.0, -0.5, -0.5, 0.0]])
    packed, _ = policy_loss("gspo", lp, torch.zeros(1, 5), adv, mask, seq_ids=torch.tensor([[1, 1, 4, 4, 4]]))
    unpacked_lp = torch.tensor([[0.1, 0.3], [-0.2, 0.05]])
    rows, _ = policy_loss(
        "gspo", unpacked_lp, torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [-0.5, -0.5]]), torch.ones(2, 2)
    )
    torch.testing.assert_close(packed[0, :4], rows.reshape(-1))


def test_cispo_keeps_gradient_on_clipped_tokens():
    lp = torch.tensor([[LOG(1.5), LOG(0.9)]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]])
    loss, m = policy_loss("cispo", lp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    # weights sg(clip(r)): 1.2 (clipped from 1.5) and 0.9; loss = -w A lp
    assert loss.tolist() == [pytest.approx([-1.2 * 2 * LOG(1.5), -0.9 * -1 * LOG(0.9)])]
    assert float(m["policy/clip_frac"]) == 0.5
    loss.sum().backward()
    assert lp.grad.tolist() == [pytest.approx([-2.4, 0.9])]


def test_composition_is_weights_entropy_and_kl():
    lp = torch.zeros(1, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    w = torch.tensor([[0.0, 0.5, 1.0]])  # first token rejected by importance correction
    ent = torch.tensor([[2.0, 2.0, 2.0]])
    kl = torch.tensor([[1.0, 1.0, 1.0]])
    params = PolicyLossParams(entropy_coef=0.1, kl_coef=0.5)
    loss, m = policy_loss(
        "ppo", lp, torch.zeros(1, 3), adv, torch.ones(1, 3), params=params, is_weights=w, entropy=ent, kl=kl
    )
    # pg = -1 * w; then - 0.1 * 2 + 0.5 * 1 (neither weighted by w)
    assert loss.tolist() == [pytest.approx([0.3, -0.2, -0.7])]
    assert float(m["policy/pg_loss"]) == pytest.approx(-0.5) and float(m["policy/entropy"]) == 2.0
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(
            "ppo", lp, torch.zeros(1, 3), adv, torch.ones(1, 3), params=PolicyLossParams(entropy_coef=0.1)
        )
    with pytest.raises(ValueError, match="kl"):
        policy_loss("ppo", lp, torch.zeros(1, 3), adv, torch.ones(1, 3), params=PolicyLossParams(kl_coef=0.1))
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(
            "ppo", lp, torch.zeros(1, 3), adv, torch.ones(1, 3), params=PolicyLossParams(dual_clip=0.5)
        )
    with pytest.raises(ValueError, match="advantages"):
        policy_loss("ppo", lp, torch.zeros(1, 3), torch.ones(1, 2), torch.ones(1, 3))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_padding_garbage_never_reaches_loss_or_gradient(name):
    lp = torch.tensor([[-0.5, 30.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-0.4, -1e4, float("inf")]])
    adv = torch.tensor([[1.0, float("nan"), float("inf")]])
    w = torch.tensor([[1.0, float("nan"), float("inf")]])
    loss, m = policy_loss(name, lp, old, adv, torch.tensor([[1, 0, 0]]), is_weights=w)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all() and (lp.grad[0, 1:] == 0).all()
    assert all(torch.isfinite(v).all() for v in m.values())


def test_value_loss_clipping_by_hand():
    values = torch.tensor([[1.0, 1.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.9, float("nan")]])
    returns = torch.tensor([[2.0, 0.0, float("inf")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: unclipped (1 - 2)^2 = 1, clipped (0.7 - 2)^2 = 1.69 -> 0.845. token 1: both 1 -> 0.5
    assert loss.tolist() == [pytest.approx([0.845, 0.5, 0.0])]
    assert float(m["critic/clip_frac"]) == 0.5
    loss.sum().backward()
    # token 0: clipped branch is constant in V (outside the clip range); token 1: V - R = 1
    assert values.grad.tolist() == [pytest.approx([0.0, 1.0, 0.0])]
    plain, _ = value_loss(values, old, returns, mask, clip_eps=None)
    assert plain.tolist() == [pytest.approx([0.5, 0.5, 0.0])]
