"""One way to solve a MILP with any of three back ends, and an honest result; and the one LP solve.

Models are built with PuLP (named variables and constraints, ``writeLP`` for review) and
solved by CBC (bundled with PuLP, the default), SCIP (PySCIPOpt) or HiGHS (highspy).
The dispatcher's small LPs (:func:`solve_lp`) go to HiGHS directly, in this process.

PuLP reports ``LpStatusOptimal`` when a time limit stops a solve that holds an incumbent
(PuLP ``apis/coin.py:get_status``); only ``sol_status`` tells a proven optimum from a
feasible solution. :func:`solve` maps the pair explicitly into :class:`SolveStatus`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from enum import StrEnum

import highspy
import numpy as np
import pulp

from lorafleet.specs.solver import SolverName
from lorafleet.work import count as count_work


class SolveStatus(StrEnum):
    OPTIMAL = "optimal"
    """Proven optimal (within the requested relative gap)."""
    FEASIBLE = "feasible"
    """A solution, not proven optimal (time limit or gap)."""
    INFEASIBLE = "infeasible"
    UNBOUNDED = "unbounded"
    FAILED = "failed"
    """No solution: error, or a limit hit before any incumbent."""


@dataclass(frozen=True)
class SolveResult:
    """What a solve produced. ``objective`` is None without a solution."""

    status: SolveStatus
    objective: float | None
    wall_s: float
    solver: SolverName

    @property
    def has_solution(self) -> bool:
        return self.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)

    @property
    def proven_optimal(self) -> bool:
        return self.status is SolveStatus.OPTIMAL

    def __str__(self) -> str:
        return f"{self.solver.value}:{self.status.value}"

    def unusable_note(self, what: str, instead: str) -> str:
        """One line saying why ``what``'s solve gave nothing the caller can use, and what stands ``instead``.

        Built from both halves of the result (its status and whether it carries a solution) so that they
        never contradict each other: a status that claims a solution whose values the caller could not use
        (``cbc returned no usable solution (status optimal, but its values were unusable; 0.12 s)``), values
        without a solution status, or a plain failure (``cbc proved it infeasible (0.12 s)``).
        """
        solver, status, wall = self.solver.value, self.status.value, f"{self.wall_s:.2f} s"
        if self.has_solution:
            said = f"{solver} returned no usable solution (status {status}, but its values were unusable; {wall})"
        elif self.objective is not None:
            said = f"{solver} returned values without a solution (status {status}; they are not used; {wall})"
        else:
            said = f"{solver} {_NO_SOLUTION.get(self.status, f'gave no solution (status {status})')} ({wall})"
        return f"{what}: {said}; {instead}"


_NO_SOLUTION = {
    SolveStatus.INFEASIBLE: "proved it infeasible",
    SolveStatus.UNBOUNDED: "found it unbounded",
    SolveStatus.FAILED: "found no solution (a solver error, or a limit reached before any solution)",
}


def _make_solver(name: SolverName, time_limit_s: float, gap_rel: float, threads: int | None) -> pulp.LpSolver:
    common = {"msg": False, "timeLimit": time_limit_s, "gapRel": gap_rel}
    if name is SolverName.CBC:
        # CBC 2.10 given any -threads (even 1) runs its threaded search, which stalls about
        # 1 % of small solves for ~10 s (docs/planner.md): serial unless more are asked for.
        # Its time limit counts CPU time, not PuLP's default wall time: on a loaded machine a MILP stopped at
        # the limit with a worse answer and service-128 planned three plans in three runs of one tree.
        threaded = {"threads": threads} if threads and threads > 1 else {}
        return pulp.PULP_CBC_CMD(**common, timeMode="cpu", **threaded)
    if name is SolverName.SCIP:
        return pulp.SCIP_PY(**common)  # PySCIPOpt solves on one thread; asking for more only warns
    # HiGHS keeps one process-wide thread pool: a solve asking for a different thread count
    # than the first one fails outright, so every solve uses the same single thread.
    return pulp.HiGHS(threads=1, **common)


def available_solvers() -> list[SolverName]:
    """Back ends importable on this machine, in preference order."""
    names = set(pulp.listSolvers(onlyAvailable=True))
    table = {SolverName.CBC: "PULP_CBC_CMD", SolverName.SCIP: "SCIP_PY", SolverName.HIGHS: "HiGHS"}
    return [s for s, pulp_name in table.items() if pulp_name in names]


def _status(problem: pulp.LpProblem) -> SolveStatus:
    if problem.sol_status == pulp.LpSolutionOptimal:
        return SolveStatus.OPTIMAL
    if problem.sol_status == pulp.LpSolutionIntegerFeasible:
        return SolveStatus.FEASIBLE
    if problem.status == pulp.LpStatusInfeasible or problem.sol_status == pulp.LpSolutionInfeasible:
        return SolveStatus.INFEASIBLE
    if problem.status == pulp.LpStatusUnbounded or problem.sol_status == pulp.LpSolutionUnbounded:
        return SolveStatus.UNBOUNDED
    return SolveStatus.FAILED


@contextlib.contextmanager
def _quiet_stdout():
    """Silence file descriptor 1 itself: highspy prints its banner from C, past ``sys.stdout``. On the main thread
    only: file descriptor 1 is the whole process's, so a solve on another thread (``train.background``'s re-plan
    beside the steps) that silenced it would lose every line the training loop printed meanwhile (#42 found step
    lines and notices of a run gone); there a solver's banner may show instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def solve(
    problem: pulp.LpProblem,
    solver: SolverName = SolverName.CBC,
    time_limit_s: float = 10.0,
    gap_rel: float = 1e-4,
    threads: int | None = None,
) -> SolveResult:
    """Solve ``problem`` in place (its variables hold the solution) and report honestly.

    ``threads`` > 1 runs CBC's parallel search; HiGHS and SCIP always solve on one thread.

    A solver error (PuLP raises ``PulpSolverError``) is reported as ``FAILED`` so the caller
    can fall back to its heuristic with a warning; nothing is swallowed silently.
    """
    backend = _make_solver(SolverName(solver), time_limit_s, gap_rel, threads)
    count_work("milp_solves")
    start = time.perf_counter()
    # highspy prints a banner even with msg=False; keep the CLI's stdout clean.
    with _quiet_stdout():
        try:
            problem.solve(backend)
        except pulp.PulpSolverError:
            return SolveResult(SolveStatus.FAILED, None, time.perf_counter() - start, SolverName(solver))
    wall = time.perf_counter() - start
    status = _status(problem)
    objective = pulp.value(problem.objective) if status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE) else None
    if status is SolveStatus.FEASIBLE and not satisfies(problem):
        status = SolveStatus.FAILED  # values without a solution: the caller falls back, saying so
    return SolveResult(status, None if objective is None else float(objective), wall, SolverName(solver))


