"""The pipeline schedule over a window of steps (``costmodel.schedule``): 1F1B, memory, no deadlock,
exact updates, and the closed-form bubble against the timeline it summarises."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lorafleet.costmodel.schedule import (
    BACKWARD,
    FORWARD,
    FORWARD_SHARE,
    StreamMicroBatch,
    bubble_slots,
    flushed_steps,
    forward_dependencies,
    max_in_flight,
    stall_slots,
    stream_order,
    stream_span,
    timeline,
)

TOL = 1e-9


def one_f_one_b(pp: int, stage: int, n: int) -> list[tuple[str, int]]:
    """Textbook 1F1B of one step on ``stage``: warm-up forwards, then B/F pairs, then the cool-down."""
    warm = min(pp - stage, n)
    ops = [(FORWARD, i) for i in range(warm)]
    for i in range(n - warm):
        ops += [(BACKWARD, i), (FORWARD, warm + i)]
    return ops + [(BACKWARD, i) for i in range(n - warm, n)]


def window(steps: list[list[frozenset[int]]]) -> list[StreamMicroBatch]:
    return [StreamMicroBatch(s, tasks) for s, step in enumerate(steps) for tasks in step]


def uniform(pp: int, stream: list[StreamMicroBatch]):
    """Every micro-batch one slot per stage, FORWARD_SHARE of it forward."""
    n = len(stream)
    return [[FORWARD_SHARE] * n] * pp, [[1.0 - FORWARD_SHARE] * n] * pp


def task_major(tasks: int, per_task: int) -> list[frozenset[int]]:
    """One step's single-task micro-batches, task by task."""
    return [frozenset({t}) for t in range(tasks) for _ in range(per_task)]


@st.composite
def windows(draw, max_pp: int = 8, max_steps: int = 6, max_tasks: int = 5, max_mbs: int = 7):
    """(pp, stream): 1..W steps, each of 1..n micro-batches holding 1..3 of the tasks (mixed ones included)."""
    pp = draw(st.integers(1, max_pp))
    n_steps = draw(st.integers(1, max_steps))
    tasks = st.frozensets(st.integers(0, max_tasks - 1), min_size=1, max_size=3)
    steps = [draw(st.lists(tasks, min_size=1, max_size=max_mbs)) for _ in range(n_steps)]
    return pp, window(steps)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 9])
def test_one_step_is_exactly_1f1b(pp, n):
    stream = window([[frozenset({k % 3}) for k in range(n)]])
    for stage in range(pp):
        assert stream_order(pp, stage, stream) == one_f_one_b(pp, stage, n)


def test_stage_outside_the_pipeline_is_refused():
    with pytest.raises(ValueError, match="not in a pipeline"):
        stream_order(2, 2, window([[frozenset({0})]]))


@settings(max_examples=200, deadline=None)
@given(windows(), st.booleans())
def test_in_flight_never_exceeds_the_1f1b_bound(case, drain):
    pp, stream = case
    for stage in range(pp):
        ops = stream_order(pp, stage, stream, drain_stalls=drain)
        assert max_in_flight(ops) <= pp - stage
        assert sorted(ops) == sorted(
            [(FORWARD, i) for i in range(len(stream))] + [(BACKWARD, i) for i in range(len(stream))]
        )


# A step two back whose tasks are all above this forward's: every update of it precedes, in the global
# order, the updates this forward needs, so its backwards must run first (they once were skipped: deadlock).
TWO_BACK = (6, window([[frozenset({4})], [frozenset({2})], [frozenset({0})]]))


