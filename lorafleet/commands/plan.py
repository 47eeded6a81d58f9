"""``lorafleet plan WORKLOAD``: the deployment plan and how it compares with the baselines."""

from __future__ import annotations

import argparse

from lorafleet.errors import InputError

ARGS = "<args>"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="plan a heterogeneous deployment and compare it with the baselines")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument("--gpus", type=int, help="override the workload's GPU count")
    parser.add_argument("--gpu", help="override the workload's GPU kind")
    parser.add_argument("--profile", help="fitted profile JSON (default: the analytic model of the GPU)")
    parser.add_argument("--solver", default="cbc", help="MILP back end: cbc (default), scip or highs")
    parser.add_argument("--mode", default="decomposed", help="decomposed (default), exhaustive or joint-minlp")
    parser.add_argument("--microbatch", default="packing", help="packing (default) or padding (LobRA's)")
    parser.add_argument("--samples", type=int, default=32, help="K sampled batches of the robust choice (0: none)")
    parser.add_argument("--json", help="write the versioned DeploymentPlan here (read by simulate and train)")
    parser.add_argument("--plot", help="write a PNG of the expected load per replica here")
    parser.set_defaults(func=run)


def _options(args: argparse.Namespace):
    import importlib.util

    from lorafleet.planner import PlannerMode, PlannerOptions
    from lorafleet.solvers import SolverName
    from lorafleet.specs.dispatch import MicroBatchMode

    for flag, value, enum in (
        ("--solver", args.solver, SolverName),
        ("--mode", args.mode, PlannerMode),
        ("--microbatch", args.microbatch, MicroBatchMode),
    ):
        if value not in {e.value for e in enum}:
            raise InputError(ARGS, flag, f"{value!r} is not one of {', '.join(e.value for e in enum)}")
    if args.samples < 0:
        raise InputError(ARGS, "--samples", f"must be >= 0, got {args.samples}")
    if args.mode == PlannerMode.JOINT_MINLP and importlib.util.find_spec("pyscipopt") is None:
        raise InputError(
            ARGS,
            "--mode",
            "joint-minlp solves LobRA's MINLP with SCIP, which needs PySCIPOpt "
            "(pip install pyscipopt); the default decomposed mode does not",
        )
    return PlannerOptions(
        solver=args.solver, mode=args.mode, microbatch_mode=args.microbatch, robust_samples=args.samples
    )


def plan_table(result):
    """Per config: count, GPUs, max tokens, share of the expected batch's tokens, expected time per replica."""
    from rich.table import Table

    plan, step = result.plan, result.expected_step
    rows: dict[str, list] = {}
    total = max(step.tokens, 1)
    for replica, work in zip(plan.replicas, step.work, strict=True):
        row = rows.setdefault(str(replica.config), [0, 0, replica.max_tokens, 0, 0.0])
        row[0] += 1
        row[1] += replica.config.n_gpus
        row[3] += sum(sum(mb.lengths) for mb in work.microbatches)
        row[4] = max(row[4], work.estimated_time_s)
    table = Table(title=f"plan: {plan.describe()}  ({plan.used_gpus} of {plan.n_gpus} x {plan.gpu}, {plan.solver})")
    for column in ("config", "count", "GPUs", "max tokens", "token share", "time/replica (s)"):
        table.add_column(column, justify="left" if column == "config" else "right")
    for config, (count, gpus, m, tokens, t) in rows.items():
        table.add_row(config, str(count), str(gpus), str(m), f"{tokens / total:.1%}", f"{t:.3f}")
    return table


def comparison_table(result):
    """Per step on the expected batch: makespan and GPU-seconds of lorafleet and every baseline, with reductions."""
    from rich.table import Table

    from lorafleet.planner import LORAFLEET

    table = Table(title="per step (expected batch)")
    for column in ("method", "GPUs", "makespan (s)", "GPU-seconds", "lorafleet: makespan", "lorafleet: GPU-s"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for cost in result.costs:
        cut = ("", "") if cost.name == LORAFLEET else tuple(f"{0.0 - r:+.1%}" for r in result.reduction(cost.name))
        table.add_row(cost.name, str(cost.gpus), f"{cost.makespan_s:.3f}", f"{cost.gpu_seconds:.1f}", *cut)
    return table


def _above(value: float, bound: float) -> str:
    """``+12.3%`` above the bound (or ``no bound`` when the bound is 0)."""
    return f"+{value / bound - 1:.1%}" if bound > 0 else "no bound"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.planner import plan_deployment
    from lorafleet.planner.bounds import step_bounds
    from lorafleet.planner.candidates import valid_candidates
    from lorafleet.planner.plot import plot_expected_load
    from lorafleet.specs.io import check_writable
    from lorafleet.workload import load_workload

    for path in (args.json, args.plot):
        if path:
            check_writable(path)
    options = _options(args)
    workload = load_workload(args.workload)
    cluster = workload_cluster(workload, args.gpus, args.gpu)
    cost_model = workload_cost_model(workload, cluster, args.profile)
    result = plan_deployment(workload, cluster, cost_model, options)

    console = Console(width=120)
    console.print(plan_table(result))
    console.print(comparison_table(result))
    for note in result.plan.notes:
        console.print(f"  note: {note}")
    bounds = step_bounds(
        result.plan, result.expected_batch, valid_candidates(cost_model, cluster), cost_model, cluster.n_gpus
    )
    ours = result.expected_step.estimated_makespan_s
    console.print("  lower bound of the expected step (perfect balance, no padding, no overhead; docs/planner.md):")
    console.print(
        f"    this deployment {bounds.deployment_s:.3f} s (plan {_above(ours, bounds.deployment_s)}); "
        f"any deployment of the {cluster.n_gpus} GPUs {bounds.fleet_s:.3f} s (plan {_above(ours, bounds.fleet_s)})"
    )
    timings = ", ".join(f"{k} {v:.2f} s" for k, v in result.diagnostics.timings_s.items())
    console.print(f"  planned in {timings}")
    console.print(f"  cost model {cost_model.source}; policy {result.plan.policy.describe()}")
    if args.json:
        result.plan.save(args.json)
        console.print(f"  plan: {args.json}")
    if args.plot:
        console.print(f"  plot: {plot_expected_load(result.plan, result.expected_step, args.plot)}")
    return 0
