"""What ``lorafleet train`` is told: :class:`TrainOptions`, one field a flag, checked as it is built. Its fields
are the command's field table (``specs.fields``): ``commands.train`` generates the flags, their help and
defaults from them. The launcher resolves the options into the run file its workers read (``train.run_file``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from lorafleet.errors import InputError
from lorafleet.rundir import RunDir
from lorafleet.runtime.checkpoint_files import CHECKPOINT_EVERY
from lorafleet.runtime.processes import START_TIMEOUT_S
from lorafleet.specs.device import Device, Precision
from lorafleet.specs.field_docs import documented
from lorafleet.specs.fields import ARGS, check_fields, flag, in_group
from lorafleet.specs.replan import ReplanSettings
from lorafleet.specs.workload import MAX_STEPS

QUEUE = "live task queue (tasks added, finished, cancelled while training)"
"""The argument group of the queue's flags and the re-plan's (``ReplanSettings``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """What ``lorafleet train`` is told: one field a flag, its field table (``specs.fields``: each field's flag,
    doc string as its help, default and bound) the one list of the command's own flags (``commands.train``)."""

    __pydantic_config__ = documented(extra="forbid")

    workload: str = field(metadata=flag("workload"))
    """workload YAML file (every task needs data)"""
    plan: str | None = field(default=None, metadata=flag("--plan"))
    """DeploymentPlan JSON (from `lorafleet plan --json`); default: on one machine, train plans for itself (as
    `lorafleet plan` would), says what it planned and keeps it as <out>/plan.json; a resume trains by that one"""
    # at most specs.workload.MAX_STEPS (checked below); None: resolved by the launcher (train.run_length)
    steps: int | None = field(default=None, metadata=flag("--steps", least=1))
    """the run's total training steps (default: until every task has taken its steps or epochs); a resumed run
    continues up to them, and may not be told fewer than it has run; a task whose steps do not fit is cut, and
    said so as the run starts"""
    out: str = field(default="runs/train", metadata=flag("--out"))
    """output directory of the plan, metrics, checkpoints and adapters, held by one run at a time"""
    resume: bool = field(default=False, metadata=flag("--resume"))
    """continue from the newest intact checkpoint in --out"""
    # train.revisions records each change
    allow_changes: bool = field(default=False, metadata=flag("--allow-changes"))
    """with --resume: train on with task hyperparameters changed since the run started (recorded with their
    step in tasks.json, workload.resolved.yaml and the adapter cards); without it they are refused"""
    overwrite: bool = field(default=False, metadata=flag("--overwrite"))
    """start afresh in an --out a previous run used (its files, and its own queue's, are removed); without it,
    or --resume, a used --out is refused"""
    max_restarts: int = field(default=0, metadata=flag("--max-restarts", "K", least=0))
    """restart the workers up to K times after a failure, from the last checkpoint"""
    start_timeout_s: float = field(default=START_TIMEOUT_S, metadata=flag("--start-timeout", "S"))
    """seconds the workers have to form their process group at each start and restart; a worker that never
    arrives ends the start with one line, and another restart with --max-restarts"""
    checkpoint_on_stop: bool = field(default=True, metadata=flag("--no-stop-checkpoint", negated=True))
    """on SIGINT/SIGTERM, commit a checkpoint at the step boundary before stopping (--no-stop-checkpoint: stop
    there without committing one)"""
    nonfinite_patience: int = field(default=3, metadata=flag("--nonfinite-patience", "K", least=1))
    """a task skipped K steps in a row for a non-finite loss or gradient stops"""
    checkpoint_every: int = field(default=CHECKPOINT_EVERY, metadata=flag("--checkpoint-every", "K", least=1))
    """commit a checkpoint every K steps, and always at the end"""
    device: Device = field(default=Device.AUTO, metadata=flag("--device"))
    """cuda: NCCL, one GPU per process; cpu: gloo; auto: cuda when there are enough GPUs"""
    dtype: Precision = field(default=Precision.FP32, metadata=flag("--dtype"))
    """of the frozen base model and the activations; adapters stay fp32 master weights over a bf16 base"""
    progress: bool = field(default=True, metadata=flag("--no-progress", negated=True))
    """rank 0's progress bar (--no-progress: a log line per step instead, as when stdout is not a terminal)"""
    # ExecutorConfig.slowdown; commands.train parses the pairs
    slowdown: tuple[tuple[int, float], ...] = field(
        default=(), metadata=flag("--inject-slowdown", "REPLICA=FACTOR", repeat=True)
    )
    """fault injection: replica REPLICA runs FACTOR >= 1 times slower (a straggler; repeatable)"""
    # lorafleet.metrics.LOGGERS; checked below (check_loggers)
    loggers: tuple[str, ...] = field(default=(), metadata=flag("--logger", "wandb|mlflow", repeat=True))
    """also log the step scalars to Weights & Biases (project lorafleet; WANDB_MODE applies) or MLflow
    (MLFLOW_TRACKING_URI, else <out>/mlruns); repeatable; needs pip install 'lorafleet[wandb]' / '[mlflow]'"""
    queue: str | None = field(default=None, metadata=flag("--queue", "DIR", group=QUEUE))
    """the directory of task request files the run watches (default <out>/queue; docs/queue.md)"""
    # train.queue.http
    queue_http: int | None = field(default=None, metadata=flag("--queue-http", "PORT", group=QUEUE))
    """also take requests over HTTP on 127.0.0.1:PORT (0: a free port), with the token written to
    <queue>/.http.json"""
    # empty: the launcher resolves the workload's own data's directories (data_roots)
    queue_data_roots: tuple[str, ...] = field(
        default=(), metadata=flag("--queue-data-root", "DIR", repeat=True, group=QUEUE)
    )
    """a queued task's data must resolve inside DIR (symlinks followed; repeatable; default: the directories
    that hold the workload's own data); a request outside is rejected"""
    replan: ReplanSettings = field(default_factory=ReplanSettings, metadata=in_group(QUEUE))
    """how the run re-plans when its tasks change, and when a move is applied (specs.replan)"""
    # lorafleet.workload.apply_overrides; the workers run the workload the launcher made (train.run_file)
    sets: tuple[str, ...] = field(default=(), metadata=flag("--set", repeat=True, shared=True))
    """--set KEY=VALUE overrides of the workload's fields, applied before it is validated"""
    gpus: int | None = field(default=None, metadata=flag("--gpus", shared=True))
    """the cluster's GPU count, as given to `plan` (default: the workload's)"""
    gpu: str | None = field(default=None, metadata=flag("--gpu", shared=True))
    """the cluster's GPU kind, as given to `plan` (default: the workload's)"""
    profile: str | None = field(default=None, metadata=flag("--profile", shared=True))
    """a cost-model profile overriding the one the plan was judged by"""
    # DispatchPolicy.with_overrides; set by the policy's own flags (commands._plan_flags)
    policy_overrides: tuple[tuple[str, object], ...] = ()
    """(policy field key, value) pairs overriding the plan's dispatch policy; the launcher applies them once, the
    workers run the policy it checked"""

    @property
    def run_dir(self) -> RunDir:
        """The run directory's layout (``--out``, with ``--queue`` when given)."""
        return RunDir(Path(self.out), Path(self.queue) if self.queue is not None else None)

    @property
    def queue_dir(self) -> Path:
        return self.run_dir.queue

    def __post_init__(self) -> None:
        check_fields(self, ARGS)  # --device, --dtype; the bounds of --steps, --checkpoint-every, ...
        if self.steps is not None and self.steps > MAX_STEPS:
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
