"""Candidates, proposal, the GPU budget rows and placement, deployments, Theorem 1: each against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.planner.candidates import (
    enumerate_deployments,
    lower_bound,
    lower_bound_filter,
    max_token_class,
    propose_candidates,
    spread_rows,
    valid_candidates,
)
from lorafleet.planner.placement import place_replicas
from lorafleet.planner.problem import Candidate, gpu_budget_rows
from lorafleet.specs.cluster import ClusterSpec
from tests.helpers.planning import lobra_like_cost_model, skewed_lengths, tiny_problem


def test_valid_candidates_are_the_configs_that_run_and_fit(cost_model_7b):
    cluster = ClusterSpec(nodes=1, gpus_per_node=4)
    got = {c.config for c in valid_candidates(cost_model_7b, cluster)}
    expected = {c for c in cost_model_7b.configs if c.tp <= 4 and c.n_gpus <= 4 and cost_model_7b.max_tokens(c) > 0}
    assert got == expected
    assert ParallelConfig(8, 1) not in got  # TP group larger than a node


def test_proposal_keeps_the_best_per_class_and_gpu_count():
    rng = np.random.default_rng(3)
    configs = [ParallelConfig(tp, pp) for tp in (1, 2, 4) for pp in (1, 2, 4)]
    candidates = [
        Candidate(
            config=c, max_tokens=int(rng.choice([1024, 1500, 2048, 4096, 6000])), throughput=float(rng.uniform(1, 5))
        )
        for c in configs
    ]
    kept = set(propose_candidates(candidates, longest=5000))
    for c in candidates:
        group = [
            d
            for d in candidates
            if max_token_class(d.max_tokens) == max_token_class(c.max_tokens) and d.n_gpus == c.n_gpus
        ]
        best = max(group, key=lambda d: d.throughput)
        assert (c in kept) == (
            c is best or c is max((d for d in candidates if d.max_tokens >= 5000), key=lambda d: d.throughput)
        )


def _first_fit_starts(replicas, nodes: int, per_node: int) -> list[tuple[int, ...]]:
    """Each replica's stages' first GPUs under first fit decreasing by TP, scanning every node from the first
    for each group (what ``place_replicas`` places)."""
    used = [0] * nodes
    starts: dict[tuple[int, int], int] = {}
    groups = [(r.config.tp, k, s) for k, r in enumerate(replicas) for s in range(r.config.pp)]
    for tp, k, stage in sorted(groups, key=lambda g: (-g[0], g[1], g[2])):
        node = next(n for n in range(nodes) if per_node - used[n] >= tp)
        starts[k, stage] = node * per_node + used[node]
        used[node] += tp
    return [tuple(starts[k, s] for s in range(r.config.pp)) for k, r in enumerate(replicas)]


def _placeable(groups: list[int], nodes: int, per_node: int) -> bool:
    """Brute force: can TP groups of these sizes be assigned to nodes without exceeding any node?"""
    free = [per_node] * nodes

    def assign(k: int) -> bool:
        if k == len(groups):
            return True
        for n in range(nodes):
            if free[n] >= groups[k]:
                free[n] -= groups[k]
                if assign(k + 1):
                    return True
                free[n] += groups[k]
        return False

    return assign(0)


@pytest.mark.parametrize("nodes,per_node", [(1, 4), (2, 4), (1, 6), (2, 6), (3, 3)])
def test_gpu_budget_rows_are_exactly_the_placeable_deployments(nodes, per_node):
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=per_node)
    configs = [
        c
        for c in (
            ParallelConfig(1, 1),
            ParallelConfig(2, 1),
            ParallelConfig(4, 1),
            ParallelConfig(2, 2),
            ParallelConfig(1, 3),
        )
        if c.tp <= per_node
    ]
    rows, caps = gpu_budget_rows(configs, cluster)
    limit = cluster.n_gpus
    for counts in itertools.product(*[range(limit // c.n_gpus + 1) for c in configs]):
        groups = sorted((c.tp for c, n in zip(configs, counts) for _ in range(n * c.pp)), reverse=True)
        feasible = bool(np.all(rows @ np.array(counts) <= caps))
        assert feasible == _placeable(groups, nodes, per_node), counts
        if feasible:
            replicas = place_replicas(
                [c for c, n in zip(configs, counts) for _ in range(n)], [1] * sum(counts), cluster
            )
            gpus = [g for r in replicas for g in r.gpus]
            assert len(gpus) == len(set(gpus)) and all(0 <= g < cluster.n_gpus for g in gpus)
            assert [r.gpus[:: r.config.tp] for r in replicas] == _first_fit_starts(replicas, nodes, per_node)
            for r in replicas:
                for stage in range(r.config.pp):
                    group = r.gpus[stage * r.config.tp : (stage + 1) * r.config.tp]
                    assert len({g // per_node for g in group}) == 1  # a TP group inside one node


def test_enumeration_lists_every_maximal_covering_deployment(cost_model_7b):
    cluster = ClusterSpec(nodes=1, gpus_per_node=8)
    configs = (
        ParallelConfig(1, 1),
        ParallelConfig(1, 2),
        ParallelConfig(2, 1),
        ParallelConfig(4, 1),
        ParallelConfig(8, 1),
    )
    problem = tiny_problem(skewed_lengths(np.random.default_rng(0), 60, 4096), cluster, cost_model_7b, configs=configs)
    limits = problem.max_replicas()
    brute = set()
    for p in itertools.product(*[range(int(m) + 1) for m in limits]):
        p = np.array(p)
        can_add = any(problem.fits(p + np.eye(len(p), dtype=np.int64)[i]) for i in range(len(p)))
        if problem.fits(p) and not can_add and problem.covers(p):
            brute.add(tuple(p))
    assert {tuple(p) for p in enumerate_deployments(problem, 10_000)} == brute
    with pytest.raises(ValueError, match="too many"):
        list(enumerate_deployments(problem, 1))


@pytest.mark.parametrize("total,replicas", [([7, 0, 3, 1], 3), ([2, 2, 2], 4), ([9], 1)])
def test_spread_rows_is_even_and_round_robin(total, replicas):
    rows = spread_rows(np.array(total), replicas)
    assert rows.shape == (replicas, len(total))
    assert rows.sum(axis=0).tolist() == total
    assert np.all(rows.max(axis=0) - rows.min(axis=0) <= 1)
    per_replica = rows.sum(axis=1)
    assert per_replica.max() - per_replica.min() <= 1  # extras continue where the last bucket stopped


def test_lower_bound_is_the_gpu_weighted_mean_replica_time():
    cm = lobra_like_cost_model(max_tp=2)
    cluster = ClusterSpec(nodes=1, gpus_per_node=4)
    problem = tiny_problem(
        skewed_lengths(np.random.default_rng(1), 80, 4096),
        cluster,
        cm,
        configs=(ParallelConfig(1, 1), ParallelConfig(2, 1)),
    )
    replicas = np.array([2, 1])
    load, length_based = problem.plan_view(replicas)
    per_replica = []  # (GPUs, time) of every replica, computed one by one
    for k, cls in enumerate(load.classes):
        for r in range(len(cls.replicas)):
            rows = spread_rows(length_based.counts[k], len(cls.replicas))[r]
            per_replica.append((cls.config.n_gpus, float(load.replica_load(k, rows))))
    expected = sum(n * t for n, t in per_replica) / sum(n for n, _ in per_replica)
    assert lower_bound(load, length_based) == pytest.approx(expected)
    # length-based: every bucket on the tightest config that holds it
    tightest = np.where(load.microbatch_rows[0] > 0, 0, 1)
    assert all(length_based.counts[tightest[j], j] == load.counts[j] for j in range(load.counts.size))


def test_lower_bound_filter_threshold_minimum_and_reference():
    bounds = [10.0, 10.5, 11.6, 12.0, 30.0]
    distinct = [False, True, True, True, True]  # the reference is the best plan with distinct M: 10.5
    assert lower_bound_filter(bounds, distinct, 0.15, 1) == [0, 1, 2, 3]  # <= 1.15 * 10.5 = 12.075
    assert lower_bound_filter(bounds, distinct, 0.0, 4) == [0, 1, 2, 3]
    assert lower_bound_filter(bounds, [False] * 5, 0.05, 1) == [0, 1]
