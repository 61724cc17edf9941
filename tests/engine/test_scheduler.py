"""The embedded engine's scheduler on plain records (ints and lists): admissions, chunked prefill across steps,
pause and resume with the requests kept, departures. The module itself imports no torch (checked in a fresh
interpreter: in this one another test may have imported it)."""

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from molt.engine.scheduler import Prefill, Scheduler, State
from molt.types import FinishReason


@dataclass(eq=False)
class Req:
    name: str
    finish: FinishReason | None = None
    tokens: list = field(default_factory=list)


def compact(rows):
    """`keep` as the runner's slots answer it when nothing moves: slot i holds old row rows[i]."""
    return rows


def job(*reqs, columns, rows=None, whole=False):
    return Prefill(list(reqs), rows or len(reqs), columns, whole)


def test_the_module_imports_no_torch():
    code = "import sys, molt.engine.scheduler; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admissions_fill_the_free_rows_in_arrival_order():
    s = Scheduler(max_rows=3, budget=100)
    a, b, c, d = (Req(n) for n in "abcd")
    s.waiting += [a, b, c, d]
    step = s.schedule(compact)
    assert step.admitted == [a, b, c] and step.decode == [] and s.waiting == [d]
    chunks = s.plan([job(a, b, c, columns=10)])  # 30 tokens: within the budget, one chunk
    assert [(x.requests, start, end) for x, start, end in chunks] == [([a, b, c], 0, 10)]
    assert s.running == [a, b, c] and not s.jobs
    step = s.schedule(compact)  # no free row: d waits, the batch decodes
    assert step.decode == [a, b, c] and step.admitted == [] and s.waiting == [d]


def test_rows_in_a_prefill_count_against_the_capacity():
    s = Scheduler(max_rows=2, budget=4)
    a, b = Req("a"), Req("b")
    s.waiting.append(a)
    s.schedule(compact)
    s.plan([job(a, columns=10)])  # 4 of 10 columns: still prefilling
    s.waiting.append(b)
    assert s.schedule(compact).admitted == [b]  # one row free
    s.plan([job(b, columns=10)])
    s.waiting.append(Req("c"))
    assert s.schedule(compact).admitted == []


def test_arrivals_wait_a_few_steps_for_company_while_a_batch_runs():
    s = Scheduler(max_rows=4, budget=100, hold_steps=2)
    a, b = Req("a"), Req("b")
    s.running = [a]
    s.waiting.append(b)
    assert s.schedule(compact).admitted == []
    assert s.schedule(compact).admitted == []
    assert s.schedule(compact).admitted == [b]  # held hold_steps times, then admitted


def test_a_long_prefill_runs_in_chunks_across_steps_under_the_budget_while_the_batch_decodes():
    s = Scheduler(max_rows=8, budget=8)
    runner, long, short = Req("run"), Req("long"), Req("short")
    s.running = [runner]
    s.waiting += [long, short]
    step = s.schedule(compact)
    assert step.decode == [runner] and step.admitted == [long, short]
    big, small = job(long, columns=20), job(short, columns=3)
    seen = []
    for jobs in ([big, small], [], []):
        chunks = s.plan(jobs)
        seen.append([(x.requests[0].name, start, end) for x, start, end in chunks])
        assert sum(x.rows * (end - start) for x, start, end in chunks) <= s.budget
        assert s.schedule(compact).decode[0] is runner  # the running row decodes at every step
    assert seen == [[("long", 0, 8)], [("long", 8, 16)], [("long", 16, 20), ("short", 0, 3)]]
    assert s.running == [runner, long, short] and not s.jobs


