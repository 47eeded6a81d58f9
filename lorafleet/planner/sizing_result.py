"""What a fleet sizing returns: one row per count planned, and the sweep with the chosen row.

``SizingRow`` is one candidate cluster and its plan, with the figures the goals compare (t̂(n), G(n),
t̂(n) G(n), t̂(n) P(n), H(n) and C(n): :mod:`.sizing`); ``SizingResult`` is every row and the one chosen,
and ``SizingError`` the InputError that carries the sweep when none is. ``by_cost`` says whether a
sweep counts money (pools with prices) rather than GPU-seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.accounting import price_per_second
from lorafleet.errors import InputError
from lorafleet.planner.driver import LORAFLEET, PlanResult
from lorafleet.planner.sizing_objective import SizingObjective
from lorafleet.specs.cluster import ClusterSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class SizingRow:
    """One candidate GPU count and its plan (None when the planner found none)."""

    cluster: ClusterSpec
    result: PlanResult | None
    error: InputError | None = None
    """Why there is no plan (the planner's error); None when there is one."""
    job_steps: int | None = None
    """S, set by :func:`judge`; None: the job totals are unknown."""
    plan_s: float = 0.0
    """Seconds the planner took on this count."""

    @property
    def gpus(self) -> int:
        """n: the GPUs of the candidate cluster (``cluster.nodes`` whole nodes)."""
        return self.cluster.n_gpus

    @property
    def infeasible(self) -> str | None:
        """The planner's message when there is no plan."""
        return None if self.error is None else self.error.msg

    @property
    def feasible(self) -> bool:
        return self.result is not None

    @property
    def step_s(self) -> float:
        """t̂(n): the plan's expected step makespan (inf when infeasible)."""
        return self.result.cost(LORAFLEET).makespan_s if self.result is not None else math.inf

    @property
    def used_gpus(self) -> int:
        """G(n): the GPUs the plan uses."""
        return self.result.plan.used_gpus if self.result is not None else 0

    @property
    def gpu_seconds_per_step(self) -> float:
        """t̂(n) G(n)."""
        return self.result.cost(LORAFLEET).gpu_seconds if self.result is not None else math.inf

    @property
    def cost_per_step(self) -> float | None:
        """t̂(n) P(n): what a step costs at the pools' prices; None when a pool has no price (inf: no plan)."""
        if self.result is None:
            return math.inf
        price = price_per_second(self.result.plan, self.cluster)
        return None if price is None else self.step_s * price

    @property
    def nodes(self) -> str:
        """``2``, or by named pool ``a100 2, h100 1``."""
        return ", ".join(f"{p.name} {p.nodes}" if p.name else str(p.nodes) for p in self.cluster.pools)

    @property
    def job_hours(self) -> float | None:
        """H(n), or None when the job's steps are unknown."""
        return None if self.job_steps is None else self.step_s * self.job_steps / 3600

    @property
    def job_gpu_hours(self) -> float | None:
        """C(n), or None when the job's steps are unknown."""
        return None if self.job_steps is None else self.gpu_seconds_per_step * self.job_steps / 3600

    def meets(self, objective: SizingObjective) -> bool:
        """Whether the plan exists and keeps the objective's deadline and budget (those it has)."""
        if not self.feasible:
            return False
        if objective.deadline is not None and not self.job_hours <= objective.deadline.hours:
            return False
        return objective.budget_gpu_hours is None or self.job_gpu_hours <= objective.budget_gpu_hours


@dataclass(frozen=True, kw_only=True, slots=True)
class SizingResult:
    """The row of every count planned (all up to K, or those the goal's search needed), smallest first, and
    the chosen one."""

    rows: tuple[SizingRow, ...]
    objective: SizingObjective
    job_steps: int | None
    chosen: int | None
    """Index into ``rows``; None only on the sweep a :class:`SizingError` carries."""
    reason: str
    """Why that row (or, on an error's sweep, why none)."""
    stopped: str = ""
    """Why the sweep planned no more counts (empty: it planned every count up to K)."""

    @property
    def chosen_row(self) -> SizingRow:
        if self.chosen is None:
            raise ValueError(f"no count was chosen: {self.reason}")
        return self.rows[self.chosen]


class SizingError(InputError):
    """No candidate count gives a plan, or none meets the objective; ``sweep`` holds every row."""

    def __init__(self, path: str, field: str, msg: str, sweep: SizingResult) -> None:
        super().__init__(path, field, msg)
        self.sweep = sweep


def by_cost(rows: Sequence[SizingRow]) -> bool:
    """Whether a sweep counts money: its candidates span several pools and every pool has a price."""
    pools = {p.name for r in rows for p in r.cluster.pools}
    return len(pools) > 1 and all(r.cost_per_step is not None for r in rows)
