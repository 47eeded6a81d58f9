"""What the live page shows of a running fleet (``GET /v1/fleet``, ``train.queue.http``), read from its run directory.

:class:`FleetWatch` builds a :class:`FleetView` from the files the run writes, and nothing else: ``run.json`` (the
run's steps, its tasks), ``run_length.json`` (the steps rank 0 counted each task takes in the run:
``train.run_length``), ``plan.json`` (the replicas), ``tasks.json`` (the ledger: every task the run has had, and how
each left), ``metrics.jsonl`` (each step's losses, GPU-seconds, replica busy times), ``evaluations.json`` and the
queue directory (pending, accepted and rejected requests). It reads no process's memory, so the page shows
what the run has committed to its files, as a resumed run or ``lorafleet sweep-report`` would see it.

A refresh must stay cheap at 64 tenants and thousands of steps (docs/queue.md, *The live page*: at most 200 ms of
the server's time), so the server reads the files once as it starts (:meth:`FleetWatch.warm`, beside the run's
start-up), every file is read again only when its size, inode or modification time changed, and
``metrics.jsonl``, which only grows between resumes, is read from where the last refresh stopped: a refresh parses
the steps written since, and folds them into running sums (:class:`_Steps`). A resume rewrites the file shorter (a
new inode): it is read again from the start. Each loss curve sent holds at most :data:`MAX_POINTS` of its steps
(every k-th, the last always), exact values, never averaged.

Per tenant (:class:`TenantView`): its state (:class:`TenantState`), the steps it has taken of its total
(as ``run_length.json`` counts them; before rank 0 wrote it, or for a task added since: ``steps``, or ``epochs`` over
the rows the run file's lengths count, or the run's steps from its start, never more than the run has left it),
an ETA, its loss curve, its evaluations, and its GPU-seconds (its evaluations' included, as the run's closing
lines count them). Per replica (:class:`ReplicaView`): its config, GPUs and pool, and its utilisation (busy over
step time) over the last :data:`ETA_STEPS` steps on the current deployment.

**ETAs.** A task with a ``share`` (``turns``) takes a batch only on some fleet steps, so its ETA is its steps left
over its progress rate ``r`` (its steps taken per fleet step), times the mean step time t̄ of the last
:data:`ETA_STEPS` steps::

    ETA = t̄ * steps_left / r

``r`` = 1 for a task without a share (it takes every step). For a shared task ``r`` is what the metrics show: the
fleet steps among the last :data:`ETA_STEPS` since its start whose row holds its loss, over those steps. Before it
has taken one there, ``r`` is the share's expectation: the turns give it ``σ_t`` of every step's tokens ``T``, so
``r = min(1, σ_t T / τ_t)`` with ``τ_t`` its batch's expected tokens (batch size times its rows' mean length, from the
run file) and, in the steady state, ``T = Σ_unshared τ_u / (1 - Σ_shared σ)`` (the unshared tasks' tokens are the
rest); where that is undefined (no unshared task, Σσ >= 1, lengths not recorded) ``r = σ_t``.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, TypeVar

from lorafleet.plans import DeploymentPlan
from lorafleet.rundir import RunDir
from lorafleet.train.queue.requests import (
    ACCEPTED,
    REJECTED,
    STOPPED_EARLY,
    SWEEP_DROPPED,
    TOOK_ITS_STEPS,
    reason_file,
    request_files,
)

MAX_POINTS = 240
"""The most points of a loss curve one refresh sends (a curve of more steps is sampled every k-th step)."""
ETA_STEPS = 20
"""The last steps whose mean time gives the ETAs, and over which a replica's utilisation is measured."""
VIEW_VERSION = 1
"""The version of :meth:`FleetView.to_json`'s shape."""

T = TypeVar("T")


class TenantState(StrEnum):
    """Where a tenant stands, as the page shows it."""

    WAITING = "waiting"
    """Its start step is ahead."""
    TRAINING = "training"
    DONE = "done"
    """It took its steps (or its epochs)."""
    STOPPED_EARLY = "stopped early"
    """Early stopping made it leave (``train.evaluation``)."""
    DROPPED = "dropped"
    """A rung of its sweep made it leave (``lorafleet.sweeps``)."""
    FINISHED = "finished"
    """A queued finish made it leave."""
    CANCELLED = "cancelled"


