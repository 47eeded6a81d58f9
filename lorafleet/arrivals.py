"""Tasks arriving and departing: replay a trace under three re-planning strategies and compare their GPU-seconds.

``lorafleet simulate WORKLOAD --arrivals TRACE`` (docs/arrivals.md).

**Trace file** (YAML)::

    events:
      - {at: 0,    add: {name: chat2, preset: dolly, steps: 30}}
      - {at: 600,  add: {name: summ, lengths: {mean: 2500, skewness: 1, kurtosis: 1},
                         batch_size: 16, context_length: 8192, steps: 40}}
      - {at: 900,  cancel: chat2}

Each event has ``at`` (seconds of simulated time, a finite number >= 0; events sorted by it) and
exactly one of ``add`` (a task, in the workload file's task schema: the workload's ``defaults:``
apply, dataset paths are relative to the trace file, and it needs ``steps``) or ``cancel`` (the name
of a task of the workload or added by an earlier event: it departs before it has taken its steps). A
task also departs by itself once it has taken its ``steps``. The WORKLOAD file's own tasks are present
from time 0 and need ``steps`` too. ``share``, ``deadline`` and ``start_step`` are refused (here a task
takes part in every step from its arrival to its departure). Every bad event is an InputError naming
the field (``events[3].add.batch_size``): a task name that is taken, a cancel of a task not yet
added or already cancelled, events out of order, a task without steps.

**Engine.** Simulated time ``t`` starts at 0; the fleet runs global steps of the tasks present. A step
draws each present task's ``batch_size`` lengths as :func:`lorafleet.sampling.sample_global_batch`
does, but seeded by (seed, the task's own step, its name), so a task sees the same batches whenever
it runs and whatever else is present. The batch is dispatched on the current plan
(:func:`lorafleet.dispatch.dispatch_step`) and run on the noise-free simulated executor, whose
makespan is the dispatcher's estimate; the clock advances by it, and the step costs
``makespan x plan.used_gpus`` GPU-seconds (the GPUs the plan's replicas hold, as ``simulate``
charges: GPUs a plan leaves unused are free for other work). Each task's part of a step is
:func:`lorafleet.accounting.task_gpu_seconds`'s (they sum to the step's GPU-seconds).

Changes happen at step boundaries: after a step, the tasks that took their last step depart
(completing at the step's end), then every event with ``at <= t`` is applied; a task that arrives
during a step joins at the next boundary, a cancelled one leaves there (its completion time is that
boundary, the first at or after its ``at``). When no task is present the fleet idles and the clock
jumps to the next event; idle time is not charged (the deployment is kept, but its GPUs are free).

**Strategies**, each replaying the same trace:

- ``incremental``: at each change, :func:`lorafleet.planner.replan_incremental` from the running plan,
  over ``min(horizon, the present tasks' most remaining steps)`` steps. When it moves, its
  ``migration_gpu_s`` (``migration_s`` x the GPUs of every replica torn down) is charged, and the
  clock waits ``migration_s`` while the fleet rebuilds (replicas rebuild in parallel);
- ``scratch``: at each change, :func:`lorafleet.planner.plan_deployment` for the present tasks, always
  taken; every replica it tears down (:func:`lorafleet.planner.incremental.torn_down`) is charged and
  waited for as above;
- ``static``: one plan for every task of the workload and the trace together, made up front and never
  changed: no migration.

The first plan of a run (the fleet starting) is a change like any other, but nothing is torn down.
The kept replicas of a migration wait for the rebuilt ones without being charged (as the
incremental planner prices a move). Migration GPU-seconds are the fleet's, not any task's.

Every strategy is priced by one cost model, built for all the tasks of the run (each replica keeps
room for every adapter the trace brings, so no deployment is rebuilt only because an adapter
arrives). Pure numpy and lorafleet's types: no torch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from pydantic import ValidationError

from lorafleet.accounting import task_gpu_seconds
from lorafleet.costmodel import CostModel
from lorafleet.dispatch import dispatch_step
from lorafleet.errors import InputError
from lorafleet.executor.simulated import SimulatedExecutor
from lorafleet.planner import PlannerOptions, ReplanOptions, plan_deployment, replan_incremental
from lorafleet.planner.incremental import torn_down
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepReport
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.workload import TaskSpec, deep_merge, describe_validation_error, fit_to_context, resolve_data_paths
from lorafleet.workload import Task, Workload, read_yaml, resolve_workload

T = TypeVar("T")

EVENT_KEYS = ("at", "add", "cancel")
UNSUPPORTED = ("share", "deadline", "start_step")
"""Task fields a trace refuses: a task here takes part in every step from its arrival to its departure."""


class Strategy(StrEnum):
    """How the fleet answers a change of its task set."""

    INCREMENTAL = "incremental"
    SCRATCH = "scratch"
    STATIC = "static"


# ----------------------------------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Arrival:
    """A task and when it arrives."""

    task: Task
    at_s: float
    source: tuple[str, str]
    """(file, field) where the task is defined: ``(workload, "tasks[2]")`` or ``(trace, "events[4].add")``."""


@dataclass(frozen=True)
class Cancel:
    """A task's departure before it has taken its steps."""

    at_s: float
    task: str


