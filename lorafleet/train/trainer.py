"""One process of a run: :func:`train_rank` joins the group and builds this rank's part of the fleet;
rank 0 drives :meth:`Trainer.train`, the others serve it.

    Trainer.train()   restore -> probe -> per window of steps {dispatch (one window ahead), run_steps,
                      per step recalibrate, watch for non-finite tasks, metrics; checkpoint every K} ->
                      final checkpoint -> PEFT adapters -> summary

A window is the plan's ``DeploymentPlan.loop_window`` steps (its policy's ``pipeline_window`` when a replica is
pipelined, else one step; cut at every checkpoint, at the boundaries the fleet's changes name and at the run's
end): its pipelined replicas do not drain between its steps (``costmodel.schedule``), and a stop asked by a
signal takes effect at the next window boundary.

Also here: the checkpoint cadence, the stop at a step boundary on a signal, and the export of the final
adapters out of the last checkpoint. The loop's components have modules of their own: the probe before the first
step (``train.probe``), the non-finite watch (``train.health``), the fleet's changes at step boundaries
(``train.changes``: queued requests, departures, the re-plan beside the steps; the executor seen through
``train.torch_fleet``) and the closing summary (``train.summary``). What the loop runs between two changes is
one value, :class:`~lorafleet.train.running.Running`, swapped whole.
"""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.errors import InputError
from lorafleet.plans import StepPlan, StepReport
from lorafleet.train.changes import FleetChanges
from lorafleet.train.evaluation import Evaluations
from lorafleet.train.health import TaskHealth
from lorafleet.train.options import TrainOptions
from lorafleet.train.phases import counted, phase
from lorafleet.train.preflight import Prepared, claim
from lorafleet.train.probe import probe, probe_forward
from lorafleet.train.queue import Ledger
from lorafleet.train.resume import RESTART_ENV
from lorafleet.train.running import Running, Stop
from lorafleet.train.summary import run_summary, summary_text

if TYPE_CHECKING:
    from lorafleet.data.workload_tokens import WorkloadTokens
    from lorafleet.dispatch import LookaheadDispatcher
    from lorafleet.executor.torch.worker import TorchExecutor
    from lorafleet.metrics import FanOut


