"""Micro-batch planning and collation."""

import pytest
import torch

from molt.trainer.batching import collate, plan_micro_batches
from molt.types import Experience


def test_plan_by_token_budget_sorts_and_respects_the_budget():
    lengths = [5, 20, 7, 9, 30, 6]
    plan = plan_micro_batches(lengths, max_tokens_per_gpu=30)
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    assert plan[0] == [4]  # longest first, alone at exactly the budget
    for mb in plan:
        assert max(lengths[i] for i in mb) * len(mb) <= 30
    assert plan_micro_batches([50, 3], max_tokens_per_gpu=10) == [[0], [1]]  # too long: a batch of its own


def test_plan_by_count_and_whole_window():
    assert plan_micro_batches([3, 9, 5, 7, 1], micro_batch_size=2) == [[1, 3], [2, 0], [4]]
    assert plan_micro_batches([3, 9, 5]) == [[1, 2, 0]]
    assert plan_micro_batches([3, 9], micro_batch_size=2, max_tokens_per_gpu=9) == [[1], [0]]  # budget wins


def _exp(ids, mask, **kw):
    return Experience(
        rollout_id="r",
        group_id="g",
        segment_index=0,
        reward=0.0,
        num_tokens=len(ids),
        num_actions=sum(mask),
        min_version=0,
        token_ids=ids,
        action_mask=mask,
        behavior_logprobs=[-1.0 * m for m in mask],
        versions=[0] * len(ids),
        **kw,
    )


def test_collate_right_pads_and_checks_inputs():
    mb = collate(
        [
            _exp([1, 2, 3], [0, 1, 1], advantages=[0, 1, 1], temperature=0.5),
            _exp([4, 5], [0, 1], advantages=[0, 2]),
        ],
        pad_id=9,
        device=torch.device("cpu"),
    )
    assert mb.input_ids.tolist() == [[1, 2, 3], [4, 5, 9]]
    assert mb.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert mb.action_mask.tolist() == [[False, True, True], [False, True, False]]
    assert mb.act_temperature.tolist() == [0.5, 0.5, 1.0] and mb.num_actions == 3 and not mb.ghost
    assert mb.act_index.tolist() == [1, 2, 4] and mb.spans == [(0, 0, 3, 0), (1, 0, 2, 0)]
    with pytest.raises(ValueError, match="advantages"):
        collate([_exp([1, 2], [0, 1])], pad_id=0, device=torch.device("cpu"))
    offloaded = _exp([1, 2], [0, 1])
    offloaded.token_ids = None
    with pytest.raises(ValueError, match="reload"):
        collate([offloaded], pad_id=0, device=torch.device("cpu"), need_advantages=False)
    ghost = collate([_exp([1, 2], [0, 0], advantages=[0, 0])], pad_id=0, device=torch.device("cpu"))
    assert ghost.ghost and ghost.num_actions == 0  # no actions: a stand-in that still runs every parameter
