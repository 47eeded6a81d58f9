"""What ``lorafleet train`` is told: :class:`TrainOptions`, one field a flag, checked as it is built,
and the command line that re-creates it (what each worker runs)."""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.assemble import policy_argv
from lorafleet.errors import InputError

ARGS = "<args>"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """What ``lorafleet train`` is told (one field a flag)."""

    workload: str
    """Workload YAML; every task needs data."""
    plan: str
    """DeploymentPlan JSON (``lorafleet plan --json``)."""
    steps: int = 10
    """The run's total steps (a resumed run continues up to it, and may not be told fewer than it has)."""
    out: str = "runs/train"
    """Run directory: plan, metrics, checkpoints, adapters; one run at a time (a lock)."""
    resume: bool = False
    """Continue from the newest intact checkpoint in ``out``."""
    overwrite: bool = False
    """Start afresh in an ``out`` a previous run used, removing its files."""
    checkpoint_every: int = 50
    """Commit a checkpoint every K steps (and always at the end)."""
    checkpoint_on_stop: bool = True
    """On SIGINT/SIGTERM, commit a checkpoint at the step boundary before stopping."""
    max_restarts: int = 0
    """Restart the workers this many times after a failure, resuming from the last checkpoint."""
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
    """(policy field, value) pairs overriding the plan's dispatch policy (``commands._plan_flags``)."""
    progress: bool = True
    """A progress bar on rank 0 when stdout is a terminal (a log line per step otherwise)."""
    slowdown: tuple[tuple[int, float], ...] = ()
    """Fault injection: (replica id, factor) stragglers (``ExecutorConfig.slowdown``)."""

    def __post_init__(self) -> None:
        for flag, value, least in (
            ("--steps", self.steps, 1),
            ("--checkpoint-every", self.checkpoint_every, 1),
            ("--max-restarts", self.max_restarts, 0),
            ("--nonfinite-patience", self.nonfinite_patience, 1),
        ):
            if value < least:
                raise InputError(ARGS, flag, f"must be >= {least}, got {value}")
        if self.resume and self.overwrite:
            raise InputError(ARGS, "--overwrite", "cannot be combined with --resume")

    def to_argv(self) -> list[str]:
        """The ``lorafleet train`` command line that re-creates these options (what each worker runs)."""
        argv = [
            "train",
            self.workload,
            "--plan",
            self.plan,
            "--steps",
            str(self.steps),
            "--out",
            self.out,
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--device",
            self.device,
            "--dtype",
            self.dtype,
            "--nonfinite-patience",
            str(self.nonfinite_patience),
        ]
        for flag, value in (("--gpus", self.gpus), ("--gpu", self.gpu), ("--profile", self.profile)):
            if value is not None:
                argv += [flag, str(value)]
        argv += policy_argv(dict(self.policy_overrides))
        argv += [f"--inject-slowdown={r}={f}" for r, f in self.slowdown]
        for flag, on in (
            ("--resume", self.resume),
            ("--no-progress", not self.progress),
            ("--no-stop-checkpoint", not self.checkpoint_on_stop),
        ):
            if on:
                argv.append(flag)
        return argv
