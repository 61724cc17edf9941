"""Importance correction: every level x mode by hand, metrics, detachment, packing, degenerate masks."""

import math

import pytest
import torch

from molt.algo import importance_weights

LOG = math.log


def token_case():
    # trainer/behavior ratios 0.4, 1.0, 3.0 on action tokens; the 4th column is padding with garbage
    behavior = torch.tensor([[-1.0, -2.0, -3.0, -float("inf")]])
    trainer = behavior + torch.tensor([[LOG(0.4), 0.0, LOG(3.0), float("nan")]])
    return trainer, behavior, torch.tensor([[1, 1, 1, 0]])


@pytest.mark.parametrize(
    "mode, weights, retained",
    [
        ("mask", [0.0, 1.0, 0.0], 1 / 3),  # IcePop: outside [0.5, 2] rejected, inside keeps its ratio
        ("clip", [0.5, 1.0, 2.0], 1 / 3),
        ("trunc", [0.4, 1.0, 2.0], 2 / 3),  # TIS: only the upper side is truncated
    ],
)
def test_token_level_by_hand(mode, weights, retained):
    trainer, behavior, mask = token_case()
    w, m = importance_weights(trainer, behavior, mask, "token", mode, low=0.5, high=2.0)
    assert w.tolist() == [pytest.approx(weights + [1.0])]
    assert float(m["is/retained_frac"]) == pytest.approx(retained)
    # mean |log ratio| = (ln 2.5 + 0 + ln 3) / 3
    assert float(m["is/logprob_gap"]) == pytest.approx((LOG(2.5) + LOG(3.0)) / 3)
    assert float(m["is/weight_mean"]) == pytest.approx(sum(weights) / 3)


def seq_case():
    # row 0: token ratios 2.0 and 0.8 -> product 1.6, geometric mean sqrt(1.6); row 1: one token ratio 0.25
    behavior = torch.full((2, 3), -1.0)
    trainer = behavior + torch.tensor([[LOG(2.0), LOG(0.8), 7.0], [LOG(0.25), 5.0, 5.0]])
    return trainer, behavior, torch.tensor([[1, 1, 0], [1, 0, 0]])


G = math.sqrt(1.6)


# (per row: the weight of each action token); the token ratios are row 0: 2.0, 0.8; row 1: 0.25
@pytest.mark.parametrize(
    "level, mode, low, high, row0, row1",
    [
        ("seq", "mask", 0.5, 2.0, [2.0, 0.8], [0.0]),  # gate 1.6 passes: survivors keep their token ratios
        ("seq", "mask", 0.5, 1.5, [0.0, 0.0], [0.0]),
        ("seq", "mis", 0.5, 2.0, [1.6, 1.6], [0.0]),  # Seq-MIS: the sequence ratio is the weight
        ("seq", "clip", 0.5, 1.5, [1.5, 1.5], [0.5]),
        ("seq", "trunc", 0.5, 1.5, [1.5, 1.5], [0.25]),
        ("geo", "mask", 0.2, 2.0, [2.0, 0.8], [0.25]),  # seq-mask-tis: both sequences pass the gate
        ("geo", "mask", 0.9, 1.1, [0.0, 0.0], [0.0]),
        ("geo", "mis", 0.2, 2.0, [G, G], [0.25]),
        ("geo", "clip", 0.9, 1.1, [1.1, 1.1], [0.9]),
        ("geo", "trunc", 0.9, 1.1, [1.1, 1.1], [0.25]),
    ],
)
def test_sequence_levels_by_hand(level, mode, low, high, row0, row1):
    trainer, behavior, mask = seq_case()
    w, _ = importance_weights(trainer, behavior, mask, level, mode, low=low, high=high)
    assert w.tolist() == [pytest.approx(row0 + [1.0]), pytest.approx(row1 + [1.0, 1.0])]


