"""Training, top to bottom: check everything, start the processes, run the step loop on rank 0.

    launch(options)       the launcher: every input checked (workload, plan, cost model, world),
                          then the command re-run under ``torchrun --standalone``, one process a rank
    train_rank(options)   one process: join the group, build its part of the fleet; rank 0 trains,
                          the others serve it
    Trainer.train()       restore -> per step {dispatch (one step ahead), run_step, recalibrate,
                          metrics, checkpoint every K} -> final checkpoint -> PEFT adapters -> summary

The plan runs under its own dispatch policy and with the cost model it was judged by
(flags may override either; the run says so). What each step measures corrects that cost
model replica by replica (``dispatch.recalibration``) for the steps that follow, and the
corrections travel in the checkpoints, so a resumed run prices replicas as it had learnt to.

Writes, under ``out``: ``metrics.jsonl`` and ``metrics.csv`` (one line per step: loss per task,
tokens/s, busy time per replica, the cost model's prediction of it, each replica's correction,
CPU seconds per rank), ``tensorboard/``, ``checkpoints/`` (``--resume``) and ``adapters/<task>/``
(the final PEFT adapters).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lorafleet.assemble import PlannedRun
from lorafleet.errors import InputError
from lorafleet.plans import StepPlan, StepReport
from lorafleet.workload import Workload

ARGS = "<args>"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """What ``lorafleet train`` is told (one field a flag)."""

    workload: str
    """Workload YAML; every task needs data."""
    plan: str
    """DeploymentPlan JSON (``lorafleet plan --json``)."""
    steps: int = 10
    """The run's total steps (a resumed run continues up to it)."""
    out: str = "runs/train"
    """Run directory: metrics, checkpoints, adapters."""
    resume: bool = False
    """Continue from the last committed checkpoint in ``out``."""
    checkpoint_every: int = 50
    """Commit a checkpoint every K steps (and always at the end)."""
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
    slowdown: tuple[tuple[int, float], ...] = field(default=())
    """Fault injection: (replica id, factor) stragglers (``ExecutorConfig.slowdown``)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InputError(ARGS, "--steps", f"must be >= 1, got {self.steps}")
        if self.checkpoint_every < 1:
            raise InputError(ARGS, "--checkpoint-every", f"must be >= 1, got {self.checkpoint_every}")

    def to_argv(self) -> list[str]:
        """The ``lorafleet train`` command line that re-creates these options (what each worker runs)."""
        from lorafleet.commands._plan_flags import policy_argv

        argv = [self.workload, "--plan", self.plan, "--steps", str(self.steps), "--out", self.out,
                "--checkpoint-every", str(self.checkpoint_every), "--device", self.device, "--dtype", self.dtype]
        for flag, value in (("--gpus", self.gpus), ("--gpu", self.gpu), ("--profile", self.profile)):
            if value is not None:
                argv += [flag, str(value)]
        argv += policy_argv(dict(self.policy_overrides))
        argv += [f"--inject-slowdown={r}={f}" for r, f in self.slowdown]
        return ["train", *argv, *(["--resume"] if self.resume else []), *([] if self.progress else ["--no-progress"])]


@dataclass(frozen=True)
class Prepared:
    """Everything checked before a process starts."""

    workload: Workload
    run: PlannedRun
    """The plan (with its policy as overridden), its cost model, and the overrides to report."""
    world_size: int
    """Processes the plan needs: one per rank it names."""


def load_training_workload(path: str) -> Workload:
    """The workload, with data for every task (planning needs only lengths; training needs rows)."""
    from lorafleet.workload import load_workload

    workload = load_workload(path)
    missing = [t.name for t in workload.tasks if t.spec.data is None]
    if missing:
        raise InputError(path, "tasks", f"training needs data for every task; {', '.join(missing)} has none")
    return workload


def prepare(options: TrainOptions) -> Prepared:
    """Every input check of a run, before any process is spawned or any file written."""
    from lorafleet.assemble import prepare_run, workload_cluster
    from lorafleet.executor.torch.launch import plan_world_size

    workload = load_training_workload(options.workload)
    cluster = workload_cluster(workload, options.gpus, options.gpu)
    run = prepare_run(workload, cluster, options.plan, options.profile, dict(options.policy_overrides))
    world = plan_world_size(run.plan)
    started = os.environ.get("WORLD_SIZE")
    if started is not None and int(started) != world:
        raise InputError(options.plan, "replicas", f"the plan needs {world} processes (one per GPU it names); "
                         f"torchrun started {started}")
    for r, _ in options.slowdown:
        if not 0 <= r < len(run.plan.replicas):
            raise InputError(ARGS, "--inject-slowdown", f"replica {r} does not exist: the plan has replicas "
                             f"0..{len(run.plan.replicas) - 1}")
    return Prepared(workload=workload, run=run, world_size=world)


def launch(options: TrainOptions) -> int:
    """``lorafleet train``: check, then run under torchrun (re-executing this command) or, already under
    one, as this process's rank."""
    from lorafleet.executor.torch.launch import torchrun_argv, under_torchrun

    prepared = prepare(options)
    if not under_torchrun():
        for line in prepared.run.overrides:
            print(f"lorafleet train: override: {line}", flush=True)
        return subprocess.call(torchrun_argv(prepared.world_size, options.to_argv()))
    return train_rank(options, prepared)


