"""The running fleet as rank 0's fleet changes and evaluations see it (``train.changes.FleetPort``,
``train.evaluation.EvalPort``): the torch executor of this run, its data streams and its checkpoints. Rank 0 only;
the components that decide stay torch-free."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorafleet.executor.torch.change import ChangeReport
    from lorafleet.executor.torch.evaluate import EvalOutcome
    from lorafleet.executor.torch.worker import TorchExecutor
    from lorafleet.planner import MigrationModel
    from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan
    from lorafleet.runtime.data_stream import TaskData
    from lorafleet.specs.device import Precision
    from lorafleet.train.queue import Ledger
    from lorafleet.turns import TaskTurns
    from lorafleet.workload import Workload


class TorchFleet:
    """``train.changes.FleetPort`` and ``train.evaluation.EvalPort`` over rank 0's :class:`TorchExecutor`."""

    def __init__(
        self,
        executor: TorchExecutor,
        steps: int,
        checkpoint: Callable[[int, bool], Path],
        stopped: Callable[[], Mapping[str, int]],
        checkpoints: Path,
    ) -> None:
        """``steps``: the run's total; ``checkpoint(step, wait)``: the trainer's (with its recalibration and health
        state); ``stopped()``: the tasks the health watch stopped now (name -> the first step left out of);
        ``checkpoints``: the run's checkpoint directory."""
        self.executor, self.steps, self._checkpoint, self._stopped = executor, steps, checkpoint, stopped
        self.checkpoints = checkpoints

    @property
    def world_size(self) -> int:
        return self.executor.world_size

    def _names(self) -> list[str]:
        return [s.data.name for s in self.executor.streams.streams]

    def turns(self) -> dict[str, TaskTurns]:
        return dict(zip(self._names(), self.executor.streams.turns, strict=True))

    def end_steps(self, horizon: int) -> dict[str, int]:
        names = self._names()
        return {names[t]: end for t, end in self.executor.streams.end_steps(horizon).items()}

    def batches_taken(self, name: str, step: int) -> int:
        return self.executor.streams.batches_taken(self._names().index(name), step)

    def end(self) -> int:
        return min(self.steps, self.executor.streams.end_step(self.steps))

    def max_batches(self, name: str) -> int | None:
        return self.executor.streams.max_batches[self._names().index(name)]

    def retire(self, name: str, step: int) -> None:
        self.executor.streams.retire(self._names().index(name), step)

    def eval_batch(self, step: int, names: Sequence[str]) -> GlobalBatch:
        return self.executor.eval_batch(step, names)

    def evaluate(self, step_plan: StepPlan, batch: GlobalBatch) -> EvalOutcome:
        return self.executor.evaluate(step_plan, batch)

    def keep_best(self, names: Sequence[str]) -> None:
        self.executor.keep_best(names)

    def checkpoint(self, step: int, wait: bool = False) -> Path:
        return self._checkpoint(step, wait)

    def flush(self) -> None:
        self.executor.flush_checkpoints()

    def committed_change(self) -> int | None:
        from lorafleet.runtime.checkpoint_files import newest_committed_change

        return newest_committed_change(self.checkpoints)

    def apply(
        self, step: int, workload: Workload, plan: DeploymentPlan, ledger: Ledger, added: Mapping[str, TaskData]
    ) -> ChangeReport:
        """The executor's change (``TorchExecutor.change``): the tasks (a new one's schedule as a launch would give
        it, from its data in ``added``), their specs, the ledger's turns, the plan, the stopped tasks that stay."""
        from lorafleet.executor.torch.change import FleetChange
        from lorafleet.executor.torch.launch import task_training
        from lorafleet.runtime.data_stream import task_batches

        running = {t.name: t for t in self.executor.config.tasks}
        specs = tuple(t.spec for t in workload.tasks)
        tasks = tuple(
            running.get(spec.name) or task_training(spec, task_batches(spec, added[spec.name]), self.steps)
            for spec in specs
        )
        change = FleetChange(
            step=step,
            tasks=tasks,
            specs=specs,
            plan=plan,
            turn_changes=ledger.turn_changes(),
            departed=ledger.departed(),
            stopped={name: at for name, at in self._stopped().items() if name in running},
        )
        return self.executor.change(change, added)


def initial_migration(
    executor: TorchExecutor, plan: DeploymentPlan, workload: Workload, dtype: Precision
) -> MigrationModel:
    """The price of a move before the run has made one: the defaults' fixed part, and the load rate of rank 0's
    own stage as this launch built it (its base weights' bytes over the seconds it took)."""
    from lorafleet.planner import MigrationModel

    model = MigrationModel(dtype_bytes=dtype.bytes)
    role = executor.replica.role
    if role is None or executor.stage_build_s <= 0:
        return model
    stage_bytes = workload.model.n_params * model.dtype_bytes / (role.replica.tp * role.replica.pp)
    return replace(model, load_bytes_per_s=stage_bytes / executor.stage_build_s)
