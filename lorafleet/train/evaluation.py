"""Rank 0's evaluations: when each task with an ``eval`` is evaluated, on the running fleet, what it reports, and
what follows (its best adapter kept, its early stop). No torch here: the fleet is an :class:`EvalPort`.

**When.** Task ``t`` is due at the boundary before global step ``b`` when it took a batch in step ``b - 1`` and
its own steps then, ``n_t(b)`` (``DataStreams.batches_taken``), are a step of its schedule (a multiple of
``eval.every_steps``, or a rung boundary of its sweep: ``lorafleet.eval_schedule``), its last (``steps`` or
``epochs``), or the run's last step is ``b - 1`` (``specs.evaluation``). The steps are a pure
function of the tasks' turns, so :meth:`Evaluations.next_boundary` names them ahead: the loop's windows end there
(``lorafleet.loop``), and an evaluation always sees the adapters of exactly its step.

**How.** The due tasks' held-out rows are one batch, dispatched by the running plan's dispatcher (packed: no
padding; ``eval_replay.dispatch_evaluation``, the what-ifs' placement too) at the replicas' recalibrated speeds,
run forward only on every replica (``executor.torch.evaluate``), and billed to their tasks by the accounting's rule
(``accounting.task_gpu_seconds`` over the evaluation's busy times).

**What follows**, per task (``lorafleet.stopping``): a new best keeps its adapter (one copy, on rank 0, saved in
every checkpoint); a stop makes it leave the run at this boundary, as a queued finish would
(``FleetChanges.stop_early``). Everything here is in the checkpoint (:meth:`Evaluations.state_dict`): a resume
evaluates, keeps and stops exactly as the uninterrupted run.

**Predicted.** Evaluation ``k``'s predicted time is the cost model's forward-only time at the steps' recalibrated
speeds ``c_r`` times a measured correction: for ``k > 1`` the evaluation before it's measured over predicted time
(:attr:`Evaluations.correction`); for the first, the launch probe's forward pass (:attr:`Evaluations.probed`,
``train.probe``: each replica's forward speed relative to its step's, ``rho_r``)::

    P_1 = max_r c_r rho_r T_F,r,        P_k = max_r c_r T_F,r x (m_{k-1} / max_r c_r T_F,r at k-1)

Each evaluation's numbers go into the metrics row of the step it follows (``eval_loss``, ``eval_token_accuracy``,
``eval_gpu_s``, ``eval_s`` and its prediction ``eval_predicted_s``: every sink a step's loss reaches,
:meth:`Evaluations.row_extra`), and every task's evaluations and state are rewritten to ``<out>/evaluations.json``
(the HTTP API's ``GET /v1/tasks/<name>``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lorafleet.eval_schedule import EvalSchedule
from lorafleet.runtime.checkpoint_files import EVALUATION_KEY as STATE_KEY
from lorafleet.runtime.processes import fault_point
from lorafleet.specs.io import write_text_atomic
from lorafleet.stopping import Stopping
from lorafleet.sweeps import Rung, rungs_due
from lorafleet.train.change_log import STOPPED_EARLY, SWEEP_DROPPED

RUNGS_KEY = "sweep_rungs"
"""A checkpoint's ``extra`` key of the sweeps' rungs decided so far (:meth:`Evaluations.state_dict`)."""

if TYPE_CHECKING:
    from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan
    from lorafleet.specs.workload import TaskSpec
    from lorafleet.train.running import Running


class Outcome(Protocol):
    """What an evaluation measured, by task (``executor.torch.evaluate.EvalOutcome``)."""

    loss: dict[str, float]
    token_accuracy: dict[str, float]
    tokens: dict[str, int]
    rows: dict[str, int]
    replica_busy_s: tuple[float, ...]
    seconds: float


class Probed(Protocol):
    """The launch probe's forward pass (``train.probe.ForwardProbe``)."""

    plan: DeploymentPlan
    """The deployment it was measured on."""

    @property
    def relative_speed(self) -> tuple[float, ...]:
        """``rho_r``: each replica's forward speed over its steps' when it ran."""
        ...


