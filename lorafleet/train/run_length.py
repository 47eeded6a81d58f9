"""What a run's length means for its tasks: how long the run is when ``--steps`` is not given, and which tasks the
run ends before they have taken their steps.

**Without ``--steps``** the run lasts until its tasks are done: the step after the last one any task takes part
in, drawn as the ranks draw it (``runtime.data_stream``: each task's ``steps``, or its ``epochs`` over its rows
after its eval split and overflow rule, its start, its share and deadline). Every task then needs ``steps`` or
``epochs``; a task with neither is one line naming it (:func:`with_run_steps`), exit 2.

**A resume told other ``--steps``** leaves the schedule of a task with its own steps as it was; that of a task with
neither ``steps`` nor ``epochs`` spans the run's steps, so it changes from the resumed step on, and a line says so
(:func:`reshaped_schedules`).

**A task the run cuts short.** With ``--steps`` given, a task whose own steps (``steps``, or ``epochs`` over its
rows) do not fit in the run takes only the steps the run leaves it. That is said as the run starts, a line per task
(:meth:`TaskLength.line`; a task the queue adds, as it joins), and recorded, per task, in ``<out>/run_length.json``
(:class:`RunLength`, rewritten at every launch and every change of the tasks: its own steps, those it takes in this
run, its rows, the rows and epochs it will have seen; a task that has left keeps its entry as last written). A
task's learning-rate schedule still spans its own steps (``executor.torch.launch.task_training``): the run cuts it,
never squeezes it.

Torch-free: the launcher resolves the run's length, rank 0 writes the record from the streams it trains on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from lorafleet.errors import InputError
from lorafleet.rundir import RunDir
from lorafleet.specs.fields import ARGS
from lorafleet.specs.io import write_text_atomic
from lorafleet.specs.workload import MAX_STEPS, TaskSpec

if TYPE_CHECKING:
    from lorafleet.runtime.data_stream import DataStreams
    from lorafleet.train.options import TrainOptions
    from lorafleet.train.preflight import Prepared

EXACT_STEPS = 1 << 20
"""The most steps whose turns :meth:`RunLength.of` draws to count a task's batches in the run; past it (a run told
more steps, with a task that never ends), a task is counted as taking part in every step from its start."""


@dataclass(frozen=True)
class TaskLength:
    """One task's steps: its own, and those the run leaves it."""

    name: str
    start_step: int
    own_steps: int | None
    """Its ``steps``, or ``epochs`` over its rows (``data_stream.task_batches``); None: neither (the run's)."""
    in_run: int
    """The global steps it takes part in within the run."""
    rows: int
    """Its rows to train on (after its eval split and overflow rule)."""
    batch_size: int
    epochs: float | None = None
    """Its ``epochs``, when it has them."""

    @property
    def finishes(self) -> bool:
        """Whether it takes all its own steps in the run."""
        return self.own_steps is None or self.in_run >= self.own_steps

    @property
    def rows_seen(self) -> int:
        """Distinct rows its adapter sees in the run (every epoch is an order of all of them)."""
        return min(self.rows, self.in_run * self.batch_size)

    @property
    def epochs_seen(self) -> float:
        return self.in_run * self.batch_size / self.rows

    def line(self, run_steps: int) -> str:
        """The start's line of a task the run cuts short."""
        own = f" (epochs {self.epochs:g} over {self.rows} rows)" if self.epochs is not None else ""
        return (
            f"task {self.name} takes {self.in_run} of its {self.own_steps} steps{own} in this run of {run_steps}: "
            f"its adapter sees {self.rows_seen} of its {self.rows} rows ({self.epochs_seen:.3g} epochs); "
            "give --steps for more, or leave it out for a run that lasts until its tasks are done"
        )


