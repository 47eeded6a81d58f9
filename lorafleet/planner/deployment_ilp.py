"""The aggregated deployment MILP: integer replica counts, fluid dispatch (LobRA Eq. 1-3, linearised).

LobRA's joint problem multiplies the replica count p_i by the per-replica counts n_ij,
which makes it a MINLP (their full MINLP runs past an hour from 48 GPUs). Aggregating the
dispatch per config removes that product: let x_ij >= 0 be the bucket-j sequences config i
takes over all its replicas, charged the amortised full-micro-batch time
w_ij = t(b_ij, s_j) / b_ij. Config i's replicas then all finish within t̂ if::

    Σ_j w_ij x_ij / p_i + a_i <= t̂,      a_i = o_i + bubble_i * max_j t(b_ij, s_j)

(a_i: the step overhead plus the pipeline bubble of a full micro-batch; bubble_i is the load
model's, ``pp_i - 1``: a drain, whatever the pipeline window, ``dispatch.load``; the window's
saving is priced where deployments are judged, on their dispatched micro-batches). Dividing by t̂ and
writing θ = 1 / t̂ (steps per second) and ξ_ij = θ x_ij (sequences per second) gives::

    max θ   s.t.   Σ_i ξ_ij = θ D_j                         every bucket fully dispatched (Eq. 2)
                   Σ_j w_ij ξ_ij <= p_i (1 - a_i / T_ref)      replicas' capacity (Eq. 1)
                   Σ_i N_i p_i <= N, TP groups inside nodes    GPU budget (Eq. 3)
                   ξ_ij = 0 where b_ij = 0                     memory

which is linear except for a_i θ, taken at a reference makespan T_ref and iterated to the
fixed point T_ref = 1 / θ: first that of the LP relaxation (replica counts continuous, HiGHS in process, a few
milliseconds a solve) from :func:`fluid_lower_bound`, then the MILP's from there, one or two solves
(:func:`solve_root`). The model is solved in units of T_ref
(θ' = T_ref θ, ξ' = T_ref ξ, both O(1)): unscaled, CBC spends ten times longer in its root
cut loop. Its only integers are the C replica counts, so it solves in tens of milliseconds
at any batch size. A tie-breaker ``- λ Σ_i N_i p_i`` prefers fewer GPUs when the makespan
is (nearly) the same.

Fragments, ceil(d / p) and the exact bubble are left to the dispatcher's load model, which
the planner applies to the deployments this model proposes (``joint_minlp`` keeps them all
in one model, for small instances). :func:`solve_root` gives the optimum and
:func:`branch_deployments` the optima of the first-level branches on the replica counts of a
center deployment (p_i <= c_i - 1, p_i >= c_i + 1, and "some config c does not use"): strong,
distinct alternatives around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pulp

from lorafleet.planner.problem import PlanningProblem
from lorafleet.solvers import SolveResult, SolverName, solve, solve_lp

FIXED_POINT_RTOL = 1e-2
"""Stop iterating T_ref when it moves by less than this fraction (the model only ranks deployments). At
2e-3 the last solve of the examples' roots only confirmed the plan of the one before (T_ref moving
0.02-0.4 %) at 0.1-0.5 CPU s each; at 1 % the 12 example plans are the same and the optimality
benchmark stays 20/20 (docs/planner.md, "Where the time goes")."""
FIXED_POINT_ITERATIONS = 5
MILP_GAP_REL = 1e-3
"""The model ranks deployments for the dispatcher's exact judgement; 0.1 % is finer than it can tell apart."""


