"""Window normalization: hand values, zero guard, rejected tokens, invariance to micro-batch/rank splits."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.algo import count_action_tokens, importance_weights, policy_loss, window_normalize


def test_hand_value_and_metrics():
    loss = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    out, m = window_normalize(loss, mask, 10)
    assert out.item() == pytest.approx((1 + 2 + 4) / 10)
    assert int(m["loss/window_tokens"]) == 10 and int(m["loss/micro_tokens"]) == 3
    assert window_normalize(loss, mask, torch.tensor(10), dp_size=4)[0].item() == pytest.approx(2.8)
    assert int(count_action_tokens([mask, torch.ones(2, 5)])) == 13


def test_zero_denominator_gives_zero_loss_and_gradient():
    x = torch.ones(2, 3, requires_grad=True)
    out, _ = window_normalize(x * 3, torch.zeros(2, 3), 0)
    out.backward()
    assert out.item() == 0.0 and (x.grad == 0).all()
    with pytest.raises(ValueError, match="dp_size"):
        window_normalize(x, torch.zeros(2, 3), 1, dp_size=0)
    with pytest.raises(ValueError, match="global_count"):
        window_normalize(x, torch.zeros(2, 3), -1)


def test_rejected_tokens_stay_in_the_denominator():
    lp = torch.zeros(1, 4)
    behavior = torch.tensor([[0.0, 0.0, -5.0, -5.0]])  # tokens 2, 3: ratio e^5, rejected by the mask
    mask = torch.ones(1, 4)
    w, _ = importance_weights(lp, behavior, mask, "token", "mask", 0.5, 2.0)
    tok, _ = policy_loss("ppo", lp, lp, torch.ones(1, 4), mask, is_weights=w)
    assert window_normalize(tok, mask, int(count_action_tokens([mask])))[0].item() == pytest.approx(-2 / 4)


VOCAB = 6


def make_sequences(seed: int, lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        seqs.append(
            {
                "tokens": torch.randint(VOCAB, (n,), generator=g),
                "mask": torch.rand(n, generator=g) < 0.7,
                "old": torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 1.5,
                "behavior": torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 1.5,
                "adv": torch.randn(n, generator=g, dtype=torch.float64),
            }
        )
    return seqs


def pad(seqs: list[dict]) -> dict:
    """Right-pad a micro-batch; padding carries garbage that must be ignored."""
    t = max((len(s["tokens"]) for s in seqs), default=1)
    out = {
        "tokens": torch.zeros(len(seqs), t, dtype=torch.long),
        "mask": torch.zeros(len(seqs), t, dtype=torch.bool),
    }
    for key, fill in (("old", -1e4), ("behavior", float("nan")), ("adv", float("inf"))):
        out[key] = torch.full((len(seqs), t), fill, dtype=torch.float64)
    for i, s in enumerate(seqs):
        for key, value in out.items():
            value[i, : len(s[key])] = s[key]
    return out


def micro_loss(theta: torch.Tensor, mb: dict, loss_name: str, global_count, dp_size: int) -> torch.Tensor:
    logprobs = torch.log_softmax(theta, -1)[mb["tokens"]]
    w, _ = importance_weights(logprobs, mb["behavior"], mb["mask"], "token", "mask", 0.6, 1.6)
    tok, _ = policy_loss(loss_name, logprobs, mb["old"], mb["adv"], mb["mask"], is_weights=w)
    return window_normalize(tok, mb["mask"], global_count, dp_size=dp_size)[0]


@settings(max_examples=40, deadline=None, derandomize=True)  # the same examples on every CI run
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
    dp_size=st.sampled_from([1, 2, 4]),
    loss_name=st.sampled_from(["ppo", "gspo", "cispo"]),
    split=st.data(),
)
def test_window_loss_and_gradient_do_not_depend_on_the_split(lengths, seed, dp_size, loss_name, split):
    seqs = make_sequences(seed, lengths)
    theta0 = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    # reference: the whole window as one micro-batch on one rank
    theta = theta0.clone().requires_grad_()
    whole = pad(seqs)
    ref_loss = micro_loss(theta, whole, loss_name, int(whole["mask"].sum()), dp_size=1)
    ref_loss.backward()
    ref_grad = theta.grad.clone()

    # split: sequences go to ranks, each rank cuts its sequences into micro-batches
    ranks = split.draw(st.lists(st.integers(0, dp_size - 1), min_size=len(seqs), max_size=len(seqs)))
    per_rank = [[s for s, r in zip(seqs, ranks) if r == k] for k in range(dp_size)]
    micro = []
    for rank_seqs in per_rank:
        cuts = sorted(
            split.draw(st.sets(st.integers(1, max(len(rank_seqs) - 1, 1)))) if len(rank_seqs) > 1 else []
        )
        bounds = [0, *cuts, len(rank_seqs)]
        micro.append([pad(rank_seqs[a:b]) for a, b in itertools.pairwise(bounds) if b > a])
    # the one all-reduce: every rank's action-token count summed
    global_count = sum(count_action_tokens([mb["mask"] for mb in mbs]) for mbs in micro)

    losses, grads = [], []
    for mbs in micro:  # each rank accumulates gradients over its micro-batches
        theta = theta0.clone().requires_grad_()
        total = torch.zeros((), dtype=torch.float64)
        for mb in mbs:
            loss = micro_loss(theta, mb, loss_name, global_count, dp_size)
            loss.backward()
            total = total + loss.detach()
        losses.append(total)
        grads.append(theta.grad if theta.grad is not None else torch.zeros_like(theta0))
    # data-parallel wrappers average gradients (and we report the averaged loss) over ranks
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.stack(grads).mean(0), ref_grad, atol=1e-6, rtol=0)
    assert torch.isfinite(ref_grad).all()