FEASIBILITY_TOL = 1e-6
"""Relative tolerance of :func:`satisfies`: a row's violation over 1 + the sum of its terms' magnitudes, and an
integer variable's distance from the nearest integer."""


def satisfies(problem: pulp.LpProblem, tol: float = FEASIBILITY_TOL) -> bool:
    """Whether the values ``problem``'s variables hold satisfy every row and integrality, to ``tol``.

    A time-limited incumbent is checked before it is used: CBC stopped on its limit (``sol_status`` integer
    feasible) has handed back values that were not a solution -- a fractional point with more replicas than the
    GPU budget row allows (seen under a 1e-6 s limit: the plan failed in replica placement, not with the
    solver's fallback). A proven optimum is not checked (the solver's proof covers it). A row
    ``sum_i a_i x_i + c (<=, >=, ==) 0`` holds when its violation is at most ``tol (1 + sum_i |a_i x_i| + |c|)``.
    """
    for variable in problem.variables():
        value = variable.varValue
        if value is None or (variable.cat == pulp.LpInteger and abs(value - round(value)) > tol):
            return False
    for row in problem.constraints.values():
        terms = [a * v.varValue for v, a in row.items()]
        value = sum(terms) + row.constant
        scale = tol * (1 + sum(abs(t) for t in terms) + abs(row.constant))
        if (row.sense == pulp.LpConstraintEQ and abs(value) > scale) or value * row.sense < -scale:
            return False
    return True


def solve_lp(
    cost: np.ndarray, a_ub: np.ndarray, b_ub: np.ndarray, a_eq: np.ndarray, b_eq: np.ndarray
) -> np.ndarray | None:
    """x minimising ``cost @ x`` s.t. ``a_ub @ x <= b_ub``, ``a_eq @ x == b_eq``, ``x >= 0`` (dense
    matrices), or None unless HiGHS proves an optimum.

    HiGHS through highspy (which PuLP imports anyway), with the settings of scipy's
    ``linprog(method="highs")`` (presolve, then the dual simplex), less its checks and conversions:
    a few hundred microseconds a solve, and no scipy.optimize (0.15 s) to import.
    """
    a = np.vstack((a_ub, a_eq))
    n_rows, n_cols = a.shape
    cols, rows = np.nonzero(a.T)  # column-major, rows ascending within a column
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n_cols, n_rows
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_, lp.col_upper_ = np.zeros(n_cols), np.full(n_cols, highspy.kHighsInf)
    lp.row_lower_ = np.concatenate((np.full(len(b_ub), -highspy.kHighsInf), b_eq)).astype(float)
    lp.row_upper_ = np.concatenate((b_ub, b_eq)).astype(float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n_cols, n_rows
    lp.a_matrix_.start_ = np.searchsorted(cols, np.arange(n_cols + 1)).astype(np.int32)
    lp.a_matrix_.index_ = rows.astype(np.int32)
    lp.a_matrix_.value_ = a[rows, cols]
    with _quiet_stdout():  # the first Highs of a process prints a banner
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("threads", 1)  # the one process-wide pool's size: every solve must ask the same
    highs.setOptionValue("simplex_strategy", 1)  # dual, as linprog asks
    highs.passModel(lp)
    highs.run()
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return np.asarray(highs.getSolution().col_value)