class EvalPort(Protocol):
    """What the evaluations ask of the running fleet (``train.torch_fleet.TorchFleet``; a fake in tests)."""

    def batches_taken(self, name: str, step: int) -> int: ...

    def max_batches(self, name: str) -> int | None:
        """The global batches task ``name`` takes in all (its ``steps`` or ``epochs``); None: unbounded."""
        ...

    def eval_batch(self, step: int, names: Sequence[str]) -> GlobalBatch: ...

    def evaluate(self, step_plan: StepPlan, batch: GlobalBatch) -> Outcome: ...

    def keep_best(self, names: Sequence[str]) -> None: ...


@dataclass(frozen=True)
class TaskEvaluations:
    """One task's evaluations so far: its early-stopping state, and each evaluation (step, loss, token accuracy)."""

    stopping: Stopping = Stopping()
    history: tuple[tuple[int, float, float], ...] = ()
    stopped_at: int | None = None
    """The boundary it stopped early at (it leaves the run there)."""
    steps_not_taken: int | None = None
    """Of its steps, those the stop spared it (to its ``steps`` or ``epochs``, or to the run's end): it is charged
    for the steps it took only."""
    dropped_rung: int | None = None
    """The rung of its sweep's successive halving that dropped it (``lorafleet.sweeps``; it left at
    :attr:`stopped_at`), None when no rung did."""

    def to_json(self) -> dict[str, Any]:
        return {"stopping": self.stopping.to_json(), "history": [list(h) for h in self.history],
                "stopped_at": self.stopped_at, "steps_not_taken": self.steps_not_taken,
                "dropped_rung": self.dropped_rung}  # fmt: skip

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TaskEvaluations:
        history = tuple((int(s), float(loss), float(acc)) for s, loss, acc in raw["history"])
        return cls(Stopping.from_json(raw["stopping"]), history, raw.get("stopped_at"), raw.get("steps_not_taken"),
                   raw.get("dropped_rung"))  # fmt: skip