@settings(max_examples=300, deadline=None)
@given(windows(), st.booleans(), st.floats(0.0, 0.5), st.integers(0, 2**31 - 1))
@example(TWO_BACK, False, 0.0, 0)
@example(TWO_BACK, True, 0.1, 1)
def test_timeline_never_deadlocks_and_respects_updates(case, drain, update_s, seed):
    """Random windows, random op durations: every op is placed, in its stage order, after its inputs; and
    every forward of a later step starts after the updates it needs (module doc, "Exactness")."""
    pp, stream = case
    rng = random.Random(seed)
    n = len(stream)
    forward = [[rng.uniform(0.05, 1.0) for _ in range(n)] for _ in range(pp)]
    backward = [[rng.uniform(0.05, 2.0) for _ in range(n)] for _ in range(pp)]
    tl = timeline(pp, stream, forward, backward, update_s, drain_stalls=drain)
    assert len(tl.ops) == 2 * pp * n
    at = {(o.kind, o.stage, o.index): o for o in tl.ops}
    for k in range(pp):
        mine = sorted((o for o in tl.ops if o.stage == k), key=lambda o: o.start)
        assert [(o.kind, o.index) for o in mine] == stream_order(pp, k, stream, drain_stalls=drain)
        assert all(a.end <= b.start + TOL for a, b in zip(mine, mine[1:]))
    for i in range(n):
        for k in range(1, pp):
            assert at[FORWARD, k, i].start >= at[FORWARD, k - 1, i].end - TOL
            assert at[BACKWARD, k - 1, i].start >= at[BACKWARD, k, i].end - TOL
        assert at[BACKWARD, pp - 1, i].start >= at[FORWARD, pp - 1, i].end - TOL

    # The updates, recomputed here: U(s, u) after every backward of step s holding u, in (s, u) order.
    keys = sorted({(mb.step, u) for mb in stream for u in mb.tasks})
    update_end, last = {}, 0.0
    for s, u in keys:
        ends = [
            at[BACKWARD, k, i].end for i, mb in enumerate(stream) if mb.step == s and u in mb.tasks for k in range(pp)
        ]
        last = update_end[s, u] = max(last, *ends) + update_s
    for i, mb in enumerate(stream):
        needed = [update_end[s, u] for s, u in keys if s < mb.step - 1 or (s == mb.step - 1 and u <= max(mb.tasks))]
        for k in range(pp):
            assert at[FORWARD, k, i].start >= max(needed, default=0.0) - TOL


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
@pytest.mark.parametrize(("tasks", "per_task"), [(1, 4), (2, 1), (2, 3), (3, 2), (4, 1), (5, 2), (8, 1), (9, 1)])
def test_bubble_slots_is_the_timeline_bubble_of_task_major_streams(pp, tasks, per_task):
    """Uniform ops, the same task-major order every step: one step costs K + (pp - 1) slots; each further
    step of a long window adds K + min(stall, pp - 1), so the window's per-step bubble is the closed form."""
    step = task_major(tasks, per_task)
    k = len(step)

    def span(w: int) -> float:
        stream = window([step] * w)
        return timeline(pp, stream, *uniform(pp, stream)).span

    assert span(1) == pytest.approx(k + pp - 1, abs=TOL)
    assert bubble_slots(pp, 1, step) == pytest.approx(span(1) - k, abs=TOL)
    stall = min(stall_slots(pp, step), pp - 1)
    for w in (3, 4, 5):
        assert span(w + 1) - span(w) - k == pytest.approx(stall, abs=1e-6)
    if stall_slots(pp, step) == 0:  # the closed form is exact from the first boundary on
        for w in (2, 3, 6):
            assert span(w) - w * k == pytest.approx(w * bubble_slots(pp, w, step), abs=TOL)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 6),
    st.lists(st.frozensets(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=8),
)
def test_a_streamed_window_is_never_slower_than_flushing_every_step(pp, w, step):
    """The same order every step, uniform ops: the streamed window (steps that would stall more than a
    drain started drained, ``flushed_steps``) is never slower than W = 1, flushed every step, and the
    closed form never charges more bubble than W = 1 either."""
    stream = window([step] * w)
    streamed = timeline(pp, stream, *uniform(pp, stream)).span
    one = window([step])
    drained = w * timeline(pp, one, *uniform(pp, one)).span
    assert streamed <= drained + TOL
    assert bubble_slots(pp, w, step) <= bubble_slots(pp, 1, step) + TOL
    if flushed_steps(pp, stream):
        assert stall_slots(pp, step) >= pp - 1


# Two boundaries each cheaper streamed on their own, dearer together: judged pair by pair, both streamed
# and the window took 18 slots where its steps flushed one by one take 17.
COMPOUNDING = (5, window([[frozenset({0}), frozenset({2})], [frozenset({1})], [frozenset({0}), frozenset({0, 1})]]))


@settings(max_examples=300, deadline=None)
@given(windows(max_pp=6, max_steps=4))
@example(COMPOUNDING)
def test_a_window_of_different_steps_is_never_slower_than_flushing_every_step(case):
    """Steps of different orders (what dispatch gives), uniform ops: each boundary streams only when
    that beats draining there, judged over the whole window up to it (``flushed_steps``), so the
    window is never slower than its steps run one by one, flushed."""
    pp, stream = case
    streamed = timeline(pp, stream, *uniform(pp, stream)).span
    drained = 0.0
    for s in sorted({mb.step for mb in stream}):
        one = [StreamMicroBatch(0, mb.tasks) for mb in stream if mb.step == s]
        drained += timeline(pp, one, *uniform(pp, one)).span
    assert streamed <= drained + TOL


