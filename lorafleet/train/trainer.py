"""One process of a run: :func:`train_rank` joins the group and builds this rank's part of the fleet;
rank 0 drives :meth:`Trainer.train`, the others serve it.

    Trainer.train()   restore -> probe -> per window of steps {dispatch (one window ahead), run_steps,
                      per step recalibrate, watch for non-finite tasks, metrics; checkpoint every K} ->
                      final checkpoint -> PEFT adapters -> summary

A window is the plan's ``pipeline_window`` steps (cut at every checkpoint and at the run's end): its
pipelined replicas do not drain between its steps (``costmodel.schedule``), and a stop asked by a
signal takes effect at the next window boundary.

Also here: the checkpoint cadence, the stop at a step boundary on a signal or for queued requests, and the
export of the final adapters out of the last checkpoint. The loop's components have modules of their own:
the probe before the first step (``train.probe``), the non-finite watch (``train.health``) and the closing
summary (``train.summary``).
"""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafleet.plans import StepPlan, StepReport
from lorafleet.train.health import TaskHealth
from lorafleet.train.options import TrainOptions
from lorafleet.train.phases import counted, phase
from lorafleet.train.preflight import Prepared, claim
from lorafleet.train.probe import probe
from lorafleet.train.summary import run_summary, summary_text

if TYPE_CHECKING:
    from lorafleet.dispatch import LookaheadDispatcher
    from lorafleet.executor.torch.data_stream import DataStreams
    from lorafleet.executor.torch.worker import TorchExecutor
    from lorafleet.metrics import FanOut
    from lorafleet.specs.workload import TaskSpec
    from lorafleet.train.queue import QueueWatcher, Request


