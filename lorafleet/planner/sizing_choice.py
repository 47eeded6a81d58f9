"""The count a sizing's goal picks from the rows planned (pure: no planning).

``judge`` gives the rows the job's steps and chooses the row the objective prefers, by the rules of
:mod:`.sizing` (the fewest GPU-seconds, the fewest GPUs in time, the fastest within a budget, the
cheapest that meets both; at the pools' prices where a sweep counts money), or raises a
:class:`~lorafleet.planner.sizing_result.SizingError` that says which limit was missed and by how much.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lorafleet.planner.sizing_objective import (
    OBJECTIVE_SOURCE,
    SizingGoal,
    SizingObjective,
    check_steps,
    format_hours,
)
from lorafleet.planner.sizing_result import SizingError, SizingResult, SizingRow, by_cost


def _span(rows: Sequence[SizingRow]) -> str:
    """``8 to 32 GPUs``, or ``8 GPUs`` for one count."""
    return f"{rows[0].gpus} to {rows[-1].gpus} GPUs" if len(rows) > 1 else f"{rows[0].gpus} GPUs"


def goal_value(row: SizingRow, goal: SizingGoal, priced: bool) -> float:
    """What ``goal`` minimises over the rows that meet it (:mod:`.sizing`), ties going to fewer GPUs: t̂(n) G(n) with
    no deadline or budget, n under a deadline, t̂(n) within a budget, C(n) under both; t̂(n) P(n) where a sweep over
    pools counts money (``priced``: :func:`by_cost`) with no budget."""
    if priced and goal in (SizingGoal.GPU_SECONDS, SizingGoal.DEADLINE):
        return row.cost_per_step
    if goal is SizingGoal.GPU_SECONDS:
        return row.gpu_seconds_per_step
    if goal is SizingGoal.DEADLINE:
        return row.gpus
    return row.step_s if goal is SizingGoal.BUDGET else row.job_gpu_hours


def _choose(rows: list[SizingRow], objective: SizingObjective, steps: int | None) -> tuple[int | None, str, str]:
    """(index of the chosen row or None, the reason, the objective field a miss names)."""
    feasible = [k for k, r in enumerate(rows) if r.feasible]
    meeting = [k for k in feasible if rows[k].meets(objective)]
    goal, deadline, budget = objective.goal, objective.deadline, objective.budget_gpu_hours
    priced = by_cost(rows)

    def best(ks: list[int]) -> int:
        return min(ks, key=lambda k: (goal_value(rows[k], goal, priced), rows[k].gpus))

    of = f"of {len(feasible)} feasible count{'s' if len(feasible) != 1 else ''}"
    if priced:
        if goal is SizingGoal.GPU_SECONDS:
            k = best(feasible)
            job = f", {rows[k].cost_per_step * steps:.4g} for {steps} steps" if steps else ""
            return k, f"cheapest {of} at the pools' prices ({rows[k].cost_per_step:.4g} a step{job})", ""
        if goal is SizingGoal.DEADLINE and meeting:
            k = best(meeting)
            why = (
                f"cheapest that finishes {steps} steps within {format_hours(deadline.hours)} at the pools' prices "
                f"({format_hours(rows[k].job_hours)}, {rows[k].cost_per_step * steps:.4g})"
            )
            return k, why, ""
    if goal is SizingGoal.GPU_SECONDS:
        k = best(feasible)
        job = f", {rows[k].job_gpu_hours:.4g} GPU-hours for {steps} steps" if steps else ""
        return k, f"fewest GPU-seconds {of} ({rows[k].gpu_seconds_per_step:.4g} GPU-s per step{job})", ""
    if meeting:
        if goal is SizingGoal.DEADLINE:
            k = best(meeting)
            why = (
                f"fewest GPUs that finish {steps} steps within {format_hours(deadline.hours)} "
                f"({format_hours(rows[k].job_hours)})"
            )
        elif goal is SizingGoal.BUDGET:
            k = best(meeting)
            why = f"fastest plan within {budget:.4g} GPU-hours ({rows[k].job_gpu_hours:.4g} GPU-hours)"
        else:
            k = best(meeting)
            why = (
                f"fewest GPU-hours that finish {steps} steps within {format_hours(deadline.hours)} and "
                f"{budget:.4g} GPU-hours ({format_hours(rows[k].job_hours)}, {rows[k].job_gpu_hours:.4g} GPU-hours)"
            )
        return k, why, ""
    none = f"none of the counts swept ({_span(rows)})"
    fastest = min(feasible, key=lambda k: (rows[k].step_s, rows[k].gpus))
    cheapest = min(feasible, key=lambda k: (rows[k].gpu_seconds_per_step, rows[k].gpus))
    if deadline is not None and not any(rows[k].job_hours <= deadline.hours for k in feasible):
        return (
            None,
            f"{none} finishes {steps} steps within {format_hours(deadline.hours)}: the fastest found, "
            f"{rows[fastest].gpus} GPUs, takes {format_hours(rows[fastest].job_hours)}",
            "deadline",
        )
    if budget is not None and not any(rows[k].job_gpu_hours <= budget for k in feasible):
        return (
            None,
            f"{none} runs {steps} steps within {budget:.4g} GPU-hours: the cheapest found, "
            f"{rows[cheapest].gpus} GPUs, needs {rows[cheapest].job_gpu_hours:.4g} GPU-hours",
            "budget_gpu_hours",
        )
    on_time = [k for k in feasible if rows[k].job_hours <= deadline.hours]
    least = min(on_time, key=lambda k: (rows[k].job_gpu_hours, rows[k].gpus))
    return (
        None,
        f"{none} meets both the deadline and the budget: the cheapest that finishes "
        f"{steps} steps within {format_hours(deadline.hours)}, {rows[least].gpus} GPUs, needs "
        f"{rows[least].job_gpu_hours:.4g} GPU-hours, more than {budget:.4g}",
        "budget_gpu_hours",
    )


def judge(rows: Sequence[SizingRow], objective: SizingObjective, steps: int | None) -> SizingResult:
    """The rows with the job's ``steps`` S, and the one ``objective`` chooses (the rules: :mod:`.sizing`).

    Raises:
        InputError: a budget with no ``steps`` (``OBJECTIVE_SOURCE``, ``steps``).
        SizingError: no row has a plan (the planner's error of the largest count, its source and field),
            or none meets the objective (``deadline`` or ``budget_gpu_hours``).
    """
    check_steps(objective, steps)
    rows = [replace(r, job_steps=steps) for r in rows]
    if not any(r.feasible for r in rows):
        last = rows[-1].error
        sweep = SizingResult(rows=tuple(rows), objective=objective, job_steps=steps, chosen=None, reason=last.msg)
        raise SizingError(last.path, last.field, f"no plan on any count swept ({_span(rows)}): {last.msg}", sweep)
    chosen, reason, missed = _choose(rows, objective, steps)
    sweep = SizingResult(rows=tuple(rows), objective=objective, job_steps=steps, chosen=chosen, reason=reason)
    if chosen is None:
        raise SizingError(OBJECTIVE_SOURCE, missed, reason, sweep)
    return sweep
