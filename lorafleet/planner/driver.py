"""``plan_deployment``: the planner top to bottom.

1. The expected global batch (every task's length quantiles, the longest length included).
2. Candidates: every valid ⟨tp, pp⟩ that fits in memory; LobRA's proposal keeps the best
   throughput per (max-token class, GPU count) (all of them in the exhaustive mode).
3. Planning buckets (the dispatcher's DP, barriers at the candidates' M) for the
   optimisation models, and the search (``search.py``): a pool of deployments, LobRA's
   Theorem-1 filter, and each survivor's expected dispatch by the dispatcher itself
   (Eq. 1-3 with p fixed).
4. Robust choice: the best ``robust_top`` are dispatched by the real per-step dispatcher on
   up to K sampled global batches, raced by successive halving; the lowest mean makespan
   wins, and a plan within ``tie_rel`` of it on fewer GPUs wins over it (GPUs are left idle
   only when that lowers GPU-seconds): the objective, ``objective.preferred``.
5. The plan is placed on GPUs, its expected dispatch recorded, and the baselines built
   and costed on the same expected batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from lorafleet.accounting import price_per_second
from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch import DispatchPolicy, dispatch_step
from lorafleet.errors import InputError
from lorafleet.planner.baselines import baseline_schedules
from lorafleet.planner.candidates import propose_candidates, valid_candidates
from lorafleet.planner.cost_search import entry_cost, frontier_of, within_bounds
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.objective import preferred, race, replica_price
from lorafleet.planner.options import PlannerMode, PlannerOptions, PlanObjective
from lorafleet.planner.placement import build_plan, with_expectation
from lorafleet.planner.problem import Candidate, PlanningProblem, build_problem
from lorafleet.planner.schedule import Phase, Schedule, expected_cost
from lorafleet.planner.search import PoolEntry, search
from lorafleet.plans import DeploymentPlan, FrontierPoint, GlobalBatch, StepPlan
from lorafleet.sampling import sample_global_batch
from lorafleet.solvers import SolveResult
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.work import WorkCounts, counting
from lorafleet.workload import Workload

LORAFLEET = "lorafleet"


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleCost:
    """One way of running the workload, costed per step on the expected batch."""

    name: str
    gpus: int
    """GPUs held (the most any phase holds)."""
    makespan_s: float
    """Expected step time: the dispatcher's estimate on the expected batch."""
    gpu_seconds: float
    """Expected GPU-seconds per step (makespan x GPUs held, summed over phases)."""
    cost_per_step: float | None = None
    """Expected currency units per step at the pools' prices (each phase's makespan x what its replicas
    cost a second, ``accounting.price_per_second``); None when a pool has no price."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanDiagnostics:
    """How the plan was found: what was considered, what the solvers said, where time went."""

    mode: PlannerMode
    valid_configs: int
    """Configs that run the model on the cluster and fit in memory."""
    candidates: tuple[Candidate, ...]
    """The configs the search used (after the proposal, except in exhaustive mode)."""
    bucket_boundaries: tuple[int, ...]
    """Planning buckets s_j of the expected batch."""
    bucket_counts: tuple[int, ...]
    """D_j."""
    pool: tuple[PoolEntry, ...]
    """Every deployment considered, best expected makespan first (filtered ones last)."""
    solves: tuple[SolveResult, ...]
    timings_s: dict[str, float] = field(default_factory=dict)
    fell_back: bool = False
    """A solver failed and the heuristic plan stands in (a SolverFallbackWarning was issued)."""
    sampled_batches: int = 0
    """Sampled batches the chosen plan was dispatched on in the robust race."""
    work: WorkCounts = field(default_factory=WorkCounts)
    """What the whole plan took, baselines included: deterministic counts (``lorafleet.work``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    """The deployment plan, how it compares with the baselines, and how it was found."""

    plan: DeploymentPlan
    schedule: Schedule
    """The plan with its per-step dispatch policy (what ``simulate`` and ``train`` replay)."""
    expected_step: StepPlan
    """The expected batch dispatched on the plan: per-replica loads and times."""
    expected_batch: GlobalBatch
    cost_model: CostModel
    """The cost model the plan was judged by (the one given); the pipeline window it was priced in is
    the plan's policy's. Simulate or dispatch the plan by this one."""
    costs: tuple[ScheduleCost, ...]
    """lorafleet first, then each baseline."""
    baselines: tuple[Schedule, ...]
    diagnostics: PlanDiagnostics
    frontier: tuple[FrontierPoint, ...] = ()
    """Under the cost objective, the cost frontier of the deployments judged on the expected batch: those no
    other is faster and cheaper than, fastest first (``cost_search.frontier_of``; also ``plan.cost_frontier``).
    Empty under the makespan objective."""

    def cost(self, name: str) -> ScheduleCost:
        return next(c for c in self.costs if c.name == name)

    def reduction(self, baseline: str) -> tuple[float, float]:
        """Fractions by which lorafleet lowers (makespan, GPU-seconds) against ``baseline``."""
        ours, theirs = self.cost(LORAFLEET), self.cost(baseline)
        return 1 - ours.makespan_s / theirs.makespan_s, 1 - ours.gpu_seconds / theirs.gpu_seconds


def _check_longest(workload: Workload, valid: tuple[Candidate, ...], cluster: ClusterSpec) -> None:
    """InputError naming the task whose longest sequence no config can hold."""
    largest = max((c.max_tokens for c in valid), default=0)
    if not valid:
        raise InputError(
            workload.path, "model", f"{workload.model.name} fits no parallel config of {cluster.describe()}"
        )
    for k, task in enumerate(workload.tasks):
        if task.lengths.max_length > largest:
            raise InputError(
                workload.path,
                f"tasks[{k}].context_length",
                f"task {task.name!r} has {task.lengths.max_length}-token sequences, but no config of "
                f"{workload.model.name} on {cluster.describe()} holds more than {largest} tokens "
                f"per micro-batch; lower context_length (overflow: truncate) or use more memory per replica",
            )


def _plan_of(
    problem: PlanningProblem, entry: PoolEntry, workload: Workload, solver: str, policy: DispatchPolicy
) -> DeploymentPlan:
    replicas = [
        (c.config, c.max_tokens, int(n)) for c, n in zip(problem.candidates, entry.replicas, strict=True) if n > 0
    ]
    return build_plan(workload, problem.cluster, replicas, solver=solver, policy=policy, cost_model=problem.cost_model)


@dataclass(frozen=True, kw_only=True, slots=True)
class RobustChoice:
    """The chosen plan among the finalists, and how it was chosen."""

    finalists: tuple[PoolEntry, ...]
    """The best plans by expected makespan, with their sampled means when raced."""
    chosen: int
    """Index into ``finalists``."""
    schedule: Schedule
    """The chosen plan as a one-phase schedule."""
    sampled_steps: int
    """Sampled batches the chosen plan was dispatched on (0: chosen on the expected batch)."""


def robust_choice(
    workload: Workload,
    problem: PlanningProblem,
    ranked: list[PoolEntry],
    options: PlannerOptions,
    policy: DispatchPolicy,
    solver: str,
) -> RobustChoice:
    """The best ``robust_top`` plans raced on sampled batches (:func:`~lorafleet.planner.objective.race`);
    the preferred mean wins (:func:`~lorafleet.planner.objective.preferred`). Without samples (or with
    one finalist) the expected batch decides. Under a step-time limit or a step-cost cap, the finalists are those
    of the best ``robust_top`` within the bounds on the expected batch (:func:`_within_bounds`) when any is, and the
    race ranks them by the same objective with the bounds lifted: with the cap alone the fastest (C = ∞), else the
    cheapest."""
    within = _within_bounds(problem, ranked[: options.robust_top], options)
    finalists = within or ranked[: options.robust_top]
    race_cap = math.inf if within and options.max_step_s is None else None
    everyone = tuple(range(len(workload.tasks)))
    schedules = [
        Schedule(name=LORAFLEET, phases=(Phase(tasks=everyone, plan=_plan_of(problem, e, workload, solver, policy)),))
        for e in finalists
    ]
    seed = workload.spec.seed if options.seed is None else options.seed
    price = replica_price(problem, options)
    prices = None if price is None else [price(e.replicas) for e in finalists]
    by_price = None if prices is None else prices.__getitem__
    if options.robust_samples <= 0 or len(finalists) == 1:
        pick = preferred(
            range(len(finalists)),
            lambda k: finalists[k].expected_makespan,
            lambda k: finalists[k].used_gpus,
            options.tie_rel,
            by_price,
            options.max_step_s,
            options.max_step_cost,
        )
        return RobustChoice(finalists=tuple(finalists), chosen=pick, schedule=schedules[pick], sampled_steps=0)
    makespans = race(
        schedules,
        lambda step: sample_global_batch(workload, step, seed),
        options.robust_samples,
        problem.cost_model,
        options.tie_rel,
        options.race_rung,
        prices,
        race_cap,
    )
    raced = [replace(e, sampled_makespan=float(m.mean())) for e, m in zip(finalists, makespans, strict=True)]
    steps = max(m.size for m in makespans)
    last = [k for k in range(len(raced)) if makespans[k].size == steps]  # still in the race at the end
    pick = preferred(
        last,
        lambda k: raced[k].sampled_makespan,
        lambda k: raced[k].used_gpus,
        options.tie_rel,
        by_price,
        cap=race_cap,
    )
    return RobustChoice(finalists=tuple(raced), chosen=pick, schedule=schedules[pick], sampled_steps=steps)


def _within_bounds(problem: PlanningProblem, finalists: list[PoolEntry], options: PlannerOptions) -> list[PoolEntry]:
    """Under the cost objective's bounds, the step-time limit L (``options.max_step_s``) and the step-cost cap C
    (``options.max_step_cost``), the ``finalists`` within both on the expected batch, where the plan reports them:
    the plan nearest a bound sits at it, and its sampled mean would cross it by chance; and a finalist past a bound
    (ranked after those within) must not win the race by being cheaper on the sampled batches. Empty without a
    bound."""
    cap, limit, prices = options.max_step_cost, options.max_step_s, problem.replica_prices
    if (cap is None and limit is None) or prices is None:
        return []
    return [e for e in finalists if within_bounds(e, prices, options)]


def _solver_label(options: PlannerOptions, outcome_solves: tuple[SolveResult, ...], fell_back: bool) -> str:
    if fell_back:
        return "heuristic"
    if options.mode is PlannerMode.EXHAUSTIVE:
        return "exhaustive"
    root = outcome_solves[0]
    return f"{'minlp-' if options.mode is PlannerMode.JOINT_MINLP else ''}{root}"


def _idle_note(problem: PlanningProblem, chosen: PoolEntry, ranked: list[PoolEntry], makespan_s: float) -> str | None:
    idle = problem.n_gpus - chosen.used_gpus
    if idle == 0:
        return None
    if not any(
        problem.fits(chosen.replicas + np.eye(len(chosen.replicas), dtype=np.int64)[i])
        for i in range(len(problem.candidates))
    ):
        if int(chosen.replicas.sum()) >= len(problem.batch):
            return f"{idle} GPU(s) idle: a replica for each of a step's {len(problem.batch)} sequences, no more"
        return f"{idle} GPU(s) idle: no candidate config fits in them (TP groups stay inside a node)"
    bigger = [e for e in ranked if e.used_gpus > chosen.used_gpus]
    versus = (
        (
            f"; the best plan using more GPUs found ({bigger[0].used_gpus} GPUs) expects "
            f"{bigger[0].expected_makespan:.3g} s vs {chosen.expected_makespan:.3g} s"
        )
        if bigger
        else ""
    )
    return (
        f"{idle} GPU(s) left idle: more replicas would not lower the expected makespan beyond the tie tolerance, "
        f"so idling them saves {idle * makespan_s:.3g} GPU-seconds per step{versus}"
    )


def _cost_notes(
    problem: PlanningProblem, chosen: PoolEntry, ranked: list[PoolEntry], options: PlannerOptions
) -> list[str]:
    """Under the cost objective: the GPUs not held and why, and the step-time limit and step-cost cap when given."""
    prices = problem.replica_prices
    assert prices is not None
    notes = []
    idle = problem.n_gpus - chosen.used_gpus
    fastest = min(ranked, key=lambda e: (e.expected_makespan, e.used_gpus))
    limit, cap = options.max_step_s, options.max_step_cost
    if idle:
        versus = ""
        if not np.array_equal(fastest.replicas, chosen.replicas):  # chosen: the race's copy of its entry
            versus = (
                f"; the fastest plan found ({fastest.expected_makespan:.4g} s on {fastest.used_gpus} GPUs) costs "
                f"{entry_cost(fastest, prices):.4g} a step against {entry_cost(chosen, prices):.4g}"
            )
        why = (
            "make a step faster within the step-cost cap"
            if cap is not None and limit is None
            else "make a step cheaper"
        )
        notes.append(f"{idle} GPU(s) not held: more replicas would not {why}{versus}")
    if limit is not None:
        met = chosen.expected_makespan <= limit
        notes.append(
            f"step-time limit {limit:.4g} s: {'met' if met else 'missed'} ({chosen.expected_makespan:.4g} s expected)"
        )
    if cap is not None:
        cost = entry_cost(chosen, prices)
        notes.append(f"step-cost cap {cap:.4g}: {'met' if cost <= cap else 'missed'} ({cost:.4g} expected)")
    return notes


def _expected_cost(schedule: Schedule, cluster: ClusterSpec) -> float | None:
    """Σ over phases of the expected makespan each phase's plan recorded x what its replicas cost a second at
    the pools' prices; None when a pool has no price."""
    total = 0.0
    for phase in schedule.phases:
        price = price_per_second(phase.plan, cluster)
        if price is None:
            return None
        total += phase.plan.expected_makespan_s * price
    return total


def plan_deployment(
    workload: Workload, cluster: ClusterSpec, cost_model: CostModel, options: PlannerOptions = PlannerOptions()
) -> PlanResult:
    """Plan how many replicas of which config to deploy on ``cluster`` for ``workload``.

    Minimises the expected step makespan (LobRA Eq. 1-3): ``min t̂`` subject to ``t̂ >= T_i``
    for every deployed config i (Eq. 12), every bucket fully dispatched, memory respected and
    the replicas fitting the GPUs with TP groups inside nodes. Solver failures fall back to
    the heuristic plan with a :class:`~lorafleet.errors.SolverFallbackWarning`.

    Every deployment is judged under ``options.policy`` (its steps priced by ``cost_model`` in the
    policy's pipeline window), and the plan records that policy whole, and what it was chosen by: the
    objective, its tolerance and the pools' prices (the cluster's, or ``options.prices``).

    The work it took, counted where it is done (``lorafleet.work``), is in ``diagnostics.work`` and in
    the plan's last note.

    Raises:
        InputError: the model fits no config, or some task's sequences fit none.
    """
    with counting() as work:
        result = _plan_deployment(workload, cluster, cost_model, options)
    note = f"work: {work.describe()}"
    plan = replace(result.plan, notes=(*result.plan.notes, note))
    phase = replace(result.schedule.phases[0], plan=plan)
    return replace(
        result,
        plan=plan,
        schedule=replace(result.schedule, phases=(phase,)),
        diagnostics=replace(result.diagnostics, work=work),
    )


def _priced(cluster: ClusterSpec, prices: tuple[tuple[str, float], ...]) -> ClusterSpec:
    """``cluster`` with each pool that ``prices`` names at its price there (``PlannerOptions.prices``: a re-plan's
    are its plan's), the others at their own."""
    if not prices:
        return cluster
    given = dict(prices)
    pools = tuple(
        p.model_copy(update={"price_per_gpu_hour": given[p.name]}) if p.name in given else p for p in cluster.pools
    )
    return cluster.model_copy(update={"pools": pools})


def _plan_deployment(
    workload: Workload, cluster: ClusterSpec, cost_model: CostModel, options: PlannerOptions
) -> PlanResult:
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now

    policy = options.policy
    cluster = _priced(cluster, options.prices)
    if options.objective is PlanObjective.COST and not cluster.priced:
        unpriced = ", ".join(
            repr(p.name) if p.name else "the cluster's" for p in cluster.pools if p.price_per_gpu_hour is None
        )
        raise InputError("<args>", "--objective", f"cost needs a price_per_gpu_hour on every pool; {unpriced} has none")
    if options.objective is PlanObjective.COST and options.mode is PlannerMode.JOINT_MINLP:
        raise InputError(
            "<args>",
            "--mode",
            "joint-minlp solves the makespan objective only; --objective cost plans in "
            "the decomposed (default) or exhaustive mode",
        )
    expected = expected_global_batch(workload)
    valid = valid_candidates(cost_model, cluster)
    _check_longest(workload, valid, cluster)
    candidates = (
        valid if options.mode is PlannerMode.EXHAUSTIVE else propose_candidates(valid, int(expected.lengths.max()))
    )
    problem = build_problem(expected, candidates, cost_model, cluster, policy)
    lap("candidates")

    outcome, ranked = search(problem, options)
    lap("search")

    choice = robust_choice(
        workload, problem, ranked, options, policy, _solver_label(options, outcome.solves, outcome.fell_back)
    )
    chosen = choice.finalists[choice.chosen]
    lap("robust")

    expected_step = dispatch_step(expected, choice.schedule.phases[0].plan, cost_model)
    notes = [
        *outcome.notes,
        f"{len(valid)} valid configs, {len(candidates)} candidates, {len(outcome.pool)} deployments "
        f"considered, {len(ranked)} judged by the dispatcher on the expected batch",
    ]
    if choice.sampled_steps:
        notes.append(
            f"robust choice among {len(choice.finalists)} plans raced on sampled batches: mean makespan "
            f"{chosen.sampled_makespan:.4g} s over {choice.sampled_steps} of them"
        )
    frontier: tuple[FrontierPoint, ...] = ()
    if options.objective is PlanObjective.COST:
        frontier = frontier_of(problem, ranked, chosen)
        notes.extend(_cost_notes(problem, chosen, ranked, options))
    else:
        idle = _idle_note(problem, chosen, ranked, expected_step.estimated_makespan_s)
        if idle:
            notes.append(idle)
    plan = replace(
        with_expectation(choice.schedule.phases[0].plan, expected_step),
        notes=tuple(notes),
        objective=options.objective,
        tie_rel=options.tie_rel,
        max_step_s=options.max_step_s,
        max_step_cost=options.max_step_cost,
        cost_frontier=frontier,
    )
    schedule = replace(choice.schedule, phases=(replace(choice.schedule.phases[0], plan=plan),))

    costs = [
        ScheduleCost(
            name=LORAFLEET,
            gpus=plan.used_gpus,
            makespan_s=expected_step.estimated_makespan_s,
            gpu_seconds=expected_step.estimated_makespan_s * plan.used_gpus,
            cost_per_step=_expected_cost(replace(schedule, phases=(replace(schedule.phases[0], plan=plan),)), cluster),
        )
    ]
    baselines: tuple[Schedule, ...] = ()
    if options.baselines:
        baselines = baseline_schedules(workload, expected, valid, cost_model, cluster, policy)
        for b in baselines:
            step = expected_cost(b)  # each phase recorded its expected step when it was built
            costs.append(
                ScheduleCost(
                    name=b.name,
                    gpus=b.max_gpus,
                    makespan_s=step.makespan_s,
                    gpu_seconds=step.gpu_seconds,
                    cost_per_step=_expected_cost(b, cluster),
                )
            )
    lap("baselines")

    sampled = {id(entry): final for entry, final in zip(ranked, choice.finalists)}
    pool = [sampled.get(id(e), e) for e in outcome.pool]
    diagnostics = PlanDiagnostics(
        mode=options.mode,
        valid_configs=len(valid),
        candidates=problem.candidates,
        bucket_boundaries=tuple(int(s) for s in problem.boundaries),
        bucket_counts=tuple(int(d) for d in problem.counts),
        pool=tuple(pool),
        solves=outcome.solves,
        timings_s=timings,
        fell_back=outcome.fell_back,
        sampled_batches=choice.sampled_steps,
    )
    return PlanResult(
        plan=plan,
        schedule=schedule,
        expected_step=expected_step,
        expected_batch=expected,
        cost_model=cost_model,
        costs=tuple(costs),
        baselines=baselines,
        diagnostics=diagnostics,
        frontier=frontier,
    )
