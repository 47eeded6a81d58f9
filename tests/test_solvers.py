"""The one solve() over CBC, SCIP and HiGHS: same answers, honest statuses."""

from __future__ import annotations

import pulp
import pytest

from lorafleet.solvers import SolverName, SolveStatus, available_solvers, solve


def knapsack_cover(n: int = 30) -> pulp.LpProblem:
    problem = pulp.LpProblem("cover", pulp.LpMinimize)
    xs = [problem.add_variable(f"x_{i}", 0, 10, cat="Integer") for i in range(n)]
    problem += pulp.lpSum((i % 7 + 1) * x for i, x in enumerate(xs))
    problem += pulp.lpSum(xs) >= 17.5, "cover"
    return problem


def test_all_three_back_ends_are_installed():
    assert set(available_solvers()) == set(SolverName)


@pytest.mark.parametrize("solver", list(SolverName))
def test_same_optimum(solver):
    result = solve(knapsack_cover(), solver, time_limit_s=20)
    assert result.status is SolveStatus.OPTIMAL and result.proven_optimal
    assert result.objective == pytest.approx(18.0)  # 18 units at cost 1


@pytest.mark.parametrize("solver", list(SolverName))
def test_infeasible_is_reported(solver):
    problem = pulp.LpProblem("bad", pulp.LpMinimize)
    x = problem.add_variable("x", 0, 1)
    problem += x
    problem += x >= 2, "impossible"
    result = solve(problem, solver, time_limit_s=5)
    assert result.status is SolveStatus.INFEASIBLE and not result.has_solution and result.objective is None


def test_thread_requests_do_not_break_later_highs_solves():
    # HiGHS's thread pool is process-wide: a solve that asked for another count used to fail.
    for threads in (None, 2, 1, None):
        assert solve(knapsack_cover(), SolverName.HIGHS, time_limit_s=20, threads=threads).proven_optimal
