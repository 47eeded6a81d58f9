"""The pipeline schedule of a PP replica over a window of steps, its timeline, and its bubble.

**Schedule.** A replica of ``pp`` stages runs the micro-batches of ``W`` consecutive steps (a
*window*) as one stream, 1F1B: stage ``k`` runs a forward whenever fewer than ``pp - k``
micro-batches are in flight on it and the forward is allowed, and a backward otherwise; forwards
and backwards each go in stream order (:func:`stream_order`). ``W = 1`` is 1F1B flushed every
step (Megatron-LM's PipeDream-flush, LobRA Eq. 12). With ``W > 1`` the stream does not drain at
step boundaries: micro-batches of step ``s + 1`` fill the stages while step ``s``'s last
backwards run, which is mLoRA's observation (LoRAPP, VLDB 2025) that adapters share no
gradient, so a task's optimizer step waits only for its own backward.

**Exactness.** Task ``a``'s update of step ``s``, ``U(a, s)``, sums its gradients over the fleet,
clips them by their global norm and steps its optimizer; it needs every backward of a micro-batch
holding ``a`` in step ``s``, on every replica. Updates run in one global order, ``(s, a)``. A
forward of step ``s + 1`` holding tasks ``T`` is allowed once ``U(u, s)`` is done for every
``u <= max T``, so on its own stage once every backward of step ``s`` (or earlier) whose micro-batch
holds such a task has run (:func:`forward_dependencies`). So no forward ever reads an adapter that
misses an update of an earlier step, and every task gets the updates it would get alone.

**Memory.** At most ``pp - k`` micro-batches are in flight on stage ``k`` whatever ``W``: the same
bound as 1F1B, which is what ``memory_model.stage_lines`` charge (``pp`` on the first stage).

**Bubble.** For micro-batches of equal stage time τ a step of ``K`` micro-batches costs ``K τ`` of
work per stage. 1F1B with a flush adds ``(pp - 1) τ`` (warm-up plus cool-down). In a stream a
forward of step ``s + 1`` on stage 0 would run right after the backward ``pp`` places before it;
when the last micro-batch it depends on (:func:`forward_dependencies`) is later than that, the stage
waits. When no forward waits (``max_i (dep(i) - i + pp) <= 0``; every task has at least ``pp - 1``
micro-batches of other tasks between its steps: mLoRA's max((D - L)/D, 0) with L adapters of one
micro-batch each) the boundary costs nothing; otherwise the waits compound and the stall is read
off the timeline (:func:`stall_slots`). A boundary whose streaming would cost at least a drain
drains instead (:func:`flushed_steps`), so a stall counts at most ``pp - 1``. A window pays the fill
and drain once and the stall at each of its ``W - 1`` inner boundaries, so per step

    bubble_slots = ((pp - 1) + (W - 1) * min(stall, pp - 1)) / W          (:func:`bubble_slots`)

and the cost model charges ``bubble_slots * max_k τ_k`` where 1F1B charged ``(pp - 1) * max_k τ_k``.
:func:`timeline` replays the schedule with any op durations (measured ones in
``benchmarks/bench_pipeline.py``) and is the reference the closed form is checked against; the stall
itself is read off :func:`stream_span`, the same span as a longest path over arrays (tens of times
faster: every pipelined replica of every dispatched step asks for it), or a small one op by op
(:class:`_SlotEnds`, the timeline's own sums without its bookkeeping), memoised on what decides it.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from lorafleet.costmodel import time_model
from lorafleet.work import count as count_work
from lorafleet.work import memo as work_memo

FORWARD, BACKWARD = "F", "B"
FORWARD_SHARE = time_model.FORWARD_SHARE[2]
"""A forward's share of a micro-batch's stage time when only the total is known: 1/2, the share of
the projections' terms of the time model (``time_model.FORWARD_SHARE``: over a frozen base the
backward computes input gradients only, one GEMM per forward GEMM). Measured on this CPU over
``bench-llama``'s 8 stages: 0.47-0.53 (``benchmarks/bench_pipeline.py``)."""


@dataclass(frozen=True)
class StreamMicroBatch:
    """One micro-batch of a replica's window, as the schedule sees it."""

    step: int
    tasks: frozenset[int]