def train_rank(options: TrainOptions, prepared: Prepared) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it.

    An error once the process group is up (but bad input, one line and exit 2) is recorded under
    ``<out>/logs/`` (``train.failures``) before the group closes, and the rank returns 1: its peers learn of
    the failure only from the closed group, so their lost-peer errors can never come first."""
    import torch.distributed as dist

    from lorafleet.executor.torch.launch import build_torch_executor, check_device_kinds, init_distributed
    from lorafleet.executor.torch.precision import torch_dtype
    from lorafleet.runtime.data_stream import workload_tokens
    from lorafleet.runtime.host_memory import keep_freed_host_memory
    from lorafleet.runtime.processes import LOCKED_ENV, check_code

    check_code()
    device = init_distributed(options.device, options.start_timeout_s)
    if device.type == "cpu":
        keep_freed_host_memory()  # the probe's warm-up grows the heap to a step's size, once (host_memory)
    report = phase if dist.get_rank() == 0 else None
    if report is not None:
        again = os.environ.get(RESTART_ENV, "0")
        restart = f", restart {again} of {options.max_restarts}" if again != "0" else ""
        report(f"process group up: {counted(dist.get_world_size(), 'rank')} ({dist.get_backend()}){restart}")
    lock = None
    try:
        check_device_kinds(prepared.run.plan, device, options.plan)
        if dist.get_rank() == 0 and not os.environ.get(LOCKED_ENV):  # under the user's own torchrun
            lock = claim(options, prepared)
        tokens = workload_tokens(prepared.workload.spec)  # data tokenized before is read: no tokenization here
        executor = build_torch_executor(
            prepared.workload.spec,
            prepared.run.plan,
            options.steps,
            device,
            torch_dtype(options.dtype),
            slowdown=dict(options.slowdown),
            turn_changes=prepared.turn_changes,
            departed=prepared.departed,
            report=report,
            tokenizer=tokens,
        )
        if dist.get_rank() != 0:
            executor.serve()  # rank 0 decides when the run stops (a signal here was recorded, no more)
            return 0
        return Trainer(options, prepared, executor, tokens).train()
    except (InputError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # recorded before the group closes: the peers' errors that follow are not news
        from lorafleet.train.failures import record_worker_error

        record_worker_error(options.run_dir, dist.get_rank(), err)
        return 1
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()


class Trainer:
    """Rank 0's loop over the steps of one run (see the module docstring)."""

    def __init__(
        self, options: TrainOptions, prepared: Prepared, executor: TorchExecutor, tokens: WorkloadTokens
    ) -> None:
        from lorafleet.dispatch import Recalibrator
        from lorafleet.runtime.processes import LOCKED_ENV
        from lorafleet.train.torch_fleet import TorchFleet, initial_migration

        self.options, self.prepared, self.executor = options, prepared, executor
        self.tokens = tokens
        """The run's data's tokens (``data_stream.workload_tokens``): its tokenizer is saved for the exports."""
        self.run_dir = options.run_dir
        plan = prepared.run.plan
        self.running = Running(prepared.workload, plan, prepared.run.cost_model, Recalibrator.for_plan(plan))
        """What the loop runs now: tasks, plan, cost model, recalibrator (swapped whole at a change)."""
        self.health = TaskHealth(self.running.names, options.nonfinite_patience, self._retire)
        self.signal: int | None = None
        self.next_step = 0
        self._said_cut: set[str] = set()
        """The tasks whose line says the run ends before they are done (``train.run_length``): each said once."""
        fleet = TorchFleet(
            executor, options.steps, self._checkpoint, lambda: self.health.stopped, self.run_dir.checkpoints
        )
        self.evaluations = Evaluations(fleet, options.steps, self.run_dir.evaluations)
        """The tasks' evaluations, their best adapters and early stops (``train.evaluation``)."""
        self.changes = FleetChanges(
            options,
            prepared.workload.spec.defaults,
            Ledger.load(options.out) or Ledger.of(prepared.workload.spec.tasks),
            fleet,
            tokens,
            initial_migration(executor, plan, prepared.workload, options.dtype),
            watch=bool(os.environ.get(LOCKED_ENV)),  # under lorafleet's launcher, which applies what the fleet cannot
        )

    def train(self) -> int:
        """Run the steps left to the run's total; 0 when done or stopped by a signal at a step boundary. The steps
        run in segments, one per task set and deployment, between two changes of the fleet (``train.changes``)."""
        start = self.next_step = self.restore()
        self._save_tokenizer()
        self._say_run_length()
        self._say_templates()
        end = self._end()
        resumed = f" (resumed from the checkpoint of step {start})" if start else ""
        if start < end:
            phase(f"training steps {start}..{end - 1} of {self.options.steps}{resumed}")
        running = self.running
        if running.plan.policy.recalibration.enabled and start < end:
            probe(self.executor, running.plan, running.cost_model, running.recalibrator, start)
            evaluated = [t.name for t in running.workload.tasks if t.spec.eval is not None]
            probed = probe_forward(
                self.executor, running.plan, running.cost_model, running.recalibrator.factors, start, evaluated
            )
            if probed is not None:
                phase(probed.describe())
            self.evaluations.probed = probed
        self.changes.resume(start, running)
        self.changes.stop_early(self.evaluations.stopped_early())  # a stop the checkpoint recorded, not yet applied
        ran = False
        with self._writers(range(start, self.options.steps)) as metrics:
            while True:
                steps = range(self.next_step, self._end())
                ran |= bool(self._segment(metrics, steps))
                if self.signal is not None and self.next_step < steps.stop:
                    return self._stopped(self.next_step)
                after = self.changes.at_boundary(self.next_step, self.running)
                if after is None:
                    return self._finish(self.next_step, ran=ran)
                if isinstance(after, Stop):
                    return self._left(self.next_step, after)
                self.running = after
                self.health.retask(after.names)
                self._say_run_length()  # a task that joined and cannot finish in the run is said so as it joins

    def _segment(self, metrics: FanOut, steps: range) -> list[StepReport]:
        """``steps`` on the running deployment and tasks, up to a boundary where a change is due."""
        from lorafleet.dispatch import LookaheadDispatcher
        from lorafleet.loop import run_loop

        running = self.running
        with LookaheadDispatcher(
            self.executor.next_global_batch, running.plan, running.cost_model, depth=running.window
        ) as ahead:
            return run_loop(
                ahead,
                self.executor,
                steps,
                partial(self._on_report, metrics, ahead),
                running.recalibrator,
                stop=self._stop_requested,
                window=running.window,
                boundary_every=self.options.checkpoint_every,
                next_boundary=self._next_boundary,
            )

    def _say_templates(self) -> None:
        """What the chat template does to each task's rows, as ``validate`` says it (prompt rows wrapped or not, a
        default system prompt added), with the tokenizer the run trains with (``data.describe.template_lines``)."""
        from lorafleet.data.describe import template_lines

        for line in template_lines(self.running.workload.spec.tasks, self.tokens.tokenizer):
            print(f"lorafleet train: {line}", flush=True)

    def _say_run_length(self) -> None:
        """Each task's steps in the run, recorded (``<out>/run_length.json``), and a line for each task the run ends
        before it has taken its steps or epochs (``train.run_length``)."""
        from lorafleet.train.run_length import RunLength

        length = RunLength.of(self.executor.streams, self.running.workload.spec.tasks, self.options.steps)
        length.save(self.run_dir)
        for task in length.cut:
            if task.name not in self._said_cut:  # each task once, at the start or as it joins
                self._said_cut.add(task.name)
                print(f"lorafleet train: {task.line(length.steps)}", flush=True)

    def _next_boundary(self, step: int) -> int | None:
        """The next step after ``step`` a window must end at: a fleet change's, or an evaluation's."""
        due = (self.changes.next_boundary(), self.evaluations.next_boundary(step, self.running.workload.spec.tasks))
        return min((b for b in due if b is not None), default=None)

    def _retire(self, task: int, from_step: int) -> None:
        """The health watch's stop of a task, in the streams the fleet runs now."""
        self.executor.streams.retire(task, from_step)

    def _end(self) -> int:
        """The step after which every task has taken all its batches (the run's total when a task still has turns)."""
        return min(self.options.steps, self.executor.streams.end_step(self.options.steps))

    def restore(self) -> int:
        """The first step to run: 0, or the resumed checkpoint's (with its recalibration and stopped tasks);
        the metrics are cut back to it, so nothing replayed is counted twice."""
        from lorafleet.metrics import truncate_metrics

        start = 0
        if self.prepared.resume_step is not None:
            state = self.executor.restore_checkpoint(self.run_dir.checkpoints)
            if state is not None:
                start = state.step
                self.running.recalibrator.load_state_dict(state.extra.get("recalibration", {}))
                self.health.load_state_dict(state.extra)
                self.evaluations.load_state_dict(state.extra)
        truncate_metrics(self.run_dir.root, start)
        return start

    def _on_report(self, metrics: FanOut, ahead: LookaheadDispatcher, report: StepReport, step_plan: StepPlan) -> None:
        """``run_loop``'s ``on_report``: one step's report watched, the evaluations due after it run
        (``train.evaluation``: a window ends wherever one is due), the step written with what the plan predicted of
        it and what the evaluations measured, and a checkpoint every ``checkpoint_every`` steps."""
        from lorafleet.accounting import task_gpu_seconds

        running = self.running
        self.next_step = report.step + 1
        self.health.watch(report, ahead.started_until)
        stops = self.evaluations.run(self.next_step, running)
        for name in stops:
            task = self.evaluations.tasks[name]
            best = task.stopping
            why = f"no eval loss below {best.best_loss:.4g} (step {best.best_step}) in {best.bad} evaluations"
            if task.dropped_rung is not None:
                why = f"rung {task.dropped_rung} of its sweep kept others (its best eval loss {best.best_loss:.4g})"
            print(f"lorafleet train: step {self.next_step}: {name} stops early: {why}; it leaves the run with its "
                  "best adapter", flush=True)  # fmt: skip
        self.changes.stop_early(self.evaluations.stopped_early(stops))
        tokens = sum(report.task_tokens.values())
        metrics.write(
            report,
            task_gpu_s=task_gpu_seconds(step_plan, report, running.plan, running.cost_model, running.names),
            tokens_per_s=tokens / report.makespan_s if report.makespan_s else 0.0,
            predicted_busy_s=tuple(w.estimated_time_s for w in step_plan.work),
            model_busy_s=tuple(step_plan.base_estimate(r) for r in range(len(step_plan.work))),
            replica_tokens=tuple(sum(sum(mb.lengths) for mb in w.microbatches) for w in step_plan.work),
            correction=running.recalibrator.factors or (),
            **self.evaluations.row_extra(),
        )
        if (report.step + 1) % self.options.checkpoint_every == 0:
            self._checkpoint(report.step + 1)

    def _stop_requested(self) -> bool:
        """At a window boundary: a signal asked to stop (this process's, ``processes.catch_stop_signals``, or the
        launcher's stop request), or a change of the fleet is due (``FleetChanges.due``)."""
        from lorafleet.runtime.processes import stop_signal

        if self.signal is None:
            self.signal = stop_signal() or self.run_dir.stop_requested()
        return self.signal is not None or self.changes.due(self.next_step, self.running)

    def _finish(self, reached: int, ran: bool) -> int:
        """The run's end after ``reached`` steps (``ran``: some of them in this launch): a final checkpoint
        (waited for), its PEFT adapters exported to ``<out>/adapters``, and the summary."""
        from lorafleet.data.model_source import base_weights_note
        from lorafleet.metrics import last_losses
        from lorafleet.runtime.checkpoint_files import export_adapters
        from lorafleet.train.promote import promote_sweeps
        from lorafleet.train.queue.ledger import revision_lines

        running = self.running
        final = self._checkpoint(reached, wait=True)
        self.changes.finish()
        export_adapters(
            final,
            running.names,
            self.run_dir.adapters,
            tasks=running.workload.spec.tasks,
            tokenizer=self.run_dir.tokenizer,
            losses=last_losses(self.run_dir.metrics_jsonl),
            changes=revision_lines(self.run_dir.root),
            base_weights=base_weights_note(running.workload.spec.model),
        )
        sweeps = promote_sweeps(self.run_dir)
        self.executor.close()
        recalibrated = ran and running.plan.policy.recalibration.enabled
        text = summary_text(
            self.run_dir,
            reached,
            run_summary(self.run_dir),
            cost_source=running.cost_model.source,
            recalibration=running.recalibrator.replicas() if recalibrated else None,
            stopped=self.health.stopped,
            evaluations=self.evaluations.tasks,
            sweeps=sweeps,
        )
        print(text, flush=True)
        return 0

    def _save_tokenizer(self) -> None:
        """The run's tokenizer into ``<out>/tokenizer/`` (once a run directory), for every adapter exported
        (here, and by the launcher when a task leaves a running job: ``train.live``) to ship with."""
        from lorafleet.runtime.checkpoint_files import save_tokenizer

        save_tokenizer(self.tokens.tokenizer(), self.run_dir.tokenizer)

    def _stopped(self, reached: int) -> int:
        """A stop asked by a signal, at the boundary before step ``reached``: checkpoint (unless told not to)."""
        committed = ""
        if self.options.checkpoint_on_stop:
            committed = f"; checkpoint {self._checkpoint(reached, wait=True).name} committed, continue with --resume"
            self.changes.committed()  # a change waiting for a checkpoint after it settles on this one
        self.executor.close()
        print(
            f"lorafleet train: stopped by {signal.Signals(self.signal).name} after {reached} steps{committed}",
            flush=True,
        )
        return 0

    def _left(self, reached: int, why: Stop) -> int:
        """The workers stop at the boundary before ``reached`` for a change (``train.changes.Stop``): the launcher
        applies it and starts them again from that boundary's checkpoint, or every task has left (its adapters
        exported)."""
        self.executor.close()
        if why is Stop.ALL_LEFT:
            print(f"lorafleet train: every task has left the run at step {reached}", flush=True)
        return 0

    def _checkpoint(self, step: int, wait: bool = False) -> Path:
        """A checkpoint after ``step`` steps, written in the background (committed on return with ``wait``)."""
        extra = {
            "recalibration": self.running.recalibrator.state_dict(),
            **self.health.state_dict(),
            **self.changes.checkpoint_extra(),
            **self.evaluations.state_dict(),
        }
        return self.executor.save_checkpoint(self.run_dir.checkpoints, step, extra, wait=wait)

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
        running = self.running
        config = {
            "plan": running.plan.describe(),
            "gpus": running.plan.used_gpus,
            "steps": self.options.steps,
            "tasks": ",".join(running.names),
            "pipeline_window": running.window,
        }
        writers += [
            experiment_logger(name, self.run_dir.root, config, resume=steps.start > 0) for name in self.options.loggers
        ]
        if self.options.progress and sys.stdout.isatty():
            writers.append(ProgressBar(steps.stop, start=steps.start))
        else:
            writers.append(LogLines(steps.stop))
        return FanOut(*writers)
