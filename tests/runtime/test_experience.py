"""Experiences: segment -> payload in Ray's object store -> reload; balanced rank assignment."""

import pickle

import numpy as np
import pytest

from molt.runtime.experience import assign_to_ranks, outcome_from_trajectory
from molt.testing.scripted import ScriptedEngine, live_capture_server
from molt.types import Experience, RolloutStatus, SamplingParams, Segment, Trajectory


def _traj():
    segs = [
        Segment([1, 2, 3, 4], [0, 0, 1, 1], [-0.5, -0.25], [3, 4]),  # log-probs and versions: action tokens
        Segment([1, 9, 8], [0, 1, 1], [0.0, -1.0, -2.0], [-1, 4, 4], break_reason="compaction"),
    ]  # or per token
    return Trajectory("r1", "g1", segs, reward=1.5, info={"turns": 2})


def test_segment_fields_become_arrays_of_the_action_tokens():
    seg = _traj().segments[1]
    assert (seg.token_ids.dtype, seg.action_mask.dtype, seg.behavior_logprobs.dtype, seg.versions.dtype) == (
        np.int32,
        np.bool_,
        np.float32,
        np.int32,
    )
    assert seg.behavior_logprobs.tolist() == [-1.0, -2.0] and seg.versions.tolist() == [4, 4]
    with pytest.raises(ValueError, match="behavior_logprobs has 2 entries for 3 tokens, 1 of them actions"):
        Segment([1, 2, 3], [0, 0, 1], [-0.5, -0.25], [3])


def test_an_outcome_keeps_payload_and_light_fields():
    out = outcome_from_trajectory(_traj())
    assert out.status is RolloutStatus.OK and out.reward == 1.5 and out.response_tokens == 4
    assert out.break_reasons == ["start", "compaction"]
    assert [e.min_version for e in out.experiences] == [3, 4] and out.min_version == 3
    assert out.experiences[1].token_ids.tolist() == [1, 9, 8] and out.experiences[1].num_actions == 2


def test_failed_trajectory_has_no_experiences():
    traj = Trajectory("r", "g", [], status=RolloutStatus.TIMEOUT, error="too slow")
    out = outcome_from_trajectory(traj)
    assert out.experiences == [] and out.error == "too slow"


def test_offload_and_reload_through_ray(ray_local):
    import ray

    exp = outcome_from_trajectory(_traj()).experiences[0]
    exp.payload_ref = ray.put(exp.split())  # as `Workers.run` keeps a worker's streamed payload
    assert exp.offloaded and exp.token_ids is None and exp.behavior_logprobs is None
    assert exp.num_tokens == 4 and exp.reward == 1.5  # light fields stay
    exp.reload()
    assert exp.token_ids.tolist() == [1, 2, 3, 4] and exp.behavior_logprobs.tolist() == [-0.5, -0.25]
    assert exp.action_mask.tolist() == [False, False, True, True] and exp.versions.tolist() == [3, 4]


async def test_a_recorded_sessions_payload_pickles_to_at_most_8_bytes_a_token(tokenizer):
    """Issue 37: per-token data travel as arrays (4 bytes an id, 1 a mask entry, 8 per action token for its
    log-prob and version), not as Python lists (18 bytes a token and more). An agent-like session: long
    observations, short replies."""
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(rng.choice(["file", "error", "line", "test", "call", "fix"], n))
    engine = ScriptedEngine(tokenizer, [words(12) for _ in range(4)], max_model_len=8192)
    async with live_capture_server(engine, tokenizer) as server:
        session = await server.open_session("r", SamplingParams(max_tokens=64))
        messages = [{"role": "system", "content": words(200)}]
        for _ in range(8):
            messages.append({"role": "user", "content": words(60)})
            messages.append((await session.chat(messages, SamplingParams(max_tokens=64))).message)
        (segment,) = await session.close()
    (exp,) = outcome_from_trajectory(Trajectory("r", "g", [segment], reward=1.0)).experiences
    payload = exp.split()
    n, k = len(payload["token_ids"]), len(payload["versions"])
    assert n > 1000 and 0 < k < n / 4 and k == payload["action_mask"].sum()
    size = len(pickle.dumps(payload, protocol=5))  # as Ray serializes it
    assert 5 * n + 8 * k < size < 5 * n + 8 * k + 1000  # the arrays' bytes and a small constant
    assert size <= 8 * n, (size, n, k)


def test_assignment_balances_tokens():
    exps = [Experience(f"r{i}", "g", 0, 0.0, n, 1, 0) for i, n in enumerate([100, 90, 50, 40, 30, 20, 10, 5])]
    ranks = assign_to_ranks(exps, 2)
    loads = [sum(e.num_tokens for e in r) for r in ranks]
    assert sorted(loads) == [170, 175] and sum(len(r) for r in ranks) == 8
    with pytest.raises(ValueError, match="cannot feed"):
        assign_to_ranks(exps[:1], 2)


def test_assignment_keeps_a_rollouts_segments_together():
    sizes = {"a": [60, 40], "b": [30], "c": [50, 20, 10], "d": [25]}
    exps = [Experience(r, "g", i, 0.0, n, 1, 0) for r, ns in sizes.items() for i, n in enumerate(ns)]
    ranks = assign_to_ranks(exps, 2)
    homes = {e.rollout_id: {i for i, rank in enumerate(ranks) if e in rank} for e in exps}
    assert all(len(h) == 1 for h in homes.values())
    # LPT over rollouts (100, 80, 30, 25): {a, d} = 125 and {c, b} = 110
    assert sorted(sum(e.num_tokens for e in r) for r in ranks) == [110, 125]
