"""What the controller writes about a step, from light records, against values worked out by hand: the rollout
metrics, pass@n/avg@n, and the trajectory dump."""

import json

import pytest

from molt.runtime.dump import dump_groups
from molt.runtime.metrics import pass_at_n, rollout_metrics
from molt.runtime.pool import Group, RolloutOutcome
from molt.types import Experience


def _exp(rid, seg, n_actions, min_version, ids=None, mask=None):
    n = len(ids) if ids else n_actions + 2
    return Experience(
        rid,
        "g",
        seg,
        0.0,
        n,
        n_actions,
        min_version,
        token_ids=ids,
        action_mask=mask,
        behavior_logprobs=[0.0] * n if ids else None,
        versions=[min_version] * n if ids else None,
    )


def _outcome(rid, reward, exps, *, breaks=None, truncated=False, info=None):
    return RolloutOutcome(
        rid,
        rid[0],
        reward=reward,
        experiences=exps,
        truncated=truncated,
        break_reasons=breaks or ["start"] * len(exps),
        info=info or {},
        response_tokens=sum(e.num_actions for e in exps),
    )


def test_rollout_metrics_by_hand():
    # group a: rewards 1, 0 (one rollout of two segments, versions 3 and 1); group b: rewards 0.5, 0.5
    a = Group(
        (0, 0),
        "a",
        {},
        [
            _outcome(
                "a1",
                1.0,
                [_exp("a1", 0, 4, 3), _exp("a1", 1, 2, 1)],
                breaks=["start", "compaction"],
                info={"correct": 1.0},
            ),
            _outcome("a2", 0.0, [_exp("a2", 0, 6, 3)], truncated=True, info={"correct": 0.0}),
        ],
    )
    b = Group(
        (0, 1),
        "b",
        {},
        [
            _outcome("b1", 0.5, [_exp("b1", 0, 3, 2)]),
            _outcome(
                "b2", 0.5, [_exp("b2", 0, 5, 3), _exp("b2", 1, 0, -1)], breaks=["start", "tools_changed"]
            ),
        ],
    )
    m = rollout_metrics([a, b], version=3)
    # rewards 1, 0, .5, .5: mean .5, population std sqrt((.25 + .25 + 0 + 0) / 4); group stds .5 and 0
    assert m["rollout/reward_mean"] == 0.5 and m["rollout/reward_std"] == pytest.approx(0.125**0.5)
    assert m["group_reward_std"] == 0.25
    assert m["rollout/response_length_mean"] == (6 + 6 + 3 + 5) / 4
    assert m["rollout/truncated_rate"] == 0.25 and m["rollout/segments_per_rollout"] == (2 + 1 + 1 + 2) / 4
    # staleness over segments with actions: 3-3, 3-1, 3-3, 3-2, 3-3 (the empty segment does not count)
    assert m["rollout/staleness_mean"] == pytest.approx(3 / 5) and m["rollout/staleness_max"] == 2
    assert (m["rollout/break/start"], m["rollout/break/compaction"], m["rollout/break/tools_changed"]) == (
        4,
        1,
        1,
    )
    assert m["rollout/info/correct"] == 0.5 and m["rollout/count"] == 4
    assert rollout_metrics([], 0) == {}


def test_pass_at_n_and_avg_at_n_by_hand():
    correct = [[True, False, False, False], [False] * 4, [True, True, True, False]]
    assert pass_at_n(correct) == (pytest.approx(2 / 3), pytest.approx((0.25 + 0 + 0.75) / 3))
    assert pass_at_n([[False], [True]]) == (0.5, 0.5) and pass_at_n([]) == (0.0, 0.0)


def test_dump_groups_writes_one_line_per_segment(tiny_llama_dir, tokenizer, tmp_path):
    hello, world = (
        tokenizer.encode("Hi", add_special_tokens=False),
        tokenizer.encode(" there", add_special_tokens=False),
    )
    ids, mask = hello + world, [0] * len(hello) + [1] * len(world)
    second = tokenizer.encode("ok", add_special_tokens=False)
    group = Group(
        (0, 4),
        "e0-p4",
        {},
        [
            _outcome(
                "r1",
                0.75,
                [
                    _exp("r1", 0, len(world), 2, ids, mask),
                    _exp("r1", 1, len(second), 2, second, [1] * len(second)),
                ],
                breaks=["start", "template_rewrite"],
            ),
        ],
    )
    path = tmp_path / "dumps" / "step_3.jsonl"
    dump_groups(path, [group], str(tiny_llama_dir), {("r1", ""): -0.5})  # advantages by (rollout, role)
    first, last = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {
        "group_id": "e0-p4",
        "rollout_id": "r1",
        "segment": 0,
        "break_reason": "start",
        "role": "",
        "reward": 0.75,
        "advantage": -0.5,
        "text": "Hi there",
        "action_text": " there",
        "token_ids": ids,
        "action_mask": mask,
        "behavior_logprobs": [0.0] * len(ids),
        "versions": [-1] * len(hello) + [2] * len(world),
        "pieces": [tokenizer.decode([t]) for t in ids],
    }
    assert last["segment"] == 1 and last["break_reason"] == "template_rewrite" and last["action_text"] == "ok"
    dump_groups(path, [group], str(tiny_llama_dir))  # token-level estimators: no per-rollout advantage
    assert json.loads(path.read_text().splitlines()[0])["advantage"] is None
