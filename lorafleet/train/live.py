"""The steps of applying a boundary's requests that the running fleet (``train.changes``) and the launcher share:
the re-plan, the leaving tasks' exports, the tasks' workload; and the launcher's own part, applying a change the
running processes could not. No torch here.

A running fleet applies a change itself, in its processes, as a transaction (``train.inflight``: its order, its
files and their invariants, docs/queue.md). What it shares with the launcher:

- the workload of the new task set (:func:`changed_workload`: a task that stays keeps its resolved lengths, a new
  one's are resolved once, from its tokenized data when the queue's check has it);
- each task that leaves has its PEFT adapter copied out of the checkpoint of the boundary ``S`` (committed before
  the change began: the fleet's state there) into ``<out>/adapters/<task>`` (:func:`export_leaving`);
- the incremental re-plan, when ``planner.decision`` says so, at the boundary or beside the next steps
  (:func:`replan_change`: ``planner.incremental``, by the run's cost model, under its dispatch policy and what the
  plan was planned for, by ``--replan-objective``, a move priced by what the in-process rebuild costs, measured).

When the new plan needs processes the run does not have (it places replicas on GPUs the old plan left idle,
beyond the ranks torchrun started), or ``LORAFLEET_RELAUNCH_CHANGES`` asks it, the workers stop at the committed
checkpoint of ``S`` with the change recorded for the launcher (``Pending.handoff``), and :func:`apply_pending`, in the
launcher, applies it between two launches: the ledger takes the requests (each once: ``Ledger.apply``), the leaving
tasks are exported, the plan is the one the workers decided (or, when they decided none, an incremental re-plan),
``.apply.json`` is removed and a ``relaunched`` row appended; then the workers start again from that checkpoint.

Each task's semantics are untouched by all this: its stream, initial adapter and updates depend on the
task alone (``runtime.data_stream.task_key``), so a task that stays trains exactly as it would have without the
change, and an added one as it would alone from its start step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from lorafleet.train.change_log import ChangeKind, ChangeRecord, Outcome, append_change, request_rows
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import Prepared, check_data, prepare
from lorafleet.train.queue import Action, Ledger, clear_pending, clear_pending_replan, launcher_pending
from lorafleet.train.resume import load_training_workload
from lorafleet.workload import Workload

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.planner import MigrationModel, PlannerOptions, Replan
    from lorafleet.plans import DeploymentPlan
    from lorafleet.specs.workload import TaskSpec

LEAVING = (Action.FINISH, Action.CANCEL)


@dataclass(frozen=True)
class Applied:
    """What applying the pending requests left."""

    prepared: Prepared | None
    """The run to relaunch (resuming from the checkpoint); None when no task is left to train."""
    step: int


def log(line: str) -> None:
    print(f"lorafleet train: queue: {line}", flush=True)


def changed_workload(
    workload: Workload, tasks: Sequence[TaskSpec], known: Mapping[str, Mapping[int, int]] | None = None
) -> Workload:
    """``workload`` with ``tasks`` (the ledger's active ones) as its tasks: each task it has keeps its resolved
    lengths (its spec is the ledger's: a share may have changed), and only the new ones are resolved, a task in
    ``known`` (task -> its rows' token-length histogram, as the queue's check tokenized them) without reading its
    data again."""
    from lorafleet.workload import resolve_workload

    have = {t.spec.name: t for t in workload.tasks}
    new = tuple(t for t in tasks if t.name not in have)
    spec = workload.spec.model_copy(update={"tasks": new}) if new else None
    resolved = {t.spec.name: t for t in resolve_workload(spec, workload.path, known).tasks} if spec else {}
    out = tuple(replace(have[t.name], spec=t) if t.name in have else resolved[t.name] for t in tasks)
    return replace(workload, spec=workload.spec.model_copy(update={"tasks": tuple(tasks)}), tasks=out)


def replan_change(
    options: TrainOptions,
    workload: Workload,
    old: DeploymentPlan,
    step: int,
    migration: MigrationModel | None = None,
    cost_model: CostModel | None = None,
    *,
    save: bool,
) -> Replan:
    """The incremental re-plan of the run after the changes of boundary ``step`` (module doc, step 3): for
    ``workload``'s tasks on the GPUs of ``old``, by ``old``'s cost model (``cost_model``, when built already)
    and policy, by the run's objective and horizon, a move priced by ``migration`` (measured; ``--migration-s``
    overrides it); with ``save``, the plan is written as the run's ``plan.json``."""
    from lorafleet.planner import ReplanOptions, replan_incremental
    from lorafleet.train.replan import replan_run

    replan = ReplanOptions(options.replan) if migration is None else ReplanOptions(options.replan, migration)
    cluster = old.fleet()

    def incremental(judged_by: CostModel, planner: PlannerOptions) -> Replan:
        return replan_incremental(old, workload, cluster, judged_by, planner, replan, options.steps - step)

    return replan_run(workload, cluster, old, old.policy, options, incremental, save=save, cost_model=cost_model)[1]


def export_leaving(
    options: TrainOptions, step: int, leaving: Sequence[str], tasks: Sequence[TaskSpec], model: str | None = None
) -> None:
    """Step 2 of the module doc: the adapters of the tasks ``leaving`` at ``step`` exported from the checkpoint of
    ``step`` (committed before the change began) into ``<out>/adapters/``, each replaced whole (done again after a
    restart, the same export). ``tasks``: the specs of the tasks before the change (for the cards); ``model``: the
    workload's (the cards say what its weights were: ``data.model_source.base_weights_note``)."""
    from lorafleet.data.model_source import base_weights_note
    from lorafleet.metrics import last_losses
    from lorafleet.runtime.checkpoint_files import export_adapters, step_dir_name
    from lorafleet.train.queue.ledger import revision_lines

    if not leaving:
        return
    run_dir = options.run_dir
    export_adapters(
        run_dir.checkpoints / step_dir_name(step),
        list(leaving),
        run_dir.adapters,
        tasks=tasks,
        tokenizer=run_dir.tokenizer,
        losses=last_losses(run_dir.metrics_jsonl),
        changes=revision_lines(options.out),
        base_weights=base_weights_note(model) if model is not None else None,
    )
    log(f"step {step}: exported {', '.join(leaving)} to {run_dir.adapters}")


def apply_pending(options: TrainOptions, prepared: Prepared) -> Applied | None:
    """Apply the change recorded for the launcher (``<queue>/.apply.json``, ``Pending.for_launcher``) between two
    launches (module doc); None when there is none (a change the workers recorded for themselves they finish on
    their next start: ``train.inflight``)."""
    pending = launcher_pending(options.queue_dir)
    if pending is None:
        return None
    step = pending.step
    ledger = Ledger.load(options.out) or Ledger.of(prepared.workload.spec.tasks)
    ledger = ledger.apply(pending.requests, step, pending.turns)
    leaving = [r.name for r in pending.requests if r.action in LEAVING]
    export_leaving(options, step, leaving, prepared.workload.spec.tasks)
    ledger.save(options.out)
    clear_pending_replan(options.queue_dir)  # a re-plan under way in the workers: this one supersedes it
    row = partial(ChangeRecord, step, ChangeKind.of(pending.requests), requests=request_rows(pending.requests))
    if not ledger.active:
        clear_pending(options.queue_dir)
        log(f"step {step}: no task is left to train")
        append_change(options.run_dir.changes, row(Outcome.ALL_LEFT, (), prepared.run.plan.describe()))
        return Applied(None, step)
    workload = load_training_workload(options.workload, options.out, options.sets)
    plan_path = options.run_dir.plan
    if pending.after is not None and pending.after.plan.tasks == tuple(t.name for t in workload.tasks):
        plan, note = pending.after.plan, f"the plan the workers decided: {pending.after.plan.describe()}"
        plan.save(plan_path)
    else:
        replan = replan_change(options, workload, prepared.run.plan, step, save=True)
        plan, note = replan.plan, replan.describe()
    log(f"step {step}: {note}")
    clear_pending(options.queue_dir)
    tasks = tuple(t.name for t in workload.tasks)
    append_change(options.run_dir.changes, row(Outcome.RELAUNCHED, tasks, plan.describe(), note=note))
    relaunch = replace(options, resume=True, overwrite=False, plan=str(plan_path))
    prepared = prepare(relaunch)
    check_data(relaunch, prepared)  # before any worker starts: one line, not a worker's traceback
    return Applied(prepared, step)