@settings(max_examples=200, deadline=None)
@given(windows(max_pp=6, max_steps=4))
@example(COMPOUNDING)
def test_a_drained_step_ends_its_own_span_after_the_window_before_it(case):
    """What ``flushed_steps``' induction rests on: with the steps decided before it, a step started
    drained ends the window exactly its own 1F1B span after the window before it ends."""
    pp, stream = case
    flushed = flushed_steps(pp, stream)
    steps = sorted({mb.step for mb in stream})
    for k, s in enumerate(steps[1:], start=1):
        before = [mb for mb in stream if mb.step < s]
        upto = [mb for mb in stream if mb.step <= s]
        one = [StreamMicroBatch(0, mb.tasks) for mb in stream if mb.step == s]
        decided = flushed & set(steps[:k]) | {s}

        def span(part, drained):
            deps = np.asarray(forward_dependencies(part, drained))
            return stream_span(pp, deps, FORWARD_SHARE, 1.0 - FORWARD_SHARE)

        assert span(upto, decided) == pytest.approx(span(before, flushed) + span(one, ()), abs=TOL)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("adapters", [1, 2, 3, 4, 5, 8, 12])
def test_mlora_single_microbatch_adapters_stall_only_below_the_stage_count(stages, adapters):
    """mLoRA's figure: L adapters of one micro-batch each on D stages stall max((D - L) / D, 0) of the
    pipeline: nothing once L >= D, so a long window pays only its one fill and drain."""
    step = task_major(adapters, 1)
    if adapters >= stages:
        assert stall_slots(stages, step) == 0
        assert bubble_slots(stages, 8, step) == pytest.approx((stages - 1) / 8)
    else:
        assert stall_slots(stages, step) > 0


def test_without_task_structure_the_stall_is_the_steady_state_zero():
    assert bubble_slots(4, 1) == 3
    assert bubble_slots(4, 8) == pytest.approx(3 / 8)
    assert bubble_slots(1, 8) == 0
    with pytest.raises(ValueError, match="at least one step"):
        bubble_slots(4, 0)


@settings(max_examples=300, deadline=None)
@given(windows(), st.booleans(), st.integers(0, 2**31 - 1))
@example(TWO_BACK, False, 0)
def test_stream_span_is_the_timeline_span_without_update_time(case, drain, seed):
    """The longest-path span (what prices a window's stall) equals the replayed timeline's, to the bit, for
    random windows and op durations (dyadic: both sides add them exactly), drained or streamed."""
    pp, stream = case
    rng = random.Random(seed)
    n = len(stream)
    forward = [[rng.randint(1, 8) / 4 for _ in range(n)] for _ in range(pp)]
    backward = [[rng.randint(1, 8) / 4 for _ in range(n)] for _ in range(pp)]
    deps = forward_dependencies(stream, flushed_steps(pp, stream) if drain else ())
    replayed = timeline(pp, stream, forward, backward, drain_stalls=drain).span
    assert stream_span(pp, np.asarray(deps), np.asarray(forward), np.asarray(backward)) == replayed


@settings(max_examples=200, deadline=None)
@given(windows(), st.booleans(), st.integers(1, 8), st.integers(1, 8))
@example(TWO_BACK, False, 2, 2)
def test_the_op_by_op_span_is_the_timeline_span(case, drain, forward, backward):
    """``_SlotEnds`` (what settles a small stall's timelines, position by position of ``_stage_rows``) gives the
    replayed timeline's span, to the bit, for random windows and one forward and one backward duration (dyadic),
    drained or streamed."""
    from lorafleet.costmodel.schedule import _SlotEnds, _stage_rows

    pp, stream = case
    n = len(stream)
    deps = forward_dependencies(stream, flushed_steps(pp, stream) if drain else ())
    replayed = timeline(pp, stream, [[forward / 4] * n] * pp, [[backward / 4] * n] * pp, drain_stalls=drain).span
    rows = _stage_rows(pp, deps)
    assert _SlotEnds(pp, n, forward / 4, backward / 4).settle(rows, 0, len(rows)) == replayed


