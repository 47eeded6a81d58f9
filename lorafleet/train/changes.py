"""Rank 0's fleet changes: one component owns every change of the running fleet's tasks or deployment.

It owns the queue's watcher and the requests due at a boundary, the departures of tasks that took their steps,
the task ledger, the data of the tasks the queue accepted (tokenized once, when checked), the price of a move
(``planner.incremental.MigrationModel``, learnt from each move) and the re-plan running beside the steps
(``train.background``). The trainer asks it two things (``train.trainer``):

- at every window boundary, :meth:`FleetChanges.due`: whether the loop must stop there (requests due, a task
  done, a re-plan's answer due), and :meth:`FleetChanges.next_boundary`, the next step a window must end at;
- at a boundary where it stopped, :meth:`FleetChanges.at_boundary`: the :class:`Running` fleet from there on,
  or a :class:`Stop` (the launcher applies what the workers cannot; no task is left), or None (nothing was
  due: the run ends).

What a change does (keep the deployment, re-plan beside the next steps, move, hand to the launcher) is the
pure rule of ``planner.decision``, which ``simulate --arrivals`` shares. How a boundary's requests are written
(checkpoint, ``.apply.json``, the ledger, the exports, the plan, ``.apply.json`` removed) is ``train.live``'s
module doc; the component follows that order, then has the fleet apply the change in its processes (a
:class:`FleetPort`: rank 0's executor, or a fake in tests) and appends a row to ``<out>/changes.jsonl``
(``train.change_log``). No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from lorafleet.planner.decision import HandOff, Keep, Move, ReplanNow, decide
from lorafleet.planner.decision import settle as after_replan
from lorafleet.planner.incremental import kept_plan
from lorafleet.runtime.processes import fault_point
from lorafleet.train import inflight
from lorafleet.train.background import BesideSteps
from lorafleet.train.change_costs import fleet_cost_model, handed_off, learnt_migration
from lorafleet.train.change_log import (
    TOOK_ITS_STEPS,
    ChangeKind,
    ChangeRecord,
    Outcome,
    append_change,
    read_changes,
    request_rows,
    truncate_changes,
)
from lorafleet.train.inflight import InFlight, Settling
from lorafleet.train.joining import Joining
from lorafleet.train.live import LEAVING, changed_workload, export_leaving, log, replan_change
from lorafleet.train.options import TrainOptions
from lorafleet.train.queue import (
    Action,
    FleetState,
    Ledger,
    Pending,
    QueueWatcher,
    Request,
    clear_pending,
    clear_pending_replan,
    load_pending_replan,
)
from lorafleet.train.running import AppliedChange, FleetPort, Running, Stop
from lorafleet.workload import Workload

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.planner import MigrationModel, Replan
    from lorafleet.plans import DeploymentPlan
    from lorafleet.runtime.data_stream import TaskData
    from lorafleet.specs.workload import TaskSpec

RELAUNCH_ENV = "LORAFLEET_RELAUNCH_CHANGES"
"""When set, every queued change is applied by stopping the workers and launching them again from the
boundary's checkpoint (``train.live.apply_pending``): the fallback's path, and the way before changes were
applied in the running fleet, which ``benchmarks/bench_queue.py`` measures against."""


class FleetChanges:
    """Rank 0's fleet changes (module doc)."""

    def __init__(
        self,
        options: TrainOptions,
        defaults: Mapping[str, Any],
        ledger: Ledger,
        fleet: FleetPort,
        tokenizer: Any,
        migration: MigrationModel,
        watch: bool = True,
    ) -> None:
        """``defaults``: the workload's (a queued task's); ``ledger``: the run's; ``migration``: the price of a move
        before the run has made one; ``watch``: read the queue (not under a user's own torchrun, where no launcher
        applies what the workers cannot)."""
        self.options, self.fleet, self.tokenizer, self.migration = options, fleet, tokenizer, migration
        self.ledger = ledger
        """The ledger as the changes applied in this process left it (written when each settles)."""
        self.joining = Joining(tokenizer)
        """The data of the tasks the queue accepted, prepared beside the steps until they join (``train.joining``)."""
        self.running: Running | None = None
        """The fleet the queue's checks judge a task against (the trainer's, set at every boundary)."""
        self.watcher = None
        if watch:
            self.watcher = QueueWatcher(
                options.queue_dir, defaults, ledger, check=self._check, data_roots=options.queue_data_roots,
                taken=fleet.batches_taken,
            )  # fmt: skip
        self.requests: list[Request] = []
        """Requests due at the boundary the loop stopped at, departures included."""
        self.departure: int | None = None
        """The next step a task is done at, or the end of the departures it waits for (``turns.departures``)."""
        self.replan = BesideSteps(options.queue_dir)
        """The last change's re-plan, running beside the steps until its boundary (``train.background``)."""
        self.flight = InFlight(options, fleet)
        """The change in flight (``train.inflight``)."""
        self.early: dict[str, tuple[int, str]] = {}
        """Tasks early stopping or their sweep's rung stops (``train.evaluation``), by name: the boundary they leave
        at, and why, as its change record names it (``STOPPED_EARLY``, ``SWEEP_DROPPED``)."""
        self.handled: int | None = None
        """The boundary handled last (:meth:`at_boundary`): it read the queue once, when the loop reached it, so a
        request that arrives while its change is applied (a checkpoint, a re-plan waited for, a rebuild) is read at
        the next window boundary, after a step on the changed fleet: one change a boundary, as a checkpoint's
        ``fleet_changed_at`` names it (``train.inflight``)."""

    # -- at every window boundary ---------------------------------------------------------------------------

    def due(self, step: int, running: Running) -> bool:
        """Whether the loop stops at the boundary before ``step``: a change found in flight due there, requests due,
        tasks done whose departure is due (``turns.departures``: at once when other changes are applied here), or a
        re-plan's answer due. A change waiting to settle settles here once its checkpoint has committed."""
        self.running = running
        self.flight.settle_committed()
        if self.flight.redo is not None:
            return self.flight.redo.step == step
        if step == self.handled:
            return False  # its queue was read when the loop reached it: what came since waits for the next boundary
        self.early = {n: left for n, left in self.early.items() if n in running.names}  # those that left are gone
        early = [n for n, (at, _) in self.early.items() if at <= step]
        if self.watcher is None and early:
            return True  # retired there (at_boundary): no launcher exports a leaving task
        if self.watcher is not None:
            watcher = self.watcher
            reject = lambda r, why: watcher.reject(self.options.queue_dir / r.file, why)  # noqa: E731
            self.requests = self.joining.ready_requests(watcher.poll(step, accept=False), step, reject)
            named = {r.name for r in self.requests}
            self.requests += [Request(self.early[n][1], Action.FINISH, n) for n in early if n not in named]
            if step < self.options.steps:
                done, self.departure = departures_due(self.fleet, step, self.options.steps, bool(self.requests))
                named = {r.name for r in self.requests}
                self.requests += [r for r in done if r.name not in named]
        return bool(self.requests) or self.replan.due(step, self.fleet.end())

    def stop_early(self, stops: Mapping[str, tuple[int, str]]) -> None:
        """Tasks early stopping stops, by name: the boundary each leaves the run at, as if a queued finish asked (its
        best adapter exported, its slot freed, its capacity re-planned: a departure, ``changes.jsonl``); without a
        launcher watching the queue, it takes no batch from there on instead."""
        self.early.update(stops)

    def next_boundary(self) -> int | None:
        """A step a window must end at: a change found in flight's, a queued request's ``at_step``, a departure's, an
        early stop's, or a re-plan answer's."""
        if self.flight.redo is not None:
            return self.flight.redo.step
        early = (at for at, _ in self.early.values())
        due = [self.watcher.next_due() if self.watcher else None, self.departure, self.replan.at, *early]
        return min((s for s in due if s is not None), default=None)

    def checkpoint_extra(self) -> dict[str, int]:
        """What a checkpoint records of the changes (``InFlight.checkpoint_extra``)."""
        return self.flight.checkpoint_extra()

    # -- where the loop stopped -----------------------------------------------------------------------------

    def at_boundary(self, step: int, running: Running) -> Running | Stop | None:
        """The fleet from the boundary before ``step`` on (module doc): a change found in flight done again, requests
        due applied (superseding a re-plan answer due here), else a re-plan's answer; None when nothing was due."""
        self.handled = step
        redo = self.flight.take_redo(step)
        if redo is not None:
            return self._change(step, running, redo.requests, redo)
        if self.watcher is None and any(at <= step for at, _ in self.early.values()):
            for name in [n for n, (at, _) in self.early.items() if at <= step]:
                self.fleet.retire(name, self.early.pop(name)[0])
                log(f"step {step}: {name} stopped early: it takes no more batches")
            return running
        if self.requests:
            requests, self.requests = self.requests, []
            return self._change(step, running, requests)
        if self.replan.due(step, self.fleet.end()):
            return self._answer(step, running)
        return None

    def resume(self, start: int, running: Running) -> None:
        """A start of the run at step ``start``: its change records after it dropped (those steps are replayed); a
        change found in flight (``resume.change_in_flight``) settled when the checkpoint was taken after it, else
        done again at its step; and the re-plan that was under way (``.replan.json``) run again, due at the same
        step (or the first boundary it can apply at, when that passed). A boundary ``start`` that has a change record
        was handled before the start (a change settled, or applied by the launcher before it started the workers
        again): its queue is not read again (``handled``)."""
        from lorafleet.train.resume import change_in_flight

        truncate_changes(self.options.run_dir.changes, start)
        pending, after = change_in_flight(self.options, start)
        if pending is not None and self.watcher is not None:
            self.watcher.accept(pending.requests)  # what a crash left in the queue directory
        if pending is not None:
            if Ledger.load(self.options.out) is None:  # the trainer's came from the fleet it built: after the change
                from lorafleet.specs.workload import TaskSpec

                self.ledger = Ledger.of([TaskSpec.model_validate(t) for t in pending.before.workload["tasks"]])
            ledger = self.ledger.apply(pending.requests, pending.step, pending.turns)
            kind, plan = ChangeKind.of(pending.requests), (pending.after or pending.before).plan.describe()
            self.flight.recovered(pending, after, ledger, ChangeRecord(pending.step, kind, Outcome.SETTLED,
                                                                       tuple(running.names), plan))  # fmt: skip
            if after:
                self._take_ledger(ledger)
            done = "applied before the restart, settled" if after else "is done again at its step"
            log(f"step {start}: the change of step {pending.step} {done}")
        self.handled = start if any(r.step == start for r in read_changes(self.options.run_dir.changes)) else None
        replan = load_pending_replan(self.options.queue_dir)
        redo = self.flight.redo
        if replan is not None and redo is not None and replan.step <= redo.step:
            clear_pending_replan(self.options.queue_dir)  # superseded or answered by the change done again, or its own
            replan = None
        first = start + (self.handled == start)  # the first boundary whose stop may apply an answer
        if replan is not None and self._start_replan(replan.step, at := max(replan.at, first), running):
            log(f"step {start}: the re-plan of step {replan.step} runs again beside the steps to step {at}")

    def committed(self) -> None:
        """A checkpoint of the fleet has committed (waited for: a stop's): the change waiting for one settles."""
        self.flight.settle_committed(wait=True)

    def finish(self) -> None:
        """The run ends (its last checkpoint committed): the change waiting to settle settles, and a re-plan due
        after the last step is never applied."""
        self.committed()
        clear_pending_replan(self.options.queue_dir)
        self.joining.close()

    # -- a change of the tasks ------------------------------------------------------------------------------

    def _change(
        self, step: int, running: Running, requests: list[Request], redo: Pending | None = None
    ) -> Running | Stop:
        """``requests`` applied at the boundary before ``step`` as a transaction (``train.inflight``): a checkpoint
        when a task leaves, the change begun, decided (``planner.decision``; a change done again takes the fleet
        it recorded), the leaving tasks exported, the fleet changed in its processes, a checkpoint of it started;
        it settles once that has committed. ``redo``: the change found in flight, done again."""
        self.flight.settle_before(step)  # one change in flight at a time
        fault_point("accepted", step)
        turns = redo.turns if redo is not None else self.fleet.turns()
        tasks_change = any(r.action is not Action.UPDATE for r in requests)
        relaunch = bool(os.environ.get(RELAUNCH_ENV))
        leaving = [r.name for r in requests if r.action in LEAVING]
        checkpoint = self.fleet.checkpoint(step, wait=True) if leaving or relaunch else None
        before = FleetState.of_ledger(running.plan, running.workload, self.ledger)
        pending = redo or inflight.begin(self.options, step, requests, turns, before)
        fault_point("begun", step)
        if self.watcher is not None:
            self.watcher.accept(requests)
        committed = f" (checkpoint {checkpoint.name})" if checkpoint is not None else ""
        log(f"step {step}: {', '.join(f'{r.action.value} {r.name}' for r in requests)}{committed}")
        ledger = self.ledger.apply(requests, step, turns)
        row = partial(ChangeRecord, step, ChangeKind.of(requests), requests=request_rows(requests))
        if relaunch:
            inflight.to_launcher(self.options, pending)
            log(f"step {step}: {RELAUNCH_ENV} is set: the workers restart to apply the changes")
            return Stop.HANDED_OFF
        superseded = self.replan.supersede()
        if not ledger.active:  # the run ends here: its ledger says so, and nothing is left to build a fleet from
            export_leaving(self.options, step, leaving, running.workload.spec.tasks, running.workload.spec.model)
            ledger.save(self.options.out)
            clear_pending(self.options.queue_dir)
            self._append(row(Outcome.ALL_LEFT, (), running.plan.describe()))
            log(f"step {step}: no task is left to train")
            return Stop.ALL_LEFT
        workload = self._workload(running.workload, ledger.active)
        cost_model = fleet_cost_model(self.options, workload, running.plan)
        names = tuple(t.name for t in workload.tasks)
        moves = tasks_change or superseded
        answer = None
        if redo is not None and redo.after is not None:  # decided before the restart: taken as recorded
            decision = inflight.recorded_decision(redo, running.plan)
        else:
            decision = decide(step, moves, partial(kept_plan, running.plan, workload, cost_model),
                              replace(running.plan, tasks=names), self.options.replan.after)  # fmt: skip
        if isinstance(decision, ReplanNow):
            answer = replan_change(self.options, workload, running.plan, step, self.migration, cost_model, save=False)
            decision = after_replan(answer, self.fleet.world_size)
        replan_at = decision.replan_at if isinstance(decision, Keep) else None
        after_state = FleetState.of_ledger(decision.plan, workload, ledger)
        pending = inflight.decided(self.options, pending, after_state, isinstance(decision, HandOff), replan_at)
        fault_point("decided", step)
        note = answer.describe() if answer else ""
        if isinstance(decision, HandOff):
            checkpoint = checkpoint or self.fleet.checkpoint(step, wait=True)
            log(handed_off(step, decision.plan, self.fleet.world_size, checkpoint, f"{note}; "))
            self._append(row(Outcome.HANDED_OFF, names, decision.plan.describe(), note=note))
            return Stop.HANDED_OFF
        export_leaving(self.options, step, leaving, running.workload.spec.tasks, running.workload.spec.model)
        fault_point("exported", step)
        if note:
            log(f"step {step}: {note}")
        self._take_ledger(ledger)  # the turns the fleet changes to are its (written when the change settles)
        after, applied = self._apply(step, running, workload, decision.plan, cost_model)
        fault_point("applied", step)
        outcome = Outcome.MOVED if isinstance(decision, Move) else Outcome.KEPT
        if replan_at is not None and self._start_replan(step, replan_at, after):
            log(f"step {step}: kept {decision.plan.describe()} for now; the re-plan runs beside the steps to step "
                f"{replan_at}")  # fmt: skip
            outcome = Outcome.KEPT_REPLANNING
        elif replan_at is not None:
            log(f"step {step}: kept {decision.plan.describe()}: the run ends before step {replan_at}, where a move "
                "would apply")  # fmt: skip
            replan_at = None
        done = row(outcome, names, decision.plan.describe(), seconds=applied.seconds, rebuilt=tuple(applied.rebuilt),
                   replan_at=replan_at, note=note, extra=dict(applied.phases))  # fmt: skip
        self.flight.applied(Settling(pending, ledger, done), now=not moves and not isinstance(decision, Move))
        if tasks_change and checkpoint is None:  # a join's: the state with the new task, written beside the steps
            self.fleet.checkpoint(step)
            fault_point("checkpointed", step)
        return after

    def _take_ledger(self, ledger: Ledger) -> None:
        """The ledger with a change's requests, for the changes and the queue's checks that follow."""
        self.ledger = ledger
        if self.watcher is not None:
            self.watcher.ledger = ledger

    def _check(self, task: TaskSpec) -> None:
        """The queue's check of a task to add (``QueueWatcher``'s ``check``): its data prepared beside the steps
        (``train.joining``); a problem with it rejects the request when found."""
        assert self.running is not None
        self.joining.start(task, self.running)

    def _workload(self, workload: Workload, tasks: Sequence[TaskSpec]) -> Workload:
        """``workload`` with the ledger's active ``tasks``; a joining task's lengths read from its data, tokenized
        once, beside the steps."""
        return changed_workload(workload, tasks, self.joining.lengths())

    def _apply(
        self, step: int, running: Running, workload: Workload, plan: DeploymentPlan, cost_model: CostModel
    ) -> tuple[Running, AppliedChange]:
        """The fleet changed in its processes to ``workload``'s tasks on ``plan`` (``cost_model``: the one built for
        the running deployment, kept when ``plan`` has as many replicas: a cost model prices the gradient sync over
        the plan's replicas), the move's price learnt, the running fleet after it."""
        added = {t.name: self._joining_data(t.spec) for t in workload.tasks if t.name not in running.names}
        applied = self.fleet.apply(step, workload, plan, self.ledger, added)
        rebuilt = ", ".join(map(str, applied.rebuilt))
        what = [f"ranks {rebuilt} built their stages" if applied.rebuilt else "every stage kept"]
        what += [f"{name} {seconds:.2g} s" for name, seconds in applied.phases.items() if seconds >= 0.01]
        log(f"step {step}: applied in the running fleet in {applied.seconds:.3g} s ({'; '.join(what)})")
        self.migration = learnt_migration(self.migration, applied, plan, workload)
        if len(plan.replicas) != len(running.plan.replicas):
            cost_model = fleet_cost_model(self.options, workload, plan)
        return running.after(workload, plan, cost_model), applied

    def _joining_data(self, task: TaskSpec) -> TaskData:
        """A joining task's data, as it was prepared beside the steps (else, a change done again after a restart,
        tokenized now)."""
        from lorafleet.runtime.data_stream import prepare_task_data

        data = self.joining.take(task.name)
        return data or prepare_task_data(task, self.tokenizer, task.data.path if task.data else "queue")

    # -- the re-plan beside the steps -----------------------------------------------------------------------

    def _start_replan(self, step: int, at: int, running: Running) -> bool:
        """The re-plan of the change at ``step`` started beside the steps (``train.background``), for the tasks and
        deployment of ``running``, its answer due at ``at``; False, and no re-plan, when the run ends before ``at``."""
        replan: Callable[[], Replan] = partial(
            replan_change, self.options, running.workload, running.plan, at, self.migration, running.cost_model,
            save=False,
        )  # fmt: skip
        return self.replan.start(step, at, self.fleet.end(), replan)

    def _answer(self, step: int, running: Running) -> Running | Stop:
        """The re-plan's answer at its boundary ``step`` (waited for when not done): the running fleet when it keeps
        the deployment, else the move applied in the running fleet as a change with no request (a transaction:
        ``train.inflight``), or handed to the launcher when it needs processes the run does not have."""
        self.flight.settle_before(step)
        replanning = self.replan.take()
        answer, waited = replanning.answer()
        wait = f" (waited {waited:.2g} s for it)" if waited >= 0.01 else ""
        log(f"step {step}: the re-plan of step {replanning.step}{wait}: {answer.describe()}")
        decision = after_replan(answer, self.fleet.world_size)
        row = partial(
            ChangeRecord, step, ChangeKind.REPLAN, tasks=tuple(running.names), plan=decision.plan.describe(),
            replanned_for=replanning.step, waited_s=waited, note=answer.describe(),
        )  # fmt: skip
        if isinstance(decision, Keep):
            clear_pending_replan(self.options.queue_dir)
            self._append(row(outcome=Outcome.KEPT))
            return running
        before = FleetState.of_ledger(running.plan, running.workload, self.ledger)
        pending = inflight.begin(self.options, step, [], self.fleet.turns(), before)
        after_state = FleetState.of_ledger(decision.plan, running.workload, self.ledger)
        pending = inflight.decided(self.options, pending, after_state, isinstance(decision, HandOff))
        fault_point("decided", step)
        clear_pending_replan(self.options.queue_dir)  # its answer is recorded with the change
        if isinstance(decision, HandOff):
            log(handed_off(step, decision.plan, self.fleet.world_size, self.fleet.checkpoint(step, wait=True)))
            self._append(row(outcome=Outcome.HANDED_OFF))
            return Stop.HANDED_OFF
        after, applied = self._apply(step, running, running.workload, decision.plan, running.cost_model)
        fault_point("applied", step)
        moved = row(outcome=Outcome.MOVED, seconds=applied.seconds, rebuilt=tuple(applied.rebuilt),
                    extra=dict(applied.phases))  # fmt: skip
        self.flight.applied(Settling(pending, self.ledger, moved), now=False)
        return after

    def _append(self, record: ChangeRecord) -> None:
        append_change(self.options.run_dir.changes, record)


def departures_due(fleet: FleetPort, step: int, steps: int, now: bool) -> tuple[list[Request], int | None]:
    """Tasks that took their last batch before ``step`` (their ``steps`` or ``epochs``) while the run of ``steps``
    goes on and whose departure is due there (``turns.departures``; ``now``: other changes are applied at this
    boundary): finished, as if asked through the queue, so their adapters are exported and their slots freed; and
    the next step a departure is to be looked at (None: no task is done within twice the departure window: the
    turns are drawn that far ahead only, so their cost grows with the steps run, not the run's)."""
    from lorafleet.turns import DEPARTURE_WINDOW, departures

    done, boundary = departures(fleet.end_steps(min(steps, step + 2 * DEPARTURE_WINDOW)), step, now)
    return [Request(TOOK_ITS_STEPS, Action.FINISH, name) for name in done], boundary