def forward_dependencies(stream: Sequence[StreamMicroBatch], flushed: Collection[int] = ()) -> list[int]:
    """``dep(i)``: the last micro-batch of an earlier step whose backward must run (on the same
    stage) before forward ``i``: the latest ``m`` with ``step(m) < step(i) - 1``, or with
    ``step(m) = step(i) - 1`` and ``min tasks(m) <= max tasks(i)`` (module doc, "Exactness": the
    updates of step ``s - 1`` that forward ``i`` needs follow, in the global order, every update of
    step ``s - 2``, hence every backward of it); -1 when there is none. A step in ``flushed`` waits
    for every earlier micro-batch (the pipeline drains before it)."""
    firsts: dict[int, int] = {}
    for i, mb in enumerate(stream):
        firsts.setdefault(mb.step, i)
    lows = [min(mb.tasks) if mb.tasks else -1 for mb in stream]
    deps = []
    for mb in stream:
        m = firsts[mb.step] - 1
        if mb.step not in flushed:
            top = max(mb.tasks) if mb.tasks else -1
            while m >= 0 and stream[m].step == mb.step - 1 and lows[m] > top:
                m -= 1
        deps.append(m)
    return deps


def flushed_steps(pp: int, stream: Sequence[StreamMicroBatch]) -> set[int]:
    """The steps of the window (after its first) that start on a drained pipeline.

    The boundaries are judged in order, each over the whole window up to it, one slot a micro-batch
    (:data:`FORWARD_SHARE` of it forward): step ``s`` starts drained when the window streamed into it
    would end no earlier than the window before it, as decided, plus ``s`` run alone (a drained
    step's ops are its own 1F1B shifted to where the window before it ends). So each prefix of the
    window ends no later than the one before it plus its last step alone, and by induction the
    window is never slower than its steps flushed one by one. Pair by pair is not enough: a forward
    may wait for a step two back (:func:`forward_dependencies`) and stalls compound, so two
    boundaries each cheaper streamed on their own can be dearer together (``pp`` = 5, steps
    ``{0},{2} | {1} | {0},{0,1}``: 18 slots streamed, 16 with the second boundary drained, 17 both).
    A replica with fewer tasks than stages gains nothing from streaming them and would lose by it.
    """
    return set(_flushed_steps(pp, tuple(stream)))


@functools.lru_cache(maxsize=4096)
def _flushed_steps(pp: int, stream: tuple[StreamMicroBatch, ...]) -> frozenset[int]:
    if pp <= 1:
        return frozenset()
    ends: dict[int, int] = {}
    for i, mb in enumerate(stream):
        ends[mb.step] = i + 1
    starts = [0, *ends.values()]
    steps = list(ends)
    flushed: set[int] = set()
    span = _unit_span(pp, list(stream[: starts[1]]))
    for k in range(1, len(steps)):
        streamed = _unit_span(pp, list(stream[: starts[k + 1]]), flushed)
        drained = span + _unit_span(pp, list(stream[starts[k] : starts[k + 1]]))
        if streamed >= drained - 1e-9:
            flushed.add(steps[k])
            span = drained
        else:
            span = streamed
    return frozenset(flushed)


