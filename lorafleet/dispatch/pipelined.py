"""A pipelined replica's packed micro-batches: as even as M allows, and as many as its step wants.

Under 1F1B a replica of ``pp`` stages running micro-batches of stage times τ_1..τ_K takes
(``CostModel.replica_time``)

    T = Σ_k τ_k + B max_k τ_k + o,      B = pp - 1 drained, down to (pp - 1) / W streamed in a window of W

so the largest micro-batch is paid B more times. First-fit decreasing (:mod:`.microbatch`, what a replica of one
stage gets: its time is a sum, and the fewest micro-batches pay the fewest constants) fills the first micro-batches
to M and leaves a remainder last: B times a full micro-batch where an even split would pay B times the mean.

**Balance.** A packed micro-batch of sequences l_1..l_n costs τ = β(max l) + Σ_q α(l_q) on a stage, LobRA's
t(b, s) = α(s) b + β(s) per row (``time_model``): α(l) = c1 l² ρ(l) + c3 l + c5 a sequence's own work, β(l) =
c2 l² + c4 l + c6 the micro-batch's, read at its longest. :func:`balanced_bins` deals the sequences longest first,
each to the micro-batch of least τ so far that has room for it (M tokens): longest processing time first, K
micro-batches opened by the K longest, so each opens with its longest and pays its β once. One that fits none
opens another. Balanced in stage time, not tokens: the bubble pays the largest τ, and attention makes a long
sequence dearer than its tokens (a 16,384-token one: about a fifth more on a 70B stage).

**Count.** Each micro-batch added costs its constant c6 once more and takes work off the largest, so with the
replica's work A (its stage times less their constants) split evenly over K micro-batches,

    T(K) ≈ K c6 + A + B (c6 + A / K),   least at   K* = sqrt(B A / c6)

unless a micro-batch would drop below the longest sequence alone, past which more micro-batches only add constants
(:func:`best_count`, with B = pp - 1: a drain; a window's smaller stall is left to the pricing). First-fit
decreasing's micro-batches give A, and the closed form's saving over them decides whether a balanced packing is
built at all (:data:`MIN_GAIN`). Where it is, :func:`pipelined_packing` balances into K and K + 1 micro-batches
(whole sequences never split evenly: the real largest is above S / K, and one more micro-batch lowers it), keeps
the one ``CostModel.replica_time`` prices less drained (B = pp - 1, as the closed form: a window's stall costs a
timeline for every new order), and keeps it over first-fit decreasing's only if it is priced less with the real
stall of each order in the window (the fewer, then first-fit decreasing, on a tie): a pipelined replica's
step is never priced above first-fit decreasing's. The count is at least first-fit decreasing's (its micro-batches
hold at most M tokens each) and at most the sequences; one that balancing cannot hold in K opens another.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.schedule import TaskRanges
from lorafleet.dispatch.microbatch import decreasing, first_fit, microbatches_of_bins, packed_with_tasks
from lorafleet.plans import MicroBatch
from lorafleet.work import memo as work_memo


def balanced_bins(needs: list[int], own: list[float], opening: list[float], k: int, max_tokens: int) -> np.ndarray:
    """Longest processing time first into ``k`` micro-batches of at most ``max_tokens``: sequence q (``needs``
    descending, tokens) goes to the micro-batch of least stage time among those with room for it, which then grows
    by ``own[q]`` (α), plus ``opening[q]`` (β) when q opens it. A sequence that fits none opens another. Each
    sequence's micro-batch, numbered in opening order."""
    smallest = needs[-1]
    room: list[int] = []
    heap: list[tuple[float, int]] = [(0.0, b) for b in range(k)]  # (stage time so far, micro-batch)
    bin_of: list[int] = []
    for need, a, b0 in zip(needs, own, opening, strict=True):
        full = []  # the least loaded ones without room for this sequence: back in after it
        while heap and heap[0][1] < len(room) and room[heap[0][1]] < need:
            full.append(heapq.heappop(heap))
        if heap:
            load, b = heapq.heappop(heap)
        else:
            load, b = 0.0, len(room)
        if b == len(room):  # an empty one: this sequence is its longest
            room.append(max_tokens)
            load = b0
        room[b] -= need
        bin_of.append(b)
        if room[b] >= smallest:  # one that cannot take the shortest sequence leaves for good
            heapq.heappush(heap, (load + a, b))
        for entry in full:
            if room[entry[1]] >= smallest:
                heapq.heappush(heap, entry)
    return np.asarray(bin_of, dtype=np.int64)


ONE_TWO = np.array([[1], [2]])
"""b = 1 and b = 2 as a column: t(1, s) and t(2, s) of many lengths s in one broadcast call of the time model."""


def one_two_times(cost_model: CostModel, config: ParallelConfig, lengths: np.ndarray, key: bytes) -> np.ndarray | None:
    """(2, n): t(1, l) and t(2, l) on a stage of ``config`` of every length of a batch (``key``: its lengths as
    bytes), what :func:`pipelined_packing` reads of each sequence (its alpha and beta). A function of the stage's
    coefficients and the lengths alone, which a plan asks for again (the replicas of a config on its expected batch,
    deployment after deployment; on a sampled batch, finalist after finalist): a counted scope keeps them in its memo,
    the latest batch's only (a plan judges one batch at a time, and a config's are 16 bytes a sequence: service-128
    held 31 MB of every batch's). None outside a scope (a step's dispatch: each replica's sequences timed alone)."""
    memo = work_memo("one-two times")
    if memo is None:
        return None
    batch = (lengths.dtype.str, key)
    if memo.get("batch") != batch:
        memo.clear()
        memo["batch"], memo["times"] = batch, {}
    stage = cost_model.stage_coeffs(config)
    times = memo["times"]
    if stage not in times:
        times[stage] = stage(ONE_TWO, lengths)
    return times[stage]


