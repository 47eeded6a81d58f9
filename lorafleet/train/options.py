"""What ``lorafleet train`` is told: :class:`TrainOptions`, one field a flag, checked as it is built. The
launcher resolves them into the run file its workers read (``train.run_file``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from pydantic import ConfigDict

from lorafleet.errors import InputError
from lorafleet.rundir import RunDir
from lorafleet.runtime.processes import START_TIMEOUT_S
from lorafleet.specs.workload import MAX_STEPS

ARGS = "<args>"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """What ``lorafleet train`` is told (one field a flag)."""

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    workload: str
    """Workload YAML; every task needs data."""
    sets: tuple[str, ...] = ()
    """``--set KEY=VALUE`` overrides of the workload's fields, applied before it is validated
    (``lorafleet.workload.apply_overrides``); the workers run the workload they made (``train.run_file``)."""
    plan: str
    """DeploymentPlan JSON (``lorafleet plan --json``)."""
    steps: int = 10
    """The run's total steps (a resumed run continues up to it, and may not be told fewer than it has); at most
    ``specs.workload.MAX_STEPS``."""
    out: str = "runs/train"
    """Run directory: plan, metrics, checkpoints, adapters; one run at a time (a lock)."""
    resume: bool = False
    """Continue from the newest intact checkpoint in ``out``."""
    overwrite: bool = False
    """Start afresh in an ``out`` a previous run used, removing its files (and its own queue's)."""
    allow_changes: bool = False
    """On a resume, train on with task hyperparameters changed since the run started, recording each change
    with its step (``train.revisions``); without it such a resume is refused."""
    checkpoint_every: int = 50
    """Commit a checkpoint every K steps (and always at the end)."""
    checkpoint_on_stop: bool = True
    """On SIGINT/SIGTERM, commit a checkpoint at the step boundary before stopping."""
    max_restarts: int = 0
    """Restart the workers this many times after a failure, resuming from the last checkpoint."""
    start_timeout_s: float = START_TIMEOUT_S
    """Seconds the workers have to form their process group (each start, each restart): a worker that never
    arrives ends the start with one line, and another restart when ``max_restarts`` allows."""
    nonfinite_patience: int = 3
    """A task whose update is skipped this many steps in a row (non-finite loss or gradient) stops."""
    device: str = "auto"
    """``cuda`` (NCCL, a GPU per process), ``cpu`` (gloo) or ``auto``."""
    dtype: str = "fp32"
    """Of the frozen base and the activations (adapters stay fp32 master weights)."""
    gpus: int | None = None
    """The cluster's GPU count, as given to ``plan`` (default: the workload's)."""
    gpu: str | None = None
    """The cluster's GPU kind, as given to ``plan`` (default: the workload's)."""
    profile: str | None = None
    """A cost-model profile overriding the one the plan was judged by."""
    policy_overrides: tuple[tuple[str, object], ...] = ()
    """(policy field key, value) pairs overriding the plan's dispatch policy (``DispatchPolicy.with_overrides``);
    the launcher applies them once, the workers run the policy it checked."""
    progress: bool = True
    """A progress bar on rank 0 when stdout is a terminal (a log line per step otherwise)."""
    slowdown: tuple[tuple[int, float], ...] = ()
    """Fault injection: (replica id, factor) stragglers (``ExecutorConfig.slowdown``)."""
    queue: str | None = None
    """The live task queue's directory (``train.queue``); default ``<out>/queue``."""
    queue_http: int | None = None
    """Also serve the queue over HTTP on 127.0.0.1 at this port (0: any free one; ``train.queue.http``)."""
    queue_data_roots: tuple[str, ...] = ()
    """Directories a queued task's data must resolve inside, symlinks followed (``--queue-data-root``); empty:
    the directories that hold the workload's own data (the launcher resolves them: :func:`data_roots`)."""
    migration_s: float | None = None
    """A flat price of a change of deployment: seconds of each torn-down replica's GPUs; None: what the in-process
    rebuild costs, measured by the run (``planner.incremental.MigrationModel``)."""
    replan_horizon: int = 200
    """The most steps an incremental re-plan counts a new deployment's savings over."""
    replan_objective: str = "makespan"
    """What an incremental re-plan minimises: ``makespan`` or ``gpu-s`` (``planner.incremental.ReplanObjective``)."""
    replan_after: int = 1
    """Steps a change's re-plan runs beside the training before its move is applied, when the running deployment
    can serve the new tasks meanwhile (``train.background``); 0: the change's boundary waits for the re-plan."""
    loggers: tuple[str, ...] = ()
    """Experiment trackers rank 0 also logs the step scalars to: ``wandb``, ``mlflow`` (``lorafleet.metrics``)."""

    @property
    def run_dir(self) -> RunDir:
        """The run directory's layout (``--out``, with ``--queue`` when given)."""
        return RunDir(Path(self.out), Path(self.queue) if self.queue is not None else None)

    @property
    def queue_dir(self) -> Path:
        return self.run_dir.queue

    def __post_init__(self) -> None:
        for flag, value, least in (
            ("--steps", self.steps, 1),
            ("--checkpoint-every", self.checkpoint_every, 1),
            ("--max-restarts", self.max_restarts, 0),
            ("--nonfinite-patience", self.nonfinite_patience, 1),
            ("--replan-horizon", self.replan_horizon, 1),
            ("--replan-after", self.replan_after, 0),
        ):
            if value < least:
                raise InputError(ARGS, flag, f"must be >= {least}, got {value}")
        if self.steps > MAX_STEPS:
            raise InputError(
                ARGS,
                "--steps",
                f"must be at most {MAX_STEPS:,} (a task's data cursor, steps x batch size, is a 64-bit sample id), "
                f"got {self.steps:,}",
            )
        if not (math.isfinite(self.start_timeout_s) and self.start_timeout_s > 0):
            raise InputError(
                ARGS, "--start-timeout", f"must be a finite number of seconds > 0, got {self.start_timeout_s}"
            )
        if self.migration_s is not None and not (math.isfinite(self.migration_s) and self.migration_s >= 0):
            raise InputError(ARGS, "--migration-s", f"must be a finite number >= 0, got {self.migration_s}")
        if self.replan_objective not in ("makespan", "gpu-s"):
            raise InputError(ARGS, "--replan-objective", f"expected makespan or gpu-s, got {self.replan_objective!r}")
        if self.queue_http is not None and not 0 <= self.queue_http < 65536:
            raise InputError(ARGS, "--queue-http", f"must be a port in 0..65535, got {self.queue_http}")
        if self.resume and self.overwrite:
            raise InputError(ARGS, "--overwrite", "cannot be combined with --resume")
        check_loggers(self.loggers)


def check_loggers(loggers: tuple[str, ...]) -> None:
    """InputError, before any process starts, for a ``--logger`` that is unknown or whose package is not
    installed (looked up, not imported: ``lorafleet.metrics.LOGGERS``)."""
    from lorafleet.metrics import LOGGERS

    for name in loggers:
        if name not in LOGGERS:
            raise InputError(ARGS, "--logger", f"expected one of {', '.join(LOGGERS)}, got {name!r}")
        package = LOGGERS[name].PACKAGE
        if find_spec(package) is None:
            raise InputError(
                ARGS, "--logger", f"{name}: the {package} package is not installed (pip install 'lorafleet[{name}]')"
            )