def stream_order(
    pp: int, stage: int, stream: Sequence[StreamMicroBatch], *, drain_stalls: bool = True
) -> list[tuple[str, int]]:
    """The ops of stage ``stage`` over ``stream``: ``("F", i)`` and ``("B", i)``, 1F1B with the
    window's dependencies (module doc). For one step it is exactly 1F1B: ``pp - stage`` forwards,
    then backward and forward alternating, then the remaining backwards. ``drain_stalls``: start the
    steps of :func:`flushed_steps` on a drained pipeline (False: stream every step, what
    :func:`stall_slots` measures)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not in a pipeline of {pp} stages")
    deps = forward_dependencies(stream, flushed_steps(pp, stream) if drain_stalls else ())
    n, limit = len(stream), pp - stage
    ops: list[tuple[str, int]] = []
    f = b = 0
    while b < n:
        if f < n and f - b < limit and b > deps[f]:
            ops.append((FORWARD, f))
            f += 1
        else:
            ops.append((BACKWARD, b))
            b += 1
    return ops


def max_in_flight(ops: Sequence[tuple[str, int]]) -> int:
    """The most micro-batches whose forward has run and backward not yet, over ``ops``."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def stall_slots(pp: int, microbatch_tasks: Sequence[Collection[int]], cap: float = float("inf")) -> float:
    """Slots of stage time a boundary between two steps of this micro-batch order costs on top of
    the steps' work, in the steady state (the same order every step); ``min(stall, cap)`` with a ``cap``
    (what a caller tells no larger stall from: :func:`bubble_slots` charges at most ``pp - 1``), which lets the
    timeline stop as soon as it shows the stall at least ``cap`` (:func:`_timed_stall`).

    First the closed form ``max_i (dep(i) - i + pp)^+`` over a second step's forwards (module doc):
    when it is 0 no forward waits and that is exact. Otherwise the waits compound (a late forward
    delays the backwards the next forwards wait for), so the stall is read off the timeline with
    every micro-batch one slot (:data:`FORWARD_SHARE` of it forward): the third step's span minus
    the second's, minus the step's work (:func:`_timed_stall`).

    Only the order's dependencies decide it: a second step's forward ``i`` waits for the backward of
    ``d(i)``, the last micro-batch ``m`` of the first step with ``min tasks(m) <= max tasks(i)``
    (:func:`forward_dependencies`). And only the late ones: stage k issues forward f after
    ``max(f - (pp - k) + 1, dep(f) + 1)`` backwards (:func:`stage_positions`), so a dependency
    ``dep(f) <= f - pp`` never moves an op and may be read as ``f - pp``. With ``d'(i) = max(d(i), K + i
    - pp)``, every ``d'(i)`` from ``i = pp - 1`` on is ``K + i - pp``: the stall is a function of ``(pp, K,
    d'(0 .. pp - 2))`` and is memoised on it. And it does not depend on ``K`` beyond ``pp``: every ``d'(i) >= K -
    pp``, so no forward of the next step waits for one of the step's micro-batches before ``K - pp``, and a stage
    has at most ``pp`` of them in flight, so the step's last ``pp`` micro-batches alone, the dependencies shifted,
    give the same stall (:data:`STALL_HORIZON`; a service-scale replica of a deep pipeline has thousands of
    micro-batches, and its timeline is then pp long, not K; tests check the equality on random orders).
    """
    if pp <= 1 or not microbatch_tasks:
        return 0.0
    d = second_step_dependencies(microbatch_tasks)
    k = d.size
    if int((d - np.arange(k, 2 * k)).max()) + pp <= 0:
        return 0.0
    late = np.maximum(d[: pp - 1], k + np.arange(min(pp - 1, k)) - pp)
    if k > STALL_HORIZON * pp:  # the same stall as the step's last STALL_HORIZON * pp micro-batches alone
        late, k = late - (k - STALL_HORIZON * pp), STALL_HORIZON * pp
    key = (pp, k, tuple(late.tolist()), float(cap))
    memo = work_memo("stall")  # a counted scope (a plan) keeps its own, so its count is reproducible
    if memo is None:
        return _cached_stall(*key)
    if key not in memo:
        memo[key] = _timed_stall(*key)
    return memo[key]


STALL_HORIZON = 1
"""A step's stall is that of its last ``STALL_HORIZON * pp`` micro-batches (:func:`stall_slots`)."""


class TaskRanges(Sequence[Collection[int]]):
    """Each micro-batch's task ids, in order (a sequence of collections, as the functions here take), with
    each one's least and largest task id as arrays (-1 for an empty one): what the stall reads of them
    (:func:`second_step_dependencies`). A caller that has those arrays already (the dispatcher's packer,
    thousands of micro-batches a step) passes this rather than have them taken one micro-batch at a time."""

    __slots__ = ("lows", "tasks", "tops")

    def __init__(self, tasks: Sequence[Collection[int]], lows: np.ndarray, tops: np.ndarray) -> None:
        if not len(tasks) == lows.size == tops.size:
            raise ValueError(f"{len(tasks)} task sets, {lows.size} least and {tops.size} largest ids")
        self.tasks, self.lows, self.tops = tasks, lows, tops

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, index: int | slice) -> Collection[int] | Sequence[Collection[int]]:
        return self.tasks[index]


def second_step_dependencies(microbatch_tasks: Sequence[Collection[int]]) -> np.ndarray:
    """``d``: :func:`forward_dependencies` of the second of two steps of this order, as indices into
    the first (-1: none). With ``lo`` the suffix minima of the micro-batches' smallest tasks,
    ``d(i) = max { m : lo(m) <= max tasks(i) }``, a sorted search."""
    if isinstance(microbatch_tasks, TaskRanges):
        lows, tops = microbatch_tasks.lows, microbatch_tasks.tops
    else:
        lows = np.array([min(t) if t else -1 for t in microbatch_tasks], dtype=np.int64)
        tops = np.array([max(t) if t else -1 for t in microbatch_tasks], dtype=np.int64)
    suffix_min = np.minimum.accumulate(lows[::-1])[::-1]
    return np.searchsorted(suffix_min, tops, side="right") - 1


