"""``lorafleet plan WORKLOAD``: the deployment plan and how it compares with the baselines."""

from __future__ import annotations

import argparse
import math

from lorafleet.errors import InputError

ARGS = "<args>"


PLAN_POLICY_FLAGS = ("microbatch_mode", "pipeline_window")
"""The policy fields ``plan`` has flags for (the others take their defaults and can be overridden when the
plan is run; ``plan``'s own ``--solver`` is the planner's MILP back end, not the exact dispatch's)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.commands._plan_flags import add_policy_flags
    from lorafleet.commands._set_flags import add_set_flag
    from lorafleet.specs.dispatch import DispatchPolicy

    parser = subparsers.add_parser("plan", help="plan a heterogeneous deployment and compare it with the baselines")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument(
        "--gpus",
        metavar="N|auto",
        help="override the workload's GPU count; auto: plan 1 .. K whole nodes and pick the count (see --deadline, "
        "--budget)",
    )
    parser.add_argument("--gpu", help="override the workload's GPU kind")
    parser.add_argument("--profile", help="fitted profile JSON (default: the analytic model of the GPU)")
    parser.add_argument("--solver", default="cbc", help="MILP back end: cbc (default), scip or highs")
    parser.add_argument("--mode", default="decomposed", help="decomposed (default), exhaustive or joint-minlp")
    parser.add_argument("--samples", type=int, default=32, help="K sampled batches of the robust choice (0: none)")
    parser.add_argument(
        "--objective",
        default="makespan",
        help="makespan (default: the shortest step, then the fewest GPUs) or cost (the fewest currency units "
        "per step at the pools' prices, on any subset of the pools' GPUs; within --step-limit or --deadline "
        "when given). cost prints the cost frontier",
    )
    parser.add_argument(
        "--makespan-tolerance",
        metavar="FRACTION",
        type=float,
        default=5e-3,
        help="plans whose expected step is within this fraction of the fastest tie, and the tie goes to fewer GPUs; "
        "with --objective cost, plans whose cost a step is within it of the cheapest tie, and the faster wins "
        "(default 0.005)",
    )
    parser.add_argument(
        "--step-limit",
        metavar="SECONDS",
        help="with --objective cost: the longest expected step a plan may have (default: none, the cheapest step "
        "however long); --deadline STEPS:HOURS sets it to 3600 HOURS / STEPS",
    )
    parser.add_argument(
        "--max-cost",
        metavar="AMOUNT",
        help="with --objective cost: the fastest plan whose job (--steps N, else the tasks' steps) costs at most "
        "AMOUNT at the pools' prices; with --step-limit or --deadline, the cheapest plan within both. Not with "
        "--gpus auto (the cost objective chooses which of the pools' GPUs to hold)",
    )
    add_policy_flags(parser, defaults=DispatchPolicy(), only=PLAN_POLICY_FLAGS)
    sizing = parser.add_argument_group("sizing the fleet (with --gpus auto; docs/planner.md)")
    sizing.add_argument(
        "--max-nodes",
        metavar="K",
        help="the most nodes --gpus auto sweeps, at most 4096 (default: the workload cluster's nodes)",
    )
    sizing.add_argument(
        "--deadline",
        metavar="STEPS:HOURS",
        help="the fewest GPUs that run STEPS steps within HOURS hours (default goal: fewest GPU-seconds); with "
        "--objective cost, also without --gpus auto: the cheapest plan that does",
    )
    sizing.add_argument("--budget", metavar="GPU_HOURS", help="the fastest plan whose job fits GPU_HOURS GPU-hours")
    sizing.add_argument(
        "--steps",
        metavar="N",
        help="the job's steps for --budget, --max-cost and the job columns (default: the tasks' steps)",
    )
    parser.add_argument("--json", help="write the versioned DeploymentPlan here (read by simulate and train)")
    parser.add_argument("--plot", help="write a PNG of the expected load per replica here")
    parser.add_argument(
        "--stats", action="store_true", help="print the planner's work counters and CPU seconds (docs/planner.md)"
    )
    add_set_flag(parser)
    parser.set_defaults(func=run)


def _options(args: argparse.Namespace):
    import importlib.util

    from lorafleet.commands._plan_flags import flagged_policy
    from lorafleet.planner import PlannerMode, PlannerOptions, PlanObjective
    from lorafleet.solvers import SolverName
    from lorafleet.specs.dispatch import DispatchPolicy

    choices = (("--solver", args.solver, SolverName), ("--mode", args.mode, PlannerMode))
    for flag, value, enum in (*choices, ("--objective", args.objective, PlanObjective)):
        if value not in {e.value for e in enum}:
            raise InputError(ARGS, flag, f"{value!r} is not one of {', '.join(e.value for e in enum)}")
    if args.samples < 0:
        raise InputError(ARGS, "--samples", f"must be >= 0, got {args.samples}")
    policy = flagged_policy(DispatchPolicy(), args)
    if args.mode == PlannerMode.JOINT_MINLP and importlib.util.find_spec("pyscipopt") is None:
        raise InputError(
            ARGS,
            "--mode",
            "joint-minlp solves LobRA's MINLP with SCIP, which needs PySCIPOpt "
            "(pip install pyscipopt); the default decomposed mode does not",
        )
    if not 0 <= args.makespan_tolerance < 1:
        raise InputError(ARGS, "--makespan-tolerance", f"must be in [0, 1), got {args.makespan_tolerance}")
    return PlannerOptions(
        policy=policy,
        solver=args.solver,
        mode=args.mode,
        robust_samples=args.samples,
        objective=args.objective,
        tie_rel=args.makespan_tolerance,
        max_step_s=_step_limit(args),
    )


def _step_limit(args: argparse.Namespace) -> float | None:
    """``--step-limit``, or ``--deadline``'s 3600 HOURS / STEPS, under ``--objective cost`` (None: no limit)."""
    from lorafleet.planner import PlanObjective

    cost = args.objective == PlanObjective.COST
    if args.step_limit is not None:
        if not cost:
            raise InputError(ARGS, "--step-limit", "goes with --objective cost (the makespan objective is the fastest)")
        if args.deadline is not None:
            raise InputError(ARGS, "--step-limit", "give --step-limit or --deadline, not both")
        return _number("--step-limit", args.step_limit, float, "a number of seconds")
    if cost and args.deadline is not None:
        steps, hours = _deadline(args.deadline)
        return 3600 * hours / steps
    return None


