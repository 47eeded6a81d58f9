"""Applying the queued requests a run stopped for (``train.queue``), between two launches of its workers.

The run's rank 0 checkpointed at the boundary before step ``S`` and left the accepted requests in
``<queue>/.apply.json``; :func:`apply_pending`, in ``lorafleet train``'s launcher, then

1. puts them in the task ledger (``<out>/tasks.json``): an added task starts at step ``S``, a finished
   or cancelled one leaves at ``S``, an update changes its share or deadline;
2. exports each task that left: its PEFT adapter out of checkpoint ``S`` into ``<out>/adapters/<task>``
   (its memory is freed with the workers that held it);
3. re-plans incrementally for the active tasks (``planner.incremental``: the running deployment is kept
   unless a new one saves more than its migration over the horizon), by the run's cost model and under
   its dispatch policy, and writes the plan the run continues on;
4. removes ``.apply.json``; the launcher restarts the workers, which resume from checkpoint ``S``.

A task to add that no config of the cluster can hold (its longest sequence is over every replica's
M) is rejected there, like a malformed file: one line, the file moved to ``rejected/``. The other
requests go ahead.

Each task's semantics are untouched by all this: its stream, initial adapter and updates depend on the
task alone (``data_stream.task_key``), so a task that stays trains exactly as it would have without the
change, and an added one as it would alone from its start step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lorafleet.specs.cluster import ClusterSpec
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import Prepared, check_data, load_training_workload, prepare
from lorafleet.train.queue import Action, Ledger, Request, clear_pending, load_pending

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.planner import PlannerOptions, Replan


@dataclass(frozen=True)
class Applied:
    """What applying the pending requests left."""

    prepared: Prepared | None
    """The run to relaunch (resuming from the checkpoint); None when no task is left to train."""
    step: int


def _log(line: str) -> None:
    print(f"lorafleet train: queue: {line}", flush=True)


def _cluster(prepared: Prepared) -> ClusterSpec:
    """The GPUs the running plan is for (the processes the run has: a re-plan keeps to them)."""
    plan = prepared.run.plan
    return plan.fleet()


def _unplaceable(requests: list[Request], prepared: Prepared) -> list[tuple[Request, str]]:
    """Tasks to add whose longest sequence fits no config of the cluster, with the reason."""
    from lorafleet.planner.candidates import valid_candidates
    from lorafleet.workload import resolve_workload

    cluster = _cluster(prepared)
    largest = max((c.max_tokens for c in valid_candidates(prepared.run.cost_model, cluster)), default=0)
    out = []
    for r in requests:
        if r.action is Action.ADD and r.task is not None:
            task = resolve_workload(prepared.workload.spec.model_copy(update={"tasks": (r.task,)}), r.file).tasks[0]
            if task.lengths.max_length > largest:
                out.append(
                    (
                        r,
                        f"its {task.lengths.max_length}-token sequences fit no config of {cluster.describe()} "
                        f"(at most {largest} tokens a micro-batch); lower context_length",
                    )
                )
    return out


def apply_pending(options: TrainOptions, prepared: Prepared) -> Applied | None:
    """Apply ``<queue>/.apply.json`` (module doc); None when there is none."""
    from lorafleet.executor.torch.checkpoint_files import export_adapters, step_dir_name
    from lorafleet.metrics import last_losses
    from lorafleet.planner import ReplanOptions, replan_incremental
    from lorafleet.train.queue import QueueWatcher
    from lorafleet.train.queue.ledger import revision_lines
    from lorafleet.train.replan import replan_run

    pending = load_pending(options.queue_dir)
    if pending is None:
        return None
    step, requests = pending.step, pending.requests
    queue = options.queue_dir
    run_dir = options.run_dir
    for request, reason in _unplaceable(requests, prepared):
        QueueWatcher(queue, {}, Ledger(()), log=_log).reject(queue / "accepted" / request.file, reason)
        requests = [r for r in requests if r is not request]
    ledger = Ledger.load(options.out) or Ledger.of(prepared.workload.spec.tasks)
    ledger = ledger.apply(requests, step, pending.turns)
    leaving = [r.name for r in requests if r.action in (Action.FINISH, Action.CANCEL)]
    if leaving:
        export_adapters(
            run_dir.checkpoints / step_dir_name(step),
            leaving,
            run_dir.adapters,
            tasks=prepared.workload.spec.tasks,
            tokenizer=run_dir.tokenizer,
            losses=last_losses(run_dir.metrics_jsonl),
            changes=revision_lines(options.out),
        )
        _log(f"step {step}: exported {', '.join(leaving)} to {run_dir.adapters}")
    ledger.save(options.out)
    if not ledger.active:
        clear_pending(queue)
        _log(f"step {step}: no task is left to train")
        return Applied(None, step)
    workload = load_training_workload(options.workload, options.out, options.sets)
    old = prepared.run.plan
    cluster = _cluster(prepared)
    replan = ReplanOptions(migration_s=options.migration_s, horizon_steps=options.replan_horizon)

    def incremental(cost_model: CostModel, planner: PlannerOptions) -> Replan:
        return replan_incremental(old, workload, cluster, cost_model, planner, replan, options.steps - step)

    plan_path, chosen = replan_run(workload, cluster, old, old.policy, options, incremental)  # the new tasks' M
    _log(f"step {step}: {chosen.describe()}")
    clear_pending(queue)
    relaunch = replace(options, resume=True, overwrite=False, plan=str(plan_path))
    prepared = prepare(relaunch)
    check_data(relaunch, prepared)  # before any worker starts: one line, not a worker's traceback
    return Applied(prepared, step)
