"""The rollout pool's scheduling policy, driven by an instant fake `run` (the real path is tested end to end)."""

import asyncio

import pytest

from molt.runtime.pool import PromptStream, RolloutOutcome, RolloutPool, RunStopped
from molt.types import Experience, RolloutStatus

ROWS = [{"prompt": f"q{i}", "label": i} for i in range(10)]


def ok(task, version=0, reward=1.0):
    """An ok outcome whose tokens are of policy `version` (`pool.version` when it runs: fresh)."""
    exp = Experience(task.rollout_id, task.group_id, 0, reward, 4, 2, version)
    return RolloutOutcome(task.rollout_id, task.group_id, reward=reward, experiences=[exp])


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


def test_prompt_stream_is_seeded_and_resumes_from_its_state():
    def keys(stream, n):
        return [key for (key, _row), _ in zip(stream, range(n))]

    first = keys(PromptStream(ROWS, seed=1), 25)
    assert first == keys(PromptStream(ROWS, seed=1), 25)
    assert sorted(i for e, i in first[:10]) == list(range(10)) and first[10][0] == 1  # epoch after epoch
    stream = PromptStream(ROWS, seed=1)
    yielded = keys(stream, 9)
    for key in yielded[:3] + yielded[4:6] + yielded[7:8]:  # trained out of order; 3 and 6 still in flight
        stream.finish(key)
    stream.finish(yielded[8])  # given up (a dropped group): not run again
    assert stream.state() == {"next": 3, "done": [4, 5, 7, 8]}
    resumed = keys(PromptStream(ROWS, seed=1, state=stream.state()), 16)
    assert resumed == [first[3], first[6], *first[9:23]]  # the groups in flight, then on: nothing twice


async def test_the_checkpoint_state_does_not_grow_with_the_run():
    """A long run's stream state is bounded by the groups in flight (issue 32, item 13: before, every trained key
    went into each checkpoint and into the resumed stream's set)."""

    async def run(task):
        return (
            ok(task, pool.version)
            if task.row["label"] % 3
            else RolloutOutcome(task.rollout_id, task.group_id, status=RolloutStatus.TIMEOUT, error="slow")
        )

    stream = PromptStream(ROWS, 0)
    pool = RolloutPool(stream, run, n_samples=2, groups_per_step=2, max_staleness=2, max_retries=0)
    pool.start()
    sizes = []
    for version in range(1, 60):  # 6 epochs of 10 prompts, a third of them dropped
        for g in await pool.next_step_groups():
            stream.finish(g.key)
        pool.set_version(version)
        sizes.append(len(stream.state()["done"]) + len(stream._open))
    await pool.stop()
    assert (
        stream.state()["next"] > 100 and max(sizes) <= 2 * (2 + 1) * 2
    )  # a few steps' groups, any run length


@pytest.mark.parametrize("staleness", [0, 2])
async def test_dispatch_is_bounded_by_staleness(staleness):
    started = []

    async def run(task):
        started.append(task)
        return ok(task, pool.version)

    pool = RolloutPool(PromptStream(ROWS, 0), run, n_samples=3, groups_per_step=2, max_staleness=staleness)
    pool.start()
    await settle()
    assert len({t.group_id for t in started}) == 2 * (staleness + 1)  # run ahead by exactly the bound
    groups = await pool.next_step_groups()
    assert len(groups) == 2 and all(len(g.outcomes) == 3 for g in groups)
    assert [o.sample_index for o in groups[0].outcomes] == [0, 1, 2]
    await settle()
    assert len({t.group_id for t in started}) == 2 * (staleness + 1)  # taking groups frees no budget ...
    pool.set_version(1)
    await settle()
    assert len({t.group_id for t in started}) == 2 * (staleness + 2)  # ... a refit does
    await pool.stop()


async def test_failures_are_retried_within_the_group_then_the_group_is_dropped():
    calls = {}

    async def run(task):
        calls[task.group_id] = calls.get(task.group_id, 0) + 1
        if task.row["label"] % 2 == 0 and task.sample_index == 1:  # even prompts always fail one sample
            return RolloutOutcome(task.rollout_id, task.group_id, status=RolloutStatus.TIMEOUT, error="slow")
        if task.row["label"] % 2 == 1 and task.sample_index == 0 and task.rollout_id.endswith("a0"):
            raise RuntimeError("worker died")  # odd prompts fail once, then succeed on retry
        return ok(task)

    pool = RolloutPool(
        PromptStream(ROWS, 0), run, n_samples=2, groups_per_step=3, max_staleness=0, max_retries=1
    )
    pool.start()
    groups = await pool.next_step_groups()
    await pool.stop()
    assert all(g.row["label"] % 2 == 1 for g in groups)  # only complete groups come out
    assert all(len(g.outcomes) == 2 and all(o.status is RolloutStatus.OK for o in g.outcomes) for g in groups)
    dropped = pool.counters["dropped/group_failed"]
    assert dropped >= 1 and pool.counters["failed/timeout"] == 2 * dropped  # first try + one retry each
    assert pool.counters["failed/agent_error"] >= 3


