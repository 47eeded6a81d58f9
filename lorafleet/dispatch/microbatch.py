"""One replica's sequences cut into micro-batches of at most M tokens, rows contiguous by task.

Padding mode (LobRA): bucket by bucket, every row padded to the boundary s, at most
b = floor(M / s) rows a micro-batch. Each task's sequences first fill single-task
micro-batches of b rows; the remainders of all tasks at the same s are then concatenated
(task by task) and cut into b-row micro-batches, so a bucket of n rows always gives
ceil(n / b) micro-batches, the count the load model charges.

Packing mode: sequences are packed end to end, first-fit decreasing by length, into
micro-batches of at most M tokens; each keeps its sequences' own lengths
(``padded_len=None``) so the executor builds cu_seqlens/position_ids and attention never
crosses a sequence.

Either way rows are sorted by task inside a micro-batch (``MicroBatch.segments`` gives the
per-task row ranges of the multi-adapter operator), and micro-batches are ordered for
1F1B: largest first, descending by (rows * padded length, padded length) - by (tokens,
longest row) when packed - so the warm-up and cool-down pay for the largest stage time once.

With a pipeline window of W > 1 steps (the policy's ``pipeline_window``, ``costmodel.schedule``)
they are ordered *task-major* instead (``task_major=True``): by the largest task id a
micro-batch holds, ascending, then largest first within that. A window streams the next
step's forwards while this step's last backwards run, and a forward holding tasks T may start
once every task u <= max T has had its update of the step before; updates run in one global
task order, each as soon as the task's last backward is done on every replica. So every
replica, pipelined or not (pp = 1 too), finishes its tasks in that same order: task 0's last
micro-batch as early as possible everywhere, so its update, and the next step's forwards that
wait for it, can start while the later tasks still run. Largest-first order would put a task's
last micro-batch anywhere in the step and make the next step wait for nearly all of it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from heapq import heapify, heappop, heappush
from itertools import groupby
from operator import itemgetter

import numpy as np

from lorafleet.costmodel.schedule import TaskRanges
from lorafleet.costmodel.time_model import LaidOutShapes
from lorafleet.dispatch.sorting import lexsort_ints
from lorafleet.plans import MicroBatch

_Row = tuple[int, int, int, int]
"""(padded length or micro-batch index, task, position in the batch, length): one sequence, as sorted."""


def _microbatch(rows: list[_Row], padded_len: int | None) -> MicroBatch:
    """A micro-batch of ``rows``, which are already sorted by (task, position)."""
    return MicroBatch(tuple(r[2] for r in rows), tuple(r[1] for r in rows), tuple(r[3] for r in rows), padded_len)


def _sorted_rows(key: np.ndarray, seq_ids: np.ndarray, lengths: np.ndarray, task_ids: np.ndarray) -> list[_Row]:
    """The sequences as rows sorted by (key, task, position); plain Python from here: the groups are small."""
    order = np.lexsort((seq_ids, task_ids[seq_ids], key))
    ids = seq_ids[order]
    return list(zip(key[order].tolist(), task_ids[ids].tolist(), ids.tolist(), lengths[ids].tolist(), strict=True))


def padded_microbatches(
    seq_ids: np.ndarray,
    lengths: np.ndarray,
    task_ids: np.ndarray,
    padded_len: np.ndarray,
    max_tokens: int,
    *,
    task_major: bool = False,
) -> list[MicroBatch]:
    """LobRA's micro-batches of one replica; ``padded_len[q]`` is sequence q's bucket boundary (<= M).
    Ordered by :func:`order_for_1f1b` (``task_major``: for a pipeline window, module docstring)."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    out = []
    for s, in_bucket in groupby(_sorted_rows(padded_len[seq_ids], seq_ids, lengths, task_ids), key=itemgetter(0)):
        b = max_tokens // s
        leftovers: list[_Row] = []
        for _, of_task in groupby(in_bucket, key=itemgetter(1)):
            of_task = list(of_task)
            n_full = len(of_task) // b * b
            out.extend(_microbatch(of_task[k : k + b], s) for k in range(0, n_full, b))
            leftovers.extend(of_task[n_full:])  # stays sorted by (task, position)
        out.extend(_microbatch(leftovers[k : k + b], s) for k in range(0, len(leftovers), b))
    return order_for_1f1b(out, task_major=task_major)


