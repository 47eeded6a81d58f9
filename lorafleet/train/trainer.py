"""One process of a run: :func:`train_rank` joins the group and builds this rank's part of the fleet;
rank 0 drives :meth:`Trainer.train`, the others serve it.

    Trainer.train()   restore -> per window of steps {dispatch (one window ahead), run_steps, per step
                      recalibrate, watch for non-finite tasks, metrics; checkpoint every K} -> final
                      checkpoint -> PEFT adapters -> summary

A window is the plan's ``pipeline_window`` steps (cut at every checkpoint and at the run's end): its
pipelined replicas do not drain between its steps (``costmodel.schedule``), and a stop asked by a
signal takes effect at the next window boundary.

Also here: the probe before the first step (``Trainer._probe``), the checkpoint cadence, the stop at a
step boundary on a signal, and the export of the final adapters out of the last checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from lorafleet.plans import MicroBatch, StepPlan, StepReport
from lorafleet.train.options import TrainOptions
from lorafleet.train.phases import counted, phase
from lorafleet.train.preflight import Prepared, claim

if TYPE_CHECKING:
    from lorafleet.executor.torch.data_stream import DataStreams
    from lorafleet.executor.torch.worker import TorchExecutor
    from lorafleet.metrics import FanOut
    from lorafleet.specs.workload import TaskSpec
    from lorafleet.train.queue import QueueWatcher, Request


def train_rank(options: TrainOptions, prepared: Prepared) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it."""
    import torch.distributed as dist

    from lorafleet.executor.torch.launch import build_torch_executor, init_distributed, task_tokenizer
    from lorafleet.executor.torch.precision import Precision
    from lorafleet.executor.torch.processes import LOCKED_ENV, check_code, die_with_parent

    die_with_parent()
    check_code()
    device = init_distributed(options.device)
    report = phase if dist.get_rank() == 0 else None
    if report is not None:
        report(f"process group up: {counted(dist.get_world_size(), 'rank')} ({dist.get_backend()})")
    lock = None
    try:
        if dist.get_rank() == 0 and not os.environ.get(LOCKED_ENV):  # under the user's own torchrun
            lock = claim(options, prepared)
        tokenizer = task_tokenizer(prepared.workload.spec)
        executor = build_torch_executor(
            prepared.workload.spec,
            prepared.run.plan,
            options.steps,
            device,
            Precision(options.dtype).dtype,
            slowdown=dict(options.slowdown),
            turn_changes=prepared.turn_changes,
            departed=prepared.departed,
            report=report,
            tokenizer=tokenizer,
        )
        if dist.get_rank() != 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the run stops
            executor.serve()
            return 0
        return Trainer(options, prepared, executor, tokenizer).train()
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()


