"""``lorafleet dispatch WORKLOAD --plan PLAN --steps K``: sample K global batches and dispatch each on the plan.

Prints, per step, the solve time, the estimated makespan, the padding ratio and every
replica's estimated load, then each task's mean tokens per replica (fairness). ``--json``
writes the assignments: per step, replica and micro-batch, the sequences' lengths and tasks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError

ARGS = "<args>"
OPTION_FLAGS = {"method": "--method", "solver": "--solver", "time_limit_s": "--time-limit", "gap_rel": "--gap",
                "n_buckets": "--buckets", "bucket_alignment": "--alignment", "microbatch_mode": "--mode"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dispatch", help="dispatch sampled global batches on a deployment plan")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument("--plan", required=True, help="deployment plan JSON (lorafleet.DeploymentPlan)")
    parser.add_argument("--steps", type=int, default=1, help="global batches to sample and dispatch (default 1)")
    parser.add_argument("--start-step", type=int, default=0, help="first step to sample (default 0)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: the workload's)")
    parser.add_argument("--method", default="fast", help="fast (default), exact (MILP) or length (LobRA's baseline)")
    parser.add_argument("--solver", default="cbc", help="MILP back end of --method exact: cbc, scip or highs")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per exact solve (default 10)")
    parser.add_argument("--gap", type=float, default=1e-4, help="relative gap an exact solve may stop at")
    parser.add_argument("--buckets", type=int, default=16, help="R, the most padding buckets per step (default 16)")
    parser.add_argument("--alignment", type=int, default=16, help="bucket boundaries are multiples of this")
    parser.add_argument("--mode", default="padding", help="padding (default) or packing micro-batches")
    parser.add_argument("--choose-buckets-by-makespan", action="store_true",
                        help="pick the bucket count <= R with the least estimated makespan, not the least padding")
    parser.add_argument("--profile", help="cost-model profile JSON (default: analytic for the workload's model and GPU)")
    parser.add_argument("--json", dest="json_out", help="write every step's assignments to this JSON file")
    parser.set_defaults(func=run)


def _options(args: argparse.Namespace):
    from lorafleet.dispatch import DispatchOptions

    try:
        return DispatchOptions(method=args.method, solver=args.solver, time_limit_s=args.time_limit, gap_rel=args.gap,
                               n_buckets=args.buckets, bucket_alignment=args.alignment, microbatch_mode=args.mode,
                               choose_buckets_by_makespan=args.choose_buckets_by_makespan)
    except InputError as err:  # name the flag, not the field
        raise InputError(ARGS, OPTION_FLAGS.get(err.field, err.field), err.msg) from None


def _check_plan(plan, workload, plan_path: str) -> None:
    if plan.model != workload.model.name:
        raise InputError(plan_path, "model", f"plan is for {plan.model!r}, the workload trains {workload.model.name!r}")
    names = tuple(t.name for t in workload.tasks)
    if plan.tasks and plan.tasks != names:
        raise InputError(plan_path, "tasks", f"plan has tasks {list(plan.tasks)}, the workload {list(names)}")


def _step_json(step_plan, batch, plan, task_names: tuple[str, ...], tokens) -> dict[str, Any]:
    replicas = []
    for work, replica, task_tokens in zip(step_plan.work, plan.replicas, tokens, strict=True):
        replicas.append({
            "replica_id": work.replica_id,
            "config": replica.config.name,
            "estimated_time_s": work.estimated_time_s,
            "task_tokens": {name: int(t) for name, t in zip(task_names, task_tokens, strict=True)},
            "microbatches": [{
                "padded_len": mb.padded_len,
                "tasks": [task_names[t] for t in mb.task_ids],
                "lengths": list(mb.lengths),
                "sample_ids": batch.sample_ids[list(mb.seq_ids)].tolist(),
                "segments": [[task_names[t], first, n] for t, first, n in mb.segments],
            } for mb in work.microbatches],
        })
    return {"step": step_plan.step, "method": step_plan.method, "solve_s": step_plan.solve_s,
            "estimated_makespan_s": step_plan.estimated_makespan_s, "padding_ratio": step_plan.padding_ratio,
            "bucket_boundaries": list(step_plan.bucket_boundaries), "truncated": step_plan.truncated,
            "rejected": step_plan.rejected, "replicas": replicas}


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a file."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as err:
        raise InputError(path, "", f"cannot write ({err.strerror})") from None
    tmp.replace(target)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from lorafleet.assemble import workload_cost_model
    from lorafleet.dispatch import dispatch_step, task_tokens_per_replica
    from lorafleet.plans import DeploymentPlan
    from lorafleet.sampling import sample_global_batch
    from lorafleet.workload import load_workload

    if args.steps < 1:
        raise InputError(ARGS, "--steps", f"must be >= 1, got {args.steps}")
    if args.start_step < 0:
        raise InputError(ARGS, "--start-step", f"must be >= 0, got {args.start_step}")
    options = _options(args)
    workload = load_workload(args.workload)
    plan = DeploymentPlan.load(args.plan)
    _check_plan(plan, workload, args.plan)
    cost_model = workload_cost_model(workload, workload.cluster, args.profile, sync_replicas=len(plan.replicas))
    task_names = tuple(t.name for t in workload.tasks)

    table = Table(title=f"{args.workload} on {plan.describe()} ({options.method.value}, {options.microbatch_mode.value}, "
                        f"R = {options.n_buckets}; cost model {cost_model.source})")
    for column in ("step", "method", "solve ms", "makespan s", "padding", "load per replica, s"):
        table.add_column(column, justify="left" if column in ("method", "load per replica, s") else "right")
    steps_json, tokens_sum = [], np.zeros((len(plan.replicas), len(task_names)))
    for step in range(args.start_step, args.start_step + args.steps):
        batch = sample_global_batch(workload, step, args.seed)
        step_plan = dispatch_step(batch, plan, cost_model, options)
        tokens = task_tokens_per_replica(step_plan, len(task_names))
        tokens_sum += tokens
        table.add_row(str(step), step_plan.method, f"{step_plan.solve_s * 1e3:.1f}", f"{step_plan.estimated_makespan_s:.3f}",
                      f"{step_plan.padding_ratio:.3f}", " ".join(f"{w.estimated_time_s:.2f}" for w in step_plan.work))
        if args.json_out:
            steps_json.append(_step_json(step_plan, batch, plan, task_names, tokens))

    fairness = Table(title="mean tokens per step of each task on each replica (fairness)")
    fairness.add_column("task")
    for replica in plan.replicas:
        fairness.add_column(f"{replica.replica_id} {replica.config}", justify="right")
    for k, name in enumerate(task_names):
        fairness.add_row(name, *(f"{t:,.0f}" for t in tokens_sum[:, k] / args.steps))
    console = Console(width=160)
    console.print(table)
    console.print(fairness)
    if args.json_out:
        _write_json(args.json_out, {
            "kind": "lorafleet.DispatchRun", "workload": str(args.workload), "plan": str(args.plan),
            "seed": workload.spec.seed if args.seed is None else args.seed, "tasks": list(task_names),
            "cost_model": cost_model.source, "method": options.method.value, "mode": options.microbatch_mode.value,
            "steps": steps_json,
        })
    return 0