def train_rank(options: TrainOptions, prepared: Prepared) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it."""
    import torch.distributed as dist

    from lorafleet.executor.torch.data_stream import task_tokenizer
    from lorafleet.executor.torch.host_memory import keep_freed_host_memory
    from lorafleet.executor.torch.launch import build_torch_executor, init_distributed
    from lorafleet.executor.torch.precision import Precision
    from lorafleet.executor.torch.processes import LOCKED_ENV, check_code

    check_code()
    device = init_distributed(options.device)
    if device.type == "cpu":
        keep_freed_host_memory()  # the probe's warm-up grows the heap to a step's size, once (host_memory)
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
            executor.serve()  # rank 0 decides when the run stops (a signal here was recorded, no more)
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
        """The run's tokenizer (its data's: ``data_stream.task_tokenizer``): saved for the exports, and what a
        queued task's data is checked with."""
        self.prepared = prepared
        self.executor = executor
        self.plan = prepared.run.plan
        self.cost_model = prepared.run.cost_model
        self.names = [t.name for t in prepared.workload.tasks]
        self.run_dir = options.run_dir
        self.out = self.run_dir.root
        self.checkpoints = self.run_dir.checkpoints
        self.recalibrator = Recalibrator(len(self.plan.replicas), self.plan.policy.recalibration)
        self.signal: int | None = None
        pipelined = any(r.config.pp > 1 for r in self.plan.replicas)
        self.window = self.plan.policy.pipeline_window if pipelined else 1
        """Steps a window runs (``lorafleet.loop``); windows also end at checkpoints and queued changes. Only
        a pipelined replica streams across a boundary: without one a window is a step, so each step is
        reported (its log line, its recalibration) as it ends."""
        self.health = TaskHealth(self.names, options.nonfinite_patience, executor.streams.retire)
        self.watcher = _queue_watcher(options, prepared, tokenizer)
        """The live task queue, read at every window boundary (None under a user's own torchrun)."""
        self.due: list[Request] = []
        """Queued requests due at the boundary the loop stopped at: applied by a restart."""
        self.next_step = 0

    def train(self) -> int:
        """Run the steps left to the run's total; 0 when done or stopped by a signal at a step boundary."""
        from lorafleet.dispatch import LookaheadDispatcher
        from lorafleet.loop import run_loop

        start = self.next_step = self.restore()
        self._save_tokenizer()
        steps = range(start, min(self.options.steps, _last_step(self.executor, self.options.steps)))
        resumed = f" (resumed from the checkpoint of step {start})" if start else ""
        if steps:
            phase(f"training steps {steps.start}..{steps.stop - 1} of {self.options.steps}{resumed}")
        if self.plan.policy.recalibration.enabled and len(steps):
            probe(self.executor, self.plan, self.cost_model, self.recalibrator, start)
        with (
            self._writers(steps) as metrics,
            LookaheadDispatcher(
                self.executor.next_global_batch, self.plan, self.cost_model, depth=self.window
            ) as ahead,
        ):
            done = run_loop(
                ahead,
                self.executor,
                steps,
                partial(self._on_report, metrics, ahead),
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
        return self._finish(reached, ran=bool(done))

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
                self.health.load_state_dict(state.extra)
        truncate_metrics(self.out, start)
        return start

    def _on_report(self, metrics: FanOut, ahead: LookaheadDispatcher, report: StepReport, step_plan: StepPlan) -> None:
        """``run_loop``'s ``on_report``: one step's report watched, written with what the plan predicted of it,
        and a checkpoint every ``checkpoint_every`` steps."""
        from lorafleet.accounting import task_gpu_seconds

        self.next_step = report.step + 1
        self.health.watch(report, ahead.started_until)
        tokens = sum(report.task_tokens.values())
        metrics.write(
            report,
            task_gpu_s=task_gpu_seconds(step_plan, report, self.plan, self.cost_model, self.names),
            tokens_per_s=tokens / report.makespan_s if report.makespan_s else 0.0,
            predicted_busy_s=tuple(w.estimated_time_s for w in step_plan.work),
            model_busy_s=tuple(step_plan.base_estimate(r) for r in range(len(step_plan.work))),
            replica_tokens=tuple(sum(sum(mb.lengths) for mb in w.microbatches) for w in step_plan.work),
            correction=self.recalibrator.factors or (),
        )
        if (report.step + 1) % self.options.checkpoint_every == 0:
            self._checkpoint(report.step + 1)

    def _stop_requested(self) -> bool:
        """At a window boundary: a signal asked to stop (this process's, ``processes.catch_stop_signals``, or the
        launcher's stop request), or queued requests are due (the run restarts to apply them)."""
        from lorafleet.executor.torch.processes import stop_signal

        if self.signal is None:
            self.signal = stop_signal() or self.run_dir.stop_requested()
        if self.signal is None and self.watcher is not None:
            self.due = self.watcher.poll(self.next_step)
            if self.next_step < self.options.steps:
                left = {r.name for r in self.due}
                self.due += [r for r in finished_tasks(self.executor.streams, self.next_step) if r.name not in left]
        return self.signal is not None or bool(self.due)

    def _finish(self, reached: int, ran: bool) -> int:
        """The run's end after ``reached`` steps (``ran``: some of them in this launch): a final checkpoint
        (waited for), its PEFT adapters exported to ``<out>/adapters``, and the summary."""
        from lorafleet.executor.torch.checkpoint_files import export_adapters
        from lorafleet.metrics import last_losses
        from lorafleet.train.queue.ledger import revision_lines

        final = self._checkpoint(reached, wait=True)
        export_adapters(
            final,
            self.names,
            self.run_dir.adapters,
            tasks=self.prepared.workload.spec.tasks,
            tokenizer=self.run_dir.tokenizer,
            losses=last_losses(self.run_dir.metrics_jsonl),
            changes=revision_lines(self.out),
        )
        self.executor.close()
        recalibrated = ran and self.plan.policy.recalibration.enabled
        text = summary_text(
            self.run_dir,
            reached,
            run_summary(self.run_dir),
            cost_source=self.cost_model.source,
            recalibration=self.recalibrator.replicas() if recalibrated else None,
            stopped=self.health.stopped,
        )
        print(text, flush=True)
        return 0

    def _save_tokenizer(self) -> None:
        """The run's tokenizer into ``<out>/tokenizer/`` (once a run directory), for every adapter exported
        (here, and by the launcher when a task leaves a running job: ``train.live``) to ship with."""
        from lorafleet.executor.torch.checkpoint_files import save_tokenizer

        save_tokenizer(self.tokenizer, self.run_dir.tokenizer)

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

    def _checkpoint(self, step: int, wait: bool = False) -> Path:
        """A checkpoint after ``step`` steps, written in the background (committed on return with ``wait``)."""
        extra = {"recalibration": self.recalibrator.state_dict(), **self.health.state_dict()}
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
            JsonlWriter(self.run_dir.metrics_jsonl),
            CsvWriter(self.run_dir.metrics_csv),
            TensorBoardWriter(self.run_dir.tensorboard, purge_step=steps.start),
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


def _last_step(executor: TorchExecutor, steps: int) -> int:
    """The step after which every task has taken all its batches (``steps`` when a task still has turns)."""
    return executor.streams.end_step(steps)
