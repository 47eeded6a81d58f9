"""How a fleet re-plans when its tasks change: :class:`ReplanSettings`, one field table.

``lorafleet train`` (its live task queue, docs/queue.md) and ``lorafleet simulate --arrivals``
(docs/arrivals.md) take the same five flags, generated from the fields below (their flag, doc string, default
and bound: :mod:`lorafleet.specs.fields`, ``commands._option_flags``) and checked once, as the settings are
built. ``TrainOptions.replan`` carries them into the run file; ``planner.incremental.ReplanOptions`` holds them
with the measured price of a move, and ``planner.decision.decide`` waits ``after`` steps.

Plain data below the planner, so the training options, the run file and the arrivals replay can hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from lorafleet.specs.field_docs import documented
from lorafleet.specs.fields import ARGS, check_fields, flag


class ReplanObjective(StrEnum):
    """What an incremental re-plan minimises (``planner.incremental``, step 4 of its module doc)."""

    MAKESPAN = "makespan"
    """The planner's fastest plan, taken when its GPU-second saving over the horizon repays its migration."""
    GPU_S = "gpu-s"
    """The fewest GPU-seconds over the horizon, migration included, among the kept, the planner's and the
    trimmed plans."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanSettings:
    """What a re-plan of a running fleet weighs and when its move is applied; strings are accepted for the
    objective and converted. A bad value is an InputError naming its flag."""

    __pydantic_config__ = documented(extra="forbid")

    migration_s: float | None = field(default=None, metadata=flag("--migration-s", "S", least=0))
    """price a change of deployment at a flat S seconds of each torn-down replica's GPUs (default: what the
    in-process rebuild costs, its stages loaded at the pools' stage_load_gbps or a run's measured rate;
    docs/arrivals.md)"""
    objective: ReplanObjective = field(default=ReplanObjective.MAKESPAN, metadata=flag("--replan-objective"))
    """what a re-plan minimises: makespan, the planner's fastest plan, taken when the GPU-seconds it saves over
    the horizon repay its migration, or gpu-s, the fewest GPU-seconds over the horizon, migration included"""
    horizon: int = field(default=200, metadata=flag("--replan-horizon", "STEPS", least=1))
    """the most steps a re-plan counts a new deployment's savings over, fewer when the job ends sooner"""
    after: int = field(default=1, metadata=flag("--replan-after", "STEPS", least=0))
    """a change the running deployment can serve is applied on it at once, its re-plan runs beside the next
    STEPS steps and a move it finds is applied after them; 0: the change waits for the re-plan"""
    samples: int = field(default=0, metadata=flag("--replan-samples", "K", least=0))
    """price a move's saving a step on K sampled batches of the new tasks, the running and the new deployment
    dispatched on the same ones, instead of on the expected batch; 0: the expected batch"""

    def __post_init__(self) -> None:
        check_fields(self, ARGS)