_LEFT_BY = {
    TOOK_ITS_STEPS: TenantState.DONE,
    STOPPED_EARLY: TenantState.STOPPED_EARLY,
    SWEEP_DROPPED: TenantState.DROPPED,
}
"""A departed task's state by how it left (the ledger's request file)."""


@dataclass(frozen=True)
class Curve:
    """Points of a curve: ``values[i]`` at global step ``steps[i]`` (1-based: the step's number on the console)."""

    steps: tuple[int, ...] = ()
    values: tuple[float | None, ...] = ()
    """None: a non-finite value (JSON has none)."""


@dataclass(frozen=True)
class TenantView:
    """One tenant on the page."""

    name: str
    state: TenantState
    steps_done: int
    """Global steps it took part in."""
    steps_total: int | None
    """The steps it will take in this run (None: not known, a task the run file does not name)."""
    start_step: int
    eta_s: float | None
    """Seconds until it has taken its steps (None: not training, or no step measured yet)."""
    loss: float | None
    """Its training loss at the last step it took (None: none yet, or not finite)."""
    gpu_s: float
    """GPU-seconds it owes, its evaluations' included."""
    eval_gpu_s: float
    loss_curve: Curve
    eval_curve: Curve
    """Its evaluations' losses, by the step after which each ran (``evaluations.json``)."""
    eval_accuracy: tuple[float, ...] = ()
    """Token accuracy of each evaluation of :attr:`eval_curve`."""
    best_eval: tuple[int, float] | None = None
    """(step, loss) of its best evaluation."""


@dataclass(frozen=True)
class ReplicaView:
    """One replica of the current deployment."""

    replica_id: int
    config: str
    """``<tp,pp>`` or ``<tp,pp,rc>``, with ``@pool`` in a fleet of named pools."""
    tp: int
    pp: int
    recompute: bool
    gpus: tuple[int, ...]
    gpu: str
    """Its pool's GPU kind."""
    max_tokens: int
    utilisation: float | None
    """Its busy time over the step time, over the last steps on this deployment (None: none yet)."""


@dataclass(frozen=True)
class RejectedRequest:
    file: str
    reason: str | None


@dataclass(frozen=True)
class QueueView:
    """The queue directory: request files waiting for a boundary, and those the watcher took or refused."""

    pending: tuple[str, ...]
    rejected: tuple[RejectedRequest, ...]
    accepted: tuple[str, ...]


@dataclass(frozen=True)
class RunView:
    """The run as a whole."""

    steps_done: int
    steps: int | None
    """The run's steps (``train --steps``; None before the run file is written)."""
    mean_step_s: float | None
    """Mean time of the last :data:`ETA_STEPS` steps."""
    eta_s: float | None
    gpu_s: float
    """GPU-seconds of all its steps so far (every held GPU for each whole step)."""
    deployment: str
    """The plan, ``<1,2> x 4 + <8,1> x 1``."""
    fleet: str
    """Its GPUs, ``16 x A100-40GB``."""
    model: str


@dataclass(frozen=True)
class FleetView:
    """A snapshot of a running fleet: what one refresh of the page draws."""

    run: RunView
    tenants: tuple[TenantView, ...]
    replicas: tuple[ReplicaView, ...]
    queue: QueueView
    version: int = VIEW_VERSION

    def to_json(self) -> dict[str, Any]:
        """The view as ``GET /v1/fleet`` answers it: every dataclass an object of its fields, tuples lists.
        Written out rather than by ``dataclasses.asdict``, which deep-copies every value: 8x the time at 64
        tenants (``benchmarks/bench_live_page.py``)."""
        return {
            "version": self.version,
            "run": _fields(self.run),
            "tenants": [
                _fields(t) | {"loss_curve": _fields(t.loss_curve), "eval_curve": _fields(t.eval_curve)}
                for t in self.tenants
            ],
            "replicas": [_fields(r) for r in self.replicas],
            "queue": _fields(self.queue) | {"rejected": [_fields(r) for r in self.queue.rejected]},
        }


def _fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields, by name, as they are (shallow)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


class _Cached(Generic[T]):
    """A file parsed by ``parse``, parsed again only when its size, inode or modification time changed; ``default``
    while it does not exist."""

    def __init__(self, path: Path, parse: Callable[[bytes], T], default: T) -> None:
        self.path, self._parse, self._default = path, parse, default
        self._key: tuple[int, int, int] | None = None
        self._value = default

    def get(self) -> T:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._key, self._value = None, self._default
            return self._value
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._key:
            self._value, self._key = self._parse(self.path.read_bytes()), key
        return self._value


