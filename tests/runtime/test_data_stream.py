"""Task streams: deterministic, every example once per epoch, resumable from the cursors."""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.data.tokenize import IGNORE_INDEX, Example
from lorafleet.runtime.data_stream import DataStreams, apply_overflow, loss_tokens
from lorafleet.specs.workload import OverflowPolicy
from tests.helpers import fleet_harness as h


def _batches(streams: DataStreams, steps: range) -> list:
    return [streams.global_batch(s) for s in steps]


def test_same_seed_same_batches_and_another_seed_others():
    a, b, c = h.synthetic_streams(), h.synthetic_streams(), h.synthetic_streams(seed=8)
    for x, y in zip(_batches(a, range(5)), _batches(b, range(5)), strict=True):
        assert np.array_equal(x.sample_ids, y.sample_ids) and np.array_equal(x.lengths, y.lengths)
    assert not all(
        np.array_equal(x.lengths, y.lengths)
        for x, y in zip(_batches(h.synthetic_streams(), range(5)), _batches(c, range(5)), strict=True)
    )


def test_every_example_once_per_epoch():
    streams = h.synthetic_streams()
    stream = streams.streams[0]
    n = len(stream.data.examples)
    for epoch in range(3):
        assert sorted(stream.example_index(k) for k in range(epoch * n, (epoch + 1) * n)) == list(range(n))
    assert [stream.example_index(k) for k in range(n)] != [stream.example_index(k) for k in range(n, 2 * n)]


def test_batches_are_a_function_of_the_step():
    """Drawn in any order (a look-ahead, a resume), a step's batch is the same; cursors advance by it."""
    straight = _batches(h.synthetic_streams(), range(6))
    jumping = h.synthetic_streams()
    for x, y in zip(straight[::-1], _batches(jumping, range(5, -1, -1)), strict=True):
        assert np.array_equal(x.task_ids, y.task_ids) and np.array_equal(x.sample_ids, y.sample_ids)
    assert jumping.cursors(3) == [3 * b for b in h.BATCH_SIZES]
    assert straight[3].sample_ids[0] == jumping.cursors(3)[0]


def test_a_resume_on_changed_data_is_refused():
    state = h.synthetic_streams().state_dict(3)
    h.synthetic_streams().check_state(state)
    with pytest.raises(ValueError, match="the data changed"):
        h.synthetic_streams(batch_sizes=(3, 4, 3, 3)).check_state(state)


def test_a_task_leaves_after_its_batches_and_the_stream_ends():
    tasks = [s.data for s in h.synthetic_streams().streams[:2]]
    streams = DataStreams(tasks, (2, 3), seed=0, max_batches=(1, 2))
    assert np.bincount(streams.global_batch(0).task_ids).tolist() == [2, 3]
    assert set(streams.global_batch(1).task_ids.tolist()) == {1}
    assert streams.cursors(5) == [2, 6]
    with pytest.raises(StopIteration):
        streams.global_batch(2)


def _example(n_prompt: int, n_reply: int) -> Example:
    ids = tuple(range(3, 3 + n_prompt + n_reply))
    return Example(ids, (IGNORE_INDEX,) * n_prompt + ids[n_prompt:])


def test_overflow_policies_are_counted_never_silent():
    examples = [_example(2, 3), _example(4, 6), _example(9, 1)]
    cut = apply_overflow("t", examples, 8, OverflowPolicy.TRUNCATE)
    # the third is cut to 8 tokens of prompt: nothing left to learn, so it is dropped and counted
    assert [len(e) for e in cut.examples] == [5, 8] and cut.truncated_ids == {1} and cut.no_target == 1
    kept = apply_overflow("t", examples, 8, OverflowPolicy.REJECT)
    assert [len(e) for e in kept.examples] == [5] and kept.rejected == 2
    with pytest.raises(ValueError, match="no example"):
        apply_overflow("t", examples, 3, OverflowPolicy.REJECT)


def test_batches_count_truncated_sequences():
    data = apply_overflow("t", [_example(1, 10), _example(1, 3)], 6, OverflowPolicy.TRUNCATE)
    batch = DataStreams([data], (2,), seed=0).global_batch(0)
    assert batch.truncated == 1 and sorted(batch.lengths.tolist()) == [4, 6]


def test_loss_tokens_follow_the_causal_shift():
    assert loss_tokens(_example(2, 3)) == 3
    assert loss_tokens(Example((5, 6), (5, IGNORE_INDEX))) == 0  # only the first token is labelled
