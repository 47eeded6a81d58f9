"""The exact per-step dispatch MILP over (config class, bucket) counts (LobRA's dispatch ILP).

Classes i (p_i replicas of one config, max tokens M_i, pp_i stages, a bubble of w_i =
``load.bubble_slots[i]`` largest stage times: ``pp_i - 1``, LobRA's 1F1B flushed every step, which
load models charge whatever the pipeline window, :mod:`~lorafleet.dispatch.load`), buckets j (boundary
s_j, D_j sequences), b_ij = floor(M_i / s_j) rows per full micro-batch; a pair with
b_ij = 0 gets no variables. Micro-batch times are linear in rows,
t(b, s) = alpha_ij b + beta_ij, so a fragment of r rows costs
t~(r, z) = alpha_ij r + beta_ij z with z = [r > 0] (LobRA's t~(r, s, z)). Variables:
d_ij in [0, D_j] (sequences to the class), m_ij >= 0 (full micro-batches per replica),
r_ij in [0, b_ij - 1] (fragment rows per replica), z_ij, y_ij binary, B_i >= 0 (largest
stage time, only when w_i > 0, i.e. pp_i > 1), and the makespan T::

    min T
    sum_i d_ij = D_j                                          coverage        for all j
    d_ij <= p_i (b_ij m_ij + r_ij) <= d_ij + p_i - 1          ceil            (rows = ceil(d/p))
    z_ij <= r_ij <= (b_ij - 1) z_ij                           fragment
    y_ij <= m_ij <= y_ij * floor(ceil(D_j / p_i) / b_ij)      full            (w_i > 0)
    B_i >= t(b_ij, s_j) y_ij,  B_i >= t~(r_ij, z_ij)          bubble          (w_i > 0)
    T >= o_i + sum_j [ t(b_ij, s_j) m_ij + t~(r_ij, z_ij) ] + w_i B_i    makespan  for all i
    T <= T_fast                                               bound           (the fast solution is feasible)

This is the :mod:`~lorafleet.dispatch.load` model exactly, so the fast method's
assignment is a feasible point and its makespan a valid upper bound. Aggregating by class
keeps the model at a few hundred variables whatever the batch size and the replica count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pulp

from lorafleet.dispatch.balance import Assignment
from lorafleet.dispatch.load import LoadModel
from lorafleet.solvers import SolveResult, SolverName, solve

_BOUND_SLACK = 1e-6
"""Relative slack on ``T <= T_fast`` so solver tolerances never cut off the fast solution."""


@dataclass
class _Vars:
    """The model's variables, keyed by (class, bucket) for the feasible pairs."""

    d: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    m: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    r: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    z: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    y: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    largest: dict[int, pulp.LpVariable] = field(default_factory=dict)
    makespan: pulp.LpVariable | None = None


@dataclass(frozen=True)
class IlpOutcome:
    """What the exact solve gave: an assignment when it found one, the honest status, and its proven bound."""

    assignment: Assignment | None
    result: SolveResult
    lower_bound_s: float | None
    """Best proven lower bound on the modelled makespan (solver's dual bound); None when the back end hides it."""


def _class_name(load: LoadModel, i: int) -> str:
    cls = load.classes[i]
    return f"{cls.config.name}_m{cls.max_tokens}"


def _bucket_name(load: LoadModel, j: int) -> str:
    return f"bucket_{j}_s{int(load.boundaries[j])}"


def _full_time(load: LoadModel, i: int, j: int) -> float:
    """t(b_ij, s_j): stage seconds of one full micro-batch."""
    return float(load.per_seq_s[i, j] * load.microbatch_rows[i, j] + load.per_microbatch_s[i, j])


def _fragment_time(load: LoadModel, v: _Vars, i: int, j: int) -> pulp.LpAffineExpression:
    """t~(r_ij, z_ij) = alpha r + beta z."""
    return float(load.per_seq_s[i, j]) * v.r[i, j] + float(load.per_microbatch_s[i, j]) * v.z[i, j]


