"""The aggregated deployment MILP against brute force: every replica-count vector, each solved as an LP.

For fixed replica counts p the relaxation is the LP ``min T`` s.t. ``Σ_j w_ij x_ij <= p_i (T - a_i)``
(capacity) and ``Σ_i x_ij = D_j`` (coverage), which scipy solves directly. The MILP (budget,
coverage, capacity and branch families together) must find the p with the least LP value.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import linprog

from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.planner.deployment_ilp import (
    Branch,
    branch_deployments,
    branches_around,
    fixed_time,
    fluid_lower_bound,
    solve_deployment,
    solve_root,
)
from lorafleet.planner.fallback import heuristic_deployment
from lorafleet.solvers import SolverName
from lorafleet.specs.cluster import ClusterSpec
from tests.helpers.planning import lobra_like_cost_model, skewed_lengths, tiny_problem

CONFIGS = (ParallelConfig(1, 1), ParallelConfig(1, 2), ParallelConfig(2, 1), ParallelConfig(4, 1))


def fluid_makespan(problem, p: np.ndarray) -> float:
    """The relaxation's makespan for fixed p, by scipy's LP (inf when p cannot hold every bucket)."""
    w, a, demand = problem.amortised_time, fixed_time(problem), problem.counts
    pairs = [
        (i, j) for i in range(len(p)) for j in range(demand.size) if p[i] > 0 and demand[j] > 0 and np.isfinite(w[i, j])
    ]
    if any(demand[j] > 0 and not any(jj == j for _, jj in pairs) for j in range(demand.size)):
        return float("inf")
    n = len(pairs) + 1  # x_ij..., T
    c = np.zeros(n)
    c[-1] = 1.0
    a_ub, b_ub = [], []
    for i in np.flatnonzero(p > 0):
        row = np.zeros(n)
        for k, (ii, j) in enumerate(pairs):
            if ii == i:
                row[k] = w[i, j]
        row[-1] = -p[i]
        a_ub.append(row)
        b_ub.append(-p[i] * a[i])
    a_eq = [[1.0 if jj == j else 0.0 for _, jj in pairs] + [0.0] for j in range(demand.size) if demand[j] > 0]
    b_eq = [float(d) for d in demand if d > 0]
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * n, method="highs")
    return float(res.fun) if res.success else float("inf")


def brute_force(problem, allowed=lambda p: True) -> tuple[float, np.ndarray]:
    best = (float("inf"), None)
    for p in itertools.product(*[range(int(m) + 1) for m in problem.max_replicas()]):
        p = np.array(p)
        if problem.fits(p) and allowed(p):
            best = min(best, (fluid_makespan(problem, p), p), key=lambda x: x[0])
    return best


def instance(seed: int, longest: int = 4096, gpus: int = 8):
    cm = lobra_like_cost_model(max_tp=4, max_pp=2)
    cluster = ClusterSpec(nodes=1, gpus_per_node=gpus)
    lengths = skewed_lengths(np.random.default_rng(seed), int(np.random.default_rng(seed).integers(30, 120)), longest)
    return tiny_problem(lengths, cluster, cm, configs=CONFIGS)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("solver", list(SolverName))
def test_milp_finds_the_best_replica_counts(seed, solver):
    problem = instance(seed)
    _, horizon = heuristic_deployment(problem)
    plan, results = solve_deployment(problem, horizon, tie_rel=0.0, solver=solver, time_limit_s=20)
    assert all(r.has_solution for r in results)
    best, _ = brute_force(problem)
    assert plan.makespan == pytest.approx(best, rel=5e-3)
    assert fluid_makespan(problem, plan.replicas) == pytest.approx(best, rel=5e-3)
    assert problem.fits(plan.replicas)


@pytest.mark.parametrize("seed", range(3))
def test_branches_find_the_best_plan_inside_them(seed):
    problem = instance(seed)
    _, horizon = heuristic_deployment(problem)
    root, _ = solve_deployment(problem, horizon, tie_rel=0.0, solver=SolverName.HIGHS, time_limit_s=20)
    i = int(np.argmax(root.replicas * problem.gpus))
    p_i = int(root.replicas[i])
    for branch, allowed in (
        (Branch(bounds={i: (0, p_i - 1)}), lambda p: p[i] <= p_i - 1),
        (Branch(bounds={i: (p_i + 1, 99)}), lambda p: p[i] >= p_i + 1),
        (Branch(deploy_one_of=tuple(np.flatnonzero(root.replicas == 0))), lambda p: p[root.replicas == 0].sum() >= 1),
    ):
        best, _ = brute_force(problem, allowed)
        plan, _ = solve_deployment(
            problem, root.makespan, tie_rel=0.0, solver=SolverName.HIGHS, time_limit_s=20, branch=branch
        )
        if not np.isfinite(best):
            assert plan is None
            continue
        assert allowed(plan.replicas)
        assert plan.makespan == pytest.approx(best, rel=3e-3)


def test_root_starts_at_the_fluid_bound_and_branches_stay_in_budget():
    problem = instance(5)
    root, results = solve_root(problem, tie_rel=0.005, solver=SolverName.CBC, time_limit_s=20)
    assert root.branch == "root" and fluid_lower_bound(problem) <= root.makespan
    assert len(results) <= 5  # fixed-point iterations
    found, results = branch_deployments(
        problem, root.replicas, root.makespan, tie_rel=0.005, solver=SolverName.CBC, time_limit_s=20, max_branches=3
    )
    assert len(results) == 3 and len(found) <= 3
    labels = [label for label, _ in branches_around(problem, root.replicas)]
    assert [f.branch for f in found] == [lab for lab in labels[:3] if lab in {f.branch for f in found}]


def test_tie_weight_trades_makespan_for_gpus_as_documented():
    """Objective θ' - (tie_rel / N) Σ N_i p_i: dropping GPUs may cost at most tie_rel of the makespan."""
    problem = instance(6)
    _, horizon = heuristic_deployment(problem)
    strict, _ = solve_deployment(problem, horizon, tie_rel=0.0, solver=SolverName.HIGHS, time_limit_s=20)
    loose, _ = solve_deployment(problem, horizon, tie_rel=0.5, solver=SolverName.HIGHS, time_limit_s=20)
    assert loose.replicas @ problem.gpus <= strict.replicas @ problem.gpus
    assert strict.makespan <= loose.makespan * 1.003 <= strict.makespan * 1.5 * 1.003
