"""Training, top to bottom: check everything, start the processes, run the step loop on rank 0.

    launch(options)       the launcher: every input checked (workload, plan, cost model, run
                          directory, checkpoint, data), the run directory locked, then the command
                          re-run under ``torchrun --standalone``, one process a rank
    train_rank(options)   one process: join the group, build its part of the fleet; rank 0 trains,
                          the others serve it
    Trainer.train()       restore -> per step {dispatch (one step ahead), run_step, recalibrate,
                          watch for non-finite tasks, metrics, checkpoint every K} -> final
                          checkpoint -> PEFT adapters -> summary

The plan runs under its own dispatch policy and with the cost model it was judged by (flags
may override either; the run says so). What each step measures corrects that cost model
replica by replica (``dispatch.recalibration``) for the steps that follow; the corrections
travel in the checkpoints. A resume on another number of GPUs re-plans for them with the
plan's cost model and policy (checkpoints do not depend on the plan). Reliability rules
(docs/reliability.md): one run per directory, ``--steps`` is the run's total, resume never
rolls back and uses the newest intact checkpoint, SIGINT/SIGTERM stop at a step boundary with a
checkpoint, workers die with their launcher, ``--max-restarts`` restarts failed workers from the
last checkpoint.

Writes, under ``out``: ``plan.json`` (the plan the run trains by), ``metrics.jsonl`` and
``metrics.csv`` (one line per step: loss per task, tokens/s, busy time per replica, the
dispatcher's prediction of it (``predicted_busy_s``, as recalibrated) and the cost model's own
(``model_busy_s``), each replica's tokens and correction, CPU seconds per rank, tasks skipped for
non-finite updates), ``tensorboard/``, ``checkpoints/`` and ``adapters/<task>/`` (the final PEFT
adapters).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lorafleet.assemble import PlannedRun
from lorafleet.errors import InputError
from lorafleet.plans import StepPlan, StepReport
from lorafleet.workload import Workload

ARGS = "<args>"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


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
        for flag, value, least in (("--steps", self.steps, 1), ("--checkpoint-every", self.checkpoint_every, 1),
                                   ("--max-restarts", self.max_restarts, 0),
                                   ("--nonfinite-patience", self.nonfinite_patience, 1)):
            if value < least:
                raise InputError(ARGS, flag, f"must be >= {least}, got {value}")
        if self.resume and self.overwrite:
            raise InputError(ARGS, "--overwrite", "cannot be combined with --resume")

    def to_argv(self) -> list[str]:
        """The ``lorafleet train`` command line that re-creates these options (what each worker runs)."""
        from lorafleet.commands._plan_flags import policy_argv

        argv = ["train", self.workload, "--plan", self.plan, "--steps", str(self.steps), "--out", self.out,
                "--checkpoint-every", str(self.checkpoint_every), "--device", self.device, "--dtype", self.dtype,
                "--nonfinite-patience", str(self.nonfinite_patience)]
        for flag, value in (("--gpus", self.gpus), ("--gpu", self.gpu), ("--profile", self.profile)):
            if value is not None:
                argv += [flag, str(value)]
        argv += policy_argv(dict(self.policy_overrides))
        argv += [f"--inject-slowdown={r}={f}" for r, f in self.slowdown]
        for flag, on in (("--resume", self.resume), ("--no-progress", not self.progress),
                         ("--no-stop-checkpoint", not self.checkpoint_on_stop)):
            if on:
                argv.append(flag)
        return argv


@dataclass(frozen=True)
class Prepared:
    """Everything checked before a process starts."""

    workload: Workload
    run: PlannedRun
    """The plan (replanned on a resume with other GPUs; its policy as overridden), its cost model,
    and what to report of it."""
    world_size: int
    """Processes the plan needs: one per rank it names."""
    resume_step: int | None
    """The step the run resumes from (None: a fresh start)."""


def load_training_workload(path: str) -> Workload:
    """The workload, with data for every task (planning needs only lengths; training needs rows)."""
    from lorafleet.workload import load_workload

    workload = load_workload(path)
    missing = [t.name for t in workload.tasks if t.spec.data is None]
    if missing:
        raise InputError(path, "tasks", f"training needs data for every task; {', '.join(missing)} has none")
    return workload


def restarted() -> bool:
    """Whether torchrun restarted this worker after a failure (then it resumes, asked or not)."""
    return int(os.environ.get(RESTART_ENV, "0") or 0) > 0


def _target_gpus(cluster) -> int:
    """The GPUs the run has: the processes torchrun started, else the cluster's."""
    started = os.environ.get("WORLD_SIZE")
    return int(started) if started is not None else cluster.n_gpus