def _timed_stall(pp: int, k: int, late: tuple[int, ...], cap: float = float("inf")) -> float:
    """Steady-state stall of a step of ``k`` micro-batches whose second-step dependencies read ``late``,
    then ``K + i - pp`` (:func:`stall_slots`): span(3 steps) - span(2 steps) - K, one slot a micro-batch; at most
    ``cap``. The three steps' timeline stops once it shows ``span(3 steps) >= span(2 steps) + K + cap`` (its
    ``stop``): the stall is then at least ``cap``, and ``cap`` is the answer (exact: every end is a sum of halves).
    A small one (:data:`SCALAR_STALL`) settles both timelines op by op, whole, and takes the same ``min`` with ``cap``:
    the same sums of halves, so the same stall."""
    if pp * k <= SCALAR_STALL:
        return _slot_stall(pp, k, late, cap)
    rel = np.concatenate((np.asarray(late, dtype=np.int64), k + np.arange(len(late), k) - pp))
    two = np.concatenate((np.full(k, -1, dtype=np.int64), rel))
    ends = _stream_ends(pp, two, FORWARD_SHARE, 1.0 - FORWARD_SHARE, (k, _one_step_ends(pp, k)))
    span = float(ends[-1].max())
    stop = span + k + cap if cap < float("inf") else None
    three = _stream_ends(pp, np.concatenate((two, rel + k)), FORWARD_SHARE, 1.0 - FORWARD_SHARE, (two.size, ends), stop)
    count_work("stall_timelines", 2)  # the two spans; the shared first step is not counted (its cache outlives a scope)
    if three is None:
        return float(cap)
    return min(max(0.0, float(three[-1].max()) - span - k), cap)


SCALAR_STALL = 400
"""A stall of ``pp`` stages and ``k`` micro-batches with ``pp k`` at most this has its timelines settled op by op
(:func:`_slot_stall`), larger ones position by position over arrays (:func:`_stream_ends`): a position's dozen array
calls cost more than its ``pp`` ops in Python up to about ``pp = k = 20`` (a service-scale plan's stalls, mostly
``pp = k`` = 8 to 20: 0.45-0.7x; ``pp = k = 40``: 1.3x the arrays' time)."""


def _slot_stall(pp: int, k: int, late: tuple[int, ...], cap: float) -> float:
    """:func:`_timed_stall` op by op: the two steps' and the three steps' timelines settled by :class:`_SlotEnds`,
    the positions where both streams hold the same ops once (every op's input sits at its position or earlier, so
    those ends are the same in both), and the three steps' stopped as soon as they show the stall at least
    ``cap``. The same sums of halves as the arrays', so the same stall."""
    rel = [*late, *range(k + len(late) - pp, 2 * k - pp)]
    two = [-1] * k + rel
    rows, more = _stage_rows(pp, two), _stage_rows(pp, two + [d + k for d in rel])
    head = k + max(0, k - pp + 1, late[0] + 1)  # where stage 0's first forward of the second step sits
    shared = head
    while shared < len(rows) and rows[shared] == more[shared]:
        shared += 1
    ends = _first_step_ends(pp, k, head).copy()
    ends.settle(more, head, shared)
    twice = ends.copy()
    span = twice.settle(rows, shared, len(rows))
    three = ends.settle(more, shared, len(more), span + k + cap)
    count_work("stall_timelines", 2)
    return float(cap) if three is None else min(max(0.0, three - span - k), cap)


def _stage_rows(pp: int, deps: list[int]) -> list[list[int]]:
    """Every stage's op at each position of its :func:`stream_order` (:func:`stage_positions`), a row a position:
    forward ``i`` as ``i``, backward ``i`` as ``~i``."""
    n = len(deps)
    forward, backward = stage_positions(pp, np.asarray(deps, dtype=np.int64))
    stage, index = np.arange(pp)[:, None], np.arange(n)
    rows = np.empty((2 * n, pp), dtype=np.int64)
    rows[forward, stage] = index
    rows[backward, stage] = ~index
    return rows.tolist()


