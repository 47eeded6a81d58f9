"""Refining the best plans: fewer replicas where they do not help (:func:`trimmed`), and
GPU-neutral swaps of one config for another (:func:`polished`), each judged by the dispatcher
(:mod:`.evaluation`) and kept only when the objective (:mod:`.objective`) prefers it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from lorafleet.dispatch import LoadModel
from lorafleet.planner.evaluation import PoolEntry, class_times, evaluate, pool_entry
from lorafleet.planner.local_search import Budget, first_improvements
from lorafleet.planner.options import PlannerOptions
from lorafleet.planner.problem import PlanningProblem


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
    replicas and estimated as the dispatcher would (:func:`class_times`, up to its first replica above
    ``bar``: a makespan above ``bar`` rules the removal out whatever its value): that dispatch's
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
            times[k] = class_times(problem, _one_fewer(load, k), expected.class_counts, only=(k,), above=bar)[k]
            out.append((int(i), float(times.max())))
        elif expected.class_times[k] - float(load.overhead_s[k]) <= slack - (bar - expected.class_times[k]):
            out.append((int(i), None))
    return out


def trimmed(problem: PlanningProblem, entry: PoolEntry, options: PlannerOptions) -> PoolEntry | None:
    """``entry`` with replicas removed while its expected makespan stays within ``tie_rel`` of the original.

    The aggregated MILP spreads even a single sequence over replicas, so it never sees that
    a replica cannot help (one long sequence sets the makespan, say); the dispatcher's load
    model does. Greedily, the removal that frees the most GPUs among the acceptable ones is made,
    until none is acceptable. Removals are screened by :func:`_removal_candidates` before any
    re-balance. A removal is judged whole (:func:`evaluate`: the deployment placed once), not class by class up to
    ``bar`` (:func:`evaluate_below` places it again for each class it prices: lobra-70b/256's trim measured 0.46 ->
    0.58 CPU s so, docs/planner.md). None when nothing can be removed. (The cost objective's removals are moves of
    its own search, ``planner.cost_search``.)
    """
    current, bar = entry, entry.expected_makespan * (1 + options.tie_rel)
    while True:
        best = None
        screened = sorted(_removal_candidates(problem, current, bar), key=lambda c: -int(problem.gpus[c[0]]))
        for i, bound in screened:
            if bound is not None and bound > bar:
                continue
            fewer = current.replicas - np.eye(len(current.replicas), dtype=np.int64)[i]
            candidate = pool_entry(problem, fewer, f"trim:{entry.source}", filtered=False)
            if not candidate.survived:
                continue
            candidate = replace(candidate, expected=evaluate(problem, candidate.load, exact=False, options=options)[0])
            if candidate.expected_makespan > bar:
                continue
            best = candidate
            break
        if best is None:
            return current if current is not entry else None
        current = best


def swaps(problem: PlanningProblem, replicas: np.ndarray) -> Iterator[np.ndarray]:
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


def _traded(
    problem: PlanningProblem, replicas: np.ndarray, i: int, give: int, j: int, take: int
) -> Iterator[np.ndarray]:
    """``replicas`` with ``give`` fewer of config i and ``take`` more of j, if that fits the GPUs."""
    swapped = replicas.copy()
    swapped[i] -= give
    swapped[j] += take
    if problem.fits(swapped):
        yield swapped


def polished(
    problem: PlanningProblem, starts: Sequence[PoolEntry], judged: Sequence[PoolEntry], options: PlannerOptions
) -> list[PoolEntry]:
    """Local search from each of ``starts``: GPU-neutral swaps (:func:`swaps`), first
    improvement, until none helps (:func:`~.local_search.first_improvements`, a swap kept when its
    step is shorter by more than ``tie_rel``); at most ``options.polish_evaluations`` deployments
    looked at in all, none of them one of ``judged`` (already evaluated). Returns the improved plans
    (none when no swap helps).

    The aggregated MILP prices a plan by a fluid model, so its optimum and branches can all
    sit one trade away from the best plan, the more so when every layout also comes with
    activation recomputation (a case: ``<1,1> x 4 + <1,2> + <1,1,rc> x 2`` found, one
    ``<1,1,rc>`` -> ``<1,1>`` swap 8% faster). A swap is evaluated only when its LP bound
    (:func:`~lorafleet.dispatch.balance.fluid_bound`) leaves room for the improvement asked;
    the Theorem-1 bound is no bound on the makespan and skipped improving swaps.
    """
    seen = {tuple(e.replicas) for e in (*starts, *judged)}
    return first_improvements(
        problem,
        starts,
        lambda replicas: ((swapped, "swap") for swapped in swaps(problem, replicas)),
        lambda current, _: current.expected_makespan * (1 - options.tie_rel),
        options,
        seen=seen,
        budget=Budget.LOOKED,
    )


def polish_starts(problem: PlanningProblem, ranked: Sequence[PoolEntry], k: int) -> list[PoolEntry]:
    """The best plan, the best of the other family (with or without a recomputing replica: a
    swap rarely turns one into the other), then the next best, ``k`` in all."""

    def recomputes(e: PoolEntry) -> bool:
        return any(problem.candidates[i].config.recompute for i in np.flatnonzero(e.replicas))

    if not ranked:
        return []
    other = [e for e in ranked if recomputes(e) != recomputes(ranked[0])][:1]
    rest = [e for e in ranked[1:] if all(e is not o for o in other)]
    return [ranked[0], *other, *rest][:k]