def test_a_stall_is_the_same_settled_op_by_op_or_over_arrays(monkeypatch):
    """``_timed_stall`` gives the same stall, capped or not, whichever way it settles its timelines
    (``SCALAR_STALL``: op by op below it, over arrays above), on random dependencies of up to 3 pp micro-batches."""
    from lorafleet.costmodel import schedule

    rng = np.random.default_rng(5)
    stalled = 0
    for _ in range(150):
        pp = int(rng.integers(2, 13))
        k = int(rng.integers(1, 3 * pp))
        order = [set(rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 4))).tolist()) for _ in range(k)]
        d = schedule.second_step_dependencies(order)
        late = tuple(np.maximum(d[: pp - 1], k + np.arange(min(pp - 1, k)) - pp).tolist())
        stalls = []
        for limit in (0, 10**9):
            monkeypatch.setattr(schedule, "SCALAR_STALL", limit)
            stalls.append([schedule._timed_stall(pp, k, late, cap) for cap in (float("inf"), pp - 1.0, 0.5)])
        assert stalls[0] == stalls[1]
        stalled += stalls[0][0] > 0
    assert stalled >= 20


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 8),
    st.lists(st.frozensets(st.integers(0, 6), min_size=1, max_size=3), min_size=1, max_size=12),
    st.booleans(),
)
def test_the_memoised_stall_is_the_replayed_timeline_stall(pp, step, sort):
    """stall_slots keyed by (pp, the second step's dependencies) gives what the timeline replay of the step's
    own micro-batches gives: span(3 steps) - span(2) - K, one slot a micro-batch (or 0 by the closed form)."""
    if sort:
        step = sorted(step, key=max)  # the dispatcher's task-major order

    def span(steps: int) -> float:
        stream = window([step] * steps)
        return timeline(pp, stream, *uniform(pp, stream), drain_stalls=False).span

    assert stall_slots(pp, step) == pytest.approx(max(0.0, span(3) - span(2) - len(step)), abs=TOL)


def test_a_long_steps_stall_is_that_of_its_last_pipeline_of_micro_batches():
    """``stall_slots`` times only the last ``STALL_HORIZON * pp`` micro-batches of a long step: on random orders of
    up to 12 pp micro-batches, the same stall as the whole step's timeline (``_timed_stall`` uncut)."""
    from lorafleet.costmodel.schedule import STALL_HORIZON, _timed_stall, second_step_dependencies, stall_slots

    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(120):
        pp = int(rng.integers(2, 9))
        k = int(rng.integers(STALL_HORIZON * pp + 1, 12 * pp))
        order = [set(rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 4))).tolist()) for _ in range(k)]
        d = second_step_dependencies(order)
        late = np.maximum(d[: pp - 1], k + np.arange(pp - 1) - pp)
        whole = _timed_stall(pp, k, tuple(late.tolist()))
        assert stall_slots(pp, order) == whole
        checked += whole > 0
    assert checked >= 10  # enough orders that stall at all


def test_a_capped_stall_is_the_stall_up_to_its_cap_and_stops_its_timeline_early():
    """``stall_slots(pp, order, cap)`` is ``min(stall, cap)`` on random orders (task-major, as dispatched, or not;
    the bubble's cap ``pp - 1`` and smaller ones), and the three steps' timeline of the order that stalls furthest
    past its cap stops early (``_stream_ends`` returns None: its ends already show the span past ``stop``)."""
    from lorafleet.costmodel.schedule import _one_step_ends, _stream_ends, _timed_stall, second_step_dependencies

    rng = np.random.default_rng(3)
    furthest = (0.0, 0, [])
    for i in range(150):
        pp = int(rng.integers(2, 13))
        k = int(rng.integers(1, 3 * pp))
        order = [set(rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(1, 4))).tolist()) for _ in range(k)]
        if i % 2:
            order.sort(key=max)
        stall = stall_slots(pp, order)
        for cap in (pp - 1, (pp - 1) / 2, 0.5):
            assert stall_slots(pp, order, cap) == min(stall, cap)
        furthest = max(furthest, (stall - (pp - 1), pp, order), key=lambda f: f[0])
    past, pp, order = furthest
    assert past >= 8
    k = len(order)
    late = tuple(np.maximum(second_step_dependencies(order)[: pp - 1], k + np.arange(min(pp - 1, k)) - pp).tolist())
    assert _timed_stall(pp, k, late) == past + pp - 1 and _timed_stall(pp, k, late, pp - 1.0) == pp - 1
    two = np.concatenate((np.full(k, -1, dtype=np.int64), late, k + np.arange(len(late), k) - pp))
    ends = _stream_ends(pp, two, FORWARD_SHARE, 1 - FORWARD_SHARE, (k, _one_step_ends(pp, k)))
    three, stop = np.concatenate((two, two[k:] + k)), float(ends[-1].max()) + k + pp - 1
    assert _stream_ends(pp, three, FORWARD_SHARE, 1 - FORWARD_SHARE, (two.size, ends), stop) is None
    assert _stream_ends(pp, three, FORWARD_SHARE, 1 - FORWARD_SHARE, (two.size, ends))[-1].max() >= stop
