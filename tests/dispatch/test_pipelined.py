"""A pipelined replica's packing: longest processing time first into K micro-batches, K from the closed form, and
never priced above first-fit decreasing (issue #43: the bubble pays the largest micro-batch pp - 1 more times)."""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.dispatch.microbatch import packed_with_tasks
from lorafleet.dispatch.pipelined import balanced_bins, best_count, one_two_times, pipelined_packing
from lorafleet.presets import lobra_7b_cost_model
from lorafleet.work import counting
from lorafleet.workload import load_workload

ONE_TASK_70B = """model: llama2-70b
quantize: nf4
cluster: {gpu: L40S, nodes: 1, gpus_per_node: 2}
tasks:
  - {name: a, batch_size: 8, context_length: 4096, lengths: {histogram: {1024: 3, 4096: 1}}}
"""


def test_one_task_on_two_l40s_splits_its_step_in_four_even_micro_batches(tmp_path):
    """The issue's case: 6 x 1,024 + 2 x 4,096 tokens on <1,2,rc> (M = 11,175). First-fit decreasing packs 10,240 and
    4,096 tokens and pays the first again as the bubble (29.07 s; padded buckets of 6,144 and 8,192: 26.88 s); the
    closed form asks for four (K* = 4.8, and no micro-batch below a 4,096-token sequence): 4,096 | 4,096 | 3,072 |
    3,072, 23.72 s."""
    path = tmp_path / "w.yaml"
    path.write_text(ONE_TASK_70B)
    workload = load_workload(path)
    cost_model = workload_cost_model(workload, workload_cluster(workload))
    config = ParallelConfig(1, 2, recompute=True)
    assert cost_model.max_tokens(config) == 11175
    lengths, tasks = np.array([1024] * 6 + [4096] * 2), np.zeros(8, dtype=np.int64)
    ffd, ffd_tasks = packed_with_tasks(np.arange(8), lengths, tasks, 11175)
    mbs, mb_tasks, seconds = pipelined_packing(np.arange(8), lengths, tasks, 11175, cost_model, config, window=8)
    assert [mb.tokens for mb in ffd] == [10240, 4096]
    assert [mb.tokens for mb in mbs] == [4096, 4096, 3072, 3072]
    assert sorted(q for mb in mbs for q in mb.seq_ids) == list(range(8))
    assert cost_model.replica_time(config, ffd, ffd_tasks, window=8) == pytest.approx(29.073, abs=1e-3)
    assert seconds == cost_model.replica_time(config, mbs, mb_tasks, window=8) == pytest.approx(23.719, abs=1e-3)


def test_longest_first_to_the_least_loaded_micro_batch_with_room():
    needs = [4096, 4096] + [1024] * 6
    own = [float(n) for n in needs]
    assert balanced_bins(needs, own, [1.0] * 8, 2, 11175).tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    # 4,096-token micro-batches: the 1,024s fill the two, and the last two open a third (none has room)
    assert balanced_bins(needs, own, [1.0] * 8, 2, 4096).tolist() == [0, 1, 2, 2, 2, 2, 3, 3]


def test_the_count_is_the_closed_forms_and_stops_at_the_longest_sequence():
    # one full micro-batch of 48 work + 1 constant, B = 3: K* = sqrt(3 x 48 / 1) = 12, T(12) = 60 + 3 x 5 = 75
    k, saving = best_count(np.array([49.0]), 1.0, 1.5, 3.0, 100)
    assert k == 12 and saving == pytest.approx(1 - 75 / (49 + 3 * 49))
    # a sequence of 9 alone: past 48 / (9 - 1) = 6 micro-batches none gets smaller
    assert best_count(np.array([49.0]), 1.0, 9.0, 3.0, 100)[0] == 6
    assert best_count(np.array([49.0]), 1.0, 1.5, 3.0, 5)[0] == 5  # no more micro-batches than sequences


@pytest.mark.parametrize("window", [1, 8])
def test_never_priced_above_first_fit_decreasing_and_keeps_the_packers_invariants(window):
    cost_model, rng, config = lobra_7b_cost_model(), np.random.default_rng(7), ParallelConfig(2, 4)
    m, balanced = cost_model.max_tokens(config), 0
    for _ in range(12):
        n = int(rng.integers(2, 60))
        lengths, tasks = rng.integers(1, m, n) // rng.integers(1, 8, n) + 1, rng.integers(0, 5, n)
        ids = np.arange(n)
        for task_major in (False, True):
            ffd = packed_with_tasks(ids, lengths, tasks, m, task_major=task_major)
            mbs, ranges, seconds = pipelined_packing(
                ids, lengths, tasks, m, cost_model, config, window, task_major=task_major
            )
            assert seconds == cost_model.replica_time(
                config, mbs, ranges, window
            )  # the price it returns is the window's
            assert seconds <= cost_model.replica_time(config, *ffd, window)
            balanced += mbs != ffd[0]
            assert sorted(q for mb in mbs for q in mb.seq_ids) == list(range(n)) and len(mbs) >= len(ffd[0])
            assert all(mb.tokens <= m and list(mb.task_ids) == sorted(mb.task_ids) for mb in mbs)
            assert list(ranges) == [mb.task_ids for mb in mbs]
            keys = [(max(mb.task_ids),) if task_major else (-mb.tokens, -max(mb.lengths)) for mb in mbs]
            assert keys == sorted(keys)
    assert balanced >= 8  # of 24: the balanced packing is taken on these draws, not only first-fit decreasing


def test_a_batchs_one_two_times_pack_and_price_as_each_replicas_own():
    """``one_two``, a batch's t(1, l) and t(2, l) from :func:`one_two_times` (in a counted scope; None outside), give
    a replica of part of the batch the micro-batches and the price its own sequences' times give, bit for bit."""
    cost_model, rng, config = lobra_7b_cost_model(), np.random.default_rng(11), ParallelConfig(2, 4)
    m = cost_model.max_tokens(config)
    lengths, tasks = rng.integers(1, m, 400) // rng.integers(1, 8, 400) + 1, rng.integers(0, 5, 400)
    assert one_two_times(cost_model, config, lengths, lengths.tobytes()) is None
    with counting():
        one_two = one_two_times(cost_model, config, lengths, lengths.tobytes())
        assert one_two_times(cost_model, config, lengths, lengths.tobytes()) is one_two
    for held in np.array_split(rng.permutation(400), 8):
        own = pipelined_packing(held, lengths, tasks, m, cost_model, config, 8)
        read = pipelined_packing(held, lengths, tasks, m, cost_model, config, 8, one_two=one_two)
        assert read[2] == own[2]
        assert [(mb.seq_ids, mb.lengths) for mb in read[0]] == [(mb.seq_ids, mb.lengths) for mb in own[0]]