@dataclass(frozen=True)
class Trace:
    """A workload and a trace of arrivals and departures, validated and resolved."""

    path: str
    workload: Workload
    arrivals: tuple[Arrival, ...]
    """The workload's tasks (at 0) first, then the trace's, in trace order."""
    cancels: tuple[Cancel, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.task.name for a in self.arrivals)

    def arrival(self, name: str) -> Arrival:
        return next(a for a in self.arrivals if a.task.name == name)

    def subset(self, names: Sequence[str]) -> Workload:
        """The workload of the tasks ``names``, in that order (planned and dispatched as one)."""
        tasks = tuple(self.arrival(n).task for n in names)
        spec = self.workload.spec.model_copy(update={"tasks": tuple(t.spec for t in tasks)})
        return Workload(path=self.workload.path, spec=spec, model=self.workload.model, tasks=tasks)

    def all_tasks(self) -> Workload:
        """Every task of the workload and the trace (what ``static`` plans for, and the cost model's adapters)."""
        return self.subset(self.names)


def _check_task(spec: TaskSpec, path: str, where: str, what: str) -> None:
    """A task of the run needs steps and takes part in every step while present."""
    if spec.steps is None:
        why = " (epochs are not replayed: give steps)" if spec.epochs is not None else ""
        raise InputError(path, f"{where}.steps", f"{what} needs steps: it departs once it has taken them{why}")
    for name in UNSUPPORTED:
        value = getattr(spec, name)
        if value is not None and value != 0:
            raise InputError(
                path,
                f"{where}.{name}",
                f"not supported with --arrivals (a task takes part in every step from its arrival to its "
                f"departure; its arrival is its event's at), got {value!r}",
            )