def _deadline(text: str) -> tuple[int, float]:
    """``--deadline STEPS:HOURS`` as (steps, hours), or an InputError naming the flag."""
    steps, colon, hours = text.partition(":")
    if not colon:
        raise InputError(ARGS, "--deadline", f"expected STEPS:HOURS (e.g. 2000:1.5), got {text!r}")
    steps = _number("--deadline", steps, int, "STEPS:HOURS with STEPS a whole number (e.g. 2000:1.5)", "STEPS")
    hours = _number("--deadline", hours, float, "STEPS:HOURS with HOURS a number (e.g. 2000:1.5)", "HOURS")
    return steps, hours


def _max_cost(args: argparse.Namespace) -> float | None:
    """``--max-cost AMOUNT`` (None when not given), refused without ``--objective cost`` or with ``--gpus auto``."""
    if args.max_cost is None:
        return None
    if args.objective != "cost":
        raise InputError(ARGS, "--max-cost", "goes with --objective cost (the makespan objective is the fastest)")
    if args.gpus == AUTO:
        raise InputError(
            ARGS,
            "--max-cost",
            "does not go with --gpus auto: the cost objective already chooses which of the pools' GPUs to hold "
            "(size a fleet by GPU-hours with --budget)",
        )
    return _number("--max-cost", args.max_cost, float, "an amount in the pools' currency")


