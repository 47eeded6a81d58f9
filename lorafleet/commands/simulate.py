"""``lorafleet simulate``: lorafleet's plan and every baseline through the same simulator.

With ``--plan`` the plan runs as it was made, under its own dispatch policy and cost model
(flags may override either, and the command says so), after the plan check; only the
baselines are chosen here. Without it, the workload is planned first.

With ``--arrivals TRACE`` it replays a trace of tasks arriving and departing instead
(:mod:`lorafleet.arrivals`, docs/arrivals.md): the GPU-seconds of re-planning incrementally, of
re-planning from scratch at every change and of one static plan for every task, and each task's
completion time under each.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from lorafleet.errors import InputError

MAX_STEPS = 100_000
DEFAULT_STEPS = 16


def register(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.commands._option_flags import add_replan_flags
    from lorafleet.commands._plan_flags import add_cluster_flags, add_policy_flags
    from lorafleet.commands._set_flags import add_set_flag

    parser = subparsers.add_parser("simulate", help="simulate lorafleet's plan and the baselines step by step")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument("--plan", help="DeploymentPlan JSON from `lorafleet plan --json` (default: plan now)")
    parser.add_argument("--steps", type=int, help=f"steps to simulate (default {DEFAULT_STEPS})")
    parser.add_argument(
        "--noise", type=float, default=0.0, help="log-normal step-time noise sigma per replica, 0 to 1 (0.03 = 3%%)"
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
    arrivals = parser.add_argument_group("arrivals and departures (docs/arrivals.md)")
    arrivals.add_argument(
        "--arrivals",
        metavar="TRACE",
        help="replay a YAML trace of tasks added and cancelled over time: incremental re-planning, "
        "re-planning from scratch and a static plan compared",
    )
    add_replan_flags(parser, arrivals, prefix="--arrivals: ")  # train's, from one table (specs.replan)
    parser.add_argument(
        "--eval-curves-from",
        metavar="RUN",
        help="each task's eval.curve fitted to the evaluations of a training run (its --out directory or its "
        "metrics.jsonl), for the workload's tasks of the same name that have an eval (docs/simulation.md)",
    )
    add_set_flag(parser)
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
    from lorafleet.executor.simulated import MAX_NOISE_SIGMA, FailureSpec, SimulationOptions

    if not 0 <= args.noise <= MAX_NOISE_SIGMA:  # NaN fails both comparisons
        raise InputError(
            "<args>", "--noise", f"must be a finite number from 0 to {MAX_NOISE_SIGMA:g}, got {args.noise}"
        )
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
    from lorafleet.assemble import workload_cluster
    from lorafleet.commands._plan_flags import given_policy_flags, planned_run
    from lorafleet.commands.plan import chosen_plan
    from lorafleet.plan_check import plan_base
    from lorafleet.planner import LORAFLEET, Phase, PlannerOptions, Schedule, workload_baselines
    from lorafleet.planner.base_choice import base_name

    cluster = workload_cluster(workload, args.gpus, args.gpu)
    if not args.plan:
        overridden = given_policy_flags(args)
        if overridden:
            raise InputError(
                "<args>",
                "--plan",
                f"policy flags ({', '.join(overridden)}) change a plan's policy: give "
                "--plan, or plan with them first (`lorafleet plan --microbatch ...`)",
            )
        result = chosen_plan(workload, cluster, args.profile, PlannerOptions(), console)  # quantize: auto, said
        return result.schedule, result.baselines, result.cost_model, cluster
    run_ = planned_run(workload, args)
    if workload.spec.quantize_candidates is not None:  # the workload lets the planner choose: the plan's choice
        bases = ", ".join(base_name(b) for b in workload.spec.quantize_candidates)
        console.print(f"base: {base_name(plan_base(run_.plan))}, the plan's, among quantize: [{bases}]", markup=False)
    for line in run_.overrides:
        console.print(f"override: {line}")
    lorafleet = Schedule(name=LORAFLEET, phases=(Phase(tasks=tuple(range(len(workload.tasks))), plan=run_.plan),))
    baselines = workload_baselines(workload, cluster, run_.cost_model, run_.plan.policy)
    return lorafleet, baselines, run_.cost_model, cluster


def replicas_table(phase_run):
    """lorafleet's replicas by config over the simulated steps: their busy seconds (min / median / max over
    the replicas and steps) and, when the run recalibrated them, the least and largest correction."""
    import numpy as np

    from lorafleet.commands._replica_groups import config_groups, groups_table

    plan = phase_run.phase.plan
    busy = np.array([r.replica_busy_s for r in phase_run.reports])
    groups = config_groups(plan, busy)
    factors = np.array([c.factor for c in phase_run.calibration])
    extra = []
    if factors.size and np.any(np.abs(factors - 1) > 0.005):
        ranges = [(factors[list(g.replicas)].min(), factors[list(g.replicas)].max()) for g in groups]
        extra.append(("recalibrated", [f"x{lo:.2f}" if lo == hi else f"x{lo:.2f}-{hi:.2f}" for lo, hi in ranges]))
    return groups_table("lorafleet's replicas by config over the simulated steps", groups, "busy (s)", extra)


def load_simulated_workload(args: argparse.Namespace, console):
    """The workload with its ``--set`` overrides and, with ``--eval-curves-from``, the curves fitted to that
    run's evaluations (``eval_replay.run_curves``), each fitted curve or why none printed."""
    from lorafleet.commands._set_flags import workload_overrides
    from lorafleet.eval_replay import run_curves, with_curves
    from lorafleet.workload import load_workload

    workload = load_workload(args.workload, workload_overrides(args))
    if not args.eval_curves_from:
        return workload
    try:
        fitted = run_curves(args.eval_curves_from)
    except ValueError as err:
        raise InputError(args.eval_curves_from, "--eval-curves-from", str(err)) from None
    workload, left = with_curves(workload, fitted.curves)
    for name, curve in fitted.curves.items():
        c = curve
        where = "not used: no task of that name with an eval" if name in left else "eval.curve"
        console.print(
            f"{name}: {where} l_inf={c.l_inf:.4g} a={c.a:.4g} alpha={c.alpha:.4g} rise={c.rise:.4g} "
            f"rise_after={c.rise_after:.4g} ({len(fitted.points[name])} evaluations)"
        )
    for name, why in fitted.unfitted.items():
        console.print(f"{name}: no curve fitted ({why})")
    return workload


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lorafleet.commands._replica_groups import WIDTH, plan_name
    from lorafleet.report import eval_rows, eval_totals, pool_rows, summary_rows, task_cost_rows, write_report
    from lorafleet.simulate import simulate_schedule
    from lorafleet.specs.io import check_writable
    from lorafleet.sweeps import may_leave_early

    if args.arrivals:
        return run_arrivals(args)
    args.steps = DEFAULT_STEPS if args.steps is None else args.steps
    if not 1 <= args.steps <= MAX_STEPS:
        raise InputError("<args>", "--steps", f"must be >= 1 and <= {MAX_STEPS:,}, got {args.steps}")
    if args.report:
        check_writable(args.report, directory=True)
    options = simulation_options(args)
    console = Console(width=WIDTH)
    workload = load_simulated_workload(args, console)
    schedule, baselines, cost_model, cluster = _schedules(workload, args, console)
    plan = schedule.phases[0].plan
    try:
        options.check_replicas(len(plan.replicas))
    except ValueError as err:
        raise InputError("<args>", "--straggler/--fail", str(err)) from None
    runs = [simulate_schedule(workload, s, cost_model, args.steps, options, args.seed) for s in (schedule, *baselines)]
    reference = None  # lorafleet's run without early stops or halving: what they save
    if any(may_leave_early(t.spec) for t in workload.tasks):
        reference = simulate_schedule(workload, schedule, cost_model, args.steps, options, args.seed, stops=False)

    console.print(f"plan: {plan_name(plan)}  ({cost_model.source}, {cluster.describe()}; {plan.policy.describe()})")
    table = Table(title=f"{args.steps} simulated steps of {workload.path}")
    rows = summary_rows(runs, cluster)
    for column in rows[0]:
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=column == "method")
    for row in rows:
        table.add_row(*[_cell(k, v) for k, v in row.items()])
    console.print(table)
    if len(cluster.pools) > 1 or cluster.priced:
        pools = Table(title=f"pools: what {runs[0].name} holds and uses of each")
        prows = pool_rows(runs[0], cluster)
        for column in prows[0]:
            pools.add_column(column, justify="left" if column in ("pool", "gpu") else "right")
        for row in prows:
            pools.add_row(*[_cell(k, v) for k, v in row.items()])
        console.print(pools)
    costs = Table(title="who pays what: lorafleet's GPU-seconds by task")
    cost_rows = task_cost_rows(runs[0])
    for column in cost_rows[0] if cost_rows else ():
        costs.add_column(column, justify="left" if column == "task" else "right")
    for row in cost_rows:
        costs.add_row(
            *[f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else v for v in row.values()]
        )
    console.print(costs)
    console.print(replicas_table(runs[0].phases[0]))
    if runs[0].evals:
        ref_gpu_s = reference.total_gpu_seconds if reference is not None else None
        evals = eval_rows(runs[0].evals, reference.evals if reference is not None else None)
        console.print(_rows_table("lorafleet's evaluations and early stops", evals))
        console.print(eval_totals(runs[0].total_gpu_seconds, sum(runs[0].eval_gpu_seconds.values()), ref_gpu_s))
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
        page = write_report(
            args.report, workload, runs, plan_rows, cluster=cluster, cost_source=cost_model.source, reference=reference
        )
        console.print(f"report: {page}")
    return 0