def packed_microbatches(
    seq_ids: np.ndarray, lengths: np.ndarray, task_ids: np.ndarray, max_tokens: int, *, task_major: bool = False
) -> list[MicroBatch]:
    """First-fit decreasing packing of one replica's sequences into micro-batches of <= M tokens.
    Ordered by :func:`order_for_1f1b`'s keys (``task_major``: for a pipeline window, module docstring)."""
    return packed_with_tasks(seq_ids, lengths, task_ids, max_tokens, task_major=task_major)[0]


def packed_with_tasks(
    seq_ids: np.ndarray, lengths: np.ndarray, task_ids: np.ndarray, max_tokens: int, *, task_major: bool = False
) -> tuple[list[MicroBatch], TaskRanges]:
    """:func:`packed_microbatches`, and their task ids with each one's least and largest as arrays (the first and
    the last row's: rows are sorted by task), which is what pricing their stall reads (``schedule.TaskRanges``)."""
    seq_ids = np.asarray(seq_ids, dtype=np.int64)
    if seq_ids.size == 0:
        return [], TaskRanges((), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    order = decreasing(seq_ids, lengths, task_ids)
    return microbatches_of_bins(order, first_fit(lengths[order], max_tokens), lengths, task_ids, task_major=task_major)


def decreasing(seq_ids: np.ndarray, lengths: np.ndarray, task_ids: np.ndarray) -> np.ndarray:
    """``seq_ids`` by decreasing length, ties by (task, position): the order the packers place them in."""
    return seq_ids[lexsort_ints((seq_ids, task_ids[seq_ids], -lengths[seq_ids]))]


def first_fit(needs: np.ndarray, max_tokens: int) -> np.ndarray:
    """Each of ``needs`` (tokens, descending)'s micro-batch by first fit into ``max_tokens``: the first micro-batch
    opened that has room for it, or a new one; numbered in opening order.

    The needs come in descending order, so a micro-batch with room for the need now has room for every later one,
    and one without may have room again later, once the need is down to its room. Two heaps keep them apart: the
    micro-batches with room for the need now, by opening order (first fit's is the least), and those waiting, by
    room (largest first), which join the first as the need comes down to their room. A sequence is then a look at
    both heaps' tops, and at most one move between them a placement (the micro-batch it fills below the need), in
    C (``heapq``), where a scan or a bisection and a rewrite of prefix maxima walked ~12 micro-batches a sequence
    in Python on a service-scale replica (0.49x of that on 6 service-sweeps steps' inputs, the same micro-batches).
    A micro-batch that cannot take the shortest sequence any more waits for nothing: it leaves both.

    The sequences longer than half a micro-batch come first and each opens its own (one cannot join a micro-batch
    holding another, at least as long), so they are placed at once (a quarter of a service-scale step's)."""
    needs = needs.tolist()
    smallest = needs[-1] if needs else 0
    opened = bisect_left([-2 * need for need in needs], -max_tokens)  # micro-batches open: those with 2 need > M
    room = [max_tokens - need for need in needs[:opened]]  # free tokens of every micro-batch, in opening order
    waiting = [(-left, b) for b, left in enumerate(room) if left >= smallest]  # less room than the need: by room
    heapify(waiting)
    fits: list[int] = []  # the micro-batches with room for the need now, by opening order
    bin_of = list(range(opened))
    place = bin_of.append
    for need in needs[opened:]:
        while waiting and -waiting[0][0] >= need:
            heappush(fits, heappop(waiting)[1])
        if fits:
            b = fits[0]
            left = room[b] - need
            room[b] = left
            place(b)
            if left < need:  # no room for this need again: it waits for a shorter one, or leaves
                heappop(fits)
                if left >= smallest:
                    heappush(waiting, (-left, b))
        else:
            left = max_tokens - need
            room.append(left)
            place(opened)
            if left >= need:
                heappush(fits, opened)
            elif left >= smallest:
                heappush(waiting, (-left, opened))
            opened += 1
    return np.asarray(bin_of, dtype=np.int64)


def microbatches_of_bins(
    order: np.ndarray, bins: np.ndarray, lengths: np.ndarray, task_ids: np.ndarray, *, task_major: bool = False
) -> tuple[list[MicroBatch], TaskRanges]:
    """The micro-batches of sequences ``order`` placed in ``bins`` (each one's micro-batch, numbered in opening
    order), as :func:`packed_with_tasks` returns them: rows by (task, position), in 1F1B order; a
    ``time_model.LaidOutShapes``, their rows' lengths along for the pricing."""
    # each micro-batch's rows by (task, position); then the micro-batches in 1F1B order (order_for_1f1b's
    # keys, over arrays: largest first, or by largest task first when task_major; ties in opening order)
    rows = lexsort_ints((order, task_ids[order], bins))
    ids, bins = order[rows], bins[rows]
    change = np.empty(bins.size, dtype=bool)  # where a micro-batch's rows start (array calls: np.r_ is Python)
    change[0] = True
    np.not_equal(bins[1:], bins[:-1], out=change[1:])
    starts = change.nonzero()[0]
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = ids.size
    held, held_tasks = lengths[ids], task_ids[ids]
    tops = held_tasks[ends - 1]
    keys = (np.arange(starts.size), -np.maximum.reduceat(held, starts), -np.add.reduceat(held, starts))
    if task_major:
        keys += (tops,)
    seqs, tasks, lens = tuple(ids.tolist()), tuple(held_tasks.tolist()), tuple(held.tolist())  # shared by all
    first = np.lexsort(keys)
    at, sizes = starts[first], (ends - starts)[first]
    # the rows in the micro-batches' order, what pricing them reads (time_model.LaidOutShapes): micro-batch j's
    # are at[j] onwards, from the sum of the sizes before it on
    laid_out = np.repeat(at - (np.cumsum(sizes) - sizes), sizes) + np.arange(ids.size)
    # each one rows a:b of the shared tuples (one object, not four); positional: keywords cost a third more
    mbs = LaidOutShapes(
        [MicroBatch(seqs, tasks, lens, None, a, b) for a, b in zip(at.tolist(), ends[first].tolist(), strict=True)],
        held[laid_out].astype(float),
        sizes,
    )
    return mbs, TaskRanges(TasksOf(mbs), held_tasks[at], tops[first])


class TasksOf(Sequence[tuple[int, ...]]):
    """The task ids of each of ``mbs``, read when asked: the stall reads their least and largest only
    (``schedule.TaskRanges``), so nothing is built for the thousands of micro-batches of a step."""

    __slots__ = ("mbs",)

    def __init__(self, mbs: Sequence[MicroBatch]) -> None:
        self.mbs = mbs

    def __len__(self) -> int:
        return len(self.mbs)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [mb.task_ids for mb in self.mbs[index]]
        return self.mbs[index].task_ids


def order_for_1f1b(microbatches: list[MicroBatch], *, task_major: bool = False) -> list[MicroBatch]:
    """Descending by (tokens, longest row): LobRA's (b * s, s) order for padded micro-batches. Stable.

    ``task_major``: ascending by the largest task id a micro-batch holds first, then as above (the
    order a pipeline window needs, module docstring)."""
    if task_major:
        return sorted(microbatches, key=lambda mb: (max(mb.task_ids), -mb.tokens, -(mb.padded_len or max(mb.lengths))))
    return sorted(microbatches, key=lambda mb: (-mb.tokens, -(mb.padded_len or max(mb.lengths))))