def _job_cap(amount: float, workload, args: argparse.Namespace) -> tuple[int, float]:
    """``--max-cost``'s job: (N steps, AMOUNT): N from ``--steps``, the ``--deadline``'s, else the tasks'
    (``sizing_objective.job_steps``); an InputError naming --max-cost when there are none."""
    from lorafleet.planner import Deadline, SizingObjective
    from lorafleet.planner.sizing_objective import job_steps

    try:
        deadline = None if args.deadline is None else Deadline(*_deadline(args.deadline))
        steps = None if args.steps is None else _number("--steps", args.steps, int, "a whole number of steps")
        objective = SizingObjective(deadline=deadline, steps=steps)
    except InputError as err:
        raise _sizing_flag_error(err) from None
    steps = job_steps(workload, objective)
    if steps is None:
        raise InputError(
            ARGS, "--max-cost", "needs the job's steps: none given (--steps N), and no task of the workload sets steps"
        )
    return steps, amount


AUTO = "auto"
SIZING_WIDTH = 160
"""Columns the sweep's table may take: a plan per row, unwrapped up to five or six configs."""
SIZING_FLAGS = {
    "deadline": "--deadline",
    "budget_gpu_hours": "--budget",
    "steps": "--steps",
    "max_nodes": "--max-nodes",
}
"""SizingObjective field (``planner.sizing_objective.OBJECTIVE_SOURCE``) -> the flag that sets it."""