@dataclass(kw_only=True)
class DeploymentVars:
    """Variables by domain name; keys are config index i or (i, j)."""

    n_replicas: dict[int, pulp.LpVariable]
    rate: dict[tuple[int, int], pulp.LpVariable]
    """ξ'_ij: sequences of bucket j on config i (all its replicas) per T_ref of step."""
    throughput: pulp.LpVariable
    """θ' = T_ref / t̂: steps per T_ref."""
    reference_makespan: float
    """T_ref, seconds: the unit of the model's time."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RelaxedDeployment:
    """A solution of the aggregated MILP."""

    replicas: np.ndarray
    """p_i, shape (C,)."""
    makespan: float
    """t̂ = 1 / θ of the relaxation: a ranking estimate, not the expected makespan."""
    branch: str
    """``root`` or the branch that produced it, e.g. ``tp2_pp1<=3``."""


def fluid_lower_bound(problem: PlanningProblem) -> float:
    """Σ_j D_j min_i N_i w_ij / N: every sequence at the best GPU-seconds any config offers, spread
    over all N GPUs with no fixed time (N: the GPUs a deployment can hold, ``PlanningProblem.usable_gpus``).
    Where the fixed-point iteration on T_ref starts."""
    gpu_seconds = np.where(problem.microbatch_size > 0, problem.amortised_time * problem.gpus[:, None], np.inf)
    present = problem.counts > 0
    return float(problem.counts[present] @ gpu_seconds[:, present].min(axis=0) / problem.usable_gpus)


def least_reference(problem: PlanningProblem) -> float:
    """max_j min_{i holds j} a_i: below this T_ref every config that holds some bucket j has no capacity
    (a_i >= T_ref), so the model's only solution is θ = 0. On a fleet far larger than its batch the fluid
    bound lies below it (4 sequences spread over 524,288 GPUs); :func:`solve_root` then starts at twice it."""
    present = (problem.microbatch_size > 0) & (problem.counts > 0)[None, :]
    modelled = np.zeros(len(problem.candidates), dtype=bool)
    modelled[modelled_configs(problem)] = True
    fixed = np.where(present & modelled[:, None], fixed_time(problem)[:, None], np.inf)
    least = fixed[:, problem.counts > 0].min(axis=0)
    return float(least.max()) if least.size and np.all(np.isfinite(least)) else 0.0


def fixed_time(problem: PlanningProblem) -> np.ndarray:
    """a_i = o_i + bubble_i * max_j t(b_ij, s_j) over the non-empty buckets config i can hold
    (bubble_i: ``load.bubble_slots``, the dispatcher's)."""
    present = (problem.microbatch_size > 0) & (problem.counts > 0)[None, :]
    largest = np.where(present, problem.full_time, 0.0).max(axis=1)
    return problem.load.overhead_s + problem.load.bubble_slots * largest


def modelled_configs(problem: PlanningProblem) -> list[int]:
    """Candidates the model has a replica count for: those that fit the GPUs and hold some non-empty bucket."""
    present = (problem.microbatch_size > 0) & (problem.counts > 0)[None, :]
    limits = problem.max_replicas()
    return [i for i in range(len(problem.candidates)) if present[i].any() and limits[i] > 0]


def add_gpu_budget_constraints(model: pulp.LpProblem, problem: PlanningProblem, v: DeploymentVars) -> None:
    """Eq. 3: the replicas fit the GPUs with every TP group inside a node (``PlanningProblem.gpu_budget_rows``)."""
    rows, caps = problem.gpu_budget_rows()
    for r, (row, cap) in enumerate(zip(rows, caps)):
        model += (pulp.lpSum(int(row[i]) * p for i, p in v.n_replicas.items() if row[i]) <= int(cap), f"gpus_row_{r}")


def add_coverage_constraints(model: pulp.LpProblem, problem: PlanningProblem, v: DeploymentVars) -> None:
    """Eq. 2: Σ_i ξ'_ij = θ' D_j over the configs that hold bucket j (memory: b_ij >= 1)."""
    by_bucket: dict[int, list[tuple[pulp.LpVariable, float]]] = {}
    for (_, j), x in v.rate.items():
        by_bucket.setdefault(j, []).append((x, 1))
    for j, demand in enumerate(problem.counts):
        if demand > 0:
            model += (
                pulp.LpAffineExpression(by_bucket.get(j, [])) == float(demand) * v.throughput,
                f"cover[bucket_{j}]",
            )


def add_capacity_constraints(model: pulp.LpProblem, problem: PlanningProblem, v: DeploymentVars) -> None:
    """Eq. 1 per config: Σ_j (w_ij / T_ref) ξ'_ij <= p_i (1 - a_i / T_ref); a config whose fixed
    time alone exceeds T_ref gets no replicas."""
    w = problem.amortised_time
    reference_makespan = v.reference_makespan
    share = 1.0 - fixed_time(problem) / reference_makespan
    by_config: dict[int, list[tuple[pulp.LpVariable, float]]] = {}
    for (i, j), x in v.rate.items():
        by_config.setdefault(i, []).append((x, float(w[i, j] / reference_makespan)))
    for i, p in v.n_replicas.items():
        name = problem.candidates[i].config.name
        work = pulp.LpAffineExpression(by_config.get(i, []))
        model += (work <= float(max(share[i], 0.0)) * p, f"capacity[{name}]")
        if share[i] <= 0:
            model += (p == 0, f"too_slow[{name}]")


def objective(model: pulp.LpProblem, problem: PlanningProblem, v: DeploymentVars, tie_weight: float) -> None:
    """max θ' - λ Σ_i N_i p_i: the shortest makespan first, then fewer GPUs (λ = ``tie_weight`` per GPU).

    A ranking surrogate, not the planner's objective: θ' is the fluid throughput of the
    aggregated model (no ceil(d/p), fragments or micro-batches), good for proposing
    deployments; which of them is the plan is decided by
    :func:`lorafleet.planner.objective.preferred` on the dispatcher's own makespans.
    """
    gpus = problem.gpus
    model.setObjective(v.throughput - tie_weight * pulp.lpSum(int(gpus[i]) * p for i, p in v.n_replicas.items()))


@dataclass(frozen=True, kw_only=True, slots=True)
class Branch:
    """Restrictions of a branch of the MILP."""

    bounds: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Per config i, (lower, upper) replica counts."""
    deploy_one_of: tuple[int, ...] = ()
    """At least one replica among these configs."""

    @property
    def key(self) -> tuple:
        """What makes two branches the same MILP (with the same problem and T_ref)."""
        return tuple(sorted(self.bounds.items())), self.deploy_one_of


def add_branch_constraints(model: pulp.LpProblem, problem: PlanningProblem, v: DeploymentVars, branch: Branch) -> None:
    """The branch's restrictions: replica-count bounds, and Σ_{i in S} p_i >= 1 for ``deploy_one_of`` S."""
    for i, (lo, hi) in branch.bounds.items():
        name = problem.candidates[i].config.name
        model += (v.n_replicas[i] >= lo, f"branch_lower[{name}]")
        model += (v.n_replicas[i] <= hi, f"branch_upper[{name}]")
    if branch.deploy_one_of:
        model += (pulp.lpSum(v.n_replicas[i] for i in branch.deploy_one_of) >= 1, "branch_new_config")


def build_model(
    problem: PlanningProblem, reference_makespan: float, tie_weight: float, branch: Branch = Branch()
) -> tuple[pulp.LpProblem, DeploymentVars]:
    """The MILP over every candidate that holds some non-empty bucket.

    Args:
        reference_makespan: T_ref, where the fixed times are linearised, and the time unit.
        tie_weight: λ, the θ' one GPU is worth when breaking ties.
        branch: restrictions of a branch (none at the root).
    """
    model = pulp.LpProblem("deployment", pulp.LpMaximize)
    limits = problem.max_replicas()
    present = (problem.microbatch_size > 0) & (problem.counts > 0)[None, :]
    v = DeploymentVars(
        n_replicas={},
        rate={},
        throughput=model.add_variable("throughput", lowBound=0),
        reference_makespan=reference_makespan,
    )
    for i in modelled_configs(problem):
        name = problem.candidates[i].config.name
        v.n_replicas[i] = model.add_variable(
            f"n_replicas[{name}]", lowBound=0, upBound=int(limits[i]), cat=pulp.LpInteger
        )
        for j in np.flatnonzero(present[i]):
            v.rate[i, int(j)] = model.add_variable(f"rate[{name}_bucket_{j}]", lowBound=0)
    add_gpu_budget_constraints(model, problem, v)
    add_coverage_constraints(model, problem, v)
    add_capacity_constraints(model, problem, v)
    add_branch_constraints(model, problem, v, branch)
    objective(model, problem, v, tie_weight)
    return model, v


def extract_plan(problem: PlanningProblem, v: DeploymentVars, branch: str) -> RelaxedDeployment:
    replicas = np.zeros(len(problem.candidates), dtype=np.int64)
    for i, p in v.n_replicas.items():
        replicas[i] = int(round(p.value() or 0.0))
    theta = v.throughput.value() or 0.0
    return RelaxedDeployment(
        replicas=replicas, makespan=v.reference_makespan / theta if theta > 0 else float("inf"), branch=branch
    )


def solve_deployment(
    problem: PlanningProblem,
    reference_makespan: float,
    *,
    tie_rel: float,
    solver: SolverName,
    time_limit_s: float,
    branch: Branch = Branch(),
    label: str = "root",
    iterate: bool = True,
) -> tuple[RelaxedDeployment | None, list[SolveResult]]:
    """Solve at T_ref, then (``iterate``) again at T_ref = 1 / θ until it settles.

    ``tie_rel``: makespans within this fraction are ties that fewer GPUs win. Returns the
    last solution (None if a solve gave none) and every solve's result.
    """
    results: list[SolveResult] = []
    plan = None
    t_ref = reference_makespan
    for _ in range(FIXED_POINT_ITERATIONS if iterate else 1):
        plan, result = _solved(
            problem, *build_model(problem, t_ref, tie_rel / problem.usable_gpus, branch), label, solver, time_limit_s
        )
        results.append(result)
        if plan is None:
            return None, results
        if abs(plan.makespan - t_ref) <= FIXED_POINT_RTOL * plan.makespan:
            break
        t_ref = plan.makespan
    return plan, results


def _solved(
    problem: PlanningProblem,
    model: pulp.LpProblem,
    v: DeploymentVars,
    label: str,
    solver: SolverName,
    time_limit_s: float,
) -> tuple[RelaxedDeployment | None, SolveResult]:
    """``model`` solved, and its plan: None without a solution, or with θ = 0 (no deployment in it
    covers every bucket)."""
    # threads=1: CBC's parallel search is not deterministic, and plans must be.
    result = solve(model, solver, time_limit_s=time_limit_s, gap_rel=MILP_GAP_REL, threads=1)
    if not result.has_solution:
        return None, result
    plan = extract_plan(problem, v, label)
    return (plan if np.isfinite(plan.makespan) else None), result


def solve_root(
    problem: PlanningProblem, *, tie_rel: float, solver: SolverName, time_limit_s: float
) -> tuple[RelaxedDeployment | None, list[SolveResult]]:
    """The MILP's optimum p*, by the fixed-point iteration from the LP relaxation's fixed point
    (:func:`relaxed_fixed_point`, from :func:`fluid_lower_bound`, or from twice :func:`least_reference` when the
    fluid bound is not above it: the model has no answer there).

    Started at the fluid bound, the MILP's iteration took 2-4 solves (service-64: 9.06 -> 13.87 -> 14.1 -> 12.85
    s), the first ones far from the answer and among the slowest; the relaxation's fixed point is within 0.6-3.7 %
    of the MILP's on the examples (12.75 s there), so the MILP settles in one or two solves. The plans of every
    example are the same (docs/planner.md, issue #43)."""
    start, least = fluid_lower_bound(problem), least_reference(problem)
    if start <= least:
        start = 2 * least
    start = relaxed_fixed_point(problem, start, tie_rel)
    return solve_deployment(problem, start, tie_rel=tie_rel, solver=solver, time_limit_s=time_limit_s)


RELAXED_ITERATIONS = 20
"""The most LP solves of :func:`relaxed_fixed_point` (3-5 on the examples)."""
RELAXED_RTOL = 1e-3
"""The relaxation's fixed point stops when T_ref moves by less than this fraction."""


def relaxed_fixed_point(problem: PlanningProblem, start: float, tie_rel: float) -> float:
    """The fixed point T_ref = 1 / θ of the model's LP relaxation (every replica count continuous), iterated from
    ``start``; ``start`` itself when an LP gives no positive θ. Only where the MILP's iteration starts: each LP is
    the model of :func:`build_model` with its replica counts continuous, in matrices (:func:`relaxed_throughput`),
    solved by ``solvers.solve_lp`` in process (a few ms; through PuLP it was 30-50 ms each)."""
    t_ref = start
    for _ in range(RELAXED_ITERATIONS):
        theta = relaxed_throughput(problem, t_ref, tie_rel / problem.usable_gpus)
        if theta is None or theta <= 0:
            return start
        new = t_ref / theta
        if abs(new - t_ref) <= RELAXED_RTOL * new:
            return new
        t_ref = new
    return t_ref


def relaxed_throughput(problem: PlanningProblem, reference_makespan: float, tie_weight: float) -> float | None:
    """θ' of :func:`build_model`'s LP relaxation at T_ref (None when the LP solve fails): the columns θ', then
    ξ'_ij of every (modelled config, non-empty bucket it holds), then p_i of the configs whose fixed time is below
    T_ref (the others have no replica); rows: coverage (=), capacity, the GPU budget and p_i's upper bounds (<=)."""
    configs = modelled_configs(problem)
    present = (problem.microbatch_size > 0) & (problem.counts > 0)[None, :]
    share = 1.0 - fixed_time(problem) / reference_makespan
    pairs = [(i, int(j)) for i in configs for j in np.flatnonzero(present[i])]
    usable = [i for i in configs if share[i] > 0]
    col_rate = {pair: 1 + k for k, pair in enumerate(pairs)}
    col_p = {i: 1 + len(pairs) + k for k, i in enumerate(usable)}
    n = 1 + len(pairs) + len(usable)
    buckets = np.flatnonzero(problem.counts > 0)
    a_eq = np.zeros((buckets.size, n))
    row_of = {int(j): r for r, j in enumerate(buckets)}
    a_eq[:, 0] = -problem.counts[buckets].astype(float)
    w = problem.amortised_time
    cap = np.zeros((len(configs), n))
    row_cfg = {i: r for r, i in enumerate(configs)}
    for (i, j), c in col_rate.items():
        a_eq[row_of[j], c] = 1.0
        cap[row_cfg[i], c] = w[i, j] / reference_makespan
    for i, c in col_p.items():
        cap[row_cfg[i], c] = -share[i]
    rows, caps = problem.gpu_budget_rows()
    limits = problem.max_replicas()
    budget = np.zeros((rows.shape[0], n))
    upper = np.zeros((len(usable), n))
    for k, (i, c) in enumerate(col_p.items()):
        budget[:, c] = rows[:, i]
        upper[k, c] = 1.0
    a_ub = np.vstack((cap, budget, upper))
    b_ub = np.concatenate((np.zeros(len(configs)), caps.astype(float), limits[usable].astype(float)))
    cost = np.zeros(n)
    cost[0] = -1.0
    for i, c in col_p.items():
        cost[c] = tie_weight * float(problem.gpus[i])
    x = solve_lp(cost, a_ub, b_ub, a_eq, np.zeros(buckets.size))
    return None if x is None else float(x[0])


def branches_around(problem: PlanningProblem, center: np.ndarray) -> list[tuple[str, Branch]]:
    """First-level branches on the replica counts of ``center``, most promising first.

    Deployed configs are taken by the GPUs they hold (most first): p_i <= c_i - 1 and
    p_i >= c_i + 1 for each; after the first config's two comes one branch that deploys
    some config ``center`` does not (Σ_{i: c_i = 0} p_i >= 1).
    """
    limits = problem.max_replicas()
    modelled = modelled_configs(problem)
    deployed = sorted((i for i in modelled if center[i] > 0), key=lambda i: (-int(center[i] * problem.gpus[i]), i))
    branches: list[tuple[str, Branch]] = []
    for i in deployed:
        name, p = problem.candidates[i].config.name, int(center[i])
        branches.append((f"{name}<={p - 1}", Branch(bounds={i: (0, p - 1)})))
        if p < limits[i]:
            branches.append((f"{name}>={p + 1}", Branch(bounds={i: (p + 1, int(limits[i]))})))
    unused = tuple(i for i in modelled if center[i] == 0)
    if unused:
        branches.insert(min(2, len(branches)), ("new-config", Branch(deploy_one_of=unused)))
    return branches


def branch_deployments(
    problem: PlanningProblem,
    center: np.ndarray,
    reference_makespan: float,
    *,
    tie_rel: float,
    solver: SolverName,
    time_limit_s: float,
    max_branches: int,
    solved: set[tuple] | None = None,
) -> tuple[list[RelaxedDeployment], list[SolveResult]]:
    """The optima of up to ``max_branches`` branches around ``center`` (:func:`branches_around`), at T_ref.

    An infeasible branch adds nothing; duplicates are the caller's to drop. ``solved``: the keys of the
    branches already solved at this T_ref (a search round around another center shares most of them);
    those are skipped (their optimum is already in the caller's pool: the same MILP solves to the same
    plan) and the new ones added.
    """
    found: list[RelaxedDeployment] = []
    results: list[SolveResult] = []
    base = None  # every branch is the model at T_ref plus its restrictions: built once, copied per branch
    for label, branch in branches_around(problem, center)[:max_branches]:
        if solved is not None:
            if branch.key in solved:
                continue
            solved.add(branch.key)
        if base is None:
            base = build_model(problem, reference_makespan, tie_rel / problem.usable_gpus)
        model, v = base[0].copy(), base[1]  # the copy shares the expressions; its constraints are its own
        add_branch_constraints(model, problem, v, branch)
        plan, result = _solved(problem, model, v, label, solver, time_limit_s)
        results.append(result)
        if plan is not None:
            found.append(plan)
    return found, results