@dataclass
class Evaluations:
    """Rank 0's evaluations (module doc) of the running tasks, through ``port``; ``end``: the run's steps."""

    port: EvalPort
    end: int
    published: Path | None = None
    """Where the tasks' evaluations are rewritten after each (``RunDir.evaluations``: the HTTP API's view)."""
    tasks: dict[str, TaskEvaluations] = field(default_factory=dict)
    """By task name, every task that has been evaluated (those that left stay: the summary reads them)."""
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    """The last evaluation's numbers for the metrics row of the step it followed (:meth:`row_extra`)."""
    rungs: list[Rung] = field(default_factory=list)
    """Every rung of the sweeps' successive halving decided so far (``lorafleet.sweeps``), in order."""
    evaluations: int = 0
    """Evaluations run in this process (a work count the tests pin)."""
    correction: float = 1.0
    """The last evaluation's measured time over the cost model's forward-only prediction of it (at the replicas'
    recalibrated speeds): the next prediction's factor. The steps' recalibration measures forward and backward
    together; how a pass splits between them is the cost model's guess (``CostModel.forward_time``), which this
    corrects from the evaluations themselves, as the recalibrator does the steps'."""
    probed: Probed | None = None
    """The launch probe's forward pass (``train.probe.probe_forward``): the first evaluation of this process, on the
    deployment it was measured on, is predicted at the steps' speed times its forward's relative speed, where no
    evaluation has measured one yet."""

    def due(self, boundary: int, specs: Sequence[TaskSpec]) -> list[str]:
        """The tasks of ``specs`` due for an evaluation at the boundary before step ``boundary`` (module doc)."""
        out = []
        for spec in specs:
            schedule = EvalSchedule.of(spec)
            if schedule is None or boundary < 1 or self._stopped(spec.name):
                continue
            taken = self.port.batches_taken(spec.name, boundary)
            if taken == self.port.batches_taken(spec.name, boundary - 1):
                continue  # no batch in step boundary - 1
            last = self.port.max_batches(spec.name)
            if schedule.evaluates(taken) or taken == last or boundary == self.end:
                out.append(spec.name)
        return out

    def next_boundary(self, step: int, specs: Sequence[TaskSpec]) -> int | None:
        """The first boundary after ``step`` where a task of ``specs`` is due (None: none before the run's end)."""
        found = [b for spec in specs if spec.eval is not None and (b := self._next(spec, step)) is not None]
        return min(found, default=None)

    def _next(self, spec: TaskSpec, step: int) -> int | None:
        """``spec``'s next due boundary after ``step``: the first ``b`` whose ``n_t(b)`` reaches the next own step of
        its schedule (or its last batch), by a galloping search (``n_t`` is non-decreasing in ``b``), or the run's
        end when it takes a batch in the run's last step."""
        schedule = EvalSchedule.of(spec)
        assert schedule is not None
        if self._stopped(spec.name) or step >= self.end:
            return None
        taken = self.port.batches_taken(spec.name, step)
        target = schedule.next_after(taken)
        last = self.port.max_batches(spec.name)
        if last is not None:
            if taken >= last:
                return None
            target = min(target, last)
        reached = lambda b: self.port.batches_taken(spec.name, b) >= target  # noqa: E731
        if not reached(self.end):
            ends = self.port.batches_taken(spec.name, self.end) > self.port.batches_taken(spec.name, self.end - 1)
            return self.end if ends else None
        low, width = step, 1  # reached(low) is False, reached(self.end) True
        while low + width < self.end and not reached(low + width):
            low, width = low + width, width * 2
        high = min(low + width, self.end)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if reached(mid) else (mid, high)
        return high

    def _stopped(self, name: str) -> bool:
        """Whether ``name`` left the run by an early stop or its sweep's rung."""
        return name in self.tasks and self.tasks[name].stopped_at is not None

    def _spared(self, name: str, boundary: int) -> int:
        """The steps a task that leaves at ``boundary`` does not take (to its last, or to the run's end)."""
        taken = self.port.batches_taken(name, boundary)
        return max((self.port.max_batches(name) or self.port.batches_taken(name, self.end)) - taken, 0)

    def run(self, boundary: int, running: Running) -> list[str]:
        """The evaluation of the tasks due at the boundary before ``boundary`` (none due: nothing runs); returns the
        tasks that stop early there."""
        from lorafleet.accounting import task_gpu_seconds
        from lorafleet.eval_replay import dispatch_evaluation, forward_seconds
        from lorafleet.plans import StepReport

        specs = {t.name: t.spec for t in running.workload.tasks}
        due = self.due(boundary, list(specs.values()))
        self.last = {}
        if not due:
            return []
        batch = self.port.eval_batch(boundary, due)
        speed = running.recalibrator.factors
        step_plan = dispatch_evaluation(batch, running.plan, running.cost_model, speed)
        outcome = self.port.evaluate(step_plan, batch)
        predicted = max(forward_seconds(step_plan, running.plan, running.cost_model, speed))
        first = self._prediction(step_plan, running)
        shown = predicted * self.correction if first is None else first
        self.evaluations += 1
        report = StepReport(boundary, outcome.replica_busy_s, outcome.seconds, dict(outcome.tokens))
        gpu_s = task_gpu_seconds(step_plan, report, running.plan, running.cost_model, running.names)
        improved, stopped = [], []
        for name in due:
            spec = specs[name]
            task = self.tasks.get(name, TaskEvaluations())
            stopping = task.stopping.observe(outcome.loss[name], boundary, spec.early_stopping)
            history = (*task.history, (boundary, outcome.loss[name], outcome.token_accuracy[name]))
            spared = self._spared(name, boundary) if stopping.stopped else None
            self.tasks[name] = TaskEvaluations(stopping, history, boundary if stopping.stopped else None, spared)
            if stopping.improved:
                improved.append(name)
            if stopping.stopped:
                stopped.append(name)
        rungs = self._rungs(boundary, due, list(specs.values()))
        stopped += [name for rung in rungs for name in rung.dropped]
        if improved:
            self.port.keep_best(improved)
        fault_point("evaluated", boundary)  # tests: a kill between an evaluation and the checkpoint that records it
        self.publish()
        self.last = {
            "eval_loss": {n: outcome.loss[n] for n in due},
            "eval_token_accuracy": {n: outcome.token_accuracy[n] for n in due},
            "eval_gpu_s": {n: gpu_s[n] for n in due},
            "eval_s": outcome.seconds,
            "eval_predicted_s": shown,
        }
        if rungs:
            self.last["sweep_rung"] = {rung.sweep: rung.rung for rung in rungs}
            self.last["sweep_dropped"] = {name: rung.rung for rung in rungs for name in rung.dropped}
            self.last["sweep_scores"] = {n: s for rung in rungs for n, s in rung.to_json()["scores"].items()}
        self.correction = outcome.seconds / predicted if predicted > 0 else 1.0
        return stopped

    def _prediction(self, step_plan: StepPlan, running: Running) -> float | None:
        """The first evaluation's predicted time by the launch probe's forward, ``max_r c_r rho_r T_F,r``
        (``train.probe``: ``c_r`` the steps' recalibrated speed now); None for a later one, or when the probe did not
        run or ran on another deployment."""
        from lorafleet.eval_replay import forward_seconds

        probed, plan = self.probed, running.plan
        if self.evaluations or probed is None or probed.plan != plan:
            return None
        steps = running.recalibrator.factors or (1.0,) * len(plan.replicas)
        speed = [c * rho for c, rho in zip(steps, probed.relative_speed, strict=True)]
        return max(forward_seconds(step_plan, plan, running.cost_model, speed))

    def _rungs(self, boundary: int, due: Sequence[str], specs: Sequence[TaskSpec]) -> list[Rung]:
        """The rungs of successive halving decided at this boundary (``lorafleet.sweeps.rungs_due``); their dropped
        members leave the run here."""
        rungs = rungs_due(
            specs, due, boundary, self._stopped, lambda name: self.port.batches_taken(name, boundary),
            self.port.max_batches, lambda name: self.tasks[name].stopping.best_loss,
        )  # fmt: skip
        for rung in rungs:
            for name in rung.dropped:
                self.tasks[name] = replace(
                    self.tasks[name], stopped_at=boundary, steps_not_taken=self._spared(name, boundary),
                    dropped_rung=rung.rung,
                )  # fmt: skip
        self.rungs += rungs
        return rungs

    def row_extra(self) -> dict[str, Any]:
        """The last evaluation's numbers for its step's metrics row (empty when none ran at this boundary)."""
        return dict(self.last)

    def stopped_early(self, names: Sequence[str] | None = None) -> dict[str, tuple[int, str]]:
        """Every task (of ``names``, default all) that left by an early stop or its sweep's rung, by name: the
        boundary it left at and why, as its change record names it (``train.change_log``)."""
        return {
            n: (t.stopped_at, STOPPED_EARLY if t.dropped_rung is None else SWEEP_DROPPED)
            for n, t in self.tasks.items()
            if t.stopped_at is not None and (names is None or n in names)
        }

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: {name: task.to_json() for name, task in self.tasks.items()},
                RUNGS_KEY: [rung.to_json() for rung in self.rungs]}  # fmt: skip

    def load_state_dict(self, extra: Mapping[str, Any]) -> None:
        self.tasks = {name: TaskEvaluations.from_json(raw) for name, raw in extra.get(STATE_KEY, {}).items()}
        self.rungs = [Rung.from_json(raw) for raw in extra.get(RUNGS_KEY, ())]
        self.publish()

    def publish(self) -> None:
        """The tasks' evaluations written whole to :attr:`published` (when given): ``{task: TaskEvaluations}``."""
        if self.published is not None:
            text = json.dumps({name: task.to_json() for name, task in self.tasks.items()}, indent=1)
            write_text_atomic(self.published, text + "\n")