def test_a_prefill_gets_at_least_one_column_and_a_whole_one_runs_alone():
    s = Scheduler(max_rows=64, budget=4)
    wide = job(*(Req(str(i)) for i in range(6)), columns=2)  # 6 rows over a budget of 4 tokens
    assert [(start, end) for _, start, end in s.plan([wide])] == [(0, 1)]
    image = job(Req("img"), columns=9, whole=True)
    chunks = s.plan([image])  # the wide one goes on first; the image waits for a step of its own
    assert [(x is wide, start, end) for x, start, end in chunks] == [
        (True, 1, 2)
    ] and s.running == wide.requests
    assert [(x is image, start, end) for x, start, end in s.plan([])] == [(True, 0, 9)]


def test_departures_leave_at_the_boundary_and_the_slots_say_where_the_rows_went():
    s = Scheduler(max_rows=4, budget=100)
    a, b, c, d = (Req(n) for n in "abcd")
    s.running = [a, b, c, d]
    b.finish = FinishReason.STOP
    s.aborts.append(d)
    moved = []

    def keep(rows):  # the slots move the last kept row into the hole
        moved.append(rows)
        return [0, 2]

    step = s.schedule(keep)
    assert moved == [[0, 2]] and s.running == [a, c] == step.decode
    assert step.finished == [b, d] and d.finish is FinishReason.ABORT and b.finish is FinishReason.STOP


def test_an_abort_of_a_waiting_request_or_one_in_a_prefill():
    s = Scheduler(max_rows=4, budget=2)
    a, b, c = Req("a"), Req("b"), Req("c")
    s.waiting += [a, b]
    s.schedule(compact)
    s.plan([job(a, b, columns=4)])
    s.waiting.append(c)
    s.pause()
    s.aborts += [c, a]
    step = s.schedule(compact)
    assert step.finished == [c] and not s.waiting and not step.run  # the waiting one completes at once
    assert a.finish is FinishReason.ABORT and s.jobs[0].requests == [
        a,
        b,
    ]  # a leaves once its rows are merged


def test_pause_keeps_every_request_and_resume_continues_them():
    s = Scheduler(max_rows=4, budget=100)
    a, b = Req("a"), Req("b")
    s.running = [a]
    s.waiting.append(b)
    s.pause()
    assert s.state is State.PAUSING and s.has_work()  # the worker must reach the boundary
    step = s.schedule(compact)
    assert s.state is State.PAUSED and not step.run and not step.decode and not step.admitted
    assert not s.has_work() and s.running == [a] and s.waiting == [b]  # kept, nothing computed
    s.aborts.append(b)
    assert s.has_work()  # an abort is served while paused
    assert s.schedule(compact).finished == [b]
    s.resume()
    assert s.state is State.RUNNING and s.schedule(compact).decode == [a]


def test_new_weights_prefill_the_kept_requests_again_before_the_new_ones():
    s = Scheduler(max_rows=4, budget=2)
    a, b, c, d = (Req(n) for n in "abcd")
    s.running = [a, b]
    s.waiting.append(c)
    s.schedule(compact)
    s.plan([job(c, columns=8)])  # a prefill in progress: its keys/values are of the old weights too
    s.waiting.append(d)
    s.pause()
    s.schedule(compact)
    b.finish = FinishReason.STOP  # it finished in the last step before the pause
    s.recompute = True  # update_weights
    s.resume()
    step = s.schedule(compact)
    assert step.recompute and step.decode == [] and step.finished == [b]
    assert step.admitted == [a, c, d] and not s.running and not s.jobs and not s.recompute
    assert not s.schedule(compact).recompute  # once


def test_a_failed_step_drops_the_batch_and_the_prefills():
    s = Scheduler(max_rows=4, budget=2)
    a, b = Req("a"), Req("b")
    s.running = [a]
    s.plan([job(b, columns=8)])
    assert s.drop() == [a, b] and not s.running and not s.jobs


def test_close_wakes_the_worker_and_a_budget_must_be_positive():
    s = Scheduler(max_rows=4, budget=1)
    assert not s.has_work()
    s.state = State.CLOSED
    assert s.has_work()
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Scheduler(max_rows=4, budget=0)