class _SlotEnds:
    """The ends of a timeline's ops with no update time, every forward ``forward_s`` and every backward
    ``backward_s`` long, settled position by position as :func:`_stream_ends` settles them (an op's input sits at
    its position or earlier: forwards down the stages, then backwards up), each op ending at ``max(the end of the
    op before it on its stage, its input's end) + its duration``: the timeline's own sums, so its bits."""

    __slots__ = ("backward", "backward_s", "forward", "forward_s", "last")

    def __init__(self, pp: int, n: int, forward_s: float, backward_s: float) -> None:
        self.forward = [[0.0] * n for _ in range(pp)]
        self.backward = [[0.0] * n for _ in range(pp)]
        self.last = [0.0] * pp  # each stage's latest end
        self.forward_s, self.backward_s = forward_s, backward_s

    def copy(self) -> _SlotEnds:
        twin = _SlotEnds.__new__(_SlotEnds)
        twin.forward, twin.backward = [list(e) for e in self.forward], [list(e) for e in self.backward]
        twin.last, twin.forward_s, twin.backward_s = list(self.last), self.forward_s, self.backward_s
        return twin

    def settle(self, rows: list[list[int]], start: int, stop: int, at_least: float | None = None) -> float | None:
        """Settles positions ``start:stop`` of ``rows`` (:func:`_stage_rows`; those before settled already) and
        returns the span so far; None as soon as the span is shown at least ``at_least``: every stage has as
        many ops left as positions, each at least the shorter duration long."""
        forward, backward, last, forward_s, backward_s = (
            self.forward,
            self.backward,
            self.last,
            self.forward_s,
            self.backward_s,
        )
        bottom = len(last) - 1
        # (stage, its ends, its input's ends): a forward takes the stage above's (none on stage 0), a backward the
        # stage below's (on the last stage its own forward's)
        down = list(zip(range(bottom + 1), forward, [None, *forward[:-1]], strict=True))
        up = list(zip(range(bottom, -1, -1), backward[::-1], [forward[-1], *backward[:0:-1]], strict=True))
        shortest, final = min(forward_s, backward_s), len(rows) - 1
        for p in range(start, stop):
            row = rows[p]
            for k, mine, above in down:
                i = row[k]
                if i >= 0:
                    ready = above[i] if k else 0.0
                    end = last[k]
                    mine[i] = last[k] = (end if end > ready else ready) + forward_s
            for k, mine, below in up:
                i = row[k]
                if i < 0:
                    i = ~i
                    ready = below[i]
                    end = last[k]
                    mine[i] = last[k] = (end if end > ready else ready) + backward_s
            if at_least is not None and max(last) + (final - p) * shortest >= at_least:
                return None
        return max(last)


@functools.lru_cache(maxsize=1024)
def _first_step_ends(pp: int, k: int, head: int) -> _SlotEnds:
    """:func:`_slot_stall`'s ends over its first ``head`` positions, before stage 0's first forward of the second step
    (at ``k + c_0(k)``, :func:`stage_positions`; later on the other stages, whose ``c`` is larger): they hold the first
    step's ops alone, at the positions the step alone gives them (no forward of a later step is before them), so
    every stall of ``(pp, k)`` whose second step starts there settles the same ends (read only: copied)."""
    ends = _SlotEnds(pp, 3 * k, FORWARD_SHARE, 1.0 - FORWARD_SHARE)
    ends.settle(_stage_rows(pp, [-1] * k), 0, head)
    return ends


@functools.lru_cache(maxsize=256)
def _one_step_ends(pp: int, k: int) -> np.ndarray:
    """The ends of one step of ``k`` micro-batches alone, one slot each: what every stall of ``(pp, k)`` starts with
    (:func:`_timed_stall`'s first step, whatever its dependencies; read only)."""
    ends = _stream_ends(pp, np.full(k, -1, dtype=np.int64), FORWARD_SHARE, 1.0 - FORWARD_SHARE)
    ends.flags.writeable = False
    return ends


_cached_stall = functools.lru_cache(maxsize=65536)(_timed_stall)


def _unit_span(pp: int, stream: list[StreamMicroBatch], flushed: Collection[int] = ()) -> float:
    """The span of ``stream`` with the steps ``flushed`` drained before and the others streamed, every
    micro-batch one slot a stage (:data:`FORWARD_SHARE` of it forward)."""
    deps = np.asarray(forward_dependencies(stream, flushed), dtype=np.int64)
    return stream_span(pp, deps, FORWARD_SHARE, 1.0 - FORWARD_SHARE)


