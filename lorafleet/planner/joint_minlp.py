"""LobRA's joint deployment MINLP (Eq. 1-3 with Eq. 10-12), built directly in PySCIPOpt.

Replica counts and the per-replica dispatch in one model, as LobRA solves it. Variables
for every candidate config i and bucket j it can hold (b_ij >= 1, D_j > 0):

- ``n_replicas[i]`` p_i in [0, P_i] and ``active[i]`` = [p_i > 0];
- ``full[i,j]`` m_ij (full micro-batches per replica) and ``frag[i,j]`` r_ij in
  [0, b_ij - 1] (rows of the fragment micro-batch): n_ij = b_ij m_ij + r_ij rows per replica;
- ``has_frag[i,j]`` z_ij = [r_ij > 0] and, for pp_i > 1, ``has_full[i,j]`` y_ij = [m_ij > 0]
  and ``bubble[i]`` B_i, the largest micro-batch stage time;
- ``makespan`` t̂.

Coverage Σ_i p_i n_ij >= D_j multiplies two integer variables: a non-convex MINLP, which
SCIP solves exactly by spatial branching. It grows with the GPU count (LobRA reports more
than an hour from 48 GPUs), so the planner uses it only as a check of its decomposition
on small instances (``PlannerMode.JOINT_MINLP``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lorafleet.planner.problem import PlanningProblem
from lorafleet.solvers import SolveResult, SolverName, SolveStatus

_SCIP_STATUS = {
    "optimal": SolveStatus.OPTIMAL,
    "gaplimit": SolveStatus.OPTIMAL,
    "infeasible": SolveStatus.INFEASIBLE,
    "unbounded": SolveStatus.UNBOUNDED,
    "inforunbd": SolveStatus.INFEASIBLE,
}


@dataclass(kw_only=True)
class JointVars:
    """The model's variables by domain name; keys are config index i or (i, j)."""

    n_replicas: dict[int, Any] = field(default_factory=dict)
    active: dict[int, Any] = field(default_factory=dict)
    full: dict[tuple[int, int], Any] = field(default_factory=dict)
    frag: dict[tuple[int, int], Any] = field(default_factory=dict)
    has_frag: dict[tuple[int, int], Any] = field(default_factory=dict)
    has_full: dict[tuple[int, int], Any] = field(default_factory=dict)
    bubble: dict[int, Any] = field(default_factory=dict)
    makespan: Any = None

    def rows(self, problem: PlanningProblem, i: int, j: int) -> Any:
        """n_ij = b_ij m_ij + r_ij: rows of bucket j on every replica of config i."""
        return int(problem.microbatch_size[i, j]) * self.full[i, j] + self.frag.get((i, j), 0)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class JointSolution:
    replicas: np.ndarray
    """p_i, shape (C,)."""
    per_replica: np.ndarray
    """n_ij, shape (C, R)."""
    makespan: float
    """max over deployed configs of the load model's T_i(n_i), recomputed from the counts."""
    solve: SolveResult


def _name(problem: PlanningProblem, i: int, j: int | None = None) -> str:
    cfg = problem.candidates[i].config.name
    return cfg if j is None else f"{cfg}_bucket_{j}"


