"""Baselines: LobRA's static buckets through the dispatcher, the best homogeneous config, the phases."""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.dispatch import DispatchPolicy, MicroBatchMode, dispatch_step
from lorafleet.planner import (
    BaselineKind,
    baseline_schedules,
    best_homogeneous,
    packing_policy,
    padding_policy,
    pow2_boundaries,
)
from lorafleet.planner.baselines import estimated_makespan, gpu_seconds_bound
from lorafleet.planner.candidates import valid_candidates
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.placement import build_plan
from lorafleet.planner.schedule import select_tasks
from lorafleet.sampling import sample_global_batch
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.work import counting
from tests.helpers.planning import batch_of, lobra_like_cost_model, small_workload


@pytest.mark.parametrize(
    "longest,max_tokens,expected",
    [
        (16384, 16384, (256, 512, 1024, 2048, 4096, 8192, 16384)),
        (3000, 8192, (256, 512, 1024, 2048, 4096)),
        (3000, 3500, (256, 512, 1024, 2048, 3500)),
        (200, 2048, (256,)),
    ],
)
def test_pow2_boundaries(longest, max_tokens, expected):
    assert pow2_boundaries(longest, max_tokens) == expected


FLUSHED = DispatchPolicy(pipeline_window=1)
"""lorafleet's policy the baselines share their bucket count (16) and window with: 1F1B flushed every step,
the window of the cost model these tests were written against."""