def build_model(load: LoadModel, upper_bound_s: float | None = None) -> tuple[pulp.LpProblem, _Vars]:
    """The MILP of the module docstring, named for review with ``writeLP``."""
    problem = pulp.LpProblem("dispatch", pulp.LpMinimize)
    v = _Vars()
    p = load.n_replicas
    for i, j in zip(*np.nonzero(load.feasible & (load.counts > 0)[None, :]), strict=True):
        i, j = int(i), int(j)
        name = f"{_class_name(load, i)}_{_bucket_name(load, j)}"
        total, rows = int(load.counts[j]), int(load.microbatch_rows[i, j])
        full_max = -(-total // int(p[i])) // rows
        v.d[i, j] = problem.add_variable(f"d_{name}", 0, total, cat=pulp.LpInteger)
        v.m[i, j] = problem.add_variable(f"m_{name}", 0, full_max, cat=pulp.LpInteger)
        v.r[i, j] = problem.add_variable(f"r_{name}", 0, rows - 1, cat=pulp.LpInteger)
        v.z[i, j] = problem.add_variable(f"z_{name}", 0, 1, cat=pulp.LpBinary)
        if load.bubble_slots[i] > 0:
            v.y[i, j] = problem.add_variable(f"y_{name}", 0, 1, cat=pulp.LpBinary)
    for i in range(len(load.classes)):
        if load.bubble_slots[i] > 0:
            v.largest[i] = problem.add_variable(f"largest_{_class_name(load, i)}", 0)
    v.makespan = problem.add_variable("makespan", 0)
    objective(problem, v)
    add_coverage_constraints(problem, load, v)
    add_ceil_constraints(problem, load, v)
    add_fragment_constraints(problem, load, v)
    add_bubble_constraints(problem, load, v)
    add_makespan_constraints(problem, load, v)
    if upper_bound_s is not None:
        problem += v.makespan <= upper_bound_s * (1 + _BOUND_SLACK), "bound_by_fast"
    return problem, v


def objective(problem: pulp.LpProblem, v: _Vars) -> None:
    """min T: the slowest replica's modelled step time (LobRA's t-hat)."""
    problem += v.makespan


def add_coverage_constraints(problem: pulp.LpProblem, load: LoadModel, v: _Vars) -> None:
    """sum_i d_ij = D_j: every sequence of every bucket goes to exactly one class."""
    for j in np.flatnonzero(load.counts > 0):
        j = int(j)
        problem += (
            pulp.lpSum(v.d[i, jj] for (i, jj) in v.d if jj == j) == int(load.counts[j]),
            f"cover_{_bucket_name(load, j)}",
        )


def add_ceil_constraints(problem: pulp.LpProblem, load: LoadModel, v: _Vars) -> None:
    """d <= p (b m + r) <= d + p - 1: the slowest replica holds ceil(d / p) rows of the bucket."""
    for (i, j), d in v.d.items():
        p, b = int(load.n_replicas[i]), int(load.microbatch_rows[i, j])
        rows = b * v.m[i, j] + v.r[i, j]
        name = f"{_class_name(load, i)}_{_bucket_name(load, j)}"
        problem += p * rows >= d, f"ceil_low_{name}"
        problem += p * rows <= d + p - 1, f"ceil_high_{name}"


def add_fragment_constraints(problem: pulp.LpProblem, load: LoadModel, v: _Vars) -> None:
    """z <= r <= (b - 1) z, and for pipelined classes (w > 0) y <= m <= y * m_max: present micro-batches."""
    for (i, j), r in v.r.items():
        name = f"{_class_name(load, i)}_{_bucket_name(load, j)}"
        problem += v.z[i, j] <= r, f"frag_low_{name}"
        problem += r <= (int(load.microbatch_rows[i, j]) - 1) * v.z[i, j], f"frag_high_{name}"
        if (i, j) in v.y:
            problem += v.y[i, j] <= v.m[i, j], f"full_low_{name}"
            problem += v.m[i, j] <= int(v.m[i, j].upBound) * v.y[i, j], f"full_high_{name}"


def add_bubble_constraints(problem: pulp.LpProblem, load: LoadModel, v: _Vars) -> None:
    """B_i >= every present micro-batch's stage time (w_i > 0): what the pipeline bubble is charged in."""
    for (i, j), y in v.y.items():
        name = f"{_class_name(load, i)}_{_bucket_name(load, j)}"
        problem += v.largest[i] >= _full_time(load, i, j) * y, f"bubble_full_{name}"
        problem += v.largest[i] >= _fragment_time(load, v, i, j), f"bubble_frag_{name}"


def add_makespan_constraints(problem: pulp.LpProblem, load: LoadModel, v: _Vars) -> None:
    """T >= o_i + sum_j [t(b, s) m + t~(r, z)] + w_i B_i for every class (LobRA Eq. 12 per class when W = 1)."""
    for i in range(len(load.classes)):
        compute = pulp.lpSum(
            _full_time(load, i, j) * v.m[i, j] + _fragment_time(load, v, i, j) for (ii, j) in v.m if ii == i
        )
        bubble = float(load.bubble_slots[i]) * v.largest[i] if i in v.largest else 0
        problem += v.makespan >= float(load.overhead_s[i]) + compute + bubble, f"makespan_{_class_name(load, i)}"


def extract_assignment(load: LoadModel, v: _Vars) -> Assignment | None:
    """Class totals from the solved variables; None if they do not cover every bucket exactly."""
    d = np.zeros(load.feasible.shape, dtype=np.int64)
    for (i, j), var in v.d.items():
        d[i, j] = int(round(var.varValue or 0.0))
    if not np.array_equal(d.sum(axis=0), load.counts):
        return None
    return Assignment(counts=d, makespan_s=load.makespan(d))


def _lower_bound(problem: pulp.LpProblem, result: SolveResult, gap_rel: float) -> float | None:
    """The back end's dual bound (HiGHS, SCIP keep their model on ``problem.solverModel``; CBC's is not exposed)."""
    model = getattr(problem, "solverModel", None)
    if result.solver is SolverName.HIGHS and model is not None:
        return float(model.getInfo().mip_dual_bound)
    if result.solver is SolverName.SCIP and model is not None:
        return float(model.getDualbound())
    if result.proven_optimal and result.objective is not None:
        return result.objective * (1 - gap_rel)
    return None


def solve_dispatch_ilp(
    load: LoadModel,
    solver: SolverName,
    time_limit_s: float,
    gap_rel: float,
    upper_bound_s: float | None = None,
) -> IlpOutcome:
    """Build and solve the MILP; ``upper_bound_s`` (the fast makespan) cuts the search."""
    problem, v = build_model(load, upper_bound_s)
    result = solve(problem, solver, time_limit_s=time_limit_s, gap_rel=gap_rel)
    assignment = extract_assignment(load, v) if result.has_solution else None
    return IlpOutcome(assignment=assignment, result=result, lower_bound_s=_lower_bound(problem, result, gap_rel))
