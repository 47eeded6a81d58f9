"""LobRA's joint MINLP against brute force on tiny instances, and against the decomposition.

The MINLP's value is min over replica counts p of min over per-replica bucket counts n of
max_i T_i(n_i) (Eq. 12) subject to Σ_i p_i n_ij >= D_j. Brute force enumerates p and every
split of each bucket over the deployed configs (per-replica rows = ceil(d / p)); the
dispatcher's exact ILP (itself tested against brute force by the dispatch tests) stands in
on slightly larger instances.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.dispatch import MicroBatchMode, bucket_of
from lorafleet.dispatch.ilp import solve_dispatch_ilp
from lorafleet.dispatch.load import build_load_model
from lorafleet.planner import PlannerOptions
from lorafleet.planner.evaluation import evaluate
from lorafleet.planner.joint_minlp import JointSolution, solve_joint
from lorafleet.planner.search import minlp_pool, search
from lorafleet.solvers import SolverName
from lorafleet.specs.cluster import ClusterSpec
from tests.helpers.planning import lobra_like_cost_model, tiny_problem

CONFIGS = (ParallelConfig(1, 1), ParallelConfig(1, 2), ParallelConfig(2, 1))


def planning_load(problem, p):
    """The load model of deployment p on the problem's planning buckets."""
    lengths = problem.batch.lengths
    return build_load_model(
        problem.plan_classes(p),
        problem.cost_model,
        problem.boundaries,
        lengths,
        bucket_of(lengths, problem.boundaries),
        MicroBatchMode.PADDING,
    )


def compositions(total: int, parts: int):
    for cut in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *cut, total + parts - 1)
        yield [edges[k + 1] - edges[k] - 1 for k in range(parts)]


def brute_force(problem) -> float:
    best = float("inf")
    for p in itertools.product(*[range(int(m) + 1) for m in problem.max_replicas()]):
        p = np.array(p)
        if not problem.fits(p) or not problem.covers(p):
            continue
        load = planning_load(problem, p)
        k = len(load.classes)
        for split in itertools.product(*[list(compositions(int(d), k)) for d in load.counts]):
            d = np.array(split).T  # (classes, buckets)
            if np.any((d > 0) & ~load.feasible):
                continue
            best = min(best, load.makespan(d))
    return best


def tiny(lengths, gpus=4, window=1):
    cm = lobra_like_cost_model(max_tp=2, max_pp=2)
    cluster = ClusterSpec(nodes=1, gpus_per_node=gpus)
    return tiny_problem(np.array(lengths), cluster, cm, n_buckets=1, configs=CONFIGS, window=window)


@pytest.mark.parametrize(
    "lengths",
    [
        [300, 280, 250, 200, 1500, 1400, 3000],
        [900, 800, 2600, 2500, 2400, 120, 100, 4000],
    ],
)
@pytest.mark.parametrize("window", [1, 8])
def test_minlp_equals_brute_force(lengths, window):
    problem = tiny(lengths, window=window)
    solution = solve_joint(problem, time_limit_s=60)
    assert isinstance(solution, JointSolution) and solution.solve.proven_optimal
    assert solution.makespan == pytest.approx(brute_force(problem), rel=1e-6)
    assert solution.solve.objective == pytest.approx(solution.makespan, rel=1e-6)
    covered = (solution.replicas[:, None] * solution.per_replica).sum(axis=0)
    assert np.all(covered >= problem.counts) and problem.fits(solution.replicas)


@pytest.mark.parametrize("seed", range(2))
def test_minlp_equals_best_fixed_deployment(seed):
    """Slightly larger: min over p of the exact dispatch ILP for that p."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.exp(rng.normal(np.log(500), 0.9, 24)).astype(int) + 1, 4096)
    lengths[0] = 4096
    problem = tiny(lengths, gpus=4)
    best = float("inf")
    for p in itertools.product(*[range(int(m) + 1) for m in problem.max_replicas()]):
        p = np.array(p)
        if problem.fits(p) and problem.covers(p):
            outcome = solve_dispatch_ilp(planning_load(problem, p), SolverName.SCIP, 30, 1e-6)
            assert outcome.assignment is not None, outcome.result
            best = min(best, outcome.assignment.makespan_s)
    solution = solve_joint(problem, time_limit_s=60, gap_rel=1e-6)
    assert solution.makespan == pytest.approx(best, rel=1e-4)


@pytest.mark.parametrize(
    "lengths",
    [
        [300, 280, 250, 200, 1500, 1400, 3000, 120, 90, 700],
        [900, 800, 2600, 2500, 2400, 120, 100, 4000, 350, 330, 310],
    ],
)
def test_decomposition_at_least_as_good_as_the_minlp_deployment(lengths):
    """Both deployments judged alike: the dispatcher's balance of the batch on each."""
    problem = tiny(lengths)
    options = PlannerOptions(robust_samples=0, time_limit_s=60)
    _, ranked = search(problem, options)
    minlp = minlp_pool(problem, options)
    assert minlp.pool[0].source == "minlp" and minlp.solves[0].proven_optimal
    minlp_value = evaluate(problem, minlp.pool[0].load, exact=False, options=options)[0].makespan
    assert ranked[0].expected_makespan <= minlp_value * 1.01