def stage_positions(pp: int, deps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where forward ``i`` and backward ``i`` sit in stage ``k``'s :func:`stream_order` (given its
    dependencies ``deps``), in closed form, as two ``(pp, n)`` arrays: forward ``f`` waits for ``c_k(f)``
    backwards,

        c_k(f) = max(0, max_{g <= f} max(g - (pp - k) + 1, dep(g) + 1)) = max(0, f - (pp - k) + 1, D(f))

    (fewer than ``pp - k`` in flight, its dependency's backward run, after forward ``f - 1``; D the running
    maximum of dep + 1), so it sits at ``f + c_k(f)``; and backward ``b`` at ``b + #{f : c_k(f) <= b}``, where
    the ``f`` counted are a prefix, the shorter of ``f <= b + pp - k - 1`` and ``D(f) <= b``."""
    n = deps.size
    idx = np.arange(n)
    ahead = (pp - np.arange(pp))[:, None]  # pp - k
    reach = np.maximum.accumulate(deps + 1)  # D(f)
    forward = idx + np.maximum(np.maximum(idx - ahead + 1, reach), 0)
    before = np.minimum(np.clip(idx + ahead, 0, n), np.searchsorted(reach, idx, side="right"))
    return forward, idx + before


def stream_span(pp: int, deps: np.ndarray, forward_s: float | np.ndarray, backward_s: float | np.ndarray) -> float:
    """The span of :func:`timeline` with no update time (``update_s = 0``), computed as a longest path
    (:func:`_stream_ends`)."""
    span = float(_stream_ends(pp, deps, forward_s, backward_s)[-1].max())
    count_work("stall_timelines")
    return span


def _stream_ends(
    pp: int,
    deps: np.ndarray,
    forward_s: float | np.ndarray,
    backward_s: float | np.ndarray,
    known: tuple[int, np.ndarray] | None = None,
    stop: float | None = None,
) -> np.ndarray | None:
    """Every op's end in :func:`timeline` with no update time, by position: row ``p + 1`` holds each stage's
    op at position ``p`` of its order (row 0: zeros), so the span is the last row's maximum.

    With no update time, a forward's updates are ready when its dependency's backward has run on
    stage 0, which stage 0's order already waits for, so every op waits only for the op before it
    on its stage and for its input (forward ``i`` on the stage before, backward ``i`` on the stage
    after). The input sits at the same position of its stage's order or earlier (:func:`stage_positions`:
    ``c_k(f)`` grows with ``k``, so a forward's position never falls from one stage to the next, nor a
    backward's from one stage to the one before), so the ends settle one position ``p`` at a time, every
    stage at once. An op of duration ``t_k`` whose input ended at ``a_k`` ends at

        e_k(p) = max(e_k(p - 1), a_k) + t_k

    and where the input sits at the same position (a chain of forwards down the stages, or of backwards
    up them, from a stage ``s`` whose input came earlier), with ``S`` the running sum of ``t`` along the
    chain and ``x_j = max(e_j(p - 1), a_j)``,

        e_k(p) = S_k + max_{s <= j <= k} (x_j - S_{j-1})

    a running maximum, kept inside each chain by adding its chain's number times a constant above every
    end. So the sums are exact, and equal the timeline's to the bit, when the durations are dyadic (the
    schedule's slots are halves). ``forward_s``, ``backward_s``: one duration for all, or ``(pp, n)``.
    ``known``: ``(n0, ends)``, the ends of this stream's first ``n0`` micro-batches alone (the same durations):
    every position before the first forward of a later micro-batch holds the same op on every stage, with the
    same inputs, in both, so those rows are copied, not settled again. ``stop``: None (nothing returned) as soon
    as the ends show the span at least ``stop``: a stage's op at position ``p`` ends at ``e_k(p)``, and its ops
    after it run one after another, so the span is at least ``max_k e_k(p) + R_k(p)``, ``R_k(p)`` the durations
    of stage ``k``'s ops after position ``p`` (checked every :data:`STOP_EVERY` positions). Raises ValueError if
    the orders deadlock (a forward waiting for a backward of its own or a later one).
    """
    n = deps.size
    if n == 0:
        return np.zeros((1, pp))
    waiting = np.flatnonzero(deps >= np.arange(n))
    if waiting.size:
        i = int(waiting[0])
        raise ValueError(f"the stage orders deadlock: forward {i} waits for the backward of {int(deps[i])}")
    f_pos, b_pos = stage_positions(pp, deps)
    width = 2 * n
    shared = int(f_pos[:, known[0]].min()) if known is not None and known[0] < n else 0
    fwd = np.broadcast_to(np.asarray(forward_s, dtype=float), (pp, n))
    bwd = np.broadcast_to(np.asarray(backward_s, dtype=float), (pp, n))
    stage = np.broadcast_to(np.arange(pp)[:, None], (pp, n))
    # the grid by position: row p holds every stage's op at position p (whether it is a forward, its duration)
    is_forward = np.zeros((width, pp), dtype=bool)
    is_forward[f_pos, stage] = True
    # each op's input as a flat index into the ends (width + 1, pp), whose row p + 1 holds position p's (row 0:
    # zeros, for no input, or one at the same position, which the chain's running maximum carries instead)
    source = np.zeros((width, pp), dtype=np.int64)
    source[f_pos[1:], stage[1:]] = np.where(f_pos[:-1] == f_pos[1:], 0, (f_pos[:-1] + 1) * pp + stage[:-1])
    source[b_pos[:-1], stage[:-1]] = np.where(b_pos[1:] == b_pos[:-1], 0, (b_pos[1:] + 1) * pp + stage[1:])
    above = 2.0 ** np.ceil(np.log2(2.0 * (fwd.sum() + bwd.sum()) + 2.0))  # > every end and every S
    # Only the rows from ``shared`` on are settled, and a row's chains are its own: its offsets are taken for those
    is_forward = is_forward[shared:]
    if np.ndim(forward_s) == np.ndim(backward_s) == 0:
        t = np.where(is_forward, float(forward_s), float(backward_s))
    else:
        t = np.empty((width, pp))
        t[f_pos, stage], t[b_pos, stage] = fwd, bwd
        t = t[shared:]
    # the input is the op above (forward) or below (backward): source 0, but for stage 0's forwards and the last
    # stage's backwards, which have none
    chained = source[shared:] == 0
    chained[:, 0] &= ~is_forward[:, 0]
    chained[:, -1] &= is_forward[:, -1]
    down_add, down_back = _chain_offsets(t, ~(is_forward & chained), above)
    up_add, up_back = _chain_offsets(t[:, ::-1], ~(~is_forward & chained)[:, ::-1], above)
    # Both running maxima in one: the stages down, then the stages up, the second half raised by (pp + 1) above
    # (a chain number past every one of the first half's), so no maximum carries from the first half into it.
    lift = (pp + 1) * above
    add = np.concatenate((down_add, up_add + lift), axis=1)
    back = np.concatenate((down_back, up_back - lift), axis=1)
    both = np.concatenate((np.arange(pp), np.arange(pp)[::-1]))  # a row's stages, down then up
    pick = np.where(is_forward, np.arange(pp), 2 * pp - 1 - np.arange(pp))  # each op's end: its chain's
    ends = np.zeros((width + 1, pp))
    if shared:
        ends[1 : shared + 1] = known[1][1 : shared + 1]
    if stop is not None:  # rest[p]: each stage's durations after position p (row p of the reversed sums, shifted)
        rest = np.zeros((width - shared + 1, pp))
        np.cumsum(t[::-1], axis=0, out=rest[-2::-1])
        rest = rest[1:]
    flat, acc, rows = ends.ravel(), np.maximum.accumulate, list(ends)  # the rows' views made in one go
    for r, (before, after, src, a, b, taken) in enumerate(
        zip(rows[shared:width], rows[shared + 1 :], source[shared:], add, back, pick)
    ):
        x = np.maximum(before, flat.take(src)).take(both)
        x += a
        acc(x, out=x)
        x += b
        x.take(taken, out=after)
        if stop is not None and r % STOP_EVERY == 0 and (after + rest[r]).max() >= stop:
            return None
    return ends


STOP_EVERY = 8
"""How often (in positions) :func:`_stream_ends` checks its ``stop``: a check costs about a third of a position's
work, and stopping a few positions late changes nothing of the answer."""


def _chain_offsets(t: np.ndarray, starts: np.ndarray, above: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row, what a chain's running maximum adds before it (``chain number x above - S_{j-1}``) and after
    it (``S_k - chain number x above``), the chains starting where ``starts`` (:func:`stream_span`)."""
    s = np.cumsum(t, axis=1)
    chain = np.cumsum(starts, axis=1) * above
    return chain - (s - t), s - chain