def test_geo_mask_matches_the_reference_definition_by_hand():
    """The reference's seq-mask-tis: gate each sequence on the geometric mean of its token ratios inside
    [low, high]; a surviving token's weight is its own ratio pi_train/pi_rollout, a gated sequence's are 0.
    Row 0: ratios 1.02, 0.99, 1.00 -> geo mean (1.0098)^(1/3) = 1.00326 in [0.99, 1.01]: kept as 1.02, 0.99, 1.
    Row 1: ratios 1.10, 1.05 -> geo mean sqrt(1.155) = 1.07471 > 1.01: both 0."""
    behavior = torch.tensor([[-0.7, -1.2, -2.0], [-0.3, -0.9, -5.0]])
    ratios = torch.tensor([[1.02, 0.99, 1.00], [1.10, 1.05, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, m = importance_weights(behavior + ratios.log(), behavior, mask, "geo", "mask", low=0.99, high=1.01)
    assert w.tolist() == [pytest.approx([1.02, 0.99, 1.00]), pytest.approx([0.0, 0.0, 1.0])]
    assert float(m["is/retained_frac"]) == pytest.approx(3 / 5)


def test_retained_fraction_counts_tokens_of_gated_sequences():
    trainer, behavior, mask = seq_case()
    _, m = importance_weights(trainer, behavior, mask, "seq", "mask", low=0.5, high=2.0)
    assert float(m["is/retained_frac"]) == pytest.approx(2 / 3)  # row 0's two tokens pass, row 1's one fails


def test_off_returns_ones_and_still_reports_the_gap():
    trainer, behavior, mask = token_case()
    w, m = importance_weights(trainer, behavior, mask, "off")
    assert (w == 1).all() and float(m["is/retained_frac"]) == 1.0
    assert float(m["is/logprob_gap"]) == pytest.approx((LOG(2.5) + LOG(3.0)) / 3)


def test_weights_are_detached_and_empty_mask_is_defined():
    trainer = torch.zeros(2, 3, requires_grad=True)
    w, m = importance_weights(trainer, torch.zeros(2, 3), torch.ones(2, 3), "geo", "mask")
    assert not w.requires_grad
    w, m = importance_weights(trainer, torch.full((2, 3), float("nan")), torch.zeros(2, 3), "seq", "mask")
    assert (w == 1).all() and float(m["is/retained_frac"]) == 1.0 and float(m["is/logprob_gap"]) == 0.0


def test_long_sequence_product_does_not_overflow():
    trainer = torch.zeros(1, 4000)
    behavior = torch.full((1, 4000), -0.5)  # product of ratios exp(2000)
    w, m = importance_weights(trainer, behavior, torch.ones(1, 4000), "seq", "trunc", high=5.0)
    assert torch.isfinite(w).all() and w[0, 0].item() == pytest.approx(5.0)
    assert float(m["is/retained_frac"]) == 0.0


def test_packed_rows_match_unpacked():
    trainer, behavior, mask = seq_case()
    packed_t = torch.cat([trainer[0, :2], trainer[1, :1]])[None]
    packed_b = torch.cat([behavior[0, :2], behavior[1, :1]])[None]
    for level in ("seq", "geo"):
        rows, _ = importance_weights(trainer, behavior, mask, level, "clip", 0.5, 1.5)
        packed, _ = importance_weights(
            packed_t, packed_b, torch.ones(1, 3), level, "clip", 0.5, 1.5, seq_ids=torch.tensor([[0, 0, 1]])
        )
        torch.testing.assert_close(packed[0], torch.cat([rows[0, :2], rows[1, :1]]))


def test_user_mistakes_raise_value_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="level"):
        importance_weights(x, x, torch.ones(1, 2), "sequence")
    with pytest.raises(ValueError, match="mode"):
        importance_weights(x, x, torch.ones(1, 2), "token", "reject_all")
    with pytest.raises(ValueError, match="low"):
        importance_weights(x, x, torch.ones(1, 2), "token", "mask", low=2.0, high=1.0)
    with pytest.raises(ValueError, match="behavior_logprobs"):
        importance_weights(x, torch.zeros(1, 3), torch.ones(1, 2))


def test_a_gate_reports_its_rejection_rate():
    """The step line warns from "is/rejected_frac" (molt.runtime.metrics): gates only, not clip or trunc."""
    trainer, behavior, mask = token_case()
    assert float(
        importance_weights(trainer, behavior, mask, "token", "mask")[1]["is/rejected_frac"]
    ) == pytest.approx(2 / 3)  # ratios 0.4 and 3.0 fall outside [0.5, 2]
    trainer, behavior, mask = seq_case()
    assert float(
        importance_weights(trainer, behavior, mask, "seq", "mis")[1]["is/rejected_frac"]
    ) == pytest.approx(1 / 3)  # row 1's sequence ratio 0.25 is out: its one token of three
    for level, mode in [("token", "clip"), ("token", "trunc"), ("off", "mask")]:
        assert "is/rejected_frac" not in importance_weights(trainer, behavior, mask, level, mode)[1]