def add_microbatch_constraints(model: Any, problem: PlanningProblem, v: JointVars) -> None:
    """The split n_ij = b_ij m_ij + r_ij and its indicators.

    ``z_ij <= r_ij <= (b_ij - 1) z_ij`` (fragment present), ``m_ij <= floor(D_j / b_ij) y_ij``
    (pp > 1: full micro-batch present) and ``n_ij <= D_j active_i`` (no rows without replicas).
    """
    for (i, j), full in v.full.items():
        b, name = int(problem.microbatch_size[i, j]), _name(problem, i, j)
        demand = int(problem.counts[j])
        if (i, j) in v.frag:
            model.addCons(v.has_frag[i, j] <= v.frag[i, j], name=f"frag_lower[{name}]")
            model.addCons(v.frag[i, j] <= (b - 1) * v.has_frag[i, j], name=f"frag_upper[{name}]")
        if (i, j) in v.has_full:
            model.addCons(full <= (demand // b) * v.has_full[i, j], name=f"full_upper[{name}]")
        model.addCons(v.rows(problem, i, j) <= demand * v.active[i], name=f"rows_active[{name}]")


def add_coverage_constraints(model: Any, problem: PlanningProblem, v: JointVars) -> None:
    """Eq. 2, every bucket fully dispatched: Σ_i p_i n_ij >= D_j (bilinear)."""
    from pyscipopt import quicksum

    for j, demand in enumerate(problem.counts):
        if demand > 0:
            terms = [v.n_replicas[i] * v.rows(problem, i, j) for (i, jj) in v.full if jj == j]
            model.addCons(quicksum(terms) >= int(demand), name=f"cover[bucket_{j}]")


def add_gpu_budget_constraints(model: Any, problem: PlanningProblem, v: JointVars) -> None:
    """Eq. 3: the replicas fit the GPUs with TP groups inside nodes, and p_i <= P_i active_i."""
    from pyscipopt import quicksum

    rows, caps = problem.gpu_budget_rows()
    limits = problem.max_replicas()
    for r, (row, cap) in enumerate(zip(rows, caps)):
        model.addCons(
            quicksum(int(row[i]) * p for i, p in v.n_replicas.items() if row[i]) <= int(cap), name=f"gpus_row_{r}"
        )
    for i, p in v.n_replicas.items():
        model.addCons(p <= int(limits[i]) * v.active[i], name=f"activate[{_name(problem, i)}]")
        model.addCons(p >= v.active[i], name=f"deploy[{_name(problem, i)}]")


def add_bubble_constraints(model: Any, problem: PlanningProblem, v: JointVars) -> None:
    """B_i >= t(b_ij, s_j) y_ij and B_i >= α_ij r_ij + β_ij z_ij: the largest micro-batch (pp_i > 1).

    A minimisation drives B_i down to the largest present, so LobRA's big-M upper bounds
    and selector binaries are not needed.
    """
    full_time = problem.full_time
    for (i, j), y in v.has_full.items():
        name = _name(problem, i, j)
        model.addCons(v.bubble[i] >= float(full_time[i, j]) * y, name=f"bubble_full[{name}]")
        if (i, j) in v.frag:
            model.addCons(v.bubble[i] >= _fragment_time(problem, v, i, j), name=f"bubble_frag[{name}]")


def _fragment_time(problem: PlanningProblem, v: JointVars, i: int, j: int) -> Any:
    """t~(r, z) = α_ij r_ij + β_ij z_ij: the fragment's stage time, 0 when r_ij = 0."""
    return (
        float(problem.load.per_seq_s[i, j]) * v.frag[i, j]
        + float(problem.load.per_microbatch_s[i, j]) * v.has_frag[i, j]
    )


def add_makespan_constraints(model: Any, problem: PlanningProblem, v: JointVars) -> None:
    """Eq. 1, t̂ >= T_i for every config (Eq. 12)::

    T_i = o_i active_i + Σ_j [ t(b_ij, s_j) m_ij + α_ij r_ij + β_ij z_ij ] + w_i B_i

    with w_i the load model's ``bubble_slots`` (``pp_i - 1``, LobRA's 1F1B flushed every step,
    whatever the pipeline window: ``dispatch.load``).
    """
    from pyscipopt import quicksum

    full_time = problem.full_time
    for i in v.n_replicas:
        work = [float(full_time[i, j]) * m for (ii, j), m in v.full.items() if ii == i]
        work += [_fragment_time(problem, v, i, j) for (ii, j) in v.frag if ii == i]
        if i in v.bubble:
            work.append(float(problem.load.bubble_slots[i]) * v.bubble[i])
        work.append(float(problem.load.overhead_s[i]) * v.active[i])
        model.addCons(v.makespan >= quicksum(work), name=f"makespan[{_name(problem, i)}]")


def objective(model: Any, v: JointVars) -> None:
    """Eq. 1: minimise the expected step makespan t̂ = max_i T_i."""
    model.setObjective(v.makespan, "minimize")


def build_model(problem: PlanningProblem) -> tuple[Any, JointVars]:
    """The PySCIPOpt model with every variable and constraint family."""
    from pyscipopt import Model

    model = Model("joint_deployment")
    model.hideOutput()
    v = JointVars()
    limits = problem.max_replicas()
    for i, cand in enumerate(problem.candidates):
        name = _name(problem, i)
        v.n_replicas[i] = model.addVar(name=f"n_replicas[{name}]", vtype="I", lb=0, ub=int(limits[i]))
        v.active[i] = model.addVar(name=f"active[{name}]", vtype="B")
        for j, demand in enumerate(problem.counts):
            b = int(problem.microbatch_size[i, j])
            if b == 0 or demand == 0:
                continue
            v.full[i, j] = model.addVar(name=f"full[{name}_bucket_{j}]", vtype="I", lb=0, ub=int(demand) // b)
            if b > 1:
                v.frag[i, j] = model.addVar(name=f"frag[{name}_bucket_{j}]", vtype="I", lb=0, ub=b - 1)
                v.has_frag[i, j] = model.addVar(name=f"has_frag[{name}_bucket_{j}]", vtype="B")
            if cand.config.pp > 1:
                v.has_full[i, j] = model.addVar(name=f"has_full[{name}_bucket_{j}]", vtype="B")
        if cand.config.pp > 1:
            v.bubble[i] = model.addVar(name=f"bubble[{name}]", vtype="C", lb=0)
    v.makespan = model.addVar(name="makespan", vtype="C", lb=0)
    add_microbatch_constraints(model, problem, v)
    add_coverage_constraints(model, problem, v)
    add_gpu_budget_constraints(model, problem, v)
    add_bubble_constraints(model, problem, v)
    add_makespan_constraints(model, problem, v)
    objective(model, v)
    return model, v


def extract_plan(model: Any, problem: PlanningProblem, v: JointVars, result: SolveResult) -> JointSolution:
    """Read p and n_ij back; the makespan is recomputed with the load model's closed form."""
    replicas = np.array(
        [int(round(model.getVal(v.n_replicas[i]))) for i in range(len(problem.candidates))], dtype=np.int64
    )
    per_replica = np.zeros(problem.microbatch_size.shape, dtype=np.int64)
    for (i, j), m in v.full.items():
        if replicas[i] > 0:
            frag = v.frag.get((i, j))
            per_replica[i, j] = int(problem.microbatch_size[i, j]) * int(round(model.getVal(m))) + (
                int(round(model.getVal(frag))) if frag is not None else 0
            )
    times = [problem.load.replica_load(int(i), per_replica[i]) for i in np.flatnonzero(replicas > 0)]
    return JointSolution(replicas=replicas, per_replica=per_replica, makespan=float(max(times)), solve=result)


def solve_joint(
    problem: PlanningProblem, time_limit_s: float = 60.0, gap_rel: float = 1e-4
) -> JointSolution | SolveResult:
    """Solve the MINLP on SCIP: a JointSolution, or the SolveResult saying why there is none.

    A time limit that stops SCIP with an incumbent is reported FEASIBLE, never OPTIMAL.
    """
    model, v = build_model(problem)
    model.setParam("limits/time", float(time_limit_s))
    model.setParam("limits/gap", float(gap_rel))
    start = time.perf_counter()
    model.optimize()
    wall = time.perf_counter() - start
    has = model.getNSols() > 0
    status = _SCIP_STATUS.get(model.getStatus(), SolveStatus.FEASIBLE if has else SolveStatus.FAILED)
    if status is SolveStatus.OPTIMAL and not has:
        status = SolveStatus.FAILED
    result = SolveResult(status, float(model.getObjVal()) if has else None, wall, SolverName.SCIP)
    if status not in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        return result
    return extract_plan(model, problem, v, result)
