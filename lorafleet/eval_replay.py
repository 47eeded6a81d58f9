"""Evaluations and early stops replayed in a what-if (``simulate`` and ``simulate --arrivals``).

**When.** A task with an ``eval`` is evaluated after every own step (the steps it took part in) its schedule
names, a multiple of ``every_steps`` or a rung boundary of its sweep (``lorafleet.eval_schedule``, ``train``'s
rule), and after its last (``specs.evaluation``). Tasks due at the same step boundary are evaluated together, as
one forward-only pass over the fleet: its :class:`EvalRecord` names the task's own step.

**What it costs.** An evaluation runs a task's held-out rows forward only. Their number:
``min(max_rows, round(split x rows))`` when the task's rows are known (:func:`known_rows`: its lengths
were read from its dataset, ``Task.histogram``, or are given inline as ``values`` or as a ``histogram`` of whole
counts, or are a dataset preset's that carries the dataset's published row count, ``DatasetPreset.rows``) and it
has a ``split``, else ``max_rows`` (lengths given by moments or by fractional weights, or a preset whose count is
not published, know no rows; a held-out ``data`` file is not read by a what-if). Their
lengths are drawn once per task from its length distribution, by the one sampling rule's generator at a step no
run reaches (:data:`HELD_OUT_STEP`), so every evaluation of the task sees the same rows. The pass is placed by the
dispatcher as ``train`` places it (:func:`dispatch_evaluation`: packed, split across the replicas like any
batch) and priced by the cost model as forward-only work (``CostModel.forward_time``: each coefficient of
the stage time times its forward share, a pipeline filled and drained once, no gradient sync and no
optimizer step)::

    T_eval = max_r T_F,r          GPU-seconds_eval = T_eval x plan.used_gpus

the fleet held for the whole pass, as a step holds it. Its GPU-seconds are billed to the tasks evaluated by
the accounting's rule (``accounting.task_gpu_seconds``: by their share of each replica's time, the idle time
by all of them), reported apart from their steps' (:attr:`TaskEvals.eval_gpu_s`), and the clock waits
``T_eval``.

**The loss and the stop.** A task's loss at an evaluation is its curve (``eval.curve``,
``lorafleet.loss_curve``) at the real tokens it has trained, deterministic; ``Stopping.observe`` (the one
rule ``train`` follows) decides whether it stops. A stopped task takes no more steps: it departs at that step
boundary, as a task that took its steps does. A task without a curve has no modelled loss: its evaluations are
priced and it never stops early.

**Curves from a training run** (:func:`run_curves`, ``simulate --eval-curves-from RUN``). A run's
``metrics.jsonl`` holds, on each step row, ``task_tokens`` (task -> real tokens of that step) and, on a step
an evaluation followed, ``eval_loss`` (task -> its mean token loss). A task's trained tokens at an evaluation
after step ``s`` are the sum of its ``task_tokens`` over the rows with ``step <= s``; its curve is
``loss_curve.fit_curve`` of those ``(tokens, eval_loss)`` points. A task whose points do not fit (fewer than
three up to its lowest loss, or none) is listed with the reason; :func:`with_curves` sets the fitted curves as
the workload's tasks' ``eval.curve``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from lorafleet.accounting import task_gpu_seconds
from lorafleet.costmodel import CostModel
from lorafleet.dispatch import dispatch_step
from lorafleet.eval_schedule import EvalSchedule
from lorafleet.loss_curve import curve_loss, fit_curve
from lorafleet.metrics.files import read_rows
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan, StepReport
from lorafleet.rundir import METRICS_JSONL
from lorafleet.sampling import TaskDraw, global_batch, task_rng
from lorafleet.specs.dispatch import MicroBatchMode
from lorafleet.specs.length_presets import find_preset
from lorafleet.specs.loss_curve import LossCurveSpec
from lorafleet.stopping import Stopping
from lorafleet.sweeps import Rung, rungs_due, without_halving
from lorafleet.workload import Task, Workload

HELD_OUT_STEP = 2**62
"""The step a task's held-out lengths are drawn at (``sampling.task_rng``): beyond any run's steps, so they are
drawn from a generator no training batch uses."""


def known_rows(task: Task) -> int | None:
    """The rows of ``task``'s data when a what-if knows them: its dataset's (``Task.histogram``); its inline
    lengths' (``lengths: {values: [...]}``: one row a value; ``lengths: {histogram: {...}}`` whose counts are
    whole numbers: their sum; a histogram of fractional weights counts no rows); its length preset's published
    row count (``DatasetPreset.rows``); else None."""
    if task.histogram is not None:
        return sum(task.histogram.values())
    lengths = task.spec.lengths
    if lengths is None:
        return None
    if lengths.values is not None:
        return len(lengths.values)
    if lengths.histogram is not None:
        counts = lengths.histogram.values()
        return round(sum(counts)) if all(float(c).is_integer() for c in counts) else None
    preset = find_preset(lengths.preset) if lengths.preset is not None else None
    return preset.rows if preset is not None else None


def held_out_rows(task: Task) -> int:
    """Rows one evaluation of ``task`` runs (module doc); ``task`` has an ``eval``."""
    spec = task.spec.eval
    assert spec is not None
    rows = known_rows(task)
    if spec.split is None or rows is None:
        return spec.max_rows
    return max(1, min(spec.max_rows, round(spec.split * rows)))


def held_out_lengths(task: Task, seed: int) -> np.ndarray:
    """The lengths of ``task``'s held-out rows in a what-if seeded ``seed`` (module doc), int64."""
    rng = task_rng(seed, HELD_OUT_STEP, task.spec.seed_name)
    return task.lengths.sample(held_out_rows(task), rng).astype(np.int64)


