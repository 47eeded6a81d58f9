"""Find the deployment: candidate pool -> Theorem-1 filter -> expected dispatch -> exact re-solve.

Every deployment p is judged by the dispatcher itself on the expected batch: the class
totals d_ij balanced as a step would be (``balance_fast``, milliseconds; re-solved by the
exact dispatch ILP, bounded by the fast answer, for the best few), the sequences placed on
the replicas, cut into micro-batches (padded or packed) and priced by the cost model as a
step is (``dispatch.step.placed_work``); the slowest replica's estimate is the plan's
expected makespan. The balancers minimise the load model (LobRA's Eq. 1-3 for a fixed p,
every replica of a config taking ceil(d_ij / p_i) rows of bucket j, Eq. 12, and in packing
mode each sequence's token share of a micro-batch's constant); the step as placed gives
only d_ij mod p_i replicas a ceil share, and packs real micro-batches, each paying its whole
constant at its longest sequence, so it is judged as its steps will run.

Where the pool comes from depends on the mode (``PlannerMode``): the aggregated MILP's k
best plus the heuristic (decomposed), every maximal deployment (exhaustive), or LobRA's
joint MINLP (joint-minlp). A solver that fails leaves the heuristic plan in the pool, with
a :class:`~lorafleet.errors.SolverFallbackWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
import numpy as np

from lorafleet.dispatch import LoadModel, balance_fast, fluid_bound, placed_work, solve_dispatch_ilp
from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner.candidates import enumerate_deployments, has_distinct_max_tokens, lower_bound, lower_bound_filter
from lorafleet.planner.deployment_ilp import branch_deployments, solve_root
from lorafleet.planner.fallback import heuristic_deployment
from lorafleet.planner.joint_minlp import JointSolution, solve_joint
from lorafleet.planner.objective import preferred
from lorafleet.planner.options import PlannerMode, PlannerOptions
from lorafleet.planner.problem import PlanningProblem
from lorafleet.solvers import SolveResult

@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Evaluation:
    """A deployment's expected dispatch: the dispatcher's balance of the expected batch on it."""

    class_counts: np.ndarray
    """d_ij: sequences of each bucket on each deployed config, shape (K, R) (the load model's classes and buckets)."""
    class_times: np.ndarray
    """T_i: the dispatcher's estimate of the slowest replica of each deployed config once d_ij is
    placed and cut into micro-batches (:func:`~lorafleet.dispatch.step.placed_work`; the
    dispatcher's class order)."""
    makespan: float
    """t̂ = max_i T_i (Eq. 1), the dispatcher's estimate of the expected step: the ranking value."""
    method: str
    """``fast`` or the exact ILP's ``milp:<solver>:<status>``."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PoolEntry:
    """One deployment the planner considered, with what it learnt about it."""

    replicas: np.ndarray
    """p_i, shape (C,)."""
    source: str
    """Where it came from: ``heuristic``, ``milp:<branch>``, ``enumeration``, ``minlp``."""
    used_gpus: int
    load: LoadModel | None
    """The dispatcher's load model of the expected batch on it (None: it cannot hold the batch)."""
    relaxed_makespan: float | None = None
    """The aggregated MILP's (or the heuristic's fluid) t̂."""
    lower_bound: float = float("inf")
    """LobRA's Theorem 1 bound (inf: the deployment cannot hold the longest sequence); it compares
    plans in the filter, but is no bound on the makespan (see :func:`lower_bound`)."""
    survived: bool = True
    """Passed the lower-bound filter."""
    expected: Evaluation | None = None
    """Expected dispatch (survivors only)."""
    sampled_makespan: float | None = None
    """Mean makespan over the sampled batches (robust stage only)."""

    @property
    def expected_makespan(self) -> float:
        return self.expected.makespan if self.expected is not None else float("inf")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOutcome:
    """Every deployment considered and what the solvers said."""

    pool: tuple[PoolEntry, ...]
    """Judged ones first, best first (the preferred plan leads); filtered-out ones last."""
    solves: tuple[SolveResult, ...] = ()
    notes: tuple[str, ...] = ()
    fell_back: bool = False
    """A solver failed and the heuristic stands in for it (a SolverFallbackWarning was issued)."""


def evaluate(problem: PlanningProblem, load: LoadModel, *, exact: bool, options: PlannerOptions
             ) -> tuple[Evaluation, SolveResult | None]:
    """The best expected dispatch on ``load`` (a deployment's view of the expected batch): the
    dispatcher's fast balance, or its exact ILP bounded by it, judged by the dispatcher's estimate
    of the step (:func:`class_times`; both balancers minimise the load model ``load.times``)."""
    assignment, method, result = balance_fast(load), "fast", None
    if exact:
        outcome = solve_dispatch_ilp(load, options.solver, options.time_limit_s, options.gap_rel, upper_bound_s=assignment.makespan_s)
        result = outcome.result
        if outcome.assignment is not None:
            assignment, method = outcome.assignment, f"milp:{result}"
        else:
            method = f"milp:{result}->fast"
            warnings.warn(f"exact dispatch ILP gave no solution ({result}, {result.wall_s:.2f} s); "
                          f"the fast dispatch stands", SolverFallbackWarning, stacklevel=2)
    times = class_times(problem, load, assignment.counts)
    return Evaluation(class_counts=assignment.counts, class_times=times, makespan=float(times.max()), method=method), result


def class_times(problem: PlanningProblem, load: LoadModel, counts: np.ndarray, only: int | None = None) -> np.ndarray:
    """(K,) the dispatcher's estimate of each class's slowest replica once class totals ``counts``
    of the expected batch are placed, cut into micro-batches and priced (``placed_work``); with
    ``only``, of that class alone (the others 0)."""
    work = placed_work(problem.batch, load, counts, problem.cost_model, problem.dispatch.microbatch_mode,
                       classes=None if only is None else (only,))
    return np.array([max(work[r][1] for r in c.replicas) for c in load.classes])


def _entry(problem: PlanningProblem, replicas: np.ndarray, source: str, relaxed: float | None = None) -> PoolEntry:
    replicas = np.asarray(replicas, dtype=np.int64)
    used = int(replicas @ problem.gpus)
    if not problem.covers(replicas):
        return PoolEntry(replicas=replicas, source=source, used_gpus=used, load=None, relaxed_makespan=relaxed, survived=False)
    load, length_based = problem.plan_view(replicas)
    return PoolEntry(replicas=replicas, source=source, used_gpus=used, load=load, relaxed_makespan=relaxed,
                     lower_bound=lower_bound(load, length_based))


def _fallback_note(what: str, result: SolveResult) -> str:
    """Warn that ``what`` failed and the heuristic plan stands in; the note for the plan."""
    message = f"{what} gave no solution ({result}, {result.wall_s:.2f} s); falling back to the heuristic plan"
    warnings.warn(message, SolverFallbackWarning, stacklevel=3)
    return message


def _filter(problem: PlanningProblem, pool: Sequence[PoolEntry], options: PlannerOptions) -> list[PoolEntry]:
    """LobRA's Theorem-1 filter over the whole pool; a dropped entry stays dropped."""
    kept = set(lower_bound_filter([e.lower_bound for e in pool], [has_distinct_max_tokens(problem, e.replicas) for e in pool],
                                  options.lower_bound_threshold, options.min_survivors))
    return [replace(e, survived=e.survived and k in kept) for k, e in enumerate(pool)]


def _evaluate_survivors(problem: PlanningProblem, pool: Sequence[PoolEntry], options: PlannerOptions) -> list[PoolEntry]:
    return [replace(e, expected=evaluate(problem, e.load, exact=False, options=options)[0])
            if e.survived and e.expected is None else e for e in pool]


def decomposed_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """The decomposed search (``_decomposed_search``), run again on the configs without
    activation recomputation when the candidates mix both, its plans judged in the full problem.

    Recomputing variants double the candidates; the MILP-guided branching then explores a
    larger space in the same rounds and can miss a plan it finds when they are absent (2 of
    20 random 7B workloads, +2.9%). Searching the plain sub-problem too means allowing
    recomputation never yields a worse expected plan than forbidding it.
    """
    outcome = _decomposed_search(problem, options)
    plain = [i for i, c in enumerate(problem.candidates) if not c.config.recompute]
    mixed = 0 < len(plain) < len(problem.candidates)
    if not mixed or max(problem.candidates[i].max_tokens for i in plain) < problem.batch.lengths.max():
        return outcome  # nothing to compare with, or no plain config holds the longest sequence
    sub = problem.restricted(plain)
    sub_outcome = _decomposed_search(sub, options)
    pool, seen = list(outcome.pool), {tuple(e.replicas) for e in outcome.pool}
    for entry in sub_outcome.pool:
        replicas = np.zeros(len(problem.candidates), dtype=np.int64)
        replicas[plain] = entry.replicas
        if tuple(replicas) not in seen:
            seen.add(tuple(replicas))
            # Its load view and evaluation depend only on the deployed configs, not on the problem's
            # planning buckets: kept as judged, re-filtered against the whole pool's bound.
            pool.append(replace(entry, replicas=replicas, source=f"plain:{entry.source}", survived=entry.load is not None))
    return SearchOutcome(pool=tuple(_evaluate_survivors(problem, _filter(problem, pool, options), options)),
                         solves=(*outcome.solves, *sub_outcome.solves), notes=(*outcome.notes, *sub_outcome.notes),
                         fell_back=outcome.fell_back and sub_outcome.fell_back)


def _decomposed_search(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """The heuristic plan, the aggregated MILP's optimum and branch optima around the best plan so far.

    Round r: branches around the center (the MILP's optimum at first, then the plan the
    dispatcher judges best), the Theorem-1 filter over everything found, the survivors
    evaluated. The search stops when the best plan beats the center by no more than the tie
    tolerance, or after ``search_rounds`` rounds: the MILP ignores fragments and ceil(d / p),
    so its optimum is a good start, not always the end.
    """
    heuristic, heuristic_fluid = heuristic_deployment(problem)
    pool = [_entry(problem, heuristic, "heuristic", heuristic_fluid)]
    root, solves = solve_root(problem, tie_rel=options.tie_rel, solver=options.solver, time_limit_s=options.time_limit_s)
    if root is None:
        note = _fallback_note("the deployment MILP", solves[-1])
        return SearchOutcome(pool=tuple(_evaluate_survivors(problem, pool, options)), solves=tuple(solves), notes=(note,),
                             fell_back=True)
    seen = {tuple(heuristic)}

    def add(replicas: np.ndarray, source: str, relaxed: float) -> None:
        if tuple(replicas) not in seen:
            seen.add(tuple(replicas))
            pool.append(_entry(problem, replicas, source, relaxed))

    add(root.replicas, "milp:root", root.makespan)
    center = root.replicas
    for _ in range(options.search_rounds):
        found, results = branch_deployments(problem, center, root.makespan, tie_rel=options.tie_rel, solver=options.solver,
                                            time_limit_s=options.time_limit_s, max_branches=options.pool_size - 1)
        solves.extend(results)
        for plan in found:
            add(plan.replicas, f"milp:{plan.branch}", plan.makespan)
        pool = _evaluate_survivors(problem, _filter(problem, pool, options), options)
        best = _preferred_entry([e for e in pool if e.expected is not None], options)
        at_center = next(e for e in pool if tuple(e.replicas) == tuple(center))
        if best.expected_makespan >= at_center.expected_makespan * (1 - options.tie_rel):
            break
        center = best.replicas
    return SearchOutcome(pool=tuple(pool), solves=tuple(solves))


def exhaustive_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """Every maximal deployment (no filter: this is the reference the others are checked against)."""
    return SearchOutcome(pool=tuple(_entry(problem, p, "enumeration") for p in enumerate_deployments(problem, options.enumeration_limit)))


def minlp_pool(problem: PlanningProblem, options: PlannerOptions) -> SearchOutcome:
    """LobRA's joint MINLP on SCIP; the heuristic plan if it gives nothing."""
    solution = solve_joint(problem, time_limit_s=options.time_limit_s, gap_rel=min(options.gap_rel, 1e-4))
    if isinstance(solution, JointSolution):
        return SearchOutcome(pool=(_entry(problem, solution.replicas, "minlp", solution.makespan),), solves=(solution.solve,))
    note = _fallback_note("the joint MINLP", solution)
    return SearchOutcome(pool=(_entry(problem, heuristic_deployment(problem)[0], "heuristic"),), solves=(solution,),
                         notes=(note,), fell_back=True)


POOLS: dict[PlannerMode, Callable[[PlanningProblem, PlannerOptions], SearchOutcome]] = {
    PlannerMode.DECOMPOSED: decomposed_pool,
    PlannerMode.EXHAUSTIVE: exhaustive_pool,
    PlannerMode.JOINT_MINLP: minlp_pool,
}


def _one_fewer(load: LoadModel, k: int) -> LoadModel:
    """``load`` with class k one replica short (the plan's later replicas moved up one place)."""
    classes, start = [], 0
    for i, cls in enumerate(load.classes):
        n = len(cls.replicas) - (i == k)
        classes.append(replace(cls, replicas=tuple(range(start, start + n))))
        start += n
    return replace(load, classes=tuple(classes), n_replicas=load.n_replicas - (np.arange(len(classes)) == k))


def _removal_candidates(problem: PlanningProblem, entry: PoolEntry, bar: float) -> list[tuple[int, float | None]]:
    """Config indices whose replica might go, each with its makespan if it goes (None: needs a re-balance).

    A class k of p_k >= 2 replicas losing one may keep its bucket totals, placed on p_k - 1
    replicas and estimated as the dispatcher would (:func:`class_times`): that dispatch's
    makespan stands for the re-balanced one. A class of one replica can only go if the
    others' slack under ``bar``, at least Σ_i p_i (bar - T_i), could absorb its time.
    """
    load, expected = entry.load, entry.expected
    deployed = np.flatnonzero(entry.replicas > 0)  # classes are the deployed configs, in candidate order
    slack = float(sum((bar - t) * len(c.replicas) for c, t in zip(load.classes, expected.class_times, strict=True)))
    out: list[tuple[int, float | None]] = []
    for k, (i, cls) in enumerate(zip(deployed, load.classes, strict=True)):
        p = len(cls.replicas)
        if p >= 2:
            times = expected.class_times.copy()
            times[k] = class_times(problem, _one_fewer(load, k), expected.class_counts, only=k)[k]
            out.append((int(i), float(times.max())))
        elif expected.class_times[k] - float(load.overhead_s[k]) <= slack - (bar - expected.class_times[k]):
            out.append((int(i), None))
    return out


def trimmed(problem: PlanningProblem, entry: PoolEntry, options: PlannerOptions) -> PoolEntry | None:
    """``entry`` with replicas removed while its expected makespan stays within ``tie_rel`` of the original.

    The aggregated MILP spreads even a single sequence over replicas, so it never sees that
    a replica cannot help (one long sequence sets the makespan, say); the dispatcher's load
    model does. Greedily, the removal that frees the most GPUs among the acceptable ones is
    made, until none is acceptable; removals are screened by :func:`_removal_candidates`
    before any re-balance. None when nothing can be removed.
    """
    current, bar = entry, entry.expected_makespan * (1 + options.tie_rel)
    while True:
        best = None
        for i, bound in sorted(_removal_candidates(problem, current, bar), key=lambda c: -int(problem.gpus[c[0]])):
            if bound is not None and bound > bar:
                continue
            fewer = current.replicas - np.eye(len(current.replicas), dtype=np.int64)[i]
            candidate = _entry(problem, fewer, f"trim:{entry.source}")
            if not candidate.survived:
                continue
            candidate = replace(candidate, expected=evaluate(problem, candidate.load, exact=False, options=options)[0])
            if candidate.expected_makespan <= bar:
                best = candidate
                break
        if best is None:
            return current if current is not entry else None
        current = best


def _swaps(problem: PlanningProblem, replicas: np.ndarray) -> Iterator[np.ndarray]:
    """Deployments on the same GPUs: one replica of a deployed config i traded for N_i / N_j
    replicas of config j (N_j dividing N_i), or N_j / N_i replicas of i for one of j; then
    every replica of a deployed config i traded for replicas of j on the same GPUs (a class
    replaced whole: mixing the two can be worse than either, so single trades cannot reach it)."""
    gpus = problem.gpus
    whole = []
    for i in np.flatnonzero(replicas > 0):
        for j in range(len(replicas)):
            if j == i:
                continue
            if gpus[i] % gpus[j] == 0:
                give, take = 1, gpus[i] // gpus[j]
            elif gpus[j] % gpus[i] == 0:
                give, take = gpus[j] // gpus[i], 1
            else:
                continue
            if replicas[i] >= give:
                yield from _traded(problem, replicas, i, give, j, take)
            if replicas[i] > give and replicas[i] * gpus[i] % gpus[j] == 0:
                whole.append((i, replicas[i], j, replicas[i] * gpus[i] // gpus[j]))
    for i, give, j, take in whole:
        yield from _traded(problem, replicas, i, give, j, take)


def _traded(problem: PlanningProblem, replicas: np.ndarray, i: int, give: int, j: int, take: int) -> Iterator[np.ndarray]:
    """``replicas`` with ``give`` fewer of config i and ``take`` more of j, if that fits the GPUs."""
    swapped = replicas.copy()
    swapped[i] -= give
    swapped[j] += take
    if problem.fits(swapped):
        yield swapped


def polished(problem: PlanningProblem, starts: Sequence[PoolEntry], judged: Sequence[PoolEntry],
             options: PlannerOptions) -> list[PoolEntry]:
    """Local search from each of ``starts``: GPU-neutral swaps (:func:`_swaps`), first
    improvement, until none helps; at most ``options.polish_evaluations`` deployments looked
    at in all, none of them one of ``judged`` (already evaluated). Returns the improved plans
    (none when no swap helps).

    The aggregated MILP prices a plan by a fluid model, so its optimum and branches can all
    sit one trade away from the best plan, the more so when every layout also comes with
    activation recomputation (a case: ``<1,1> x 4 + <1,2> + <1,1,rc> x 2`` found, one
    ``<1,1,rc>`` -> ``<1,1>`` swap 8% faster). A swap is evaluated only when its LP bound
    (:func:`~lorafleet.dispatch.balance.fluid_bound`) leaves room for the improvement asked;
    the Theorem-1 bound is no bound on the makespan and skipped improving swaps.
    """
    looked, seen, found = 0, {tuple(e.replicas) for e in (*starts, *judged)}, []
    for start in starts:
        current = start
        while looked < options.polish_evaluations:
            better = None
            for replicas in _swaps(problem, current.replicas):
                if looked >= options.polish_evaluations:
                    break
                if tuple(replicas) in seen:
                    continue
                seen.add(tuple(replicas))
                looked += 1
                candidate = _entry(problem, replicas, f"swap:{start.source}")
                if not candidate.survived or fluid_bound(candidate.load) >= current.expected_makespan * (1 - options.tie_rel):
                    continue
                candidate = replace(candidate, expected=evaluate(problem, candidate.load, exact=False, options=options)[0])
                if candidate.expected_makespan < current.expected_makespan * (1 - options.tie_rel):
                    better = candidate
                    break
            if better is None:
                break
            current = better
        if current is not start:
            found.append(current)
    return found


def _polish_starts(problem: PlanningProblem, ranked: Sequence[PoolEntry], k: int) -> list[PoolEntry]:
    """The best plan, the best of the other family (with or without a recomputing replica: a
    swap rarely turns one into the other), then the next best, ``k`` in all."""
    def recomputes(e: PoolEntry) -> bool:
        return any(problem.candidates[i].config.recompute for i in np.flatnonzero(e.replicas))

    if not ranked:
        return []
    other = [e for e in ranked if recomputes(e) != recomputes(ranked[0])][:1]
    rest = [e for e in ranked[1:] if all(e is not o for o in other)]
    return [ranked[0], *other, *rest][:k]


def search(problem: PlanningProblem, options: PlannerOptions) -> tuple[SearchOutcome, list[PoolEntry]]:
    """The pool of ``options.mode`` and its survivors with their expected dispatch, best first.

    Every survivor gets the fast expected dispatch; the best ``exact_top`` are then
    re-solved by the exact dispatch ILP. In decomposed mode the best ``polish_starts`` are
    polished by GPU-neutral swaps (:func:`polished`). The preferred one (least expected
    makespan, or within ``tie_rel`` of it on fewer GPUs) is also offered with idle replicas
    trimmed (:func:`trimmed`); the list returned starts with the preferred plan, then the others
    by expected makespan.
    """
    outcome = POOLS[options.mode](problem, options)
    pool = _evaluate_survivors(problem, outcome.pool, options)
    solves = list(outcome.solves)
    ranked = sorted((e for e in pool if e.expected is not None), key=lambda e: (e.expected_makespan, e.used_gpus))
    for k, entry in enumerate(ranked[: options.exact_top]):
        expected, result = evaluate(problem, entry.load, exact=True, options=options)
        ranked[k] = replace(entry, expected=expected)
        solves.append(result)
    if options.mode is PlannerMode.DECOMPOSED:
        ranked.extend(polished(problem, _polish_starts(problem, ranked, options.polish_starts), ranked, options))
        ranked.sort(key=lambda e: (e.expected_makespan, e.used_gpus))
    if ranked:
        trim = trimmed(problem, _preferred_entry(ranked, options), options)
        ranked.extend([trim] if trim is not None else [])
        ranked.sort(key=lambda e: (e.expected_makespan, e.used_gpus))
        best = _preferred_entry(ranked, options)
        ranked = [best, *(e for e in ranked if e is not best)]
    pool = ranked + [e for e in pool if e.expected is None]
    return replace(outcome, pool=tuple(pool), solves=tuple(solves)), ranked


def _preferred_entry(entries: list[PoolEntry], options: PlannerOptions) -> PoolEntry:
    return preferred(entries, lambda e: e.expected_makespan, lambda e: e.used_gpus, options.tie_rel)