def _replan(workload: Workload, cluster, options: TrainOptions) -> PlannedRun:
    """A resumed run on another number of GPUs: the plan for the GPUs it now has, by the old plan's cost
    model and dispatch policy, saved as the run's ``plan.json`` (then checked like any plan)."""
    from lorafleet.assemble import plan_cost_model, prepare_run
    from lorafleet.planner import PlannerOptions, plan_deployment
    from lorafleet.plans import DeploymentPlan
    from lorafleet.specs.cluster import ClusterSpec

    old = DeploymentPlan.load(options.plan)
    try:
        target = ClusterSpec.with_gpus(_target_gpus(cluster), cluster.gpu, cluster.gpus_per_node)
    except ValueError as err:
        raise InputError(ARGS, "--gpus", str(err).splitlines()[-1]) from None
    cost_model, _ = plan_cost_model(workload, target, old, options.plan, options.profile)
    planned = plan_deployment(workload, target, cost_model, PlannerOptions(
        microbatch_mode=old.policy.options.microbatch_mode, n_buckets=old.policy.options.n_buckets, baselines=False))
    path = Path(options.out) / "plan.json"
    replace(planned.plan, policy=old.policy).save(path)
    run = prepare_run(workload, target, str(path), options.profile, dict(options.policy_overrides))
    note = (f"re-planned for {target.n_gpus} GPUs: {run.plan.describe()} (the plan was {old.describe()} on "
            f"{old.n_gpus}); checkpoints do not depend on the plan")
    return replace(run, overrides=(*run.overrides, note))


def prepare(options: TrainOptions) -> Prepared:
    """Every input check of a run, before any process is spawned or any file written (but a re-plan's)."""
    from lorafleet.assemble import prepare_run, workload_cluster
    from lorafleet.plans import DeploymentPlan
    from lorafleet.specs.io import check_writable

    check_writable(options.out, directory=True)
    workload = load_training_workload(options.workload)
    cluster = workload_cluster(workload, options.gpus, options.gpu)
    resume_step = _resume_step(options) if options.resume or restarted() else None
    if resume_step is not None and DeploymentPlan.load(options.plan).n_gpus != _target_gpus(cluster):
        run = _replan(workload, cluster, options)
    else:
        run = prepare_run(workload, cluster, options.plan, options.profile, dict(options.policy_overrides))
    world = run.plan.world_size
    started = os.environ.get("WORLD_SIZE")
    if started is not None and int(started) != world:
        raise InputError(options.plan, "replicas", f"the plan needs {world} processes (one per GPU it names); "
                         f"torchrun started {started}")
    for r, _ in options.slowdown:
        if not 0 <= r < len(run.plan.replicas):
            raise InputError(ARGS, "--inject-slowdown", f"replica {r} does not exist: the plan has replicas "
                             f"0..{len(run.plan.replicas) - 1}")
    return Prepared(workload=workload, run=run, world_size=world, resume_step=resume_step)


def _resume_step(options: TrainOptions) -> int | None:
    """The step a resume starts from, checked: an intact checkpoint exists (a restart may find none yet)
    and ``--steps`` does not go below it. Broken newer checkpoints are reported."""
    from lorafleet.executor.torch.checkpoint_files import resumable_checkpoint

    found = resumable_checkpoint(Path(options.out) / "checkpoints")
    if found is None:
        if restarted():
            return 0
        raise InputError(ARGS, "--resume", f"nothing to resume: no checkpoint in {Path(options.out) / 'checkpoints'}")
    for line in found.broken:
        print(f"lorafleet train: warning: checkpoint {line}; resuming from {found.step_dir.name}", file=sys.stderr)
    if options.steps < found.step:
        raise InputError(ARGS, "--steps", f"{options.steps} is below the {found.step} steps the run has committed; "
                         "--steps is the run's total and a resume never rolls back")
    return found.step


def _claim(options: TrainOptions, prepared: Prepared):
    """Lock the run directory and make it this run's: refuse a used one unless resuming or told to
    overwrite; check the data against the checkpoint resumed from; write the run's plan."""
    from lorafleet.rundir import clear_run, lock_run, used_by

    lock = lock_run(options.out)
    try:
        used = used_by(options.out)
        if prepared.resume_step is None and used and not restarted():
            if not options.overwrite:
                raise InputError(options.out, "", f"holds a previous run ({', '.join(used)}); pass --resume to continue "
                                 "it or --overwrite to replace it")
            clear_run(options.out)
        if prepared.resume_step:
            _check_data(options, prepared)
        if not prepared.run.plan == _saved_plan(options.out):
            prepared.run.plan.save(Path(options.out) / "plan.json")
    except BaseException:
        lock.release()
        raise
    return lock


