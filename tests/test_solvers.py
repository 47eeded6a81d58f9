"""The one solve() over CBC, SCIP and HiGHS: same answers, honest statuses; and the one LP solve."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pulp
import pytest
from scipy.optimize import linprog

from lorafleet.solvers import SolverName, SolveStatus, available_solvers, satisfies, solve, solve_lp


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
    # HiGHS's thread pool is process-wide: a solve that asked for another count used to fail, and so
    # did every MILP on HiGHS after the first LP (solve_lp) when that left the pool at its default size.
    for threads in (None, 2, 1, None):
        assert solve_lp(*min_max_lp(0)) is not None
        assert solve(knapsack_cover(), SolverName.HIGHS, time_limit_s=20, threads=threads).proven_optimal


def min_max_lp(seed: int) -> tuple[np.ndarray, ...]:
    """A random instance of the dispatcher's LP: min tau s.t. sum_i x_ij = D_j, o_i + sum_j a_ij x_ij <= tau."""
    rng = np.random.default_rng(seed)
    k, r = 5, 12
    rate = rng.uniform(0.1, 2.0, (k, r)) * (rng.random((k, r)) < 0.7)
    rate[0] = rng.uniform(0.1, 2.0, r)  # every bucket has a class
    pairs = np.argwhere(rate > 0)
    n = len(pairs)
    cost = np.zeros(n + 1)
    cost[-1] = 1.0
    a_ub = np.zeros((k, n + 1))
    a_ub[pairs[:, 0], np.arange(n)] = rate[pairs[:, 0], pairs[:, 1]]
    a_ub[:, -1] = -1.0
    a_eq = np.zeros((r, n + 1))
    a_eq[pairs[:, 1], np.arange(n)] = 1.0
    return cost, a_ub, -rng.uniform(0, 1, k), a_eq, rng.integers(1, 50, r).astype(float)


@pytest.mark.parametrize("seed", range(5))
def test_lp_optimum_is_scipys(seed):
    cost, a_ub, b_ub, a_eq, b_eq = min_max_lp(seed)
    x = solve_lp(cost, a_ub, b_ub, a_eq, b_eq)
    reference = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    assert x is not None and reference.status == 0
    assert cost @ x == pytest.approx(reference.fun, rel=1e-9)
    assert np.all(x >= -1e-9) and np.all(a_ub @ x <= b_ub + 1e-7) and np.allclose(a_eq @ x, b_eq)


def test_lp_without_an_optimum_is_none():
    cost, a_ub, b_ub, a_eq, b_eq = min_max_lp(0)
    assert solve_lp(cost, a_ub, b_ub, a_eq, -b_eq) is None  # x >= 0 cannot sum to a negative demand


def test_lp_prints_nothing():
    # the first Highs of a process prints a banner from C, past sys.stdout: min x s.t. x = 1, in a fresh one
    code = (
        "import numpy as np; from lorafleet.solvers import solve_lp; "
        "assert solve_lp(np.ones(1), np.zeros((0, 1)), np.zeros(0), np.ones((1, 1)), np.ones(1)) == [1.0]"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == ""


def test_a_solve_beside_the_main_thread_leaves_its_lines_alone(capfd):
    """The stdout silence around a solve is the main thread's only: file descriptor 1 is the whole process's, and a
    re-plan solving beside the training steps (``train.background``) silenced the step lines the loop printed
    meanwhile (#42: a run's ``step 7/12`` line and its notices were lost)."""
    import os
    import threading

    from lorafleet.solvers import _quiet_stdout

    inside, leave = threading.Event(), threading.Event()

    def solving() -> None:
        with _quiet_stdout():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=solving)
    thread.start()
    assert inside.wait(10)
    os.write(1, b"step 7/12 printed while a re-plan solves\n")
    leave.set()
    thread.join()
    assert "step 7/12 printed while a re-plan solves" in capfd.readouterr().out


@pytest.mark.parametrize("threads", [1, None], ids=["planner", "dispatcher"])
def test_cbcs_time_limit_counts_cpu_time(threads):
    """A wall-clock limit made plans depend on the machine's load (#43: service-128 planned three plans in three runs
    of one tree at load 12-17, a MILP stopped at its limit); CBC is told to count its own CPU time, on the command
    line PuLP writes for it, for the planner's MILPs (threads=1) and the dispatcher's exact ILP (threads unset)
    alike, and searches serially (no ``threads`` option: CBC's threaded search is not deterministic)."""
    from lorafleet.solvers import _make_solver

    solver = _make_solver(SolverName.CBC, 10.0, 1e-3, threads)
    assert solver.optionsDict["timeMode"] == "cpu"
    assert solver.timeLimit == 10.0
    options = solver.getOptions()  # what PuLP adds to CBC's command line beside -sec
    assert "timeMode cpu" in options
    assert not any(o.startswith("threads") for o in options)


def test_values_that_break_a_row_or_integrality_are_not_a_solution():
    """A time-limited incumbent is checked (solvers.satisfies): CBC stopped on a 1e-6 s limit once handed back a
    fractional point over the GPU budget as integer feasible, and the plan failed in placement."""
    x = pulp.LpVariable("x", 0, 10, cat=pulp.LpInteger)
    y = pulp.LpVariable("y", 0, 10)
    problem = pulp.LpProblem("budget", pulp.LpMaximize)
    problem += x + y
    problem += x + y <= 4.5, "budget"
    problem += x - y == 1, "tie"

    for xv, yv, ok in ((2, 1, True), (2.75, 1.75, False), (3, 2, False), (2, 2, False), (2, 1 + 1e-9, True)):
        x.varValue, y.varValue = xv, yv
        assert satisfies(problem) is ok, (xv, yv)
    x.varValue = None
    assert not satisfies(problem)
