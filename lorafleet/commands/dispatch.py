"""``lorafleet dispatch WORKLOAD --plan PLAN --steps K``: sample K global batches and dispatch each on the plan.

Prints, per step, the solve time, the estimated makespan, the padding ratio and every
replica's estimated load, then each task's mean tokens per replica (fairness). ``--json``
writes the assignments: per step, replica and micro-batch, the sequences' lengths and tasks.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lorafleet.errors import InputError

ARGS = "<args>"
MAX_STEPS = 100_000
"""More global batches than this in one call is almost surely a typo (and would run for hours)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.commands._plan_flags import add_cluster_flags, add_policy_flags
    from lorafleet.commands._set_flags import add_set_flag

    parser = subparsers.add_parser("dispatch", help="dispatch sampled global batches on a deployment plan")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument("--plan", required=True, help="deployment plan JSON (lorafleet.DeploymentPlan)")
    parser.add_argument("--steps", type=int, default=1, help="global batches to sample and dispatch (default 1)")
    parser.add_argument("--start-step", type=int, default=0, help="first step to sample (default 0)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: the workload's)")
    parser.add_argument("--json", dest="json_out", help="write every step's assignments to this JSON file")
    add_set_flag(parser)
    add_cluster_flags(parser)
    add_policy_flags(parser)
    parser.set_defaults(func=run)


def _step_json(step_plan, batch, plan, task_names: tuple[str, ...], tokens) -> dict[str, Any]:
    replicas = []
    for work, replica, task_tokens in zip(step_plan.work, plan.replicas, tokens, strict=True):
        replicas.append(
            {
                "replica_id": work.replica_id,
                "config": replica.config.name,
                "estimated_time_s": work.estimated_time_s,
                "task_tokens": {name: int(t) for name, t in zip(task_names, task_tokens, strict=True)},
                "microbatches": [
                    {
                        "padded_len": mb.padded_len,
                        "tasks": [task_names[t] for t in mb.task_ids],
                        "lengths": list(mb.lengths),
                        "sample_ids": batch.sample_ids[list(mb.seq_ids)].tolist(),
                        "segments": [[task_names[t], first, n] for t, first, n in mb.segments],
                    }
                    for mb in work.microbatches
                ],
            }
        )
    return {
        "step": step_plan.step,
        "method": step_plan.method,
        "solve_s": step_plan.solve_s,
        "estimated_makespan_s": step_plan.estimated_makespan_s,
        "padding_ratio": step_plan.padding_ratio,
        "bucket_boundaries": list(step_plan.bucket_boundaries),
        "truncated": step_plan.truncated,
        "rejected": step_plan.rejected,
        "replicas": replicas,
    }


PROGRESS_FROM = 50
"""Runs of at least this many steps show their progress on stderr (a bar on a terminal, else a line every tenth)."""


def _with_progress(steps: range):
    """``steps``, reporting progress on stderr when there are many of them."""
    import sys

    if len(steps) < PROGRESS_FROM:
        yield from steps
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import track

        yield from track(steps, description="dispatching", console=Console(stderr=True), transient=True)
        return
    every = max(1, len(steps) // 10)
    for k, step in enumerate(steps, start=1):
        yield step
        if k % every == 0 or k == len(steps):
            print(f"lorafleet dispatch: {k:,}/{len(steps):,} steps dispatched", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from lorafleet.commands._plan_flags import planned_run
    from lorafleet.commands._set_flags import workload_overrides
    from lorafleet.dispatch import dispatch_step, task_tokens_per_replica
    from lorafleet.sampling import sample_global_batch
    from lorafleet.specs.io import check_writable, write_text_atomic
    from lorafleet.workload import load_workload

    if args.json_out:
        check_writable(args.json_out)
    if not 1 <= args.steps <= MAX_STEPS:
        raise InputError(ARGS, "--steps", f"must be >= 1 and <= {MAX_STEPS:,}, got {args.steps}")
    if args.start_step < 0:
        raise InputError(ARGS, "--start-step", f"must be >= 0, got {args.start_step}")
    workload = load_workload(args.workload, workload_overrides(args))
    run_ = planned_run(workload, args)
    plan, cost_model = run_.plan, run_.cost_model
    options = plan.policy.options
    task_names = tuple(t.name for t in workload.tasks)

    console = Console(width=160)
    for line in run_.overrides:
        console.print(f"override: {line}")
    table = Table(
        title=f"{args.workload} on {plan.describe()} ({plan.policy.describe()}; cost model {cost_model.source})"
    )
    for column in ("step", "method", "solve ms", "makespan s", "padding", "load per replica, s"):
        table.add_column(column, justify="left" if column in ("method", "load per replica, s") else "right")
    steps_json, tokens_sum = [], np.zeros((len(plan.replicas), len(task_names)))
    for step in _with_progress(range(args.start_step, args.start_step + args.steps)):
        batch = sample_global_batch(workload, step, args.seed)
        step_plan = dispatch_step(batch, plan, cost_model)
        tokens = task_tokens_per_replica(step_plan, len(task_names))
        tokens_sum += tokens
        table.add_row(
            str(step),
            step_plan.method,
            f"{step_plan.solve_s * 1e3:.1f}",
            f"{step_plan.estimated_makespan_s:.3f}",
            f"{step_plan.padding_ratio:.3f}",
            " ".join(f"{w.estimated_time_s:.2f}" for w in step_plan.work),
        )
        if args.json_out:
            steps_json.append(_step_json(step_plan, batch, plan, task_names, tokens))

    fairness = Table(title="mean tokens per step of each task on each replica (fairness)")
    fairness.add_column("task")
    for replica in plan.replicas:
        fairness.add_column(f"{replica.replica_id} {replica.config}", justify="right")
    for k, name in enumerate(task_names):
        fairness.add_row(name, *(f"{t:,.0f}" for t in tokens_sum[:, k] / args.steps))
    console.print(table)
    console.print(fairness)
    if args.json_out:
        write_text_atomic(
            args.json_out,
            json.dumps(
                {
                    "kind": "lorafleet.DispatchRun",
                    "workload": str(args.workload),
                    "plan": str(args.plan),
                    "seed": workload.spec.seed if args.seed is None else args.seed,
                    "tasks": list(task_names),
                    "cost_model": cost_model.source,
                    "method": options.method.value,
                    "mode": options.microbatch_mode.value,
                    "policy": plan.policy.to_json(),
                    "steps": steps_json,
                },
                indent=1,
                sort_keys=True,
            )
            + "\n",
        )
    return 0