@dataclass
class _TaskSteps:
    """One task's running sums over the steps read so far."""

    steps: list[int] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    gpu_s: float = 0.0
    eval_gpu_s: float = 0.0


class _Steps:
    """``metrics.jsonl`` folded into running sums, read on from where the last :meth:`update` stopped (module doc)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reset(None)

    def _reset(self, inode: int | None) -> None:
        self._inode, self._offset, self._partial = inode, 0, b""
        self.count = 0
        self.last_step = -1
        self.tasks: dict[str, _TaskSteps] = {}
        self.makespans: list[float] = []
        self.busy: list[Sequence[float]] = []
        self.gpu_s = 0.0

    def update(self) -> None:
        """Fold in the rows written since the last call (from the start when the file was replaced or cut)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._reset(None)
            return
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._reset(st.st_ino)
        if st.st_size == self._offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # a line not ended yet: read with the next refresh
        for line in lines:
            if line.strip():
                self._fold(json.loads(line))

    def _fold(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"]) + 1
        self.count += 1
        self.last_step = max(self.last_step, step)
        for name, loss in row.get("losses", {}).items():
            task = self.tasks.get(name) or self.tasks.setdefault(name, _TaskSteps())
            task.steps.append(step)
            task.losses.append(_finite(loss))
        for key, attr in (("task_gpu_s", "gpu_s"), ("eval_gpu_s", "eval_gpu_s")):
            for name, seconds in row.get(key, {}).items():
                task = self.tasks.get(name) or self.tasks.setdefault(name, _TaskSteps())
                setattr(task, attr, getattr(task, attr) + float(seconds))
        self.makespans.append(float(row["makespan_s"]))
        self.busy.append(row.get("replica_busy_s", ()))
        self.gpu_s += sum(row.get("task_gpu_s", {}).values())

    def mean_step_s(self) -> float | None:
        recent = self.makespans[-ETA_STEPS:]
        return sum(recent) / len(recent) if recent else None


def sampled(steps: Sequence[int], values: Sequence[float | None], most: int = MAX_POINTS) -> Curve:
    """At most ``most`` points of a curve: every k-th, the last always, values exact."""
    every = max(1, math.ceil(len(steps) / most))
    if every == 1:
        return Curve(tuple(steps), tuple(values))
    keep_steps, keep_values = list(steps[-1::-every]), list(values[-1::-every])
    return Curve(tuple(reversed(keep_steps)), tuple(reversed(keep_values)))


def queue_view(queue_dir: Path, reasons: dict[str, str | None] | None = None) -> QueueView:
    """The queue directory's request files: pending, rejected (each with its reason, from ``<file>.reason``),
    accepted. ``reasons``: a cache of the rejected files' reasons by name (a rejected file's reason never changes)."""
    reasons = {} if reasons is None else reasons
    rejected = []
    for path in request_files(queue_dir / REJECTED):
        if path.name not in reasons:
            try:
                reasons[path.name] = reason_file(path).read_text(encoding="utf-8", errors="replace").strip()
            except OSError:
                reasons[path.name] = None
        rejected.append(RejectedRequest(path.name, reasons[path.name]))
    return QueueView(
        pending=tuple(p.name for p in request_files(queue_dir)),
        rejected=tuple(rejected),
        accepted=tuple(p.name for p in request_files(queue_dir / ACCEPTED)),
    )


def _json(data: bytes) -> Any:
    return json.loads(data)


def _plan(data: bytes) -> DeploymentPlan | None:
    return DeploymentPlan.from_json(json.loads(data), "plan.json")


class FleetWatch:
    """The fleet of the run in ``run_dir``, as its files say (module doc); :meth:`view` is thread-safe (the HTTP
    server answers each request on a thread of its own)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self._run = _Cached(run_dir.run_file, _json, None)
        self._plan: _Cached[DeploymentPlan | None] = _Cached(run_dir.plan, _plan, None)
        self._ledger = _Cached(run_dir.ledger, _json, None)
        self._evaluations = _Cached(run_dir.evaluations, _json, {})
        self._run_length = _Cached(run_dir.run_length, _json, None)
        self._changes = _Cached(run_dir.changes, _moved_at, 0)
        self._steps = _Steps(run_dir.metrics_jsonl)
        self._reasons: dict[str, str | None] = {}

    def warm(self) -> None:
        """Read the run's files as a first refresh would (what the server does as it starts, on a thread beside the
        run's start-up: a resumed run's long ``metrics.jsonl`` is not parsed by the page's first request). A file
        it cannot read is left to the requests, whose answer says so."""
        try:
            self.view()
        except Exception:
            pass  # a request reads it again and answers 500 for it

    def view(self) -> FleetView:
        """The fleet now."""
        with self._lock:
            self._steps.update()
            run, plan = self._run.get(), self._plan.get()
            steps = self._steps
            run_steps = run["options"]["steps"] if run else None
            mean = steps.mean_step_s()
            return FleetView(
                run=RunView(
                    steps_done=steps.count,
                    steps=run_steps,
                    mean_step_s=mean,
                    eta_s=_eta(mean, None if run_steps is None else run_steps - steps.count),
                    gpu_s=steps.gpu_s,
                    deployment=plan.describe() if plan else "",
                    fleet=plan.describe_fleet() if plan else "",
                    model=plan.model if plan else "",
                ),
                tenants=self._tenants(run, run_steps, mean),
                replicas=self._replicas(plan),
                queue=queue_view(self.run_dir.queue, self._reasons),
            )

    def _tenants(
        self, run: Mapping[str, Any] | None, run_steps: int | None, mean: float | None
    ) -> tuple[TenantView, ...]:
        specs: dict[str, Mapping[str, Any]] = {}
        left: dict[str, TenantState] = {}
        lengths = run["state"].get("lengths", {}) if run else {}
        for spec in run["state"]["workload"]["tasks"] if run else ():
            specs[spec["name"]] = spec
        ledger = self._ledger.get()
        if ledger:
            how = {a["name"]: a["file"] for a in ledger.get("applied", ()) if a["action"] in ("finish", "cancel")}
            for entry in ledger["tasks"]:
                name = entry["spec"]["name"]
                specs[name] = entry["spec"]
                if entry["state"] != "active":
                    left[name] = _LEFT_BY.get(how.get(name, ""), TenantState(entry["state"]))
        evaluations = self._evaluations.get()
        record = self._run_length.get()  # the steps rank 0 counted each task takes in the run (train.run_length)
        in_run = {t["name"]: int(t["in_run"]) for t in record["tasks"]} if record else {}
        names = list(specs) + [n for n in self._steps.tasks if n not in specs]
        expected = _expected_rates(specs, lengths)
        out = []
        for name in names:
            spec, sums = specs.get(name, {}), self._steps.tasks.get(name) or _TaskSteps()
            evals = evaluations.get(name) or {}
            start = int(spec.get("start_step", 0))
            total = in_run[name] if name in in_run else _task_steps(spec, lengths.get(name), run_steps, start)
            done = len(sums.steps)
            state = left.get(name) or _evaluated_state(evals)
            if state is None:
                if total is not None and done >= total:
                    state = TenantState.DONE
                else:
                    state = TenantState.WAITING if start >= self._steps.count and not done else TenantState.TRAINING
            history = evals.get("history") or ()
            stopping = evals.get("stopping") or {}
            best = stopping.get("best_step")
            out.append(
                TenantView(
                    name=name,
                    state=state,
                    steps_done=done,
                    steps_total=total,
                    start_step=start,
                    eta_s=(
                        _eta(mean, total - done, self._rate(sums, start, expected.get(name)))
                        if state is TenantState.TRAINING and total is not None
                        else None
                    ),
                    loss=sums.losses[-1] if sums.losses else None,
                    gpu_s=sums.gpu_s + sums.eval_gpu_s,
                    eval_gpu_s=sums.eval_gpu_s,
                    loss_curve=sampled(sums.steps, sums.losses),
                    eval_curve=Curve(tuple(int(h[0]) for h in history), tuple(_finite(h[1]) for h in history)),
                    eval_accuracy=tuple(float(h[2]) for h in history),
                    best_eval=(int(best), float(stopping["best_loss"])) if best is not None else None,
                )
            )
        return tuple(out)

    def _rate(self, sums: _TaskSteps, start: int, expected: float | None) -> float:
        """A task's steps per fleet step (module doc): 1 without a share (``expected`` None), else over the last
        :data:`ETA_STEPS` fleet steps since its start, or ``expected`` before it took one there."""
        if expected is None:
            return 1.0
        first = max(start, self._steps.count - ETA_STEPS) + 1  # 1-based, as its steps are recorded
        taken = sum(1 for step in sums.steps[-ETA_STEPS:] if step >= first)
        return taken / (self._steps.count - first + 1) if taken else expected

    def _replicas(self, plan: DeploymentPlan | None) -> tuple[ReplicaView, ...]:
        if plan is None:
            return ()
        steps, n = self._steps, len(plan.replicas)
        start = max(self._changes.get(), len(steps.busy) - ETA_STEPS)
        window = [i for i in range(start, len(steps.busy)) if len(steps.busy[i]) == n]  # rows are steps 0, 1, ...
        held = sum(steps.makespans[i] for i in window)
        gpu = {p.name: p.gpu for p in plan.pools}
        return tuple(
            ReplicaView(
                replica_id=r.replica_id,
                config=str(r.config),
                tp=r.config.tp,
                pp=r.config.pp,
                recompute=r.config.recompute,
                gpus=r.gpus,
                gpu=gpu.get(r.pool, ""),
                max_tokens=r.max_tokens,
                utilisation=sum(steps.busy[i][k] for i in window) / held if held > 0 else None,
            )
            for k, r in enumerate(plan.replicas)
        )


def _moved_at(data: bytes) -> int:
    """The first step (0-based) of the current deployment: the last boundary where the fleet moved (0: none)."""
    moved = ("moved", "relaunched", "handed-off")
    steps = [row["step"] for row in map(json.loads, data.splitlines()) if row.get("outcome") in moved]
    return max(steps, default=0)


def _evaluated_state(evaluations: Mapping[str, Any]) -> TenantState | None:
    """Stopped early or dropped by its sweep, as ``evaluations.json`` says (before the ledger does, or without one)."""
    if evaluations.get("dropped_rung") is not None:
        return TenantState.DROPPED
    if evaluations.get("stopped_at") is not None:
        return TenantState.STOPPED_EARLY
    return None


def _task_steps(spec: Mapping[str, Any], lengths: Sequence[Sequence[int]] | None, run_steps: int | None, start: int):
    """The steps a task takes in the run: its ``steps``, or ``epochs`` over its rows (``runtime.data_stream``'s
    rule), else the run's from its start; never more than the run has from its start."""
    left = None if run_steps is None else max(run_steps - start, 0)
    own = spec.get("steps")
    if own is None and spec.get("epochs") is not None and lengths:
        rows = sum(int(count) for _, count in lengths)
        own = max(1, math.ceil(float(spec["epochs"]) * rows / int(spec["batch_size"])))
    if own is None:
        return left
    return int(own) if left is None else min(int(own), left)


def _finite(value: Any) -> float | None:
    """``value`` as a float, None where it is not finite (a task's non-finite loss: JSON has no NaN)."""
    number = float(value)
    return number if math.isfinite(number) else None


def _expected_rates(
    specs: Mapping[str, Mapping[str, Any]], lengths: Mapping[str, Sequence[Sequence[int]]]
) -> dict[str, float]:
    """The steps per fleet step each task with a ``share`` is expected to take (module doc); the others: none."""
    shares = {name: float(spec["share"]) for name, spec in specs.items() if spec.get("share") is not None}

    def tokens(name: str) -> float | None:
        rows = lengths.get(name)
        count = sum(int(c) for _, c in rows) if rows else 0
        return int(specs[name]["batch_size"]) * sum(int(n) * int(c) for n, c in rows) / count if count else None

    unshared = [tokens(name) for name in specs if name not in shares]
    step_tokens = None
    if unshared and all(t is not None for t in unshared) and sum(shares.values()) < 1:
        step_tokens = sum(t for t in unshared if t is not None) / (1 - sum(shares.values()))
    rates = {}
    for name, share in shares.items():
        own = tokens(name)
        rates[name] = min(1.0, share * step_tokens / own) if step_tokens is not None and own else share
    return rates


def _eta(mean_step_s: float | None, steps_left: int | None, rate: float = 1.0) -> float | None:
    """``t̄ * steps_left / r`` seconds (module doc); None without a step time or a step count."""
    if mean_step_s is None or steps_left is None:
        return None
    return mean_step_s * max(steps_left, 0) / rate