async def test_stale_groups_are_dropped_and_backfilled():
    async def run(task):  # even prompts come back with version-0 tokens (e.g. a long multi-turn agent)
        return ok(task, version=0 if task.row["label"] % 2 == 0 else pool.version)

    # seed 4 orders prompts 8, 2, 0, 7, ...: three stale groups complete before the first fresh one
    pool = RolloutPool(PromptStream(ROWS, 4), run, n_samples=2, groups_per_step=1, max_staleness=1)
    pool.set_version(5)  # the trainer is far ahead: version-0 tokens are 5 versions old
    pool.start()
    groups = await pool.next_step_groups()
    await pool.stop()
    assert groups[0].row["label"] == 7 and groups[0].min_version == 5
    assert pool.counters["dropped/stale"] == 3


async def test_group_filter_drops_by_reason_and_backfills():
    async def run(task):
        return ok(task, reward=float(task.row["label"] < 5) if task.sample_index else 0.0)

    def only_mixed(group):
        return None if len({o.reward for o in group.outcomes}) > 1 else "all_equal"

    pool = RolloutPool(
        PromptStream(ROWS, 0), run, n_samples=2, groups_per_step=3, max_staleness=0, group_filter=only_mixed
    )
    pool.start()
    groups = await pool.next_step_groups()
    await pool.stop()
    assert len(groups) == 3 and all(g.row["label"] < 5 for g in groups)
    assert pool.counters["dropped/all_equal"] >= 1


async def test_a_resumed_pool_budgets_from_its_start_version():
    started = []

    async def run(task):
        started.append(task.group_id)
        return ok(task, pool.version)

    pool = RolloutPool(PromptStream(ROWS, 0), run, n_samples=1, groups_per_step=2, max_staleness=0)
    pool.set_version(7)  # resumed from a checkpoint at step 7
    pool.start()
    await settle()
    assert len(set(started)) == 2  # one step's groups, not (7 + 1) * 2
    await pool.stop()


async def test_rollouts_that_all_fail_stop_the_pool_with_the_first_traceback(capsys):
    async def run(task):
        if task.sample_index == 0:
            raise ValueError(f"no tool named {task.row['label']}")  # raised here: a traceback to print
        return RolloutOutcome(task.rollout_id, task.group_id, status=RolloutStatus.TIMEOUT, error="slow")

    pool = RolloutPool(
        PromptStream(ROWS, 0),
        run,
        n_samples=2,
        groups_per_step=2,
        max_staleness=0,
        failure_window=8,
        max_failed_share=1.0,
    )
    pool.start()
    with pytest.raises(
        RunStopped,
        match=r"8 of the last 8 rollouts failed \(rollout.max_failed_share 1.0 of "
        r"rollout.failure_window 8\); .*failed/agent_error \d+, failed/timeout \d+; "
        r"first (agent_error .*ValueError: no tool named|timeout .*slow)",
    ):
        await asyncio.wait_for(pool.next_step_groups(), 10)
    await pool.stop()
    err = capsys.readouterr().err
    # the first error of each reason, once, with its traceback when there is one
    assert err.count("molt: first agent_error") == 1 and err.count("molt: first timeout") == 1
    assert err.count("Traceback (most recent call last)") == 1 and "in run\n    raise ValueError" in err
    # which reason fills the window more depends on the order the tasks finish in; the message names the larger
    assert pool.counters["failed/agent_error"] >= 1 and pool.counters["failed/timeout"] >= 1
    assert pool.counters["failed/agent_error"] + pool.counters["failed/timeout"] >= 8


async def test_a_healthy_share_of_failures_does_not_stop_the_pool():
    async def run(task):  # every other rollout fails once, then succeeds on retry
        if task.sample_index == 1 and task.rollout_id.endswith("a0"):
            return RolloutOutcome(
                task.rollout_id, task.group_id, status=RolloutStatus.AGENT_ERROR, error="flaky"
            )
        return ok(task, pool.version)

    pool = RolloutPool(
        PromptStream(ROWS, 0),
        run,
        n_samples=2,
        groups_per_step=2,
        max_staleness=0,
        failure_window=4,
        max_failed_share=0.75,
    )
    pool.start()
    for version in range(1, 4):
        assert len(await asyncio.wait_for(pool.next_step_groups(), 10)) == 2
        pool.set_version(version)
    await pool.stop()


async def test_a_pool_that_forms_no_step_stops_after_the_stall_timeout():
    async def run(task):
        return ok(task, reward=1.0)  # every group all-equal: the filter drops them all, forever

    def only_mixed(group):
        return None if len({o.reward for o in group.outcomes}) > 1 else "all_equal"

    pool = RolloutPool(
        PromptStream(ROWS, 0),
        run,
        n_samples=2,
        groups_per_step=1,
        max_staleness=0,
        group_filter=only_mixed,
        stall_timeout_s=0.5,
    )
    pool.start()
    with pytest.raises(
        RunStopped,
        match=r"no training step formed in 0.5 s \(train.stall_timeout_s\): "
        r"0 of 1 groups ready; .*dropped/all_equal \d+",
    ):
        await asyncio.wait_for(pool.next_step_groups(), 10)
    await pool.stop()


async def test_stopping_the_pool_cancels_the_rollouts_in_flight():
    running, cancelled = set(), set()

    async def run(task):
        running.add(task.rollout_id)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.add(task.rollout_id)
            raise

    pool = RolloutPool(PromptStream(ROWS, 0), run, n_samples=3, groups_per_step=2, max_staleness=0)
    pool.start()
    await settle()
    assert len(running) == 6
    await pool.stop()
    assert cancelled == running  # none left running (in a real run: on its worker, see Workers.run)
