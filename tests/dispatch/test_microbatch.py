"""Micro-batches: LobRA's padded cut with merged remainders, first-fit packing, task segments, 1F1B order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lorafleet.dispatch.microbatch import order_for_1f1b, packed_microbatches, padded_microbatches


def test_padded_full_single_task_batches_then_merged_remainders():
    # bucket 512 with M = 2048: b = 4 rows; task 0 has 5 sequences, task 1 has 4, task 2 has 2
    task_ids = np.array([0] * 5 + [1] * 4 + [2] * 2)
    lengths = np.array([500, 400, 300, 200, 100, 510, 410, 310, 210, 50, 60])
    padded = np.full(task_ids.size, 512)
    mbs = padded_microbatches(np.arange(task_ids.size), lengths, task_ids, padded, max_tokens=2048)
    assert [mb.task_ids for mb in mbs] == [(0, 0, 0, 0), (1, 1, 1, 1), (0, 2, 2)]
    assert [mb.segments for mb in mbs][2] == ((0, 0, 1), (2, 1, 2))
    assert all(mb.padded_len == 512 and mb.tokens <= 2048 for mb in mbs)


def test_padded_batch_count_is_ceil_per_bucket_and_order_is_1f1b():
    rng = np.random.default_rng(0)
    n = 200
    padded = rng.choice([256, 1024, 2048], n)
    lengths = padded - rng.integers(0, 200, n)
    task_ids = rng.integers(0, 5, n)
    mbs = padded_microbatches(np.arange(n), lengths, task_ids, padded, max_tokens=4096)
    for s in (256, 1024, 2048):
        rows = int((padded == s).sum())
        assert sum(mb.padded_len == s for mb in mbs) == -(-rows // (4096 // s))
    keys = [(mb.tokens, mb.padded_len) for mb in mbs]
    assert keys == sorted(keys, reverse=True)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=60),
    max_tokens=st.sampled_from([4096, 8192]),
    data=st.data(),
)
def test_packing_keeps_every_sequence_whole_within_m(lengths, max_tokens, data):
    lengths = np.array(lengths)
    task_ids = np.array(data.draw(st.lists(st.integers(0, 3), min_size=lengths.size, max_size=lengths.size)))
    mbs = packed_microbatches(np.arange(lengths.size), lengths, task_ids, max_tokens)
    assert sorted(q for mb in mbs for q in mb.seq_ids) == list(range(lengths.size))
    for mb in mbs:
        assert mb.padded_len is None and mb.padding_tokens == 0 and mb.tokens <= max_tokens
        assert list(mb.task_ids) == sorted(mb.task_ids)  # one segment per task
        assert list(mb.lengths) == lengths[list(mb.seq_ids)].tolist()
    # first-fit decreasing needs fewer than 2 * optimal bins; the token bound is a lower bound on optimal
    assert len(mbs) <= 2 * -(-int(lengths.sum()) // max_tokens) + 1


def test_order_for_1f1b_is_stable():
    task_ids = np.zeros(4, dtype=np.int64)
    mbs = packed_microbatches(np.arange(4), np.array([100, 100, 3000, 900]), task_ids, max_tokens=3100)
    # first fit by decreasing length: 3000 | 900 | 100 joins 3000 | 100 joins 900; rows back in batch order
    assert [mb.seq_ids for mb in mbs] == [(0, 2), (1, 3)]
    assert [mb.tokens for mb in mbs] == [3100, 1000]
    assert order_for_1f1b(mbs) == mbs


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 2048), min_size=1, max_size=60),
    packed=st.booleans(),
    data=st.data(),
)
def test_task_major_order_finishes_tasks_in_order(lengths, packed, data):
    """For a pipeline window: ascending by the largest task a micro-batch holds, largest first within it;
    the same micro-batches as the 1F1B order, only reordered."""
    lengths = np.array(lengths)
    task_ids = np.array(data.draw(st.lists(st.integers(0, 4), min_size=lengths.size, max_size=lengths.size)))
    ids = np.arange(lengths.size)
    padded = np.where(lengths <= 512, 512, 2048)
    if packed:
        plain = packed_microbatches(ids, lengths, task_ids, 4096)
        major = packed_microbatches(ids, lengths, task_ids, 4096, task_major=True)
    else:
        plain = padded_microbatches(ids, lengths, task_ids, padded, 4096)
        major = padded_microbatches(ids, lengths, task_ids, padded, 4096, task_major=True)
    assert sorted(mb.seq_ids for mb in major) == sorted(mb.seq_ids for mb in plain)
    keys = [(max(mb.task_ids), -mb.tokens, -(mb.padded_len or max(mb.lengths))) for mb in major]
    assert keys == sorted(keys)


def scanned_first_fit(needs: list[int], max_tokens: int) -> list[int]:
    """First fit by its definition: each need to the first micro-batch opened with room for it, else a new one."""
    rooms: list[int] = []
    out = []
    for need in needs:
        b = next((b for b, room in enumerate(rooms) if room >= need), len(rooms))
        if b == len(rooms):
            rooms.append(max_tokens)
        rooms[b] -= need
        out.append(b)
    return out


def test_first_fit_keeps_micro_batches_apart_by_room_and_fills_them_as_the_scan():
    """A deep pipeline's replica at service scale packs thousands of sequences into hundreds of micro-batches:
    ``first_fit``'s two heaps (room for the need now, or waiting for a shorter one) give the scan's micro-batches,
    sequence for sequence, also where most micro-batches leave (the shortest sequence long: rooms below it), where
    they fill to the token, and over runs of equal lengths (a service-scale replica has ~9 sequences a length)."""
    from lorafleet.dispatch.microbatch import first_fit

    rng = np.random.default_rng(0)
    for i in range(200):
        max_tokens = int(rng.integers(64, 4096))
        floor = (1, 1, max_tokens // 9, max_tokens // 3)[i % 4]
        n = int(rng.integers(1, 1500 if floor == 1 else 300))
        needs = sorted(rng.integers(floor, max_tokens + 1, n).tolist(), reverse=True)
        assert first_fit(np.array(needs), max_tokens).tolist() == scanned_first_fit(needs, max_tokens)
    for divisor in (2, 3, 4, 7):  # equal sequences that fill a micro-batch exactly, and a remainder
        needs = [1024 // divisor] * 500 + [5] * 30
        assert first_fit(np.array(needs), 1024).tolist() == scanned_first_fit(needs, 1024)
    for _ in range(100):  # runs of equal lengths
        max_tokens = int(rng.integers(64, 3000))
        needs = sorted(rng.choice(rng.integers(1, max_tokens + 1, 40), 1200).tolist(), reverse=True)
        assert first_fit(np.array(needs), max_tokens).tolist() == scanned_first_fit(needs, max_tokens)
    lengths = rng.integers(1, 1100, 2000)
    mbs = packed_microbatches(np.arange(2000), lengths, rng.integers(0, 50, 2000), 1115)
    assert (
        sorted(s for mb in mbs for s in mb.seq_ids) == list(range(2000)) and max(sum(mb.lengths) for mb in mbs) <= 1115
    )


def test_packed_micro_batches_carry_their_task_ranges_and_read_as_their_shapes():
    """``packed_with_tasks`` hands the stall each micro-batch's least and largest task as arrays: the stall and
    the dependencies they give are those of the task tuples themselves; and a micro-batch prices as its shape."""
    from lorafleet.costmodel.schedule import second_step_dependencies, stall_slots
    from lorafleet.costmodel.time_model import features_of
    from lorafleet.dispatch.microbatch import packed_with_tasks

    rng = np.random.default_rng(3)
    for task_major in (False, True):
        lengths, task_ids = rng.integers(1, 900, 600), rng.integers(0, 12, 600)
        mbs, ranges = packed_with_tasks(np.arange(600), lengths, task_ids, 1024, task_major=task_major)
        assert mbs == packed_microbatches(np.arange(600), lengths, task_ids, 1024, task_major=task_major)
        tasks = [mb.task_ids for mb in mbs]
        assert list(ranges) == tasks
        assert ranges.lows.tolist() == [min(t) for t in tasks] and ranges.tops.tolist() == [max(t) for t in tasks]
        assert np.array_equal(second_step_dependencies(ranges), second_step_dependencies(tasks))
        assert all(stall_slots(pp, ranges) == stall_slots(pp, tasks) for pp in (2, 5, 9))
        assert np.array_equal(features_of(mbs), features_of([mb.shape for mb in mbs]))


def test_packed_micro_batches_are_views_of_one_set_of_rows():
    """A packer's micro-batches are one object each, rows ``start:stop`` of tuples the replica's share (not three
    tuples each: every object a step keeps brings the next garbage collection nearer), and each still equals,
    hashes, pickles and ``dataclasses.replace``-s as the standalone micro-batch of its own rows."""
    import dataclasses
    import pickle

    from lorafleet.plans import MicroBatch

    rng = np.random.default_rng(5)
    lengths, task_ids = rng.integers(1, 900, 300), rng.integers(0, 7, 300)
    mbs = packed_microbatches(np.arange(300), lengths, task_ids, 2048)
    assert len(mbs) > 10
    assert len({id(mb._seq_ids) for mb in mbs}) == len({id(mb._task_ids) for mb in mbs}) == 1  # one set of rows
    for mb in mbs:
        alone = MicroBatch(mb.seq_ids, mb.task_ids, mb.lengths, mb.padded_len)
        assert mb == alone and hash(mb) == hash(alone) and repr(mb) == repr(alone)
        shape = (alone.n_seqs, alone.tokens, alone.lengths, alone.segments)
        assert (mb.n_seqs, mb.tokens, mb.seq_lens, mb.segments) == shape
        assert pickle.loads(pickle.dumps(mb)) == alone and len(pickle.dumps(mb)) == len(pickle.dumps(alone))
    cut = dataclasses.replace(mbs[0], lengths=mbs[0].lengths[::-1])
    assert cut.seq_ids == mbs[0].seq_ids and cut.lengths == mbs[0].lengths[::-1]
