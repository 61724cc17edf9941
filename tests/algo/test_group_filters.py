"""DAPO dynamic filtering by hand: why a complete group's scores drop it (the first reason that applies)."""

import pytest

from molt.algo.filters import dapo_drop


@pytest.mark.parametrize(
    ("scores", "reason"),
    [
        ([1.0, 0.0, 0.0, 1.0], None),  # mean 0.5
        ([1.0] * 4, "all_equal"),
        ([0.0] * 4, "all_equal"),  # and out of range: the first reason counts
        ([0.5, 0.5 + 1e-12], "all_equal"),  # equal but for float rounding
        ([1.0, 1.0, 1.0, 1.0, 0.0], "out_of_range"),  # mean 0.8 > 0.75
        ([0.0] * 7 + [1.0], "out_of_range"),  # mean 0.125 < 0.25
        ([0.0, 0.0, 0.0, 1.0], None),  # mean 0.25: the band is closed
        ([0.0, 1.0, 1.0, 1.0], None),  # mean 0.75
        ([0.2, 0.4, 0.3, 0.5], None),  # scores, not only 0/1 rewards: mean 0.35
    ],
)
def test_dapo_drop_by_hand(scores, reason):
    assert dapo_drop(scores, (0.25, 0.75)) == reason


def test_the_default_band_drops_only_all_equal_groups():
    assert dapo_drop([0.0, 1.0], (0.0, 1.0)) is None and dapo_drop([0.3, 0.3], (0.0, 1.0)) == "all_equal"