class Trainer:
    """Rank 0's loop over the steps of one run (see the module docstring)."""

    def __init__(self, options: TrainOptions, prepared: Prepared, executor: TorchExecutor, tokenizer: Any) -> None:
        from lorafleet.dispatch.recalibration import Recalibrator

        self.options = options
        self.tokenizer = tokenizer
        """The run's tokenizer (its data's: ``launch.task_tokenizer``): saved for the exports, and what a
        queued task's data is checked with."""
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
        pipelined = any(r.config.pp > 1 for r in self.plan.replicas)
        self.window = self.plan.policy.pipeline_window if pipelined else 1
        """Steps a window runs (``lorafleet.loop``); windows also end at checkpoints and queued changes. Only
        a pipelined replica streams across a boundary: without one a window is a step, so each step is
        reported (its log line, its recalibration) as it ends."""
        self.watcher = _queue_watcher(options, prepared, tokenizer)
        """The live task queue, read at every window boundary (None under a user's own torchrun)."""
        self.due: list[Request] = []
        """Queued requests due at the boundary the loop stopped at: applied by a restart."""
        self.next_step = 0

    def restore(self) -> int:
        """The first step to run: 0, or the resumed checkpoint's (with its recalibration and stopped tasks);
        the metrics are cut back to it, so nothing replayed is counted twice."""
        from lorafleet.metrics import truncate_metrics

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
        """At a window boundary: a signal asked to stop, or queued requests are due (the run restarts to apply them)."""
        from lorafleet.executor.torch.processes import stop_requested

        if self.signal is None:
            self.signal = stop_requested(self.out)
        if self.signal is None and self.watcher is not None:
            self.due = self.watcher.poll(self.next_step)
            if self.next_step < self.options.steps:
                left = {r.name for r in self.due}
                self.due += [r for r in finished_tasks(self.executor.streams, self.next_step) if r.name not in left]
        return self.signal is not None or bool(self.due)

    def train(self) -> int:
        """Run the steps left to the run's total; 0 when done or stopped by a signal at a step boundary."""
        from lorafleet.accounting import task_gpu_seconds
        from lorafleet.dispatch import LookaheadDispatcher
        from lorafleet.executor.torch.checkpoint_files import export_adapters
        from lorafleet.loop import run_loop
        from lorafleet.metrics import last_losses

        def on_signal(signum: int, _frame: FrameType | None) -> None:  # under a user's torchrun: a stop request
            self.signal = signum

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, on_signal)
        start = self.restore()
        self.next_step = start
        self._save_tokenizer()
        steps = range(start, min(self.options.steps, _last_step(self.executor, self.options.steps)))
        resumed = f" (resumed from the checkpoint of step {start})" if start else ""
        if steps:
            phase(f"training steps {steps.start}..{steps.stop - 1} of {self.options.steps}{resumed}")
        if self.plan.policy.recalibration.enabled and len(steps):
            self._probe(start)
        with (
            self._writers(steps) as metrics,
            LookaheadDispatcher(
                self.executor.next_global_batch, self.plan, self.prepared.run.cost_model, depth=self.window
            ) as ahead,
        ):

            def on_report(report: StepReport, step_plan: StepPlan) -> None:
                self.next_step = report.step + 1
                self.reports.append((report, step_plan))
                self._watch(report)
                tokens = sum(report.task_tokens.values())
                metrics.write(
                    report,
                    task_gpu_s=task_gpu_seconds(step_plan, report, self.plan, self.prepared.run.cost_model, self.names),
                    tokens_per_s=tokens / report.makespan_s if report.makespan_s else 0.0,
                    predicted_busy_s=tuple(w.estimated_time_s for w in step_plan.work),
                    model_busy_s=tuple(step_plan.base_estimate(r) for r in range(len(step_plan.work))),
                    replica_tokens=tuple(sum(sum(mb.lengths) for mb in w.microbatches) for w in step_plan.work),
                    correction=self.recalibrator.factors or (),
                )
                if (report.step + 1) % self.options.checkpoint_every == 0:
                    self._checkpoint(report.step + 1)

            done = run_loop(
                ahead,
                self.executor,
                steps,
                on_report,
                self.recalibrator,
                stop=self._stop_requested,
                window=self.window,
                boundary_every=self.options.checkpoint_every,
                next_boundary=(lambda _step: self.watcher.next_due()) if self.watcher is not None else None,
            )
        reached = start + len(done)
        if self.signal is not None and reached < steps.stop:
            return self._stopped(reached)
        if self.due:
            return self._apply_queued(reached)
        final = self._checkpoint(reached, wait=True)
        export_adapters(
            final,
            self.names,
            self.out / "adapters",
            tasks=self.prepared.workload.spec.tasks,
            run_dir=self.out,
            losses=last_losses(self.out / "metrics.jsonl"),
        )
        self.executor.close()
        print(self.summary(reached), flush=True)
        return 0

    def _save_tokenizer(self) -> None:
        """The run's tokenizer into ``<out>/tokenizer/`` (once a run directory), for every adapter exported
        (here, and by the launcher when a task leaves a running job: ``train.live``) to ship with."""
        from lorafleet.executor.torch.checkpoint_files import TOKENIZER_DIR, save_tokenizer

        save_tokenizer(self.tokenizer, self.out / TOKENIZER_DIR)

    def _probe(self, step: int) -> None:
        """Before the first step: each replica's first micro-batch of step ``step``'s dispatch, at most
        ``PROBE_TOKENS`` of it, run ``1 + PROBE_TIMINGS`` times without training on it
        (``TorchExecutor.probe``). The first pass pays a fresh process's one-time costs; of the others,
        each replica's shortest busy time is the recalibrator's first observation, so the run's first
        steps are already priced by this machine's speed and by each replica's. The minimum, not one
        pass: on a shared machine a pass is only ever slowed (a core taken by another process), and the
        probe's one observation prices the first steps whole (in a loaded CI, one pass priced an injected
        4x straggler at well under 2x its peer); the steps after it are averaged as usual."""
        from lorafleet.dispatch import dispatch_step

        batch = self.executor.streams.global_batch(step)
        full = dispatch_step(batch, self.plan, self.prepared.run.cost_model)
        cost_model = self.prepared.run.cost_model
        work = []
        for replica, w in zip(self.plan.replicas, full.work, strict=True):
            mbs = w.microbatches[:1]
            if mbs and mbs[0].tokens > PROBE_TOKENS:
                mbs = (_cut(mbs[0], PROBE_TOKENS),)
            work.append(
                replace(
                    w,
                    microbatches=mbs,
                    estimated_time_s=cost_model.replica_time(
                        replica.config, [mb.shape for mb in mbs], tasks=[mb.task_ids for mb in mbs]
                    )
                    if mbs
                    else 0.0,
                )
            )
        probe = replace(full, work=tuple(work), speed=())
        self.executor.probe(probe, batch)
        timed = [self.executor.probe(probe, batch) for _ in range(PROBE_TIMINGS)]
        fastest = tuple(min(busy) for busy in zip(*(r.replica_busy_s for r in timed), strict=True))
        failed = tuple(sorted({r for report in timed for r in report.failed_replicas}))
        self.recalibrator.observe(probe, replace(timed[-1], replica_busy_s=fastest, failed_replicas=failed))
        # The first real step still meets shapes the probe did not (allocator growth, on CPU up to 2x
        # on one rank and not another): its report is left out too.
        self.recalibrator.skip_next(1)

    def _stopped(self, reached: int) -> int:
        """A stop asked by a signal, at the boundary before step ``reached``: checkpoint (unless told not to)."""
        committed = ""
        if self.options.checkpoint_on_stop:
            committed = f"; checkpoint {self._checkpoint(reached, wait=True).name} committed, continue with --resume"
        self.executor.close()
        print(
            f"lorafleet train: stopped by {signal.Signals(self.signal).name} after {reached} steps{committed}",
            flush=True,
        )
        return 0

    def _apply_queued(self, reached: int) -> int:
        """Queued requests due before step ``reached``: checkpoint, hand them to the launcher (``train.live``),
        which applies them and restarts the run from this checkpoint."""
        from lorafleet.train.queue import Pending, save_pending

        step_dir = self._checkpoint(reached, wait=True)
        turns = dict(zip(self.names, self.executor.streams.turns, strict=True))
        save_pending(self.options.queue_dir, Pending(reached, self.due, turns))
        self.executor.close()
        changes = ", ".join(f"{r.action.value} {r.name}" for r in self.due)
        print(f"lorafleet train: queue: step {reached}: {changes} (checkpoint {step_dir.name})", flush=True)
        return 0

    def _watch(self, report: StepReport) -> None:
        """Non-finite updates (skipped by the executor) counted per task; a task skipped
        ``nonfinite_patience`` steps in a row stops; a task whose adapter never moved is warned about."""
        for name in report.losses:
            self.nonfinite_streak[name] = self.nonfinite_streak[name] + 1 if name in report.nonfinite_tasks else 0
        for name in report.nonfinite_tasks:
            streak = self.nonfinite_streak[name]
            print(
                f"lorafleet train: step {report.step}: task {name!r} has a non-finite loss or gradient; its update "
                f"is skipped ({streak} in a row)",
                file=sys.stderr,
                flush=True,
            )
            if streak >= self.options.nonfinite_patience and name not in self.stopped_tasks:
                # The rest of this window and the next window's plans may be drawn already (look-ahead).
                self._stop_task(name, report.step + 1 + 2 * self.window)
        for name in report.unmoved_tasks:
            print(
                f"lorafleet train: warning: task {name!r}: its adapter has not moved after its warm-up; check its "
                "learning rate, alpha and grad_clip",
                file=sys.stderr,
                flush=True,
            )

    def _stop_task(self, name: str, from_step: int, announce: bool = True) -> None:
        if name not in self.names:
            return  # stopped, then finished or cancelled through the queue
        self.stopped_tasks[name] = from_step
        self.executor.streams.retire(self.names.index(name), from_step)
        if announce:
            print(
                f"lorafleet train: task {name!r} stopped after {self.options.nonfinite_patience} non-finite steps "
                "in a row; its adapter stays at its last finite update",
                file=sys.stderr,
                flush=True,
            )

    def _checkpoint(self, step: int, wait: bool = False) -> Path:
        """A checkpoint after ``step`` steps, written in the background (committed on return with ``wait``)."""
        extra = {"recalibration": self.recalibrator.state_dict(), "stopped_tasks": dict(self.stopped_tasks)}
        return self.executor.save_checkpoint(self.checkpoints, step, extra, wait=wait)

    def _writers(self, steps: range) -> FanOut:
        """The run's metrics files, its ``--logger`` trackers (continuing their run when this launch resumes
        one) and, on the console, a progress bar on a terminal or a flushed line per step elsewhere."""
        from lorafleet.metrics import (
            CsvWriter,
            FanOut,
            JsonlWriter,
            LogLines,
            ProgressBar,
            TensorBoardWriter,
            experiment_logger,
        )

        writers = [
            JsonlWriter(self.out / "metrics.jsonl"),
            CsvWriter(self.out / "metrics.csv"),
            TensorBoardWriter(self.out / "tensorboard", purge_step=steps.start),
        ]
        config = {
            "plan": self.plan.describe(),
            "gpus": self.plan.used_gpus,
            "steps": self.options.steps,
            "tasks": ",".join(self.names),
            "pipeline_window": self.window,
        }
        writers += [experiment_logger(name, self.out, config, resume=steps.start > 0) for name in self.options.loggers]
        if self.options.progress and sys.stdout.isatty():
            writers.append(ProgressBar(steps.stop, start=steps.start))
        else:
            writers.append(LogLines(steps.stop))
        return FanOut(*writers)

    def summary(self, stop: int) -> str:
        """What the run did, predicted against measured, and where its files are."""
        from lorafleet.dispatch.recalibration import summarize_factors
        from lorafleet.metrics import read_rows, summarize_rows

        lines = [
            f"lorafleet train: {stop} steps; adapters in {self.out / 'adapters'}, metrics in "
            f"{self.out / 'metrics.jsonl'} (and .csv, tensorboard/)"
        ]
        summary = summarize_rows(read_rows(self.out / "metrics.jsonl"))  # the whole run's steps, across restarts
        if summary.steps:
            measured = summary.mean_makespan_s
            predicted = summary.mean_estimated_makespan_s
            lines.append(
                f"  step time: measured {measured:.3f} s, predicted {predicted:.3f} s "
                f"(x{measured / predicted:.2f}, mean over {summary.steps} steps; "
                f"cost model {self.prepared.run.cost_model.source})"
            )
        if self.reports and self.plan.policy.recalibration.enabled:
            lines.append(f"  recalibrated: {summarize_factors(self.recalibrator.replicas())}")
        owed = summary.task_gpu_seconds
        if owed:
            total = sum(owed.values()) or 1.0
            shares = ", ".join(f"{name} {s:.4g} ({100 * s / total:.0f} %)" for name, s in owed.items())
            lines.append(f"  GPU-seconds by task (the whole run): {shares}")
        if self.stopped_tasks:
            lines.append(f"  stopped tasks (non-finite updates): {', '.join(self.stopped_tasks)}")
        return "\n".join(lines)


