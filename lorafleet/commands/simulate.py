"""``lorafleet simulate``: lorafleet's plan and every baseline through the same simulator."""

from __future__ import annotations

import argparse

from lorafleet.errors import InputError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("simulate", help="simulate lorafleet's plan and the baselines step by step")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument("--plan", help="DeploymentPlan JSON from `lorafleet plan --json` (default: plan now)")
    parser.add_argument("--steps", type=int, default=16, help="steps to simulate (default 16)")
    parser.add_argument("--gpus", type=int, help="override the workload's GPU count")
    parser.add_argument("--gpu", help="override the workload's GPU kind")
    parser.add_argument("--profile", help="fitted profile JSON (default: the analytic model of the GPU)")
    parser.add_argument("--noise", type=float, default=0.0, help="log-normal step-time noise sigma per replica (0.03 = 3%%)")
    parser.add_argument("--straggler", action="append", default=[], metavar="REPLICA=FACTOR",
                        help="replica id slowed down by a factor >= 1 (repeatable)")
    parser.add_argument("--fail", action="append", default=[], metavar="STEP:REPLICA",
                        help="replica failing during a step, restarted (repeatable)")
    parser.add_argument("--seed", type=int, help="seed of the sampled batches and the noise (default: the workload's)")
    parser.add_argument("--report", help="directory for PNG plots, summary.json and index.html")
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
        return kind(text)
    except ValueError:
        raise InputError("<args>", flag, f"not a number: {text!r}") from None


def simulation_options(args: argparse.Namespace):
    from lorafleet.executor.simulated import FailureSpec, SimulationOptions

    slowdown = {int(_number(r, int, "--straggler")): _number(f, float, "--straggler") for r, f in _pairs(args.straggler, "=", "--straggler")}
    failures = [FailureSpec(step=int(_number(s, int, "--fail")), replica_id=int(_number(r, int, "--fail")))
                for s, r in _pairs(args.fail, ":", "--fail")]
    try:
        return SimulationOptions(noise_sigma=args.noise, slowdown=slowdown, failures=tuple(failures),
                                 seed=args.seed if args.seed is not None else 0)
    except ValueError as err:
        raise InputError("<args>", "--noise/--straggler", str(err)) from None


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.plans import DeploymentPlan
    from lorafleet.planner import plan_deployment
    from lorafleet.report import summary_rows, write_report
    from lorafleet.simulate import simulate_schedule
    from lorafleet.workload import load_workload

    if args.steps < 1:
        raise InputError("<args>", "--steps", f"must be >= 1, got {args.steps}")
    options = simulation_options(args)
    workload = load_workload(args.workload)
    cluster = workload_cluster(workload, args.gpus, args.gpu)
    cost_model = workload_cost_model(workload, cluster, args.profile)
    result = plan_deployment(workload, cluster, cost_model)
    schedule = result.schedule
    if args.plan:
        plan = DeploymentPlan.load(args.plan)
        if plan.tasks != tuple(t.name for t in workload.tasks):
            raise InputError(args.plan, "tasks", f"plan is for tasks {list(plan.tasks)}, workload has {[t.name for t in workload.tasks]}")
        schedule = replace(schedule, phases=(replace(schedule.phases[0], plan=plan),))
    runs = [simulate_schedule(workload, s, cost_model, args.steps, options, args.seed) for s in (schedule, *result.baselines)]

    console = Console(width=150)
    console.print(f"plan: {schedule.phases[0].plan.describe()}  ({cost_model.source}, {cluster.n_gpus} x {cluster.gpu})")
    table = Table(title=f"{args.steps} simulated steps of {workload.path}")
    rows = summary_rows(runs)
    for column in rows[0]:
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=column == "method")
    for row in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) and k != "saved_by_lorafleet" else
                        (f"{v:.1%}" if k == "saved_by_lorafleet" else str(v)) for k, v in row.items()])
    console.print(table)
    if args.report:
        plan = schedule.phases[0].plan
        times = plan.expected_replica_time_s or (0.0,) * len(plan.replicas)
        plan_rows = [{"replica": r.replica_id, "config": str(r.config), "gpus": ",".join(map(str, r.gpus)),
                      "max_tokens": r.max_tokens, "expected_s": t} for r, t in zip(plan.replicas, times, strict=True)]
        page = write_report(args.report, workload, runs, plan_rows)
        console.print(f"report: {page}")
    return 0
