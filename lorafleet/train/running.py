"""What the training loop runs between two fleet changes, and what the changes ask of the running fleet.

:class:`Running` is the loop's state as one value (tasks, plan, cost model, recalibrator), swapped whole at a
change (``train.changes``); :class:`Stop` says why the workers stop at a change instead; :class:`FleetPort` is
the running fleet as the changes see it (rank 0's executor: ``train.torch_fleet``; a fake in tests). No torch
here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.dispatch import Recalibrator
    from lorafleet.plans import DeploymentPlan
    from lorafleet.runtime.data_stream import TaskData
    from lorafleet.train.queue import Ledger
    from lorafleet.turns import TaskTurns
    from lorafleet.workload import Workload


@dataclass(frozen=True)
class Running:
    """What the fleet runs between two changes, swapped whole at a change: the tasks (resolved), the plan, the cost
    model it is priced by and the recalibrator of its replicas."""

    workload: Workload
    plan: DeploymentPlan
    cost_model: CostModel
    recalibrator: Recalibrator

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.workload.tasks]

    @property
    def window(self) -> int:
        """Steps a window runs (``lorafleet.loop``; ``DeploymentPlan.loop_window``); windows also end at checkpoints
        and changes."""
        return self.plan.loop_window

    def after(self, workload: Workload, plan: DeploymentPlan, cost_model: CostModel) -> Running:
        """The fleet on ``workload``'s tasks and ``plan``: a replica that stays keeps what it measured, a new one is
        priced at its pool's scale until it reports (``Recalibrator.moved``)."""
        recalibrator = self.recalibrator
        if plan.placements != self.plan.placements:
            recalibrator = recalibrator.moved(plan, plan.replica_ids_in(self.plan))
        return Running(workload, plan, cost_model, recalibrator)


class Stop(StrEnum):
    """Why the workers stop at a change's boundary."""

    HANDED_OFF = "handed-off"
    """The launcher applies the change (``train.live.apply_pending``) and starts them again."""
    ALL_LEFT = "all-left"
    """Every task has left the run."""


class AppliedChange(Protocol):
    """What a change cost the fleet, measured (``executor.torch.change.ChangeReport``)."""

    seconds: float
    phases: Mapping[str, float]
    rebuilt: tuple[int, ...]


class FleetPort(Protocol):
    """What the component asks of the running fleet (the trainer's view of rank 0's executor)."""

    world_size: int
    """Processes the run has."""

    def turns(self) -> dict[str, TaskTurns]:
        """The running tasks' turns, by name."""
        ...

    def end_steps(self, horizon: int) -> dict[str, int]:
        """The step after each running task's last batch, for the tasks done by ``horizon``, by name."""
        ...

    def batches_taken(self, name: str, step: int) -> int:
        """The global batches running task ``name`` took part in before ``step``."""
        ...

    def end(self) -> int:
        """The step after which every task has taken all its batches (the run's total when one still has turns)."""
        ...

    def retire(self, name: str, step: int) -> None:
        """Running task ``name`` takes no batch from ``step`` on (a stop where no launcher is watching the queue)."""
        ...

    def checkpoint(self, step: int, wait: bool = False) -> Path:
        """A checkpoint after ``step`` steps (committed on return with ``wait``)."""
        ...

    def flush(self) -> None:
        """Waits for the checkpoint being written, if any."""
        ...

    def committed_change(self) -> int | None:
        """The last change of the fleet the newest committed checkpoint was taken after (its ``fleet_changed_at``;
        None: none, or no checkpoint)."""
        ...

    def apply(
        self, step: int, workload: Workload, plan: DeploymentPlan, ledger: Ledger, added: Mapping[str, TaskData]
    ) -> AppliedChange:
        """The fleet changed in its processes to ``workload``'s tasks on ``plan`` at ``step`` (the turns and departed
        tasks are ``ledger``'s; ``added``: the joining tasks' data)."""
        ...