def one_node_plan(workload, cand, policy, cost_model):
    """``cand``'s replicas filling the 8 GPUs of ``workload``'s one node, under ``policy``."""
    replicas = [(cand.config, cand.max_tokens, 8 // cand.n_gpus)]
    return build_plan(workload, workload.cluster, replicas, solver="test", policy=policy, cost_model=cost_model)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    return small_workload(tmp_path_factory.mktemp("wl"), seed=1, nodes=1)


def test_static_buckets_pad_to_their_boundary_and_keep_real_lengths(workload, cost_model_7b):
    cluster = workload.cluster
    cand = max(valid_candidates(cost_model_7b, cluster), key=lambda c: (c.max_tokens >= workload.max_length, -c.n_gpus))
    batch = sample_global_batch(workload, 3)
    policy = padding_policy(int(batch.lengths.max()), cand.max_tokens, FLUSHED)
    plan = one_node_plan(workload, cand, policy, cost_model_7b)
    step = dispatch_step(batch, plan, cost_model_7b)
    bounds = np.array(policy.static_boundaries)
    seen = []
    for work, replica in zip(step.work, plan.replicas, strict=True):
        for mb in work.microbatches:
            assert all(
                bounds[np.searchsorted(bounds, n)] == mb.padded_len for n in mb.lengths
            )  # each row in its static bucket
            assert all(n == batch.lengths[q] <= mb.padded_len for q, n in zip(mb.seq_ids, mb.lengths))
            assert mb.tokens <= replica.max_tokens
            seen.extend(mb.seq_ids)
        assert work.estimated_time_s == pytest.approx(
            cost_model_7b.replica_time(replica.config, [mb.shape for mb in work.microbatches])
        )
    assert sorted(seen) == list(range(len(batch)))
    expected_padding = int((bounds[np.searchsorted(bounds, batch.lengths)] - batch.lengths).sum())
    assert step.padding_tokens == expected_padding
    assert step.bucket_boundaries == policy.static_boundaries


@pytest.mark.parametrize("mode", list(MicroBatchMode))
def test_best_homogeneous_is_the_fewest_estimated_gpu_seconds(workload, cost_model_7b, mode):
    cluster = ClusterSpec(nodes=2, gpus_per_node=8)
    batch = expected_global_batch(workload)
    candidates = valid_candidates(cost_model_7b, cluster)
    chosen, replicas = best_homogeneous(batch, workload.max_length, candidates, cost_model_7b, cluster, mode, FLUSHED)
    brute = min(
        (estimated_makespan(batch, c, n, cost_model_7b, mode, FLUSHED) * n * c.n_gpus, c.config)
        for c in candidates
        if c.max_tokens >= workload.max_length
        for n in [cluster.n_gpus // c.n_gpus]
    )
    assert (
        estimated_makespan(batch, chosen, replicas, cost_model_7b, mode, FLUSHED) * replicas * chosen.n_gpus,
        chosen.config,
    ) == brute


@pytest.mark.parametrize("window", [1, 8])
def test_a_packed_estimate_stops_at_the_first_replica_above_the_limit(workload, cost_model_7b, window):
    """best_homogeneous asks a packed estimate only whether it is above a limit: the pricing stops at the first
    replica above it and returns a value above the limit and at most the estimate, having priced fewer replicas;
    at or above the estimate it is the estimate itself, every replica priced. Every deployable config of 16 GPUs,
    pipelined ones included, flushed and in a window of 8 steps."""
    cluster, policy = ClusterSpec(nodes=2, gpus_per_node=8), DispatchPolicy(pipeline_window=window)
    batch, packing = expected_global_batch(workload), MicroBatchMode.PACKING
    stopped = 0
    for c in valid_candidates(cost_model_7b, cluster):
        n = cluster.n_gpus // c.n_gpus
        if c.max_tokens < batch.lengths.max() or n < 2:
            continue
        with counting() as whole:
            full = estimated_makespan(batch, c, n, cost_model_7b, packing, policy)
        assert estimated_makespan(batch, c, n, cost_model_7b, packing, policy, above=full) == full
        with counting() as part:
            early = estimated_makespan(batch, c, n, cost_model_7b, packing, policy, above=full / 2)
        assert full / 2 < early <= full
        assert part["replicas_priced"] <= whole["replicas_priced"]
        stopped += part["replicas_priced"] < whole["replicas_priced"]
    assert stopped > 0


@pytest.mark.parametrize("window", [1, 8])
@pytest.mark.parametrize("mode", list(MicroBatchMode))
def test_gpu_seconds_bound_is_below_every_estimate(workload, cost_model_7b, mode, window):
    """The bound best_homogeneous skips configs by is below every deployable config's estimate (to rounding: the
    padded one is the estimate itself when one replica holds one bucket), pipelined ones (whose padded bound
    charges the drained bubble) included, in a flushed pipeline and in a window of 8 steps; padded, it is at least
    the packed bound (rows at their bucket's length, in full micro-batches, and the bubble)."""
    cluster, policy = ClusterSpec(nodes=2, gpus_per_node=8), DispatchPolicy(pipeline_window=window)
    batch = expected_global_batch(workload)
    for c in valid_candidates(cost_model_7b, cluster):
        if c.max_tokens < batch.lengths.max():
            continue
        n = cluster.n_gpus // c.n_gpus
        bound = gpu_seconds_bound(batch, c, n, cost_model_7b, mode)
        assert 0 < bound <= estimated_makespan(batch, c, n, cost_model_7b, mode, policy) * n * c.n_gpus * (1 + 1e-12)
        assert bound >= gpu_seconds_bound(batch, c, n, cost_model_7b, MicroBatchMode.PACKING)


@pytest.mark.parametrize("mode", list(MicroBatchMode))
def test_estimate_is_the_dispatch_under_the_baselines_policy(workload, cost_model_7b, mode):
    """The estimate a baseline's config is chosen by is the makespan of the step its policy dispatches."""
    cluster = ClusterSpec(nodes=1, gpus_per_node=8)
    expected = expected_global_batch(workload)
    for c in valid_candidates(cost_model_7b, cluster):
        if c.max_tokens < expected.lengths.max():
            continue
        n = cluster.n_gpus // c.n_gpus
        policy = (
            padding_policy(int(expected.lengths.max()), c.max_tokens, FLUSHED)
            if mode is MicroBatchMode.PADDING
            else packing_policy(FLUSHED)
        )
        plan = build_plan(
            workload, cluster, [(c.config, c.max_tokens, n)], solver="test", policy=policy, cost_model=cost_model_7b
        )
        real = dispatch_step(expected, plan, cost_model_7b).estimated_makespan_s
        assert estimated_makespan(expected, c, n, cost_model_7b, mode, FLUSHED) == pytest.approx(real, rel=1e-9)


def test_baseline_schedules_replay_step_by_step(workload, cost_model_7b):
    cluster = workload.cluster
    expected = expected_global_batch(workload)
    schedules = baseline_schedules(
        workload, expected, valid_candidates(cost_model_7b, cluster), cost_model_7b, cluster, FLUSHED
    )
    assert [s.name for s in schedules] == [k.value for k in BaselineKind]
    padding, packing, sequential = schedules
    assert len(padding.phases) == len(packing.phases) == 1
    assert padding.phases[0].plan.policy.static_boundaries and not packing.phases[0].plan.policy.static_boundaries
    assert packing.phases[0].plan.policy.options.microbatch_mode is MicroBatchMode.PACKING
    assert [p.tasks for p in sequential.phases] == [(k,) for k in range(len(workload.tasks))]
    batch = sample_global_batch(workload, 0)
    cost = sequential.step_cost(batch, cost_model_7b)
    parts = [
        dispatch_step(select_tasks(batch, p.tasks), p.plan, cost_model_7b).estimated_makespan_s
        for p in sequential.phases
    ]
    assert cost.makespan_s == pytest.approx(sum(parts))
    assert cost.gpu_seconds == pytest.approx(sum(t * p.plan.used_gpus for t, p in zip(parts, sequential.phases)))
    for phase in sequential.phases:  # every step's sequences fit, not just the expected batch's
        longest = max(workload.tasks[k].lengths.max_length for k in phase.tasks)
        assert max(r.max_tokens for r in phase.plan.replicas) >= longest
        assert phase.plan.policy.static_boundaries[-1] >= longest
    for step in range(8):
        for schedule in schedules:
            assert schedule.step_cost(sample_global_batch(workload, step), cost_model_7b).makespan_s > 0


def test_best_homogeneous_judges_replicas_as_placed():
    """Nine sequences in LobRA's static buckets (1, 4, 1, 1, 2 of them) on 4 GPUs: two <2,1> replicas
    (1.02 s as placed, 1.28 s if each took every bucket's ceil(d / 2)) beat one <2,2> (1.25 s);
    the all-ceil estimate chose <2,2>."""
    cost_model, cluster = lobra_like_cost_model(max_tp=2, max_pp=2), ClusterSpec(nodes=1, gpus_per_node=4)
    batch = batch_of(np.array([166, 299, 319, 386, 432, 969, 1332, 3236, 4096]))
    chosen, replicas = best_homogeneous(
        batch, 4096, valid_candidates(cost_model, cluster), cost_model, cluster, MicroBatchMode.PADDING, FLUSHED
    )
    assert (str(chosen.config), replicas) == ("<2,1>", 2)


def test_task_sequential_tasks_of_equal_expected_lengths_share_one_choice(tmp_path, cost_model_7b, monkeypatch):
    """Two tasks of one length histogram and batch size, and a third: Task-Sequential chooses a config for each
    distinct (longest, expected lengths) once (2 choices, not 3; with the two Task-Fused ones, 4 calls of
    ``best_homogeneous``), and every phase is the one chosen alone."""
    from lorafleet.planner import baselines
    from lorafleet.workload import load_workload
    from tests.helpers.planning import skewed_histogram, write_workload

    rng = np.random.default_rng(5)
    same = {"batch_size": 32, "context_length": 2048, "histogram": skewed_histogram(rng, 300, 2048)}
    other = {"batch_size": 16, "context_length": 4096, "histogram": skewed_histogram(rng, 900, 4096)}
    tasks = [{"name": "a", **same}, {"name": "b", **other}, {"name": "c", **same}]
    workload = load_workload(write_workload(tmp_path / "w.yaml", tasks, nodes=1))
    cluster, expected = workload.cluster, expected_global_batch(workload)
    candidates = valid_candidates(cost_model_7b, cluster)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return best_homogeneous(*args, **kwargs)

    monkeypatch.setattr(baselines, "best_homogeneous", counted)
    sequential = baseline_schedules(workload, expected, candidates, cost_model_7b, cluster, FLUSHED)[2]
    assert len(calls) == 4
    for k, phase in enumerate(sequential.phases):
        alone = baselines._phase(
            workload,
            (k,),
            expected,
            candidates,
            cost_model_7b,
            cluster,
            MicroBatchMode.PADDING,
            FLUSHED,
            f"{BaselineKind.TASK_SEQUENTIAL.value}:{workload.tasks[k].name}",
        )
        assert phase.plan == alone.plan


def test_a_one_task_batch_dispatches_the_same_whichever_task_it_is(workload, cost_model_7b):
    """What Task-Sequential's shared expected steps rest on (``baselines._phase``): one task's expected sequences on
    a padded, pipelined plan streamed in a window of steps (the stall at its boundaries compares task ids) get the
    same buckets, makespan and replica times under every other task's id, and other sample ids."""
    from dataclasses import replace

    cluster, expected = workload.cluster, expected_global_batch(workload)
    longest = workload.tasks[0].lengths.max_length
    cand = next(c for c in valid_candidates(cost_model_7b, cluster) if c.config.pp > 1 and c.max_tokens >= longest)
    policy = padding_policy(longest, cand.max_tokens, DispatchPolicy())
    assert policy.pipeline_window > 1
    plan = one_node_plan(workload, cand, policy, cost_model_7b)
    part = select_tasks(expected, (0,))

    def recorded(batch):
        step = dispatch_step(batch, plan, cost_model_7b)
        return step.bucket_boundaries, step.estimated_makespan_s, [w.estimated_time_s for w in step.work]

    first = recorded(part)
    assert first[1] > 0
    for other in range(1, len(workload.tasks)):
        relabeled = replace(part, task_ids=np.full_like(part.task_ids, other), sample_ids=part.sample_ids + 10_000)
        assert recorded(relabeled) == first
