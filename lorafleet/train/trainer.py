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
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafleet.errors import InputError
from lorafleet.plans import StepPlan, StepReport
from lorafleet.train.health import TaskHealth
from lorafleet.train.options import TrainOptions
from lorafleet.train.phases import counted, phase
from lorafleet.train.preflight import Prepared, claim
from lorafleet.train.probe import probe
from lorafleet.train.queue import Action, Ledger
from lorafleet.train.resume import RESTART_ENV
from lorafleet.train.summary import run_summary, summary_text

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.dispatch import LookaheadDispatcher
    from lorafleet.executor.torch.change import ChangeReport, FleetChange
    from lorafleet.executor.torch.worker import TorchExecutor
    from lorafleet.metrics import FanOut
    from lorafleet.planner import MigrationModel
    from lorafleet.plans import DeploymentPlan
    from lorafleet.runtime.data_stream import DataStreams, TaskData
    from lorafleet.specs.workload import TaskSpec
    from lorafleet.train.background import BackgroundReplan
    from lorafleet.train.queue import QueueWatcher, Request
    from lorafleet.turns import TaskTurns
    from lorafleet.workload import Workload


def train_rank(options: TrainOptions, prepared: Prepared) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it.

    An error once the process group is up (but bad input, one line and exit 2) is recorded under
    ``<out>/logs/`` (``train.failures``) before the group closes, and the rank returns 1: its peers learn of
    the failure only from the closed group, so their lost-peer errors can never come first."""
    import torch.distributed as dist

    from lorafleet.executor.torch.launch import build_torch_executor, check_device_kinds, init_distributed
    from lorafleet.executor.torch.precision import Precision
    from lorafleet.runtime.data_stream import task_tokenizer
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
        self.recalibrator = Recalibrator.for_plan(self.plan)
        self.signal: int | None = None
        pipelined = any(r.config.pp > 1 for r in self.plan.replicas)
        self.window = self.plan.policy.pipeline_window if pipelined else 1
        """Steps a window runs (``lorafleet.loop``); windows also end at checkpoints and queued changes. Only
        a pipelined replica streams across a boundary: without one a window is a step, so each step is
        reported (its log line, its recalibration) as it ends."""
        self.health = TaskHealth(self.names, options.nonfinite_patience, self._retire)
        self.workload = prepared.workload
        """The run's tasks now (the ledger's active ones, resolved)."""
        self.ledger = Ledger.load(options.out) or Ledger.of(prepared.workload.spec.tasks)
        self.added: dict[str, TaskData] = {}
        """The data of the tasks the queue accepted (tokenized when they were checked), until they join."""
        self.watcher = _queue_watcher(self, options, prepared, tokenizer)
        """The live task queue, read at every window boundary (None under a user's own torchrun)."""
        self.due: list[Request] = []
        """Queued requests due at the boundary the loop stopped at: applied in the running fleet (:meth:`_change`)."""
        self.departure: int | None = None
        """The next step a task is done at, or the end of the departures it waits for (``turns.departures``)."""
        self.migration = _start_migration(executor, self.plan, self.workload, options.dtype)
        """What a move of the deployment costs, measured (``planner.incremental.MigrationModel``)."""
        self.replanning: BackgroundReplan | None = None
        """The last change's re-plan, running beside the steps until its boundary (``train.background``)."""
        self.next_step = 0

    def train(self) -> int:
        """Run the steps left to the run's total; 0 when done or stopped by a signal at a step boundary. The steps
        run in segments, one per task set and deployment: queued changes are applied in the running fleet
        between two segments (:meth:`_change`)."""
        start = self.next_step = self.restore()
        self._save_tokenizer()
        end = self._end()
        resumed = f" (resumed from the checkpoint of step {start})" if start else ""
        if start < end:
            phase(f"training steps {start}..{end - 1} of {self.options.steps}{resumed}")
        if self.plan.policy.recalibration.enabled and start < end:
            probe(self.executor, self.plan, self.cost_model, self.recalibrator, start)
        self._resume_replan(start)
        ran = False
        with self._writers(range(start, self.options.steps)) as metrics:
            while True:
                steps = range(self.next_step, self._end())
                ran |= bool(self._segment(metrics, steps))
                if self.signal is not None and self.next_step < steps.stop:
                    return self._stopped(self.next_step)
                replanned = self._replan_due()  # superseded by requests due at its boundary (_change)
                if replanned and not self.due and not self._apply_replan(self.next_step):
                    return self._apply_queued(self.next_step)
                if not self.due:
                    if replanned:
                        continue
                    return self._finish(self.next_step, ran=ran)
                if not self._change(self.next_step):
                    return self._apply_queued(self.next_step)
                if not self.names:
                    return self._all_left(self.next_step)

    def _segment(self, metrics: FanOut, steps: range) -> list[StepReport]:
        """``steps`` on the running deployment and tasks, up to a boundary where changes are due."""
        from lorafleet.dispatch import LookaheadDispatcher
        from lorafleet.loop import run_loop

        with LookaheadDispatcher(
            self.executor.next_global_batch, self.plan, self.cost_model, depth=self.window
        ) as ahead:
            return run_loop(
                ahead,
                self.executor,
                steps,
                partial(self._on_report, metrics, ahead),
                self.recalibrator,
                stop=self._stop_requested,
                window=self.window,
                boundary_every=self.options.checkpoint_every,
                next_boundary=self._next_boundary,
            )

    def _end(self) -> int:
        """The step after which every task has taken all its batches (the run's total when a task still has turns)."""
        return min(self.options.steps, self.executor.streams.end_step(self.options.steps))

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
        launcher's stop request), or queued requests are due (applied in the running fleet), with the tasks
        whose batches are done and whose departure is due (``turns.departures``)."""
        from lorafleet.runtime.processes import stop_signal

        if self.signal is None:
            self.signal = stop_signal() or self.run_dir.stop_requested()
        if self.signal is None and self.watcher is not None:
            self.due = self.watcher.poll(self.next_step)
            if self.next_step < self.options.steps:
                done, self.departure = finished_tasks(
                    self.executor.streams, self.next_step, self.options.steps, bool(self.due)
                )
                left = {r.name for r in self.due}
                self.due += [r for r in done if r.name not in left]
        return self.signal is not None or bool(self.due) or self._replan_due()

    def _next_boundary(self, step: int) -> int | None:
        """A step a window must end at: a queued request's ``at_step``, a departure's, or the step a re-plan's
        answer is due at (``run_loop``)."""
        due = [
            self.watcher.next_due() if self.watcher else None,
            self.departure,
            self.replanning.at if self.replanning else None,
        ]
        return min((s for s in due if s is not None), default=None)

    def _replan_due(self) -> bool:
        """The change's re-plan is due at this boundary (before the run's last step: else it is never applied)."""
        return self.replanning is not None and self.replanning.at == self.next_step < self._end()

    def _retire(self, task: int, from_step: int) -> None:
        """The health watch's stop of a task, in the streams the fleet runs now."""
        self.executor.streams.retire(task, from_step)

    def _change(self, step: int) -> bool:
        """The requests due at the boundary before ``step`` applied in the running fleet (``train.live``): a
        checkpoint when a task joins or leaves, the requests left in ``.apply.json``, then the ledger, the exports,
        the plan and the executor's change of its slots or deployment (:meth:`_apply_plan`). When tasks join or
        leave and the running deployment can serve them, it is kept for now and the re-plan runs beside the next
        ``--replan-after`` steps (:meth:`_start_replan`); else the boundary re-plans. False when the new plan needs
        processes the run does not have: the workers then stop and the launcher applies the changes."""
        from lorafleet.train import live
        from lorafleet.train.queue import Pending, clear_pending, clear_pending_replan, save_pending

        requests, self.due = self.due, []
        turns = self._turns()
        tasks_change = any(r.action is not Action.UPDATE for r in requests)
        relaunch = bool(os.environ.get(RELAUNCH_ENV))
        # A task that leaves is exported from this checkpoint, and the ledger records it gone only once it is
        # committed (a resume from an older one would lose its last steps); a join or an update may be recorded
        # before: a resume from an older checkpoint replays the steps before it, then the change. A join's
        # checkpoint is written once the change is applied (the state with the new task, in the background):
        # begun here, its data would be flushed by the fsyncs of the ledger and the plan, at the boundary.
        leaving = any(r.action in live.LEAVING for r in requests)
        checkpoint = self._checkpoint(step, wait=True) if leaving or relaunch else None
        committed = f" (checkpoint {checkpoint.name})" if checkpoint is not None else ""
        save_pending(self.options.queue_dir, Pending(step, requests, turns))
        live.log(f"step {step}: {', '.join(f'{r.action.value} {r.name}' for r in requests)}{committed}")
        active = self.ledger.apply(requests, step, turns).active
        plan, replan = self.plan, None
        if active:
            lengths = {name: data.raw_lengths for name, data in self.added.items()}
            workload = live.changed_workload(self.workload, active, lengths)
            plan = replace(self.plan, tasks=tuple(t.name for t in active))
        if relaunch:
            live.log(f"step {step}: {RELAUNCH_ENV} is set: the workers restart to apply the changes")
            return False
        # A re-plan under way was for the tasks before these changes: this boundary's supersedes it.
        superseded, self.replanning = self.replanning is not None, None
        if superseded:
            clear_pending_replan(self.options.queue_dir)
        kept, cost_model = None, None  # the running deployment on the new tasks, its re-plan beside the steps
        if active and (tasks_change or superseded):
            if self.options.replan_after:
                kept, cost_model = live.kept_change(self.options, workload, self.plan)
            if kept is not None:
                plan = kept
            else:
                replan = live.replan_change(self.options, workload, self.plan, step, self.migration, save=False)
                plan = replan.plan
                if plan.world_size > self.executor.world_size:
                    return self._hand_to_launcher(step, plan, f"{replan.describe()}; ", checkpoint)
        self.ledger = live.record_change(self.options, self.ledger, step, requests, turns, self.workload.spec.tasks)
        if not active:
            clear_pending(self.options.queue_dir)
            live.log(f"step {step}: no task is left to train")
            self.names = []
            return True
        self._commit_plan(workload, plan)
        clear_pending(self.options.queue_dir)
        if replan is not None:
            live.log(f"step {step}: {replan.describe()}")
        self._apply_plan(step, workload, plan, cost_model if kept is not None else None)
        if kept is not None:
            at = step + self.options.replan_after
            if self._start_replan(step, at):
                live.log(f"step {step}: kept {plan.describe()} for now; the re-plan runs beside the steps to step {at}")
            else:
                live.log(
                    f"step {step}: kept {plan.describe()}: the run ends before step {at}, where a move would apply"
                )
        if tasks_change and checkpoint is None:
            self._checkpoint(step)
        return True

    def _commit_plan(self, workload: Workload, plan: DeploymentPlan) -> None:
        """The tasks and plan the fleet runs from this boundary on, where a restart finds them: the run's
        ``plan.json`` and its run file (``train.run_file``: a torchrun restart of the workers reads the tasks and
        the plan there; a resume re-reads the ledger and ``plan.json``)."""
        from lorafleet.train.run_file import ResolvedRun

        plan.save(self.run_dir.plan)
        if self.run_dir.run_file.is_file():
            run = ResolvedRun.load(self.run_dir.run_file)
            spec = workload.spec.model_dump(mode="json", exclude_none=True)
            replace(run, plan=plan, workload=spec).save(self.run_dir)

    def _apply_plan(
        self, step: int, workload: Workload, plan: DeploymentPlan, cost_model: CostModel | None = None
    ) -> None:
        """The executor's change, in the running fleet, to ``workload``'s tasks on ``plan`` (its adapter slots, or
        its deployment: ``TorchExecutor.change``), then rank 0's loop state (:meth:`_continue_with`; ``cost_model``:
        ``plan``'s, when the caller has built it)."""
        from lorafleet.train import live

        change = self._fleet_change(step, workload, plan)
        report = self.executor.change(
            change, {t.name: self.added.pop(t.name) for t in change.tasks if t.name in self.added}
        )
        what = [
            f"ranks {', '.join(map(str, report.rebuilt))} built their stages" if report.rebuilt else "every stage kept"
        ]
        what += [f"{name} {seconds:.2g} s" for name, seconds in report.phases.items() if seconds >= 0.01]
        live.log(f"step {step}: applied in the running fleet in {report.seconds:.3g} s ({'; '.join(what)})")
        self._learn_migration(report, plan)
        self._continue_with(workload, plan, cost_model)

    def _start_replan(self, step: int, at: int) -> bool:
        """The re-plan of the change at ``step`` started beside the steps (``train.background``), for the tasks and
        the deployment the fleet runs now, its answer due at ``at`` and recorded in ``<queue>/.replan.json``
        (for a resume); False, and no re-plan, when the run ends before ``at`` (its answer would never apply)."""
        from lorafleet.train import live
        from lorafleet.train.background import BackgroundReplan
        from lorafleet.train.queue import PendingReplan, clear_pending_replan, save_pending_replan

        if at >= self._end():
            clear_pending_replan(self.options.queue_dir)
            return False
        save_pending_replan(self.options.queue_dir, PendingReplan(step, at))
        replan = partial(live.replan_change, self.options, self.workload, self.plan, at, self.migration, save=False)
        self.replanning = BackgroundReplan.start(step, at, replan)
        return True

    def _resume_replan(self, start: int) -> None:
        """A resumed run's re-plan that was under way (``<queue>/.replan.json``), run again and due at the same
        step (or this launch's first, when that has passed)."""
        from lorafleet.train import live
        from lorafleet.train.queue import load_pending_replan

        pending = load_pending_replan(self.options.queue_dir)
        if pending is not None and self._start_replan(pending.step, at := max(pending.at, start)):
            live.log(f"step {start}: the re-plan of step {pending.step} runs again beside the steps to step {at}")

    def _apply_replan(self, step: int) -> bool:
        """The re-plan's answer at its boundary ``step`` (waited for when not done): nothing when it keeps the
        deployment, else the move applied in the running fleet; False when the move needs processes the run does
        not have (the workers stop at a committed checkpoint, and the launcher re-plans and relaunches them)."""
        from lorafleet.train import live
        from lorafleet.train.queue import Pending, clear_pending_replan, save_pending

        running, self.replanning = self.replanning, None
        assert running is not None
        replan, waited = running.answer()
        wait = f" (waited {waited:.2g} s for it)" if waited >= 0.01 else ""
        live.log(f"step {step}: the re-plan of step {running.step}{wait}: {replan.describe()}")
        if replan.moved and replan.plan.world_size > self.executor.world_size:
            checkpoint = self._checkpoint(step, wait=True)
            save_pending(self.options.queue_dir, Pending(step, [], self._turns()))  # the launcher re-plans
            return self._hand_to_launcher(step, replan.plan, checkpoint=checkpoint)
        if replan.moved:
            self._commit_plan(self.workload, replan.plan)
        clear_pending_replan(self.options.queue_dir)
        if replan.moved:
            self._apply_plan(step, self.workload, replan.plan)
        return True

    def _turns(self) -> dict[str, TaskTurns]:
        """The running tasks' turns, by name."""
        return dict(zip(self.names, self.executor.streams.turns, strict=True))

    def _hand_to_launcher(
        self, step: int, plan: DeploymentPlan, said: str = "", checkpoint: Path | None = None
    ) -> bool:
        """False, for the loop to stop: ``plan`` needs more processes than the run has, so the workers stop at the
        committed checkpoint of ``step`` and the launcher applies the pending changes (``live.apply_pending``);
        ``said``: what the log line starts with."""
        from lorafleet.train import live

        checkpoint = checkpoint or self._checkpoint(step, wait=True)
        live.log(
            f"step {step}: {said}it needs {plan.world_size} processes and the run has {self.executor.world_size}: "
            f"the workers restart to apply it (checkpoint {checkpoint.name})"
        )
        return False

    def _fleet_change(self, step: int, workload: Workload, plan: DeploymentPlan) -> FleetChange:
        """What the executor is told of the change at ``step``: the tasks (a new one's schedule as a launch would
        give it), their specs and turns (the ledger's), the plan, the stopped tasks that stay."""
        from lorafleet.executor.torch.change import FleetChange
        from lorafleet.executor.torch.launch import task_training
        from lorafleet.runtime.data_stream import task_batches

        running = {t.name: t for t in self.executor.config.tasks}
        specs = tuple(t.spec for t in workload.tasks)
        tasks = tuple(
            running.get(spec.name)
            or task_training(spec, task_batches(spec, self._added_data(spec)), self.options.steps)
            for spec in specs
        )
        stopped = {name: at for name, at in self.health.stopped.items() if name in running}
        return FleetChange(
            step=step,
            tasks=tasks,
            specs=specs,
            plan=plan,
            turn_changes=self.ledger.turn_changes(),
            departed=self.ledger.departed(),
            stopped=stopped,
        )

    def _added_data(self, spec: TaskSpec) -> TaskData:
        """A joining task's data, as the queue's check tokenized it (else tokenized now); kept for the executor."""
        from lorafleet.runtime.data_stream import prepare_task_data

        if spec.name not in self.added:
            self.added[spec.name] = prepare_task_data(spec, self.tokenizer, spec.data.path if spec.data else "queue")
        return self.added[spec.name]

    def _learn_migration(self, report: ChangeReport, plan: DeploymentPlan) -> None:
        """A move's measured phases price the next one: its stage builds give the load rate (the largest stage
        built over the slowest rank's build), the rest of its time the fixed part (``MigrationModel``)."""
        if not report.rebuilt:
            return
        n_params = self.workload.model.n_params
        built = [r for r in plan.replicas if set(r.gpus) & set(report.rebuilt)]
        largest = max(n_params * self.migration.dtype_bytes / r.config.n_gpus for r in built)
        stage = report.phases["stage"]
        self.migration = replace(
            self.migration,
            fixed_s=max(report.seconds - stage, 0.0),
            load_bytes_per_s=largest / stage if stage > 0 else self.migration.load_bytes_per_s,
        )

    def _continue_with(self, workload: Workload, plan: DeploymentPlan, cost_model: CostModel | None = None) -> None:
        """Rank 0's loop state after a change: the tasks, the plan and its cost model (as a launch would build
        them, unless given), the recalibration of the replicas that stay, the health watch and the queue's view of
        the tasks."""
        from lorafleet.assemble import plan_cost_model
        from lorafleet.train.live import cluster_of

        old = {(r.config, r.gpus): r.replica_id for r in self.plan.replicas}
        if list(old) != [(r.config, r.gpus) for r in plan.replicas]:
            # A replica that stays keeps what it measured; a new one is priced at its pool's scale until it
            # reports (``Recalibrator.moved``).
            self.recalibrator = self.recalibrator.moved(plan, [old.get((r.config, r.gpus)) for r in plan.replicas])
        if cost_model is None:
            cost_model, _ = plan_cost_model(workload, cluster_of(plan), plan, self.options.plan, self.options.profile)
        self.cost_model, self.plan, self.workload = cost_model, plan, workload
        self.names = [t.spec.name for t in workload.tasks]
        pipelined = any(r.config.pp > 1 for r in plan.replicas)
        self.window = plan.policy.pipeline_window if pipelined else 1
        self.health.retask(self.names)
        if self.watcher is not None:
            self.watcher.ledger = self.ledger

    def _finish(self, reached: int, ran: bool) -> int:
        """The run's end after ``reached`` steps (``ran``: some of them in this launch): a final checkpoint
        (waited for), its PEFT adapters exported to ``<out>/adapters``, and the summary. A re-plan due after the
        last step is never applied."""
        from lorafleet.metrics import last_losses
        from lorafleet.runtime.checkpoint_files import export_adapters
        from lorafleet.train.queue import clear_pending_replan
        from lorafleet.train.queue.ledger import revision_lines

        final = self._checkpoint(reached, wait=True)
        clear_pending_replan(self.options.queue_dir)
        export_adapters(
            final,
            self.names,
            self.run_dir.adapters,
            tasks=self.workload.spec.tasks,
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
        from lorafleet.runtime.checkpoint_files import save_tokenizer

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
        """Queued requests due before step ``reached`` that the running fleet cannot apply (:meth:`_change` left
        them in ``.apply.json``, after the checkpoint): the workers stop, and the launcher applies them
        (``train.live.apply_pending``) and starts them again from this checkpoint."""
        self.executor.close()
        return 0

    def _all_left(self, reached: int) -> int:
        """Every task has left the run at the boundary before ``reached`` (its adapters exported)."""
        self.executor.close()
        print(f"lorafleet train: every task has left the run at step {reached}", flush=True)
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


def finished_tasks(
    streams: DataStreams, step: int, run_steps: int, now: bool = False
) -> tuple[list[Request], int | None]:
    """Tasks that took their last batch before ``step`` (their ``steps`` or ``epochs``) while the run goes on and
    whose departure is due there (``turns.departures``: ``now``, other changes are applied at this boundary):
    finished, as if asked through the queue, so their adapters are exported and their slots freed; and the next
    step a departure is to be looked at (None: no task is done within twice the departure window: the turns are
    drawn that far ahead only, so their cost grows with the steps run, not the run's ``run_steps``)."""
    from lorafleet.train.queue import Action, Request
    from lorafleet.turns import DEPARTURE_WINDOW, departures

    names = [s.data.name for s in streams.streams]
    horizon = min(run_steps, step + 2 * DEPARTURE_WINDOW)
    ends = {names[t]: end for t, end in streams.end_steps(horizon).items()}
    done, boundary = departures(ends, step, now)
    return [Request(TOOK_ITS_STEPS, Action.FINISH, name) for name in done], boundary


TOOK_ITS_STEPS = "(took its steps)"
"""The request file of a task that finished on its own (no file)."""

RELAUNCH_ENV = "LORAFLEET_RELAUNCH_CHANGES"
"""When set, every queued change is applied by stopping the workers and launching them again from the
boundary's checkpoint (``train.live.apply_pending``): the fallback's path, and the way before changes were
applied in the running fleet, which ``benchmarks/bench_queue.py`` measures against."""


def _queue_watcher(trainer: Trainer, options: TrainOptions, prepared: Prepared, tokenizer: Any) -> QueueWatcher | None:
    """The queue's watcher, under ``lorafleet train``'s own launcher only (which applies what the running fleet
    cannot): a task to add is checked against the workload's defaults, its data tokenized as training will (and
    kept for when it joins) and its sequences held to the configs of the run's GPUs."""
    from lorafleet.runtime.data_stream import prepare_task_data
    from lorafleet.runtime.processes import LOCKED_ENV
    from lorafleet.train.live import check_placeable
    from lorafleet.train.queue import QueueWatcher

    if not os.environ.get(LOCKED_ENV):
        return None

    def check(task: TaskSpec) -> None:
        data = prepare_task_data(task, tokenizer, task.data.path if task.data else "queue")
        check_placeable(task, trainer.workload, trainer.plan, trainer.cost_model)
        trainer.added[task.name] = data

    defaults = prepared.workload.spec.defaults
    return QueueWatcher(options.queue_dir, defaults, trainer.ledger, check=check, data_roots=options.queue_data_roots)


def _start_migration(executor: TorchExecutor, plan: DeploymentPlan, workload: Workload, dtype: str) -> MigrationModel:
    """The price of a move before the run has made one: the defaults' fixed part, and the load rate of rank 0's
    own stage as this launch built it (its base weights' bytes over the seconds it took)."""
    from lorafleet.executor.torch.precision import Precision
    from lorafleet.planner import MigrationModel

    model = MigrationModel(dtype_bytes=Precision(dtype).bytes)
    role = executor.replica.role
    if role is None or executor.stage_build_s <= 0:
        return model
    stage_bytes = workload.model.n_params * model.dtype_bytes / (role.replica.tp * role.replica.pp)
    return replace(model, load_bytes_per_s=stage_bytes / executor.stage_build_s)