def bubble_slots(pp: int, window: int, microbatch_tasks: Sequence[Collection[int]] | None = None) -> float:
    """Bubble of one step in slots of the largest stage time: ``((pp - 1) + (W - 1) min(stall, pp - 1)) / W``
    (a step that would stall more than a drain costs is run after a drain: :func:`flushed_steps`).

    Without the step's micro-batches the stall is taken as 0: the steady state of a step whose
    tasks each have ``pp - 1`` micro-batches of other tasks around them.
    """
    if pp <= 1:
        return 0.0
    if window < 1:
        raise ValueError(f"a pipeline window is at least one step, got {window}")
    stall = stall_slots(pp, microbatch_tasks, cap=pp - 1) if microbatch_tasks is not None else 0.0
    return ((pp - 1) + (window - 1) * stall) / window


@dataclass(frozen=True)
class TimedOp:
    """One op of a stage on the timeline, seconds from the window's start."""

    stage: int
    kind: str
    index: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every stage's ops of one window, placed by their dependencies (see :func:`timeline`)."""

    pp: int
    ops: tuple[TimedOp, ...]

    @property
    def span(self) -> float:
        """From the first op's start to the last op's end."""
        return max(o.end for o in self.ops) - min(o.start for o in self.ops) if self.ops else 0.0

    def busy(self, lo: float = float("-inf"), hi: float = float("inf")) -> float:
        """Stage-seconds of work inside ``[lo, hi]``, summed over stages."""
        return sum(max(0.0, min(o.end, hi) - max(o.start, lo)) for o in self.ops)

    def bubble(self) -> float:
        """Idle fraction of ``pp`` stages over the span: ``1 - busy / (pp span)``."""
        return 1.0 - self.busy() / (self.pp * self.span) if self.span else 0.0

    def steady_bubble(self) -> float:
        """Idle fraction between the fill and the drain: from the last stage's first op to stage 0's
        last forward (before it, stages wait to be filled; after it, they empty)."""
        lo = min(o.start for o in self.ops if o.stage == self.pp - 1)
        hi = max(o.end for o in self.ops if o.stage == 0 and o.kind == FORWARD)
        if hi <= lo:
            return 0.0
        return 1.0 - self.busy(lo, hi) / (self.pp * (hi - lo))