def _number(value: Any, path: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(path, where, f"must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise InputError(path, where, f"must be a finite number >= 0, got {value!r}")
    return float(value)


def _resolve_added(workload: Workload, spec: TaskSpec, path: str, where: str) -> Task:
    """The added task's length distribution, errors named at its event."""
    try:
        resolved = resolve_workload(workload.spec.model_copy(update={"tasks": (spec,)}), path)
    except InputError as err:
        if err.path == path and err.field.startswith("tasks[0]"):
            raise InputError(path, where + err.field.removeprefix("tasks[0]"), err.msg) from None
        raise
    return resolved.tasks[0]


def load_trace(path: str | Path, workload: Workload) -> Trace:
    """Read and validate a trace of ``workload`` (module docstring); every problem is an InputError."""
    path = str(path)
    for k, task in enumerate(workload.tasks):
        _check_task(task.spec, workload.path, f"tasks[{k}]", f"with --arrivals, task {task.name!r}")
    raw = read_yaml(path)
    if not isinstance(raw, dict) or "events" not in raw:
        got = type(raw).__name__ if not isinstance(raw, dict) else f"keys {sorted(raw)}"
        raise InputError(path, "", f"expected a mapping with an 'events' list, got {got}")
    extra = sorted(set(raw) - {"events"})
    if extra:
        raise InputError(path, str(extra[0]), "unknown key (a trace has only 'events')")
    events = raw["events"]
    if events is None:
        events = []
    if not isinstance(events, list):
        raise InputError(path, "events", f"must be a list of events, got {type(events).__name__}")
    defaults = workload.spec.defaults
    arrivals = [Arrival(t, 0.0, (workload.path, f"tasks[{k}]")) for k, t in enumerate(workload.tasks)]
    defined = {t.name: f"task {t.name!r} is in the workload" for t in workload.tasks}
    cancelled: dict[str, int] = {}
    cancels: list[Cancel] = []
    last = 0.0
    for i, event in enumerate(events):
        here = f"events[{i}]"
        if not isinstance(event, dict):
            raise InputError(path, here, f"must be a mapping with at and add or cancel, got {event!r}")
        unknown = sorted(set(event) - set(EVENT_KEYS), key=str)
        if unknown:
            raise InputError(path, f"{here}.{unknown[0]}", "unknown key (an event has at and one of add, cancel)")
        if "at" not in event:
            raise InputError(path, f"{here}.at", "missing: the event's time in seconds")
        at = _number(event["at"], path, f"{here}.at")
        if at < last:
            raise InputError(path, f"{here}.at", f"events must be sorted by at: {at:g} comes after {last:g}")
        last = at
        if ("add" in event) == ("cancel" in event):
            raise InputError(path, here, "needs exactly one of add (a task) or cancel (a task name)")
        if "cancel" in event:
            name = event["cancel"]
            where = f"{here}.cancel"
            if not isinstance(name, str):
                raise InputError(path, where, f"must be a task name, got {name!r}")
            if name not in defined:
                raise InputError(
                    path, where, f"unknown task {name!r}: not in the workload nor added by an earlier event"
                )
            if name in cancelled:
                raise InputError(path, where, f"task {name!r} is already cancelled by events[{cancelled[name]}]")
            cancelled[name] = i
            cancels.append(Cancel(at, name))
            continue
        where = f"{here}.add"
        body = event["add"]
        if not isinstance(body, dict):
            raise InputError(path, where, f"must be a task mapping, got {body!r}")
        try:
            spec = TaskSpec.model_validate(deep_merge(defaults, body))
        except ValidationError as err:
            loc, msg = describe_validation_error(err.errors()[0])
            raise InputError(path, f"{where}.{loc}" if loc else where, msg) from None
        if spec.name in defined:
            raise InputError(path, f"{where}.name", f"task name {spec.name!r} is taken: {defined[spec.name]}")
        _check_task(spec, path, where, f"task {spec.name!r}")
        task = _resolve_added(workload, resolve_data_paths(spec, Path(path).parent), path, where)
        defined[spec.name] = f"added by {here}"
        arrivals.append(Arrival(task, at, (path, where)))
    return Trace(path=path, workload=workload, arrivals=tuple(arrivals), cancels=tuple(cancels))


# ------------------------------------------------------------------------------------------- the replay


@dataclass(frozen=True, kw_only=True)
class ArrivalOptions:
    """How the trace is replayed."""

    planner: PlannerOptions = PlannerOptions(robust_samples=0, baselines=False)
    """Options of every plan made (the first plan, each re-plan, the static plan)."""
    replan: ReplanOptions = ReplanOptions()
    """``migration_s`` (every strategy's price of a rebuilt replica) and the incremental horizon."""
    seed: int | None = None
    """Seed of the sampled batches; None: the workload's."""
    strategies: tuple[Strategy, ...] = tuple(Strategy)


@dataclass(frozen=True)
class Change:
    """One re-plan: the task set changed at a step boundary (or the fleet started)."""

    at_s: float
    tasks: tuple[str, ...]
    """The tasks present from here on."""
    plan: str
    """The deployment that runs them (``DeploymentPlan.describe``)."""
    gpus: int
    """GPUs its replicas use."""
    moved: bool
    """The deployment changed (the first plan of a run is not a move)."""
    torn_down: int
    """Replicas of the previous deployment rebuilt."""
    migration_gpu_s: float
    """Charged for this change (0 when nothing was torn down, or the strategy kept its deployment)."""
    step_gpu_s: float
    """The chosen deployment's expected GPU-seconds per step on the new task set."""
    keep_step_gpu_s: float | None = None
    """incremental only: the running deployment's expected GPU-seconds per step on it (inf: cannot serve it)."""
    note: str = ""


@dataclass(frozen=True)
class TaskOutcome:
    """What became of one task under one strategy."""

    name: str
    arrival_s: float
    steps: int
    """Steps it asked for."""
    steps_done: int = 0
    start_s: float | None = None
    """When its first step began (None: it never ran)."""
    completion_s: float | None = None
    """When it departed: the end of its last step, or the boundary its cancel took effect at."""
    cancelled: bool = False
    gpu_s: float = 0.0
    """Its GPU-seconds of the steps it took part in (``accounting.task_gpu_seconds``)."""
    tokens: int = 0


@dataclass(frozen=True)
class StrategyRun:
    """One strategy's replay of the trace."""

    strategy: Strategy
    step_gpu_s: float
    """GPU-seconds of the steps (makespan x the plan's used GPUs, summed)."""
    migration_gpu_s: float
    finish_s: float
    """When the last task departed."""
    steps: int
    """Global steps run."""
    plans: int
    """Plans made (the planner's calls: the first plan, then one per change; 1 for static)."""
    moves: int
    """Changes of deployment after the first plan."""
    rebuilt: int
    """Replicas torn down and rebuilt, in all."""
    tasks: dict[str, TaskOutcome]
    changes: tuple[Change, ...]
    step_s: tuple[float, ...] = field(repr=False, default=())
    """Each global step's makespan."""

    @property
    def gpu_s(self) -> float:
        """Total: the steps' and the migrations'."""
        return self.step_gpu_s + self.migration_gpu_s

    @property
    def tokens(self) -> int:
        """Real tokens trained, all tasks (fewer where a cancel came before a task's steps were taken)."""
        return sum(o.tokens for o in self.tasks.values())


@dataclass(frozen=True)
class ArrivalsResult:
    """Every strategy's replay of one trace."""

    trace: Trace
    runs: tuple[StrategyRun, ...]
    static_plan: DeploymentPlan | None = None

    def run(self, strategy: Strategy | str) -> StrategyRun:
        return next(r for r in self.runs if r.strategy == Strategy(strategy))


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def task_lengths(task: Task, own_step: int, seed: int) -> tuple[np.ndarray, int, int]:
    """Task ``task``'s batch at its own step ``own_step``: its ``batch_size`` lengths, truncated and rejected
    counts (``sampling.sample_global_batch``'s draw, seeded by (seed, own step, the task's name))."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, own_step, _name_key(task.name)]))
    n = task.batch_size
    fit = fit_to_context(task.raw_lengths.sample(n, rng), task.spec.context_length, task.spec.overflow)
    drawn = fit.lengths
    if fit.rejected.any():
        drawn[fit.rejected] = task.lengths.sample(int(fit.rejected.sum()), rng)
    return drawn.astype(np.int64), int(fit.truncated.sum()), int(fit.rejected.sum())


class _Planner:
    """The plans a replay makes, cached by task list (scratch and every first plan ask for the same ones),
    with planner errors named where the task was defined."""

    def __init__(self, trace: Trace, cluster: ClusterSpec, cost_model: CostModel, options: ArrivalOptions) -> None:
        self.trace, self.cluster, self.cost_model, self.options = trace, cluster, cost_model, options
        self._fresh: dict[tuple[str, ...], DeploymentPlan] = {}

    def named(self, names: Sequence[str], fn: Callable[[Workload], T]) -> T:
        workload = self.trace.subset(names)
        try:
            return fn(workload)
        except InputError as err:
            if err.path != workload.path or not err.field.startswith("tasks["):
                raise
            k, _, rest = err.field.removeprefix("tasks[").partition("]")
            path, where = self.trace.arrival(names[int(k)]).source
            raise InputError(path, where + rest, err.msg) from None

    def fresh(self, names: tuple[str, ...]) -> DeploymentPlan:
        if names not in self._fresh:
            self._fresh[names] = self.named(
                names, lambda w: plan_deployment(w, self.cluster, self.cost_model, self.options.planner).plan
            )
        return self._fresh[names]


def _gpus_of(plan: DeploymentPlan, replica_ids: Sequence[int]) -> int:
    return sum(plan.replicas[r].config.n_gpus for r in replica_ids)


def _run_step(
    step: int,
    present: Sequence[str],
    outcome: dict[str, TaskOutcome],
    tasks: dict[str, Task],
    plan: DeploymentPlan,
    cost_model: CostModel,
    seed: int,
) -> tuple[StepReport, dict[str, float]]:
    """One global step of the tasks ``present`` (each at its own next step) on ``plan``: the simulated
    executor's report and each task's GPU-seconds. Task ids index ``plan.tasks``."""
    index = {n: k for k, n in enumerate(plan.tasks)}
    ids, samples, lengths = [], [], []
    truncated = rejected = 0
    for name in present:
        own = outcome[name].steps_done
        drawn, cut, dropped = task_lengths(tasks[name], own, seed)
        truncated, rejected = truncated + cut, rejected + dropped
        ids.append(np.full(drawn.size, index[name], dtype=np.int64))
        samples.append(np.arange(own * drawn.size, (own + 1) * drawn.size, dtype=np.int64))
        lengths.append(drawn)
    batch = GlobalBatch(
        step=step,
        task_ids=np.concatenate(ids),
        sample_ids=np.concatenate(samples),
        lengths=np.concatenate(lengths),
        truncated=truncated,
        rejected=rejected,
    )
    step_plan = dispatch_step(batch, plan, cost_model)
    report = SimulatedExecutor(plan, cost_model, plan.tasks).run_step(step_plan)
    return report, task_gpu_seconds(step_plan, report, plan, cost_model, plan.tasks)


def _replay(
    strategy: Strategy,
    trace: Trace,
    planner: _Planner,
    dispatch_cost_model: CostModel,
    options: ArrivalOptions,
    static_plan: DeploymentPlan | None,
) -> StrategyRun:
    seed = trace.workload.spec.seed if options.seed is None else options.seed
    migration_s = options.replan.migration_s
    # (at, order, kind, name): arrivals first at equal times, then cancels, each in trace order
    queue = sorted(
        [(a.at_s, 0, k, "add", a.task.name) for k, a in enumerate(trace.arrivals)]
        + [(c.at_s, 1, k, "cancel", c.task) for k, c in enumerate(trace.cancels)]
    )
    outcome = {a.task.name: TaskOutcome(a.task.name, a.at_s, int(a.task.spec.steps)) for a in trace.arrivals}
    tasks = {a.task.name: a.task for a in trace.arrivals}
    present: list[str] = []
    plan = static_plan if strategy is Strategy.STATIC else None
    t = 0.0
    dirty = False
    step_gpu_s = migration_gpu_s = 0.0
    step = plans = moves = rebuilt = 0
    changes: list[Change] = []
    step_s: list[float] = []
    if strategy is Strategy.STATIC:
        assert plan is not None
        plans = 1
    while True:
        while queue and queue[0][0] <= t:
            _, _, _, kind, name = queue.pop(0)
            if kind == "add":
                present.append(name)
                dirty = True
            elif name in present:  # else it has completed already: nothing to cancel
                present.remove(name)
                outcome[name] = replace(outcome[name], completion_s=t, cancelled=True)
                dirty = True
        if not present:
            if not queue:
                break
            t = max(t, queue[0][0])  # idle: nothing charged
            continue
        if dirty and strategy is not Strategy.STATIC:
            names = tuple(present)
            left = max(outcome[n].steps - outcome[n].steps_done for n in names)
            if plan is None:
                plan = planner.fresh(names)
                change = Change(
                    t,
                    names,
                    plan.describe(),
                    plan.used_gpus,
                    False,
                    0,
                    0.0,
                    plan.expected_gpu_seconds,
                    note="first plan",
                )
            elif strategy is Strategy.INCREMENTAL:
                current = plan
                r = planner.named(
                    names,
                    lambda w, current=current, left=left: replan_incremental(
                        current, w, planner.cluster, planner.cost_model, options.planner, options.replan, left
                    ),
                )
                plan = r.plan
                keep = r.keep_step_s * current.used_gpus
                gone = r.torn_down if r.moved else 0
                charged = r.migration_gpu_s if r.moved else 0.0
                chosen = plan.expected_gpu_seconds
                change = Change(
                    t, names, plan.describe(), plan.used_gpus, r.moved, gone, charged, chosen, keep, r.describe()
                )
            else:
                new = planner.fresh(names)
                gone_ids = torn_down(plan, new)
                moved = {(r.config, r.gpus) for r in new.replicas} != {(r.config, r.gpus) for r in plan.replicas}
                charged = migration_s * _gpus_of(plan, gone_ids)
                change = Change(
                    t, names, new.describe(), new.used_gpus, moved, len(gone_ids), charged, new.expected_gpu_seconds
                )
                plan = new
            plans += 1
            moves += change.moved
            rebuilt += change.torn_down
            migration_gpu_s += change.migration_gpu_s
            if change.torn_down:
                t += migration_s  # the fleet rebuilds (its replicas in parallel) before the next step
            changes.append(change)
        dirty = False
        assert plan is not None and set(present) <= set(plan.tasks), (present, plan.tasks)
        report, owed = _run_step(step, present, outcome, tasks, plan, dispatch_cost_model, seed)
        start, t = t, t + report.makespan_s
        step_s.append(report.makespan_s)
        step_gpu_s += report.makespan_s * plan.used_gpus
        step += 1
        for name in list(present):
            o = outcome[name]
            o = replace(
                o,
                steps_done=o.steps_done + 1,
                start_s=start if o.start_s is None else o.start_s,
                gpu_s=o.gpu_s + owed[name],
                tokens=o.tokens + int(report.task_tokens.get(name, 0)),
            )
            if o.steps_done >= o.steps:
                o = replace(o, completion_s=t)
                present.remove(name)
                dirty = True
            outcome[name] = o
    finish = max((o.completion_s or 0.0 for o in outcome.values()), default=0.0)
    return StrategyRun(
        strategy=strategy,
        step_gpu_s=step_gpu_s,
        migration_gpu_s=migration_gpu_s,
        finish_s=finish,
        steps=step,
        plans=plans,
        moves=moves,
        rebuilt=rebuilt,
        tasks=outcome,
        changes=tuple(changes),
        step_s=tuple(step_s),
    )


def replay_trace(
    trace: Trace, cluster: ClusterSpec, cost_model: CostModel, options: ArrivalOptions = ArrivalOptions()
) -> ArrivalsResult:
    """Replay ``trace`` under each of ``options.strategies`` (module docstring) on ``cluster``, priced by
    ``cost_model`` (one for the run's tasks: ``assemble.workload_cost_model(trace.all_tasks(), cluster)``)."""
    planner = _Planner(trace, cluster, cost_model, options)
    static_plan = None
    if Strategy.STATIC in options.strategies:
        static_plan = planner.fresh(trace.names)
    runs = tuple(_replay(s, trace, planner, cost_model, options, static_plan) for s in options.strategies)
    return ArrivalsResult(trace=trace, runs=runs, static_plan=static_plan)