def finished_tasks(streams: DataStreams, step: int) -> list[Request]:
    """Tasks that took their last batch before ``step`` (their ``steps`` or ``epochs``) while the run goes on:
    finished, as if asked through the queue, so their adapters are exported now and their memory freed."""
    from lorafleet.train.queue import Action, Request

    out = []
    for t, (stream, limit) in enumerate(zip(streams.streams, streams.max_batches, strict=True)):
        if limit is not None and streams.batches_taken(t, step) >= limit and t not in streams.retired:
            out.append(Request(TOOK_ITS_STEPS, Action.FINISH, stream.data.name))
    return out


TOOK_ITS_STEPS = "(took its steps)"
"""The request file of a task that finished on its own (no file)."""


def _queue_watcher(options: TrainOptions, prepared: Prepared, tokenizer: Any) -> QueueWatcher | None:
    """The queue's watcher, under ``lorafleet train``'s own launcher only (which applies what it accepts):
    a task to add is checked against the workload's defaults and its data tokenized as training will."""
    from lorafleet.executor.torch.data_stream import prepare_task_data
    from lorafleet.executor.torch.processes import LOCKED_ENV
    from lorafleet.train.queue import Ledger, QueueWatcher

    if not os.environ.get(LOCKED_ENV):
        return None

    def check(task: TaskSpec) -> None:
        prepare_task_data(task, tokenizer, task.data.path if task.data else "queue")

    ledger = Ledger.load(options.out) or Ledger.of(prepared.workload.spec.tasks)
    return QueueWatcher(options.queue_dir, prepared.workload.spec.defaults, ledger, check=check)


PROBE_TOKENS = 1024
"""The most tokens of a replica's probe micro-batch (``Trainer._probe``): enough to be timed as its
steps are, small next to a step."""

PROBE_TIMINGS = 2
"""Timed passes of the probe after its warm-up pass; each replica's shortest is observed."""


def _cut(mb: MicroBatch, tokens: int) -> MicroBatch:
    """The first rows of a micro-batch that fit in ``tokens`` (at least one)."""
    keep = 1
    while (
        keep < len(mb.lengths)
        and replace(
            mb, seq_ids=mb.seq_ids[: keep + 1], task_ids=mb.task_ids[: keep + 1], lengths=mb.lengths[: keep + 1]
        ).tokens
        <= tokens
    ):
        keep += 1
    return replace(mb, seq_ids=mb.seq_ids[:keep], task_ids=mb.task_ids[:keep], lengths=mb.lengths[:keep])


def _last_step(executor: TorchExecutor, steps: int) -> int:
    """The step after which every task has taken all its batches (``steps`` when a task still has turns)."""
    return executor.streams.end_step(steps)