def train_rank(options: TrainOptions, prepared: Prepared) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it."""
    import torch.distributed as dist

    from lorafleet.executor.torch.launch import build_torch_executor, init_distributed
    from lorafleet.executor.torch.precision import Precision

    device = init_distributed(options.device)
    try:
        executor = build_torch_executor(prepared.workload.spec, prepared.run.plan, options.steps, device,
                                        Precision(options.dtype).dtype, slowdown=dict(options.slowdown))
        if dist.get_rank() != 0:
            executor.serve()
            return 0
        return Trainer(options, prepared, executor).train()
    finally:
        dist.destroy_process_group()


class Trainer:
    """Rank 0's loop over the steps of one run (see the module docstring)."""

    def __init__(self, options: TrainOptions, prepared: Prepared, executor) -> None:
        from lorafleet.dispatch.recalibration import Recalibrator

        self.options = options
        self.prepared = prepared
        self.executor = executor
        self.plan = prepared.run.plan
        self.out = Path(options.out)
        self.checkpoints = self.out / "checkpoints"
        self.recalibrator = Recalibrator(len(self.plan.replicas), self.plan.policy.recalibration)
        self.reports: list[tuple[StepReport, StepPlan]] = []

    def restore(self) -> int:
        """The first step to run: 0, or the resumed checkpoint's (with its recalibration)."""
        if not self.options.resume:
            return 0
        state = self.executor.restore_checkpoint(self.checkpoints)
        if state is None:
            raise InputError(ARGS, "--resume", f"no committed checkpoint in {self.checkpoints}")
        self.recalibrator.load_state_dict(state.extra.get("recalibration", {}))
        return state.step

    def train(self) -> int:
        from lorafleet.dispatch import LookaheadDispatcher
        from lorafleet.executor.torch.checkpoint import latest_step_dir
        from lorafleet.loop import run_loop

        start = self.restore()
        steps = range(start, min(self.options.steps, _last_step(self.executor, self.options.steps)))
        with self._writers(steps) as metrics, \
                LookaheadDispatcher(self.executor.next_global_batch, self.plan, self.prepared.run.cost_model) as ahead:

            def on_report(report: StepReport, step_plan: StepPlan) -> None:
                self.reports.append((report, step_plan))
                tokens = sum(report.task_tokens.values())
                metrics.write(report, tokens_per_s=tokens / report.makespan_s if report.makespan_s else 0.0,
                              predicted_busy_s=tuple(w.estimated_time_s for w in step_plan.work),
                              replica_tokens=tuple(sum(sum(mb.lengths) for mb in w.microbatches) for w in step_plan.work),
                              correction=self.recalibrator.factors or ())
                if (report.step + 1) % self.options.checkpoint_every == 0:
                    self._checkpoint(report.step + 1)

            run_loop(ahead, self.executor, steps, on_report, self.recalibrator)
        self._checkpoint(steps.stop)
        names = [t.name for t in self.prepared.workload.tasks]
        _export_adapters(latest_step_dir(self.checkpoints), names, self.out / "adapters")
        self.executor.close()
        print(self.summary(steps.stop), flush=True)
        return 0

    def _checkpoint(self, step: int) -> None:
        self.executor.save_checkpoint(self.checkpoints, step, {"recalibration": self.recalibrator.state_dict()})

    def _writers(self, steps: range):
        from lorafleet.metrics import CsvWriter, FanOut, JsonlWriter, LogLines, ProgressBar, TensorBoardWriter

        writers = [JsonlWriter(self.out / "metrics.jsonl"), CsvWriter(self.out / "metrics.csv"),
                   TensorBoardWriter(self.out / "tensorboard")]
        if self.options.progress and sys.stdout.isatty():
            writers.append(ProgressBar(steps.stop, start=steps.start))
        else:
            writers.append(LogLines(steps.stop))
        return FanOut(*writers)

    def summary(self, stop: int) -> str:
        """What the run did, predicted against measured, and where its files are."""
        from lorafleet.dispatch.recalibration import summarize_factors

        lines = [f"lorafleet train: {stop} steps; adapters in {self.out / 'adapters'}, metrics in "
                 f"{self.out / 'metrics.jsonl'} (and .csv, tensorboard/)"]
        if self.reports:
            measured = np.mean([r.makespan_s for r, _ in self.reports])
            predicted = np.mean([p.estimated_makespan_s for _, p in self.reports])
            lines.append(f"  step time: measured {measured:.3f} s, predicted {predicted:.3f} s (x{measured / predicted:.2f}"
                         f", mean over {len(self.reports)} steps; cost model {self.prepared.run.cost_model.source})")
            if self.plan.policy.recalibration.enabled:
                lines.append(f"  recalibrated: {summarize_factors(self.recalibrator.replicas())}")
        return "\n".join(lines)


def _last_step(executor, steps: int) -> int:
    """The step after which every task has taken all its batches (``steps`` when a task is unbounded)."""
    limits = executor.streams.max_batches
    return steps if any(limit is None for limit in limits) else max(limits)


def _export_adapters(step_dir: Path, names: Sequence[str], target: Path) -> None:
    """The final PEFT adapters, copied out of the last checkpoint."""
    import shutil

    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

    for name in names:
        (target / name).mkdir(parents=True, exist_ok=True)
        for file in (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME):
            shutil.copy2(step_dir / name / file, target / name / file)
