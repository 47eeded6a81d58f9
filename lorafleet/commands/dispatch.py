"""``lorafleet dispatch WORKLOAD --plan PLAN --steps K``: sample K global batches and dispatch each on the plan.

Prints, per step, the solve time, the estimated makespan, the padding ratio, the spread of the
replicas' estimated loads and the slowest replica; then the replicas grouped by config over the
steps (count, GPUs, token share, load min / median / max), and per task how proportionally its
tokens are spread over the replicas (fairness). No column per replica, so hundreds of replicas stay
readable; ``--json`` writes every replica's figures and assignments: per step, replica and
micro-batch, the sequences' lengths and tasks.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

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


def fairness_table(task_names: tuple[str, ...], tokens):
    """Per task: its tokens a step, how many replicas hold some, and the least, median and most a holding
    replica gets (``tokens``: (replicas, tasks), a step's mean; every replica's figure is in ``--json``)."""
    from rich.table import Table

    table = Table(title="fairness: each task's mean tokens per step, over the replicas that hold some (all: --json)")
    for column in ("task", "tokens/step", "replicas holding it", "per replica min", "median", "max"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for k, name in enumerate(task_names):
        held = tokens[tokens[:, k] > 0, k]
        spread_ = [f"{x:,.0f}" for x in (held.min(), np.median(held), held.max())] if held.size else ["-"] * 3
        table.add_row(name, f"{tokens[:, k].sum():,.0f}", str(held.size), *spread_)
    return table


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lorafleet.commands._plan_flags import planned_run
    from lorafleet.commands._replica_groups import WIDTH, config_groups, groups_table, plan_name, spread
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

    console = Console(width=WIDTH)
    for line in run_.overrides:
        console.print(f"override: {line}")
    table = Table(
        title=f"{args.workload} on {plan_name(plan)} ({plan.policy.describe()}; cost model {cost_model.source})"
    )
    for column in ("step", "method", "solve ms", "makespan s", "padding", "load per replica, s", "slowest replica"):
        table.add_column(column, justify="left" if column in ("method", "slowest replica") else "right")
    steps_json, loads, tokens_sum = [], [], np.zeros((len(plan.replicas), len(task_names)))
    for step in _with_progress(range(args.start_step, args.start_step + args.steps)):
        batch = sample_global_batch(workload, step, args.seed)
        step_plan = dispatch_step(batch, plan, cost_model)
        tokens = task_tokens_per_replica(step_plan, len(task_names))
        tokens_sum += tokens
        load = np.array([w.estimated_time_s for w in step_plan.work])
        loads.append(load)
        slowest = plan.replicas[int(np.argmax(load))]
        table.add_row(
            str(step),
            step_plan.method,
            f"{step_plan.solve_s * 1e3:.1f}",
            f"{step_plan.estimated_makespan_s:.3f}",
            f"{step_plan.padding_ratio:.3f}",
            spread(load),
            f"{slowest.replica_id} {slowest.config}",
        )
        if args.json_out:
            steps_json.append(_step_json(step_plan, batch, plan, task_names, tokens))
    table.caption = "load per replica: min / median / max of the replicas' estimated times"
    console.print(table)
    by_config = config_groups(plan, np.array(loads), tokens_sum.sum(axis=1))
    console.print(groups_table(f"replicas by config over {args.steps} step(s)", by_config, "load (s)"))
    console.print(fairness_table(task_names, tokens_sum / args.steps))
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