@dataclass(frozen=True)
class RunLength:
    """``<out>/run_length.json``: the run's steps and each task's (module doc)."""

    steps: int
    tasks: tuple[TaskLength, ...]

    @classmethod
    def of(cls, streams: DataStreams, specs: Sequence[TaskSpec], run_steps: int) -> RunLength:
        """The tasks of ``streams`` (each with its spec in ``specs``, by name) in a run of ``run_steps``, counted as
        the ranks draw them."""
        end = min(run_steps, streams.end_step(run_steps))
        exact = end <= EXACT_STEPS
        taken = [c // b for c, b in zip(streams.cursors(end), streams.batch_sizes, strict=True)] if exact else None
        by_name = {spec.name: spec for spec in specs}
        tasks = []
        for t, (stream, limit) in enumerate(zip(streams.streams, streams.max_batches, strict=True)):
            spec = by_name[stream.data.name]
            every = max(0, end - spec.start_step)
            in_run = taken[t] if taken is not None else (every if limit is None else min(limit, every))
            tasks.append(
                TaskLength(
                    name=spec.name,
                    start_step=spec.start_step,
                    own_steps=limit,
                    in_run=in_run,
                    rows=len(stream.data.examples),
                    batch_size=spec.batch_size,
                    epochs=spec.epochs,
                )
            )
        return cls(steps=run_steps, tasks=tuple(tasks))

    @property
    def cut(self) -> tuple[TaskLength, ...]:
        """The tasks the run ends before they have taken their own steps."""
        return tuple(t for t in self.tasks if not t.finishes)

    def save(self, run_dir: RunDir) -> None:
        """The record, over the one there: a task that has left the fleet since (finished, stopped early, dropped by
        its sweep) keeps its entry as last written, as the ledger keeps every task the run has had."""
        now = [asdict(t) | {"finishes": t.finishes} for t in self.tasks]
        names = {t.name for t in self.tasks}
        left = []
        if run_dir.run_length.is_file():
            left = [
                t for t in json.loads(run_dir.run_length.read_text(encoding="utf-8"))["tasks"] if t["name"] not in names
            ]
        record = {"steps": self.steps, "tasks": left + now}
        write_text_atomic(run_dir.run_length, json.dumps(record, indent=2) + "\n")


def reshaped_schedules(run_dir: RunDir, steps: int, tasks: Sequence[TaskSpec]) -> str | None:
    """The line of a resume told other ``--steps`` than the run it continues had, when a task's cosine or linear
    schedule spans the run's steps (it has neither ``steps`` nor ``epochs``): that schedule changes from the resumed
    step on. None when nothing changes (a task with its own steps keeps its schedule whatever ``--steps`` says)."""
    from lorafleet.specs.lora import LrSchedule

    try:
        previous = json.loads(run_dir.run_file.read_text(encoding="utf-8"))["options"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    spanning = [t.name for t in tasks if t.name in unbounded([t]) and t.optimizer.schedule is not LrSchedule.CONSTANT]
    if previous in (None, steps) or not spanning:
        return None
    return (
        f"--steps {steps}, where the run had {previous}: the learning-rate schedule of {', '.join(spanning)} (over "
        f"the run's steps) spans {steps} steps from the resumed step on, not {previous}; give a task its own steps "
        "to keep its schedule whole"
    )


def unbounded(tasks: Sequence[TaskSpec]) -> list[str]:
    """The tasks with neither ``steps`` nor ``epochs``."""
    return [t.name for t in tasks if t.steps is None and t.epochs is None]


def with_run_steps(options: TrainOptions, prepared: Prepared) -> TrainOptions:
    """``options`` with the run's steps: ``--steps`` as given, or (none given) until every task is done (module
    doc), said in a line; an InputError naming ``--steps`` when a task has neither ``steps`` nor ``epochs``."""
    if options.steps is not None:
        return options
    spec = prepared.workload.spec
    endless = unbounded(spec.tasks)
    if endless:
        raise InputError(
            ARGS,
            "--steps",
            f"not given, and {', '.join(endless)} {'has' if len(endless) == 1 else 'have'} neither steps nor epochs: "
            "give --steps N (the run's total), or each task its steps or epochs",
        )
    from lorafleet.runtime.data_stream import training_streams

    # No tokenizer given: the data the launcher measured is read from the token cache (no torch imported).
    streams = training_streams(spec, MAX_STEPS, turn_changes=prepared.turn_changes, departed=prepared.departed)
    steps = max(1, streams.end_step(MAX_STEPS))
    print(f"lorafleet train: --steps not given: the run lasts until its tasks are done, {steps} steps", flush=True)
    return replace(options, steps=steps)