def dispatch_evaluation(
    batch: GlobalBatch, plan: DeploymentPlan, cost_model: CostModel, speed: Sequence[float] | None = None
) -> StepPlan:
    """An evaluation's rows placed on ``plan``'s replicas by its dispatcher, as a step's are, but packed (no padding:
    a forward-only pass has no bucket to match), at the replicas' ``speed`` (recalibration). The one placement of an
    evaluation, ``train``'s and the what-ifs'."""
    options = replace(plan.policy.options, microbatch_mode=MicroBatchMode.PACKING)
    return dispatch_step(batch, plan, cost_model, options, speed=speed)


def forward_seconds(
    step_plan: StepPlan, plan: DeploymentPlan, cost_model: CostModel, speed: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Each replica's predicted time for its part of an evaluation, ``T_F,r`` (``CostModel.forward_time``), times
    its ``speed`` factor when given (a recalibrated replica's): the pass takes the largest."""
    factors = speed or (1.0,) * len(plan.replicas)
    return tuple(
        f * cost_model.forward_time(r.config, [mb.shape for mb in w.microbatches])
        for r, w, f in zip(plan.replicas, step_plan.work, factors, strict=True)
    )


@dataclass(frozen=True)
class EvalCost:
    """One evaluation pass over the fleet."""

    seconds: float
    """Its wall time: the slowest replica's forward-only time."""
    task_gpu_s: dict[str, float]
    """What each task evaluated owes of ``seconds x plan.used_gpus``."""


def price_evaluation(
    lengths: Mapping[str, np.ndarray], step: int, plan: DeploymentPlan, cost_model: CostModel, names: Sequence[str]
) -> EvalCost:
    """The pass over the held-out rows ``lengths[task]`` of the tasks evaluated together at ``step`` on ``plan``
    (module doc); ``names`` are the task ids the plan's dispatch and accounting index."""
    draws = [(names.index(name), 0, TaskDraw(rows, 0, 0)) for name, rows in lengths.items()]
    step_plan = dispatch_evaluation(global_batch(step, draws), plan, cost_model)
    busy = forward_seconds(step_plan, plan, cost_model)
    report = StepReport(step=step, replica_busy_s=busy, makespan_s=max(busy))
    owed = task_gpu_seconds(step_plan, report, plan, cost_model, names)
    return EvalCost(seconds=report.makespan_s, task_gpu_s={name: owed[name] for name in lengths})


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation of one task."""

    task: str
    step: int
    """Global steps run when it ran (it follows the step numbered ``step - 1`` from 0)."""
    own_step: int
    """The task's own steps taken then."""
    tokens: int
    """Real tokens the task had trained."""
    loss: float | None
    """Its curve's loss there (None: the task has no curve)."""
    rows: int
    gpu_s: float
    """The task's part of the pass's GPU-seconds."""
    seconds: float
    """The pass's wall time (shared by the tasks evaluated together)."""
    improved: bool
    stopped: bool


@dataclass(frozen=True)
class TaskEvals:
    """What became of one task's evaluations in a what-if."""

    task: str
    steps: int
    """Its own steps taken."""
    records: tuple[EvalRecord, ...]
    state: Stopping
    """The early-stopping state after its last evaluation (its best, whether it stopped)."""
    dropped_rung: int | None = None
    """The rung of its sweep's successive halving that dropped it (``lorafleet.sweeps``), None when none did."""

    @property
    def eval_gpu_s(self) -> float:
        return sum(r.gpu_s for r in self.records)

    @property
    def stop_step(self) -> int | None:
        """The global step count after which it stopped early or its sweep dropped it (None: neither)."""
        return self.records[-1].step if self.state.stopped or self.dropped_rung is not None else None


@dataclass
class EvalReplay:
    """The evaluations of one run's tasks, step after step (module doc). The caller reports each step's tokens
    (:meth:`took`), asks which tasks are due (:meth:`due`) and evaluates them on its plan (:meth:`evaluate`);
    :attr:`stopped` are the tasks that stopped early or that a sweep's rung dropped. ``stops=False`` evaluates
    without ever stopping or halving (the reference a saving is measured against): a sweep's members as without
    halving (``sweeps.without_halving``: every ``every_steps`` and at their last step, not at its rungs)."""

    tasks: Mapping[str, Task]
    seed: int
    stops: bool = True
    own: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    state: dict[str, Stopping] = field(default_factory=dict)
    records: list[EvalRecord] = field(default_factory=list)
    stopped: set[str] = field(default_factory=set)
    """Tasks that stopped early or that their sweep's rung dropped: they take no more steps."""
    rungs: list[Rung] = field(default_factory=list)
    """The sweeps' rungs decided so far (``lorafleet.sweeps``: the same rule as ``train``)."""
    eval_seconds: float = 0.0
    """Wall time of every pass so far."""
    _rows: dict[str, np.ndarray] = field(default_factory=dict)
    _evaluated_at: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stops:
            self.tasks = {n: replace(t, spec=without_halving(t.spec)) for n, t in self.tasks.items()}

    def took(self, task_tokens: Mapping[str, int]) -> None:
        """A step ran: each task with tokens in it took one more of its own steps."""
        for name, n in task_tokens.items():
            if n > 0:
                self.own[name] = self.own.get(name, 0) + 1
                self.tokens[name] = self.tokens.get(name, 0) + int(n)

    def _evaluated(self, name: str) -> bool:
        """Task ``name`` has no eval, has stopped, or was evaluated after its latest step."""
        return (
            self.tasks[name].spec.eval is None
            or name in self.stopped
            or self._evaluated_at.get(name) == self.own.get(name, 0)
        )

    def due(self, last: Collection[str] = ()) -> list[str]:
        """Tasks due an evaluation now: their own steps are a step of their schedule (module doc), or they have
        taken their last step (``last``: tasks that have)."""
        out = []
        for name, own in self.own.items():
            schedule = EvalSchedule.of(self.tasks[name].spec)
            if schedule is not None and not self._evaluated(name) and (schedule.evaluates(own) or name in last):
                out.append(name)
        return out

    def next_boundary(self, step: int, present: Collection[str]) -> int | None:
        """The first step boundary after ``step`` where a task of ``present`` may be due, if it takes part in
        every step (a task that skips steps is due no sooner); None: none has an eval."""
        ahead = []
        for name in present:
            schedule = EvalSchedule.of(self.tasks[name].spec)
            if schedule is not None and name not in self.stopped:
                own = self.own.get(name, 0)
                ahead.append(step + schedule.next_after(own) - own)
        return min(ahead, default=None)

    def evaluate(
        self, names: Sequence[str], step: int, plan: DeploymentPlan, cost_model: CostModel, ids: Sequence[str]
    ) -> EvalCost | None:
        """Evaluate the tasks ``names`` together after global step count ``step`` on ``plan`` (task ids index
        ``ids``): each loss from its curve, each stop decided; None when ``names`` is empty."""
        if not names:
            return None
        for name in names:
            if name not in self._rows:
                self._rows[name] = held_out_lengths(self.tasks[name], self.seed)
        cost = price_evaluation({n: self._rows[n] for n in names}, step, plan, cost_model, ids)
        self.eval_seconds += cost.seconds
        for name in names:
            spec = self.tasks[name].spec
            curve = spec.eval.curve  # type: ignore[union-attr]
            loss = None if curve is None else curve_loss(curve, self.tokens[name])
            before = self.state.get(name, Stopping())
            after = before if loss is None else before.observe(loss, step, spec.early_stopping if self.stops else None)
            self.state[name] = after
            self._evaluated_at[name] = self.own[name]
            if after.stopped:
                self.stopped.add(name)
            self.records.append(
                EvalRecord(
                    name,
                    step,
                    self.own[name],
                    self.tokens[name],
                    loss,
                    len(self._rows[name]),
                    cost.task_gpu_s[name],
                    cost.seconds,
                    loss is not None and after.improved,
                    after.stopped,
                )  # fmt: skip
            )
        self._rungs(names, step)
        return cost

    def _rungs(self, names: Sequence[str], step: int) -> None:
        """The rungs of successive halving due after this evaluation of ``names`` (``lorafleet.sweeps.rungs_due``,
        ``train``'s rule): the dropped members stop. Without curves the scores tie, and the rung keeps the first
        members in the sweep's order: the halving's cost is priced, its pick is not modelled."""
        if not self.stops:
            return
        rungs = rungs_due(
            [self.tasks[n].spec for n in self.own], names, step, self.stopped.__contains__, self.own.__getitem__,
            lambda name: self.tasks[name].spec.steps, lambda name: self.state.get(name, Stopping()).best_loss,
        )  # fmt: skip
        self.rungs += rungs
        for rung in rungs:
            self.stopped.update(rung.dropped)

    def outcomes(self) -> dict[str, TaskEvals]:
        """Every task with an eval that took a step: its records and state."""
        dropped = {name: rung.rung for rung in self.rungs for name in rung.dropped}
        return {
            name: TaskEvals(
                name,
                self.own[name],
                tuple(r for r in self.records if r.task == name),
                self.state.get(name, Stopping()),
                dropped.get(name),
            )
            for name, task in self.tasks.items()
            if task.spec.eval is not None and name in self.own
        }


@dataclass(frozen=True)
class RunCurves:
    """Each task's eval-loss curve fitted to a training run's evaluations (module doc)."""

    curves: dict[str, LossCurveSpec]
    points: dict[str, tuple[tuple[int, float], ...]]
    """Each evaluated task's ``(trained tokens, eval loss)``, in step order: what its curve was fitted to."""
    unfitted: dict[str, str]
    """Evaluated tasks with no curve, and why."""


def eval_points(rows: Iterable[Mapping[str, Any]]) -> dict[str, tuple[tuple[int, float], ...]]:
    """Each task's ``(trained tokens, eval loss)`` at its evaluations, from a run's metrics rows (module doc;
    rows in any order, a step's last row counts when it repeats)."""
    by_step = {int(row["step"]): row for row in rows}
    tokens: dict[str, int] = {}
    points: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(by_step):
        row = by_step[step]
        for name, n in (row.get("task_tokens") or {}).items():
            tokens[name] = tokens.get(name, 0) + int(n)
        for name, loss in (row.get("eval_loss") or {}).items():
            points.setdefault(name, []).append((tokens.get(name, 0), float(loss)))
    return {name: tuple(p) for name, p in points.items()}


def fit_run_curves(rows: Iterable[Mapping[str, Any]]) -> RunCurves:
    """:func:`eval_points` of ``rows``, each task's fitted by ``loss_curve.fit_curve``."""
    points = eval_points(rows)
    curves: dict[str, LossCurveSpec] = {}
    unfitted: dict[str, str] = {}
    for name, task_points in points.items():
        try:
            curves[name] = fit_curve([t for t, _ in task_points], [loss for _, loss in task_points])
        except (ValueError, RuntimeError) as err:  # RuntimeError: curve_fit did not converge
            unfitted[name] = str(err)
    return RunCurves(curves, points, unfitted)


def run_curves(run: str | Path) -> RunCurves:
    """:func:`fit_run_curves` of a run directory's ``metrics.jsonl`` (or of that file named directly);
    ValueError when there is no such file or it has no evaluation."""
    path = Path(run)
    path = path / METRICS_JSONL if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"{path}: no such metrics file")
    try:
        fitted = fit_run_curves(read_rows(path))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a run's metrics rows ({err})") from None
    if not fitted.points:
        raise ValueError(f"{path}: no evaluation (no eval_loss in any row)")
    return fitted


def with_curves(workload: Workload, curves: Mapping[str, LossCurveSpec]) -> tuple[Workload, list[str]]:
    """``workload`` with each task named in ``curves`` given that curve as its ``eval.curve``, and the names
    of ``curves`` it did not take (no such task, or a task without an ``eval``)."""
    tasks, taken = [], set()
    for task in workload.tasks:
        curve = curves.get(task.name)
        if curve is not None and task.spec.eval is not None:
            spec = task.spec.model_copy(update={"eval": task.spec.eval.model_copy(update={"curve": curve})})
            task = Task(spec, task.raw_lengths, task.lengths, task.overflow_fraction, task.histogram)
            taken.add(task.name)
        tasks.append(task)
    spec = workload.spec.model_copy(update={"tasks": tuple(t.spec for t in tasks)})
    changed = Workload(path=workload.path, spec=spec, model=workload.model, tasks=tuple(tasks))
    return changed, sorted(set(curves) - taken)