def _saved_plan(out: str):
    from lorafleet.plans import DeploymentPlan

    path = Path(out) / "plan.json"
    try:
        return DeploymentPlan.load(path) if path.is_file() else None
    except InputError:
        return None


def _check_data(options: TrainOptions, prepared: Prepared) -> None:
    """InputError when the workload's data is not the data the checkpoint was trained on."""
    from lorafleet.executor.torch.checkpoint_files import read_manifest, resumable_checkpoint
    from lorafleet.executor.torch.launch import training_streams

    found = resumable_checkpoint(Path(options.out) / "checkpoints")
    if found is None:
        return
    manifest = read_manifest(found.step_dir)
    names = [t.name for t in prepared.workload.tasks]
    saved = [t["name"] for t in manifest["tasks"]]
    if saved != names:
        raise InputError(str(found.step_dir), "tasks", f"the checkpoint has tasks {saved}, the workload {names}")
    streams = training_streams(prepared.workload.spec, options.steps)
    try:
        streams.check_state(manifest["data"])
    except ValueError as err:
        raise InputError(str(found.step_dir), "data", str(err)) from None


def launch(options: TrainOptions) -> int:
    """``lorafleet train``: check, lock, then run under torchrun (re-executing this command) or, already
    under one, as this process's rank. SIGINT/SIGTERM stop the run at a step boundary: exit 130/143."""
    from lorafleet.executor.torch.processes import under_torchrun

    prepared = prepare(options)
    if under_torchrun():
        return train_rank(options, prepared)
    lock = _claim(options, prepared)
    try:
        for line in prepared.run.overrides:
            print(f"lorafleet train: {line}", flush=True)
        plan_path = str(Path(options.out) / "plan.json")
        return _supervise(replace(options, plan=plan_path), prepared)
    finally:
        lock.release()


