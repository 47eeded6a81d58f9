"""A run's fleet changes without processes: :class:`FakeFleet`, a ``train.changes.FleetPort`` that runs nothing and
records what it is asked, and :func:`fleet_of` (docsum and chat of the demo on two ``<1,1>`` replicas on GPUs 0 and
3 of a 4-GPU node, its queue watched as under lorafleet's launcher). Every other part is real: the queue directory
and its watcher, the ledger, the planner's re-plan, the run's files and ``changes.jsonl``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from lorafleet.dispatch import Recalibrator
from lorafleet.planner import MigrationModel
from lorafleet.plans import DeploymentPlan
from lorafleet.train.changes import FleetChanges
from lorafleet.train.options import TrainOptions
from lorafleet.train.queue import Ledger
from lorafleet.train.running import Running
from tests.helpers.queue_fleet import on_four_gpus
from tests.helpers.repo import DEMO

STEPS = 10


@dataclass
class FakeFleet:
    """``train.changes.FleetPort`` that runs nothing: what it was asked, recorded."""

    world_size: int = 4
    steps: int = STEPS
    checkpoints: list[tuple[int, bool]] = field(default_factory=list)
    applied: list[tuple[int, tuple[str, ...], str, tuple[str, ...]]] = field(default_factory=list)
    """(step, tasks, plan, joining tasks' data) of every change applied."""

    def turns(self):
        return {}

    def end_steps(self, horizon):
        return {}

    def batches_taken(self, name, step):
        return step  # every task takes a batch every step

    def end(self):
        return self.steps

    retired: list[tuple[str, int]] = field(default_factory=list)

    def retire(self, name, step):
        self.retired.append((name, step))

    changes: FleetChanges | None = None
    marks: list[int | None] = field(default_factory=list)
    """Each checkpoint's ``fleet_changed_at``, as the trainer's checkpoint records it (all commit at once)."""

    def checkpoint(self, step, wait=False):
        self.checkpoints.append((step, wait))
        self.marks.append(self.changes.flight.changed_at if self.changes is not None else None)
        return Path(f"step-{step:06d}")

    def flush(self):
        pass

    def committed_change(self):
        return self.marks[-1] if self.marks else None

    def apply(self, step, workload, plan, ledger, added):
        self.applied.append((step, tuple(t.name for t in workload.tasks), plan.describe(), tuple(sorted(added))))
        return SimpleNamespace(seconds=0.25, phases={"data": 0.25}, rebuilt=())


def fleet_of(tmp_path: Path, tokenizer: Path) -> tuple[TrainOptions, Running, FleetChanges, FakeFleet]:
    """(options, running, changes, fake fleet) of the module doc's run."""
    from lorafleet.assemble import plan_cost_model
    from lorafleet.workload import load_workload

    path, profile = on_four_gpus(tmp_path, tokenizer, slots=(0, 3))
    out = tmp_path / "out"
    (out / "queue").mkdir(parents=True)
    plan_path = path.with_suffix(".plan.json")
    options = TrainOptions(
        workload=str(path), plan=str(plan_path), out=str(out), steps=STEPS, profile=str(profile),
        queue_data_roots=(str(DEMO),),
    )  # fmt: skip
    workload = load_workload(path)
    plan = DeploymentPlan.load(plan_path)
    cost_model = plan_cost_model(workload, plan.fleet(), plan, str(plan_path), str(profile))[0]
    running = Running(workload, plan, cost_model, Recalibrator.for_plan(plan))
    fake = FakeFleet()
    changes = restarted(options, running, fake)
    return options, running, changes, fake


def restarted(options: TrainOptions, running: Running, fake: FakeFleet) -> FleetChanges:
    """Rank 0's fleet changes as a start of the run builds them: the ledger read from the run directory."""
    from lorafleet.runtime.data_stream import task_tokenizer

    spec = running.workload.spec
    ledger = Ledger.load(options.out) or Ledger.of(spec.tasks)
    changes = FleetChanges(options, spec.defaults, ledger, fake, task_tokenizer(spec), MigrationModel(dtype_bytes=4))
    fake.changes = changes
    return changes


def due_when_ready(changes: FleetChanges, step: int, running: Running) -> bool:
    """``changes.due(step)`` once the data of the tasks its requests add is prepared (``train.joining``: in a thread
    from the first reading; a test waits for it instead of running steps beside it)."""
    changes.due(step, running)
    changes.joining.wait()
    return changes.due(step, running)