def _rows_table(title: str, rows: list[dict]):
    """A table of ``rows`` (one dict a row, the first's keys its columns), cells by :func:`_cell`."""
    from rich.table import Table

    table = Table(title=title)
    for column in rows[0]:
        table.add_column(column, justify="left" if column == "task" else "right", no_wrap=column == "task")
    for row in rows:
        table.add_row(*[_cell(k, v) for k, v in row.items()])
    return table


def _cell(column: str, value: object) -> str:
    """A table cell: what lorafleet saves as a percentage, costs to four figures, other floats with three
    decimals."""
    if column in ("saved_by_lorafleet", "cost_saved_by_lorafleet") and isinstance(value, float):
        return f"{value:.1%}"
    if column.startswith("cost") and isinstance(value, float):
        return f"{value:.4g}"  # a step costs cents
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _arrival_flags(args: argparse.Namespace):
    """``--arrivals``'s options, after refusing the flags that mean nothing to it."""
    from lorafleet.arrivals import ArrivalOptions
    from lorafleet.commands._option_flags import replan_settings
    from lorafleet.commands._plan_flags import given_policy_flags
    from lorafleet.planner import ReplanOptions

    refused = {
        "--plan": args.plan is not None,
        "--steps": args.steps is not None,
        "--noise": args.noise != 0,
        "--straggler": bool(args.straggler),
        "--fail": bool(args.fail),
        "--report": args.report is not None,
    }
    given = [flag for flag, on in refused.items() if on]
    overridden = given_policy_flags(args)
    if given or overridden:
        names = ", ".join(given + [f"policy flags ({', '.join(overridden)})"] * bool(overridden))
        raise InputError(
            "<args>",
            "--arrivals",
            f"not with {names}: the trace's tasks bring their own steps and every plan is made by the replay",
        )
    return ArrivalOptions(replan=ReplanOptions(replan_settings(args)), seed=args.seed)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _start_base(workload, cluster, profile, console):
    """``workload`` over the base ``plan`` and ``simulate`` choose for its own tasks (``commands.plan.chosen_plan``,
    each candidate's line said), chosen once, at the start: a running fleet's adapters cannot change the function
    they learn over, so every arrival trains over it too."""
    from lorafleet.commands.plan import chosen_plan
    from lorafleet.plan_check import plan_base
    from lorafleet.planner import PlannerOptions
    from lorafleet.planner.base_choice import base_name, with_base

    base = plan_base(chosen_plan(workload, cluster, profile, PlannerOptions(), console).plan)
    tasks = f"{len(workload.tasks)} task{'s' if len(workload.tasks) != 1 else ''}"
    console.print(f"base {base_name(base)} for the whole trace: chosen once, over the workload's {tasks} at the start")
    return with_base(workload, base)


