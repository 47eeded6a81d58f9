"""``lorafleet simulate``: lorafleet's plan and every baseline through the same simulator.

With ``--plan`` the plan runs as it was made, under its own dispatch policy and cost model
(flags may override either, and the command says so), after the plan check; only the
baselines are chosen here. Without it, the workload is planned first.
"""

from __future__ import annotations

import argparse
import math

from lorafleet.errors import InputError

MAX_STEPS = 100_000


def register(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.commands._plan_flags import add_cluster_flags, add_policy_flags

    parser = subparsers.add_parser("simulate", help="simulate lorafleet's plan and the baselines step by step")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument("--plan", help="DeploymentPlan JSON from `lorafleet plan --json` (default: plan now)")
    parser.add_argument("--steps", type=int, default=16, help="steps to simulate (default 16)")
    parser.add_argument(
        "--noise", type=float, default=0.0, help="log-normal step-time noise sigma per replica (0.03 = 3%%)"
    )
    parser.add_argument(
        "--straggler",
        action="append",
        default=[],
        metavar="REPLICA=FACTOR",
        help="replica id slowed down by a factor >= 1 (repeatable)",
    )
    parser.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="STEP:REPLICA",
        help="replica failing during a step, restarted (repeatable)",
    )
    parser.add_argument("--seed", type=int, help="seed of the sampled batches and the noise (default: the workload's)")
    parser.add_argument("--report", help="directory for PNG plots, summary.json and index.html")
    add_cluster_flags(parser)
    add_policy_flags(parser)
    parser.set_defaults(func=run)


def _pairs(items: list[str], sep: str, flag: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        left, mid, right = item.partition(sep)
        if not mid or not left or not right:
            raise InputError("<args>", flag, f"expected A{sep}B, got {item!r}")
        out.append((left, right))
    return out


def _number(text: str, kind: type, flag: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise InputError("<args>", flag, f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise InputError("<args>", flag, f"must be a finite number, got {text!r}")
    return value


def simulation_options(args: argparse.Namespace):
    from lorafleet.executor.simulated import FailureSpec, SimulationOptions

    if not (math.isfinite(args.noise) and args.noise >= 0):
        raise InputError("<args>", "--noise", f"must be a finite number >= 0, got {args.noise}")
    slowdown = {
        int(_number(r, int, "--straggler")): _number(f, float, "--straggler")
        for r, f in _pairs(args.straggler, "=", "--straggler")
    }
    failures = [
        FailureSpec(step=int(_number(s, int, "--fail")), replica_id=int(_number(r, int, "--fail")))
        for s, r in _pairs(args.fail, ":", "--fail")
    ]
    try:
        return SimulationOptions(
            noise_sigma=args.noise,
            slowdown=slowdown,
            failures=tuple(failures),
            seed=args.seed if args.seed is not None else 0,
        )
    except ValueError as err:
        raise InputError("<args>", "--fail" if "failure" in str(err) else "--noise/--straggler", str(err)) from None


def _schedules(workload, args: argparse.Namespace, console):
    """lorafleet's schedule (the plan of ``--plan`` as it was made, or a fresh one), the baselines, and the
    cost model and cluster both are simulated with."""
    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.commands._plan_flags import planned_run, policy_overrides
    from lorafleet.planner import LORAFLEET, Phase, Schedule, plan_deployment, workload_baselines

    cluster = workload_cluster(workload, args.gpus, args.gpu)
    if not args.plan:
        overridden = sorted(policy_overrides(args))
        if overridden:
            raise InputError(
                "<args>",
                "--plan",
                f"policy flags ({', '.join(overridden)}) change a plan's policy: give "
                "--plan, or plan with them first (`lorafleet plan --microbatch ...`)",
            )
        cost_model = workload_cost_model(workload, cluster, args.profile)
        result = plan_deployment(workload, cluster, cost_model)
        return result.schedule, result.baselines, cost_model, cluster
    run_ = planned_run(workload, args)
    for line in run_.overrides:
        console.print(f"override: {line}")
    lorafleet = Schedule(name=LORAFLEET, phases=(Phase(tasks=tuple(range(len(workload.tasks))), plan=run_.plan),))
    baselines = workload_baselines(workload, cluster, run_.cost_model, run_.plan.policy.options.n_buckets)
    return lorafleet, baselines, run_.cost_model, cluster


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lorafleet.report import summary_rows, write_report
    from lorafleet.simulate import simulate_schedule
    from lorafleet.specs.io import check_writable
    from lorafleet.workload import load_workload

    if not 1 <= args.steps <= MAX_STEPS:
        raise InputError("<args>", "--steps", f"must be >= 1 and <= {MAX_STEPS:,}, got {args.steps}")
    if args.report:
        check_writable(args.report, directory=True)
    options = simulation_options(args)
    workload = load_workload(args.workload)
    console = Console(width=150)
    schedule, baselines, cost_model, cluster = _schedules(workload, args, console)
    plan = schedule.phases[0].plan
    try:
        options.check_replicas(len(plan.replicas))
    except ValueError as err:
        raise InputError("<args>", "--straggler/--fail", str(err)) from None
    runs = [simulate_schedule(workload, s, cost_model, args.steps, options, args.seed) for s in (schedule, *baselines)]

    console.print(
        f"plan: {plan.describe()}  ({cost_model.source}, {cluster.n_gpus} x {cluster.gpu}; {plan.policy.describe()})"
    )
    table = Table(title=f"{args.steps} simulated steps of {workload.path}")
    rows = summary_rows(runs)
    for column in rows[0]:
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=column == "method")
    for row in rows:
        table.add_row(
            *[
                f"{v:.3f}"
                if isinstance(v, float) and k != "saved_by_lorafleet"
                else (f"{v:.1%}" if k == "saved_by_lorafleet" else str(v))
                for k, v in row.items()
            ]
        )
    console.print(table)
    calibration = runs[0].phases[0].calibration
    if any(abs(c.factor - 1) > 0.005 for c in calibration):
        from lorafleet.dispatch import summarize_factors

        console.print(f"recalibrated: {summarize_factors(calibration)}")
    if args.report:
        times = plan.expected_replica_time_s or (0.0,) * len(plan.replicas)
        plan_rows = [
            {
                "replica": r.replica_id,
                "config": str(r.config),
                "gpus": ",".join(map(str, r.gpus)),
                "max_tokens": r.max_tokens,
                "expected_s": t,
            }
            for r, t in zip(plan.replicas, times, strict=True)
        ]
        page = write_report(args.report, workload, runs, plan_rows)
        console.print(f"report: {page}")
    return 0