MIN_GAIN = 0.01
"""A balanced packing is built and priced only where the closed form expects it to save this share of the replica's
step over first-fit decreasing (module docstring): below it the stall and the packing's whole sequences decide more
than the closed form can tell, and a deep pipeline's replica with hundreds of full micro-batches is left as it is."""


def best_count(times: np.ndarray, constant: float, longest: float, bubble: float, n: int) -> tuple[int, float]:
    """The micro-batch count the closed form prefers for ``n`` sequences that first-fit decreasing packs into
    micro-batches of stage times ``times`` (ms), and the share of first-fit decreasing's step ``Σ times + B max
    times`` it saves. With ``S(K) = Σ times + (K - k_min) c6`` (each added micro-batch one more ``constant`` c6) and
    an even split,

        T(K) = S(K) + B max(S(K) / K, longest),    least where S(K) / K meets ``longest`` (the longest sequence
                                                   alone) or at K* = sqrt(B (Σ times - k_min c6) / c6)

    (``bubble`` B), among the whole numbers on either side of both, in [k_min, n]; the fewest on a tie."""
    k_min = times.size
    work = float(times.sum()) - k_min * constant  # what no count changes

    def step(k: int) -> float:
        total = work + k * constant
        return total + bubble * max(total / k, longest)

    star = math.sqrt(bubble * work / constant) if constant > 0 else float(n)
    meet = work / (longest - constant) if longest > constant else float(n)
    near = {k_min} | {min(max(k, k_min), n) for x in (star, meet) for k in (math.floor(x), math.ceil(x))}
    k = min(sorted(near), key=step)
    return k, 1.0 - step(k) / (float(times.sum()) + bubble * float(times.max()))


def pipelined_packing(
    seq_ids: np.ndarray,
    lengths: np.ndarray,
    task_ids: np.ndarray,
    max_tokens: int,
    cost_model: CostModel,
    config: ParallelConfig,
    window: int = 1,
    *,
    task_major: bool = False,
    one_two: np.ndarray | None = None,
) -> tuple[list[MicroBatch], TaskRanges, float]:
    """The micro-batches of a replica of ``config`` (pp > 1) holding ``seq_ids``, packed to at most ``max_tokens``:
    first-fit decreasing's, or, where the closed form expects a balanced packing into :func:`best_count`'s K
    micro-batches to save :data:`MIN_GAIN`, the balanced packing into K or K + 1 that ``cost_model.replica_time``
    prices below it in a pipeline window of ``window`` steps (module docstring); as
    ``microbatch.packed_with_tasks`` returns them (rows by task, 1F1B or ``task_major`` order), with their tasks and
    that price, seconds (``replica_time`` in the window: the caller need not price them again). ``one_two``: t(1, l)
    and t(2, l) on a stage of ``config`` of every length of ``lengths`` (:func:`one_two_times`), when the caller has
    them; each of these sequences' own otherwise (the same times: the time model is elementwise in l)."""

    def priced(packing: tuple[list[MicroBatch], TaskRanges]) -> tuple[list[MicroBatch], TaskRanges, float]:
        return *packing, cost_model.replica_time(config, *packing, window)

    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    if seq_ids.size < 2:  # one micro-batch at most: nothing to balance
        return priced(packed_with_tasks(seq_ids, lengths, task_ids, max_tokens, task_major=task_major))
    order = decreasing(seq_ids, lengths, task_ids)
    needs = lengths[order]
    bins = first_fit(needs, max_tokens)
    first = microbatches_of_bins(order, bins, lengths, task_ids, task_major=task_major)
    stage = cost_model.stage_coeffs(config)
    one, two = stage(ONE_TWO, needs) if one_two is None else one_two[:, order]  # t(1, s), t(2, s) of each sequence
    own, opening = two - one, 2 * one - two  # α, β of each sequence (LobRA's t(b, s) = α b + β)
    # each micro-batch's longest sequence, the first placed there: micro-batches are numbered in opening order,
    # so micro-batch b opens where the running maximum of the numbers first reaches b
    reached = np.maximum.accumulate(bins)
    opened = reached.searchsorted(np.arange(int(reached[-1]) + 1))
    times = np.bincount(bins, weights=own) + opening[opened]
    k, saving = best_count(times, stage.c[5], float(own[0] + opening[0]), config.pp - 1.0, needs.size)
    if saving < MIN_GAIN:
        return priced(first)
    # K and K + 1 (the real largest is above the even split) compared drained, B = pp - 1 as the closed form
    # (a window's stall costs a timeline per new order); the better against first-fit decreasing in the window,
    # where a window of one step is the drain (its stall is never charged): its drained price is that price
    drained = []
    dealt = needs.tolist(), own.tolist(), opening.tolist()  # balanced_bins walks them in Python, for K and K + 1
    for count in range(k, min(k + 1, needs.size) + 1):
        bins = balanced_bins(*dealt, count, max_tokens)
        packing = microbatches_of_bins(order, bins, lengths, task_ids, task_major=task_major)
        drained.append((*packing, cost_model.replica_time(config, packing[0])))
    packed = min(drained, key=lambda p: p[2])
    if window > 1:
        packed = priced(packed[:2])
    ffd = priced(first)
    return packed if packed[2] < ffd[2] else ffd