def timeline(
    pp: int,
    stream: Sequence[StreamMicroBatch],
    forward_s: Sequence[Sequence[float]],
    backward_s: Sequence[Sequence[float]],
    update_s: float = 0.0,
    *,
    drain_stalls: bool = True,
) -> Timeline:
    """Replays the window on ``pp`` stages with op durations ``forward_s[k][i]``, ``backward_s[k][i]``.

    Each stage runs :func:`stream_order` in order; an op starts when its stage is free and its
    inputs exist: forward ``i`` on stage ``k`` after forward ``i`` on ``k - 1``; backward ``i`` after
    backward ``i`` on ``k + 1`` (on the last stage after its own forward); a forward of a later step
    also after the updates it needs (module doc), ``U(u, s)`` ending ``update_s`` after the last
    backward of step ``s`` holding ``u`` on any stage, in the global ``(s, u)`` order. Raises
    ValueError if the orders deadlock (they never should: this is also the property tests' check).
    """
    n = len(stream)
    orders = [stream_order(pp, k, stream, drain_stalls=drain_stalls) for k in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    placed: list[TimedOp] = []
    free = [0.0] * pp
    cursor = [0] * pp
    # The updates of the window, in their global order, and which micro-batches each waits for.
    keys = sorted({(mb.step, u) for mb in stream for u in mb.tasks})
    holders = {key: [i for i, mb in enumerate(stream) if mb.step == key[0] and key[1] in mb.tasks] for key in keys}
    update_end: dict[tuple[int, int], float] = {}
    position = {key: j for j, key in enumerate(keys)}

    def updates_ready_at(i: int) -> float | None:
        """When every update forward ``i`` needs has ended (None: one of them cannot end yet)."""
        mb = stream[i]
        top = max(mb.tasks) if mb.tasks else -1
        needed = keys[: bisect.bisect_right(keys, (mb.step - 1, top))]
        needed = [key for key in needed if key[0] < mb.step and (key[0] < mb.step - 1 or key[1] <= top)]
        last = 0.0
        for key in needed:
            if key not in update_end:
                ends = [done.get((BACKWARD, 0, m)) for m in holders[key]]
                if any(e is None for e in ends):
                    return None
                before = update_end[keys[position[key] - 1]] if position[key] else 0.0
                update_end[key] = max(before, max(ends, default=0.0)) + update_s
            last = max(last, update_end[key])
        return last

    progressed = True
    while progressed:
        progressed = False
        for k in range(pp):
            while cursor[k] < len(orders[k]):
                kind, i = orders[k][cursor[k]]
                if kind == FORWARD:
                    ready = updates_ready_at(i)
                    inputs = done.get((FORWARD, k - 1, i)) if k > 0 else 0.0
                else:
                    ready = 0.0
                    inputs = done.get((BACKWARD, k + 1, i)) if k < pp - 1 else done.get((FORWARD, k, i))
                if ready is None or inputs is None:
                    break
                start = max(free[k], ready, inputs)
                end = start + (forward_s if kind == FORWARD else backward_s)[k][i]
                done[(kind, k, i)] = free[k] = end
                placed.append(TimedOp(k, kind, i, start, end))
                cursor[k] += 1
                progressed = True
    if len(placed) != 2 * pp * n:
        raise ValueError(f"the stage orders deadlock after {len(placed)} of {2 * pp * n} ops")
    return Timeline(pp, tuple(placed))