def _number(flag: str, text: str, kind: type, what: str, part: str = ""):
    """``text`` as a positive ``kind`` (int or float), else an InputError naming ``flag`` (and ``part`` of it)."""
    try:
        value = kind(text)
    except ValueError:
        raise InputError(ARGS, flag, f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        finite = "" if math.isfinite(value) else " and finite"
        raise InputError(ARGS, flag, f"{part + ' ' if part else ''}must be > 0{finite}, got {text}")
    return value


def _gpus(text: str | None) -> int | None:
    """``--gpus``: None (the workload's), a count as given (``workload_cluster`` checks it) or ``AUTO``."""
    if text is None or text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise InputError(ARGS, "--gpus", f"expected a whole number of GPUs or auto, got {text!r}") from None


def _sizing(args: argparse.Namespace):
    """The SizingObjective and K of ``--gpus auto`` (None, None without it; its flags are refused then)."""
    from lorafleet.planner import Deadline, SizingObjective

    flags = ("--max-nodes", "--deadline", "--budget", "--steps")
    if args.objective == "cost":  # a deadline is the cost objective's step-time limit on any cluster
        flags = ("--max-nodes", "--budget", "--steps")
    if args.max_cost is not None:  # the job whose cost is capped
        flags = tuple(f for f in flags if f != "--steps")
    given = [f for f in flags if getattr(args, f[2:].replace("-", "_"))]
    if args.gpus != AUTO:
        if given:
            raise InputError(ARGS, given[0], "goes with --gpus auto (it sizes the fleet)")
        return None, None
    if args.deadline is not None:
        steps, hours = _deadline(args.deadline)
    max_nodes = None if args.max_nodes is None else _number("--max-nodes", args.max_nodes, int, "a whole number")
    try:
        deadline = None if args.deadline is None else Deadline(steps, hours)
        objective = SizingObjective(
            deadline=deadline,
            budget_gpu_hours=None if args.budget is None else _number("--budget", args.budget, float, "GPU-hours"),
            steps=None if args.steps is None else _number("--steps", args.steps, int, "a whole number of steps"),
        )
    except InputError as err:
        raise _sizing_flag_error(err) from None
    return objective, max_nodes


def _sizing_flag_error(err: InputError) -> InputError:
    """An objective error (``planner.sizing_objective.OBJECTIVE_SOURCE``) as the error of the flag that set it."""
    from lorafleet.planner.sizing_objective import OBJECTIVE_SOURCE

    if err.path != OBJECTIVE_SOURCE:
        return err
    return InputError(ARGS, SIZING_FLAGS.get(err.field, err.field), err.msg)


def sizing_table(sizing):
    """Every GPU count swept: its plan and figures, whether it meets the goal, and the chosen row."""
    from rich.table import Table

    from lorafleet.planner.sizing_objective import describe_objective
    from lorafleet.planner.sizing_result import by_cost

    objective = sizing.objective
    priced = all(r.cost_per_step is not None for r in sizing.rows)
    job = f"a {sizing.job_steps}-step job" if sizing.job_steps else "job totals need --steps N"
    table = Table(
        title=f"fleet sizing: {describe_objective(objective, by_cost(sizing.rows))} ({job})",
        caption=f"chosen: {sizing.chosen_row.gpus} GPUs, {sizing.reason}"
        if sizing.chosen is not None
        else f"none chosen: {sizing.reason}",
    )
    columns = ("GPUs", "nodes", "plan", "used", "step (s)", "GPU-s/step", "job h", "job GPU-h")
    columns += ("cost/step", "judged") if priced else ("judged",)
    for column in columns:
        table.add_column(column, justify="left" if column in ("plan", "judged") else "right")
    for k, row in enumerate(sizing.rows):
        if not row.feasible:
            table.add_row(str(row.gpus), row.nodes, "infeasible", *[""] * (len(columns) - 4), row.infeasible)
            continue
        judged = []
        if objective.deadline is not None:
            judged.append("meets deadline" if row.job_hours <= objective.deadline.hours else "misses deadline")
        if objective.budget_gpu_hours is not None:
            judged.append("within budget" if row.job_gpu_hours <= objective.budget_gpu_hours else "over budget")
        if k == sizing.chosen:
            judged.append("<- chosen")
        jobs = ("-", "-") if row.job_steps is None else (f"{row.job_hours:.3g}", f"{row.job_gpu_hours:.4g}")
        table.add_row(
            str(row.gpus),
            row.nodes,
            row.result.plan.describe(),
            str(row.used_gpus),
            f"{row.step_s:.3f}",
            f"{row.gpu_seconds_per_step:.1f}",
            *jobs,
            *((f"{row.cost_per_step:.4g}",) if priced else ()),
            ", ".join(judged),
            style="bold" if k == sizing.chosen else None,
        )
    return table


def plan_table(plan, step):
    """Per config of ``plan``: count, GPUs, max tokens, share of the expected batch's tokens, and the min /
    median / max of its replicas' times in the expected ``step`` (every replica's own: ``--json``,
    ``expected_replica_time_s``)."""
    import numpy as np

    from lorafleet.commands._replica_groups import config_groups, groups_table, plan_name

    times = np.array([w.estimated_time_s for w in step.work])
    tokens = np.array([sum(sum(mb.lengths) for mb in w.microbatches) for w in step.work])
    title = f"plan: {plan_name(plan)}  ({plan.used_gpus} of {plan.describe_fleet()}, {plan.solver})"
    return groups_table(title, config_groups(plan, times, tokens), "time/replica (s)")


def comparison_table(result):
    """Per step on the expected batch: makespan and GPU-seconds of lorafleet and every baseline, with reductions."""
    from rich.table import Table

    from lorafleet.planner import LORAFLEET

    table = Table(title="per step (expected batch)")
    priced = all(c.cost_per_step is not None for c in result.costs)
    columns = ("method", "GPUs", "makespan (s)", "GPU-seconds", "lorafleet: makespan", "lorafleet: GPU-s")
    for column in (*columns, *(("cost", "lorafleet: cost") if priced else ())):
        table.add_column(column, justify="left" if column == "method" else "right")
    ours = result.cost(LORAFLEET)
    for cost in result.costs:
        cut = ("", "") if cost.name == LORAFLEET else tuple(f"{0.0 - r:+.1%}" for r in result.reduction(cost.name))
        money = ()
        if priced:
            saved = "" if cost.name == LORAFLEET else _relative(ours.cost_per_step, cost.cost_per_step)
            money = (f"{cost.cost_per_step:.4g}", saved)
        table.add_row(cost.name, str(cost.gpus), f"{cost.makespan_s:.3f}", f"{cost.gpu_seconds:.1f}", *cut, *money)
    return table


def _relative(ours: float, theirs: float) -> str:
    """``-12.3%``: what ``ours`` saves on ``theirs``; ``-`` when ``theirs`` is 0 and ``ours`` is not (pools at a
    price of 0: a baseline on them alone costs nothing), ``+0.0%`` when both are."""
    if theirs > 0:
        return f"{ours / theirs - 1:+.1%}"
    return "+0.0%" if ours == 0 else "-"


def _check_limit(result, options, args: argparse.Namespace) -> None:
    """An InputError naming ``--step-limit`` (or ``--deadline``) when the cost objective's plan misses its limit:
    no deployment the planner judged meets it."""
    limit = options.max_step_s
    step = result.plan.expected_makespan_s
    if limit is None or step <= limit:
        return
    flag = "--step-limit" if args.step_limit is not None else "--deadline"
    raise InputError(
        ARGS,
        flag,
        f"no deployment found of {result.plan.describe_fleet()} has an expected step within {limit:.4g} s: the "
        f"fastest found takes {step:.4g} s",
    )


def _check_cap(result, options, job: tuple[int, float] | None) -> None:
    """An InputError naming ``--max-cost`` when the cost objective's plan misses the cap: no deployment the planner
    judged has a job within it (the plan is then the cheapest found, within the step-time limit when given). The
    test is the planner's own: the plan's cost a step against ``options.max_step_cost`` (the amount over the job's
    steps), as :func:`_check_limit` tests the step against ``options.max_step_s``; a relative 1e-12 absorbs the
    rounding between the search's t̄·c(p') and the plan's recorded cost of the same step."""
    cap, per_step = options.max_step_cost, _plan_cost(result)
    if job is None or cap is None or per_step is None or per_step <= cap * (1 + 1e-12):
        return
    steps, amount = job
    raise InputError(
        ARGS,
        "--max-cost",
        f"no deployment found of {result.plan.describe_fleet()} runs the {steps}-step job for at most {amount:.4g}: "
        f"the cheapest found ({result.plan.describe()}) costs {per_step * steps:.4g} ({per_step:.4g} a step)",
    )


def frontier_table(result):
    """The cost objective's frontier (``PlanResult.frontier``): the cheapest plan found at each step time, fastest
    first, the chosen one marked, each point's cost against the chosen plan's."""
    from rich.table import Table

    plan = result.plan
    limit = f"; step-time limit {plan.max_step_s:.4g} s" if plan.max_step_s is not None else ""
    table = Table(title=f"cost frontier (expected batch): no plan judged is both faster and cheaper{limit}")
    for column in ("", "step (s)", "cost/step", "vs chosen", "GPUs", "deployment"):
        table.add_column(column, justify="left" if column in ("deployment", "") else "right")
    chosen = plan.describe()
    mine = [p.cost_per_step for p in result.frontier if p.deployment == chosen]
    ours = mine[0] if mine else _plan_cost(result)
    for point in result.frontier:
        table.add_row(
            "chosen" if point.deployment == chosen else "",
            f"{point.makespan_s:.3f}",
            f"{point.cost_per_step:.4g}",
            _relative(point.cost_per_step, ours) if ours else "",
            str(point.gpus),
            point.deployment,
        )
    return table


def _plan_cost(result) -> float | None:
    from lorafleet.planner import LORAFLEET

    return result.cost(LORAFLEET).cost_per_step


def stats_table(result, cpu_s: float):
    """The plan's work counters (deterministic: ``lorafleet.work``), then where the seconds went."""
    from rich.table import Table

    from lorafleet.work import WORK

    work = result.diagnostics.work
    laps = ", ".join(f"{k} {v:.2f} s" for k, v in result.diagnostics.timings_s.items())
    table = Table(title="planner work", caption=f"{cpu_s:.2f} CPU s for the whole command (wall: {laps})")
    for column in ("counter", "count", "one is"):
        table.add_column(column, justify="right" if column == "count" else "left")
    for name, (label, what) in WORK.items():
        table.add_row(label, str(work[name]), what)
    return table


def cost_line(result, workload, job: tuple[int, float] | None = None) -> str | None:
    """``cost 0.0123 a step at the pools' prices, 24.6 for the 2000-step job``, and with ``--max-cost``'s ``job``
    (steps, amount) its cost against the cap; None when a pool has no price."""
    from lorafleet.planner import LORAFLEET
    from lorafleet.planner.sizing_objective import SizingObjective, job_steps

    per_step = result.cost(LORAFLEET).cost_per_step
    if per_step is None:
        return None
    if job is not None:
        steps, amount = job
        return (
            f"cost {per_step:.4g} a step at the pools' prices, {per_step * steps:.4g} for the {steps}-step job "
            f"against --max-cost {amount:.4g} ({per_step * steps / amount:.1%} of it)"
        )
    steps = job_steps(workload, SizingObjective())
    total = f", {per_step * steps:.4g} for the {steps}-step job" if steps else " (a job's cost needs the tasks' steps)"
    return f"cost {per_step:.4g} a step at the pools' prices{total}"


def _above(value: float, bound: float) -> str:
    """``+12.3%`` above the bound (or ``no bound`` when the bound is 0)."""
    return f"+{value / bound - 1:.1%}" if bound > 0 else "no bound"


def _sized_plan(workload, args: argparse.Namespace, options, objective, max_nodes: int | None):
    """``--gpus auto``: every whole-node count planned (``planner.size_fleet``; written ``quantize: auto`` or as a
    list, once per candidate base, ``planner.sizing_bases.size_per_base``), the sweep printed (also when no count is
    chosen, before the error; the chosen base's, then a line per base), and the chosen count's PlanResult and
    cluster."""
    from rich.console import Console

    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.planner import SizingError, size_fleet
    from lorafleet.planner.base_choice import base_name
    from lorafleet.planner.sizing_bases import size_per_base

    console = Console(width=SIZING_WIDTH)
    cluster, choice = workload_cluster(workload, None, args.gpu), None
    try:
        if workload.spec.quantize_candidates is None:
            sizing = size_fleet(
                workload,
                cluster,
                lambda candidate: workload_cost_model(workload, candidate, args.profile),
                options,
                objective,
                max_nodes=max_nodes,
                progress=_sizing_progress,
            )
        else:
            choice = size_per_base(
                workload,
                cluster,
                lambda over, candidate: workload_cost_model(over, candidate, args.profile),
                options,
                objective,
                max_nodes=max_nodes,
                progress=lambda base, row, planned: _sizing_progress(row, planned, f" over {base_name(base)}"),
            )
            sizing = choice.sizing
    except SizingError as err:
        console.print(sizing_table(err.sweep))
        raise _sizing_flag_error(err) from None
    except InputError as err:
        raise _sizing_flag_error(err) from None
    console.print(sizing_table(sizing))
    for line in choice.lines() if choice is not None else ():
        console.print(line, highlight=False, markup=False)
    pools = len({p.name for r in sizing.rows for p in r.cluster.pools}) > 1
    each = ", ".join(f"{row.gpus}{f' ({row.nodes})' if pools else ''}: {row.plan_s:.1f} s" for row in sizing.rows)
    what = "fleet" if pools else "GPU count"
    counts = f"{len(sizing.rows)} {what}{'s' if len(sizing.rows) != 1 else ''}"
    console.print(f"  swept {counts} in {sum(r.plan_s for r in sizing.rows):.1f} s ({each})")
    if sizing.stopped:
        console.print(f"  {sizing.stopped}")
    return sizing.chosen_row.result, sizing.chosen_row.cluster


def _sizing_progress(row, planned: int, over: str = "") -> None:
    """One line on stderr per count planned (a sweep of many counts takes minutes; ``over``: its base, a choice's)."""
    import sys

    got = (
        f"{row.result.plan.describe()}, {row.step_s:.4g} s and {row.gpu_seconds_per_step:.4g} GPU-s a step"
        if row.feasible
        else f"no plan ({row.infeasible})"
    )
    nodes = row.nodes if len(row.cluster.pools) > 1 or row.cluster.pools[0].name else row.cluster.nodes
    of = f"{nodes} node{'s' if nodes != 1 else ''}" if isinstance(nodes, int) else f"nodes {nodes}"
    print(
        f"lorafleet plan: sizing{over}: {row.gpus} GPUs ({of}): {got} "
        f"[{row.plan_s:.1f} s; {planned} count{'s' if planned != 1 else ''} planned]",
        file=sys.stderr,
        flush=True,
    )


def chosen_plan(workload, cluster, profile, options, console):
    """The PlanResult of ``workload`` on ``cluster``: over its one base, or, written ``quantize: auto`` or as a list,
    over the base the planner chooses (``planner.base_choice``), each candidate's line printed first."""
    from lorafleet.assemble import workload_cost_model
    from lorafleet.planner.base_choice import plan_over_base

    result, choice = plan_over_base(
        workload, cluster, lambda over: workload_cost_model(over, cluster, profile), options
    )
    for line in choice.lines() if choice is not None else ():
        console.print(line, highlight=False, markup=False)
    return result


def run(args: argparse.Namespace) -> int:
    """``lorafleet plan``: the plan of a workload (or a sizing over GPU counts), printed and written."""
    from dataclasses import replace

    from rich.console import Console

    from lorafleet.assemble import workload_cluster
    from lorafleet.commands._replica_groups import WIDTH
    from lorafleet.commands._set_flags import workload_overrides
    from lorafleet.data.describe import check_chat_templates
    from lorafleet.data.model_source import checkable_tokenizer
    from lorafleet.planner.bounds import step_bounds
    from lorafleet.planner.candidates import valid_candidates
    from lorafleet.specs.io import check_writable
    from lorafleet.workload import load_workload

    for path in (args.json, args.plot):
        if path:
            check_writable(path)
    gpus = _gpus(args.gpus)
    amount = _max_cost(args)
    objective, max_nodes = _sizing(args)
    options = _options(args)
    workload = load_workload(args.workload, workload_overrides(args))
    job = None if amount is None else _job_cap(amount, workload, args)
    if job is not None:
        steps, amount = job
        options = replace(options, max_step_cost=amount / steps)
    spec = workload.spec  # chats need a chat template (lengths from the rows checked it already)
    check_chat_templates(
        spec.tasks, lambda: checkable_tokenizer(spec.model, spec.tokenizer, source=workload.path), workload.path
    )
    console = Console(width=WIDTH)
    if gpus == AUTO:
        result, cluster = _sized_plan(workload, args, options, objective, max_nodes)
    else:
        cluster = workload_cluster(workload, gpus, args.gpu)
        result = chosen_plan(workload, cluster, args.profile, options, console)
        _check_limit(result, options, args)
        _check_cap(result, options, job)
    cost_model = result.cost_model  # with the plan's pipeline window

    console.print(plan_table(result.plan, result.expected_step))
    console.print(comparison_table(result))
    for note in result.plan.notes:
        console.print(f"  note: {note}")
    money = cost_line(result, workload, job)
    if money:
        console.print(f"  {money}")
    if result.frontier:
        console.print(frontier_table(result))
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
        from lorafleet.planner.plot import plot_expected_load  # matplotlib only when asked for: ~0.4 s

        console.print(f"  plot: {plot_expected_load(result.plan, result.expected_step, args.plot)}")
    if args.stats:
        from lorafleet.work import cpu_seconds

        console.print(stats_table(result, cpu_seconds()))
    return 0
