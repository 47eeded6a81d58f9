"""What makes one plan better than another: a choice the planner is given (``plan --objective``,
``--makespan-tolerance``) and a plan records, so that every re-plan of it chooses the same way."""

from __future__ import annotations

from enum import StrEnum


class PlanObjective(StrEnum):
    """What makes one plan better than another (``planner.objective.preferred``)."""

    MAKESPAN = "makespan"
    """The shortest expected step; within ``tie_rel`` of it, the fewest GPUs."""
    COST = "cost"
    """Within ``tie_rel`` of the shortest expected step, the fewest currency units per step at the pools'
    prices (every pool needs a ``price_per_gpu_hour``)."""


TIE_REL = 5e-3
"""The default makespan tolerance ε (``PlannerOptions.tie_rel``): makespans within this fraction are equal, and
the objective decides between them. What a plan that records none (schema 3 or older) was planned with."""