def _supervise(options: TrainOptions, prepared: Prepared) -> int:
    """Run torchrun in a session of its own, dying with this process; turn the first SIGINT/SIGTERM into a
    stop request, a second into a kill; the exit code says which (128 + signal) or torchrun's."""
    from lorafleet.executor.torch.processes import clear_stop, die_with_parent, request_stop, torchrun_argv, worker_env

    clear_stop(options.out)
    argv = torchrun_argv(prepared.world_size, options.to_argv(), max_restarts=options.max_restarts)
    child = subprocess.Popen(argv, env=worker_env(locked=True), start_new_session=True, preexec_fn=die_with_parent)
    received: list[int] = []

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if len(received) == 1:
            request_stop(options.out, signum)
            print(f"lorafleet train: {signal.Signals(signum).name}: stopping at the next step boundary "
                  "(again to abort)", file=sys.stderr, flush=True)
        else:
            os.killpg(child.pid, signal.SIGKILL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        clear_stop(options.out)
    if received:
        return 128 + received[0]
    return code


def train_rank(options: TrainOptions, prepared: Prepared) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it."""
    import torch.distributed as dist

    from lorafleet.executor.torch.launch import build_torch_executor, init_distributed
    from lorafleet.executor.torch.precision import Precision
    from lorafleet.executor.torch.processes import LOCKED_ENV, check_code, die_with_parent

    die_with_parent()
    check_code()
    device = init_distributed(options.device)
    lock = None
    try:
        if dist.get_rank() == 0 and not os.environ.get(LOCKED_ENV):  # under the user's own torchrun
            lock = _claim(options, prepared)
        executor = build_torch_executor(prepared.workload.spec, prepared.run.plan, options.steps, device,
                                        Precision(options.dtype).dtype, slowdown=dict(options.slowdown))
        if dist.get_rank() != 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the run stops
            executor.serve()
            return 0
        return Trainer(options, prepared, executor).train()
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()


class Trainer:
    """Rank 0's loop over the steps of one run (see the module docstring)."""

    def __init__(self, options: TrainOptions, prepared: Prepared, executor) -> None:
        from lorafleet.dispatch.recalibration import Recalibrator

        self.options = options
        self.prepared = prepared
        self.executor = executor
        self.plan = prepared.run.plan
        self.names = [t.name for t in prepared.workload.tasks]
        self.out = Path(options.out)
        self.checkpoints = self.out / "checkpoints"
        self.recalibrator = Recalibrator(len(self.plan.replicas), self.plan.policy.recalibration)
        self.reports: list[tuple[StepReport, StepPlan]] = []
        self.nonfinite_streak = dict.fromkeys(self.names, 0)
        self.stopped_tasks: dict[str, int] = {}
        """Task -> the first step it was left out of (``nonfinite_patience`` non-finite updates in a row)."""
        self.signal: int | None = None

    def restore(self) -> int:
        """The first step to run: 0, or the resumed checkpoint's (with its recalibration and stopped tasks);
        the metrics are cut back to it, so nothing replayed is counted twice."""
        from lorafleet.rundir import truncate_metrics

        start = 0
        if self.prepared.resume_step is not None:
            state = self.executor.restore_checkpoint(self.checkpoints)
            if state is not None:
                start = state.step
                self.recalibrator.load_state_dict(state.extra.get("recalibration", {}))
                for name, step in state.extra.get("stopped_tasks", {}).items():
                    self._stop_task(name, int(step), announce=False)
        truncate_metrics(self.out, start)
        return start

    def _stop_requested(self) -> bool:
        from lorafleet.executor.torch.processes import stop_requested

        if self.signal is None:
            self.signal = stop_requested(self.out)
        return self.signal is not None

    def train(self) -> int:
        from lorafleet.dispatch import LookaheadDispatcher
        from lorafleet.loop import run_loop

        for s in (signal.SIGINT, signal.SIGTERM):  # under a user's torchrun: the same stop request
            signal.signal(s, lambda signum, _frame: setattr(self, "signal", signum))
        start = self.restore()
        steps = range(start, min(self.options.steps, _last_step(self.executor, self.options.steps)))
        if self.plan.policy.recalibration.enabled and len(steps):
            self._probe(start)
        with self._writers(steps) as metrics,                 LookaheadDispatcher(self.executor.next_global_batch, self.plan, self.prepared.run.cost_model) as ahead:

            def on_report(report: StepReport, step_plan: StepPlan) -> None:
                self.reports.append((report, step_plan))
                self._watch(report)
                tokens = sum(report.task_tokens.values())
                metrics.write(report, tokens_per_s=tokens / report.makespan_s if report.makespan_s else 0.0,
                              predicted_busy_s=tuple(w.estimated_time_s for w in step_plan.work),
                              model_busy_s=tuple(step_plan.base_estimate(r) for r in range(len(step_plan.work))),
                              replica_tokens=tuple(sum(sum(mb.lengths) for mb in w.microbatches) for w in step_plan.work),
                              correction=self.recalibrator.factors or ())
                if (report.step + 1) % self.options.checkpoint_every == 0:
                    self._checkpoint(report.step + 1)

            done = run_loop(ahead, self.executor, steps, on_report, self.recalibrator, stop=self._stop_requested)
        reached = start + len(done)
        if self.signal is not None and reached < steps.stop:
            return self._stopped(reached)
        final = self._checkpoint(reached, wait=True)
        _export_adapters(final, self.names, self.out / "adapters")
        self.executor.close()
        print(self.summary(reached), flush=True)
        return 0

    def _probe(self, step: int) -> None:
        """Before the first step: each replica's first micro-batch of step ``step``'s dispatch, at most
        ``PROBE_TOKENS`` of it, timed twice without training on it (``TorchExecutor.probe``). The first
        pass pays a fresh process's one-time costs; the second is the recalibrator's first observation,
        so the run's first steps are already priced by this machine's speed and by each replica's."""
        from lorafleet.dispatch import dispatch_step

        batch = self.executor.streams.global_batch(step)
        full = dispatch_step(batch, self.plan, self.prepared.run.cost_model)
        cost_model = self.prepared.run.cost_model
        work = []
        for replica, w in zip(self.plan.replicas, full.work, strict=True):
            mbs = w.microbatches[:1]
            if mbs and mbs[0].tokens > PROBE_TOKENS:
                mbs = (_cut(mbs[0], PROBE_TOKENS),)
            work.append(replace(w, microbatches=mbs, estimated_time_s=cost_model.replica_time(
                replica.config, [mb.shape for mb in mbs]) if mbs else 0.0))
        probe = replace(full, work=tuple(work), speed=())
        self.executor.probe(probe, batch)
        self.recalibrator.observe(probe, self.executor.probe(probe, batch))
        # The first real step still meets shapes the probe did not (allocator growth, on CPU up to 2x
        # on one rank and not another): its report is left out too.
        self.recalibrator.skip_next(1)

    def _stopped(self, reached: int) -> int:
        """A stop asked by a signal, at the boundary before step ``reached``: checkpoint (unless told not to)."""
        committed = ""
        if self.options.checkpoint_on_stop:
            committed = f"; checkpoint {self._checkpoint(reached, wait=True).name} committed, continue with --resume"
        self.executor.close()
        print(f"lorafleet train: stopped by {signal.Signals(self.signal).name} after {reached} steps{committed}",
              flush=True)
        return 0

    def _watch(self, report: StepReport) -> None:
        """Non-finite updates (skipped by the executor) counted per task; a task skipped
        ``nonfinite_patience`` steps in a row stops; a task whose adapter never moved is warned about."""
        for name in report.losses:
            self.nonfinite_streak[name] = self.nonfinite_streak[name] + 1 if name in report.nonfinite_tasks else 0
        for name in report.nonfinite_tasks:
            streak = self.nonfinite_streak[name]
            print(f"lorafleet train: step {report.step}: task {name!r} has a non-finite loss or gradient; its update "
                  f"is skipped ({streak} in a row)", file=sys.stderr, flush=True)
            if streak >= self.options.nonfinite_patience and name not in self.stopped_tasks:
                self._stop_task(name, report.step + 2)  # step + 1 may be drawn already (look-ahead)
        for name in report.unmoved_tasks:
            print(f"lorafleet train: warning: task {name!r}: its adapter has not moved after its warm-up; check its "
                  "learning rate, alpha and grad_clip", file=sys.stderr, flush=True)

    def _stop_task(self, name: str, from_step: int, announce: bool = True) -> None:
        self.stopped_tasks[name] = from_step
        self.executor.streams.retire(self.names.index(name), from_step)
        if announce:
            print(f"lorafleet train: task {name!r} stopped after {self.options.nonfinite_patience} non-finite steps in a "
                  "row; its adapter stays at its last finite update", file=sys.stderr, flush=True)

    def _checkpoint(self, step: int, wait: bool = False) -> Path:
        """A checkpoint after ``step`` steps, written in the background (committed on return with ``wait``)."""
        extra = {"recalibration": self.recalibrator.state_dict(), "stopped_tasks": dict(self.stopped_tasks)}
        return self.executor.save_checkpoint(self.checkpoints, step, extra, wait=wait)

    def _writers(self, steps: range):
        from lorafleet.metrics import CsvWriter, FanOut, JsonlWriter, LogLines, ProgressBar, TensorBoardWriter

        writers = [JsonlWriter(self.out / "metrics.jsonl"), CsvWriter(self.out / "metrics.csv"),
                   TensorBoardWriter(self.out / "tensorboard", purge_step=steps.start)]
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
        if self.stopped_tasks:
            lines.append(f"  stopped tasks (non-finite updates): {', '.join(self.stopped_tasks)}")
        return "\n".join(lines)


PROBE_TOKENS = 1024
"""The most tokens of a replica's probe micro-batch (``Trainer._probe``): enough to be timed as its
steps are, small next to a step."""


def _cut(mb, tokens: int):
    """The first rows of a micro-batch that fit in ``tokens`` (at least one)."""
    keep = 1
    while keep < len(mb.lengths) and replace(mb, seq_ids=mb.seq_ids[:keep + 1], task_ids=mb.task_ids[:keep + 1],
                                             lengths=mb.lengths[:keep + 1]).tokens <= tokens:
        keep += 1
    return replace(mb, seq_ids=mb.seq_ids[:keep], task_ids=mb.task_ids[:keep], lengths=mb.lengths[:keep])


def _last_step(executor, steps: int) -> int:
    """The step after which every task has taken all its batches (``steps`` when a task is unbounded)."""
    limits = executor.streams.max_batches
    return steps if any(limit is None for limit in limits) else max(limits)


def _export_adapters(step_dir: Path, names: Sequence[str], target: Path) -> None:
    """The final PEFT adapters, copied out of the last checkpoint; each task's directory appears whole
    (written beside it, then renamed over the old one)."""
    import shutil

    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        staging = target / f".{name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for file in (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME):
            shutil.copy2(step_dir / name / file, staging / file)
        old = target / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if (target / name).exists():
            (target / name).rename(old)
        staging.rename(target / name)
        shutil.rmtree(old, ignore_errors=True)