def run_arrivals(args: argparse.Namespace) -> int:
    """``simulate WORKLOAD --arrivals TRACE``: the strategies' table and the per-task table."""
    from rich.console import Console
    from rich.table import Table

    from lorafleet.arrivals import load_trace, replay_trace
    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.report import eval_rows, eval_totals
    from lorafleet.sweeps import may_leave_early

    options = _arrival_flags(args)
    console = Console(width=150)
    workload = load_simulated_workload(args, console)
    cluster = workload_cluster(workload, args.gpus, args.gpu)
    if workload.spec.quantize_candidates is not None:  # quantize: auto or a list: one base for the whole replay
        workload = _start_base(workload, cluster, args.profile, console)
    trace = load_trace(args.arrivals, workload)
    cost_model = workload_cost_model(trace.all_tasks(), cluster, args.profile)
    settings = options.replan.settings
    if settings.migration_s is None:  # the measured model, for the fleet's weights
        migration = replace(options.replan.migration, dtype_bytes=cost_model.activation_bytes)
        options = replace(options, replan=replace(options.replan, migration=migration))
    result = replay_trace(trace, cluster, cost_model, options)
    reference = None  # the same replay without early stops or halving: what they save
    if any(may_leave_early(a.task.spec) for a in trace.arrivals):
        reference = replay_trace(trace, cluster, cost_model, replace(options, stops=False))
    added = len(trace.arrivals) - len(workload.tasks)
    console.print(
        f"{len(trace.arrivals)} tasks ({len(workload.tasks)} in the workload, {added} added by the trace, "
        f"{len(trace.cancels)} cancelled) on {cluster.describe()} ({cost_model.source})"
    )
    console.print(
        f"migration {options.replan.pricing.describe(cluster)}; incremental horizon {settings.horizon} steps, "
        f"objective {settings.objective.value}"
    )
    if result.static_plan is not None:
        console.print(f"static plan: {result.static_plan.describe()}")
    table = Table(title=f"{trace.path}: GPU-seconds by strategy")
    columns = ("strategy", "GPU-s", "migration GPU-s", "finish (s)", "steps", "tokens (M)", "plans", "moves", "rebuilt")
    for column in columns:
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)
    for run_ in result.runs:
        table.add_row(
            run_.strategy.value,
            f"{run_.gpu_s:,.0f}",
            f"{run_.migration_gpu_s:,.0f}",
            _seconds(run_.finish_s),
            str(run_.steps),
            f"{run_.tokens / 1e6:,.2f}",
            str(run_.plans),
            str(run_.moves),
            str(run_.rebuilt),
        )
    console.print(table)
    tasks = Table(
        title="tasks: arrival and completion time (s), GPU-seconds, by strategy",
        caption="(cut at n): cancelled after n of its steps",
    )
    tasks.add_column("task", no_wrap=True)
    tasks.add_column("arrives", justify="right")
    tasks.add_column("steps", justify="right")
    for run_ in result.runs:
        tasks.add_column(f"{run_.strategy.value} done", justify="right")
        tasks.add_column(f"{run_.strategy.value} GPU-s", justify="right")
    for arrival in trace.arrivals:
        name = arrival.task.name
        cells = [name, _seconds(arrival.at_s), str(arrival.task.spec.steps)]
        for run_ in result.runs:
            o = run_.tasks[name]
            done = _seconds(o.completion_s) + (f" (cut at {o.steps_done})" if o.cancelled else "")
            cells += [done, f"{o.gpu_s:,.0f}"]
        tasks.add_row(*cells)
    console.print(tasks)
    for k, run_ in enumerate(result.runs):
        if not run_.evals:
            continue
        ref = reference.runs[k] if reference is not None else None
        title = f"{run_.strategy.value}: evaluations and early stops"
        console.print(_rows_table(title, eval_rows(run_.evals, ref.evals if ref is not None else None)))
        moved = f"; {run_.moves} moves, {run_.rebuilt} replicas rebuilt" + (
            f" (without stops {ref.moves}, {ref.rebuilt})" if ref is not None else ""
        )
        console.print(eval_totals(run_.gpu_s, run_.eval_gpu_s, ref.gpu_s if ref is not None else None) + moved)
    return 0
