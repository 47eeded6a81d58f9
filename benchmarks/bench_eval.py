"""What evaluation costs and what early stopping saves, in simulation (issue #39, targets T2 and T4).

**T2, overhead.** ``examples/lobra-7b.yaml`` (6 tenants, Llama2-7B, 16 x A100-40GB), every task evaluated every
50 of its steps on a 2% split (``defaults.eval``), 100 steps of lorafleet's plan in ``simulate``: the
evaluations' GPU-seconds over the steps'. A preset task holds out 2% of its dataset's published row count, at
most ``max_rows`` (512), and ``max_rows`` where no count is published (``eval_replay.held_out_rows``,
``DatasetPreset.rows``); the script prints each task's held-out rows and how busy the fleet is during a pass.

**T4, hand-back.** The same tenants, each with ``steps`` (``--set defaults.steps``), evaluated every
``--every`` steps with ``early_stopping: {patience: 2}``, replayed by ``simulate --arrivals`` with no events
(``examples/eval/no-arrivals.yaml``) under the incremental re-plan. Half the tenants have a curve whose minimum
is at 40% of their steps' expected tokens (``rise_after`` there, ``rise`` twice the power law's slope there);
the other half's curves fall for ever (no ``rise``: they never stop). The saving is against the same replay
with no stop (``ArrivalOptions(stops=False)``), every task trained to its ``steps``. T4 asks for both at once:
at least 25% saved and the re-plan moving the fleet. Printed:

a) ``--steps`` (200) a task, evaluated every ``--every`` (10), the re-plan's defaults: the first three tenants in
   the file's order (they hold 33% of the GPU-seconds: the fleet moves, too little is saved) and the last three
   (67%: 31% saved, but the move repays 217 of its 656 GPU-s over the 100 steps left, so the fleet is kept);
b) ``--long-steps`` (800) a task, evaluated every 1/20th of them (the stop again at half the steps), the last
   three tenants: with the default ``--replan-horizon`` (200) the move still cannot repay its migration (the
   horizon caps the steps its saving is counted over), with a horizon of the 400 steps left after the stop
   it does, and the fleet moves. The move is priced on expected batches and the sampled ones gain less: at 800
   steps the run that moves ends 148 GPU-s above the one that keeps; at ``--long-steps 1600`` it ends 300 below
   (docs/simulation.md, "Evaluations and early stops").

    python benchmarks/bench_eval.py [--steps 200] [--every 10] [--long-steps 800]

Each figure is printed with the ``lorafleet`` command that prints it too.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from lorafleet.arrivals import ArrivalOptions, Strategy, load_trace, replay_trace
from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.dispatch import dispatch_step
from lorafleet.eval_replay import held_out_lengths, held_out_rows
from lorafleet.loss_curve import TOKENS_UNIT
from lorafleet.planner import plan_deployment
from lorafleet.planner.incremental import ReplanOptions
from lorafleet.sampling import TaskDraw, global_batch
from lorafleet.simulate import simulate_schedule
from lorafleet.specs.replan import ReplanSettings
from lorafleet.workload import Workload, load_workload

WORKLOAD = "examples/lobra-7b.yaml"
TRACE = "examples/eval/no-arrivals.yaml"
T2_SETS = ("defaults.eval.every_steps=50", "defaults.eval.split=0.02")
L_INF, A, ALPHA = 1.0, 0.5, 0.5
"""Every tenant's power law (n in M tokens): the plateau, the excess at 1 M tokens, the exponent."""


def command(*sets: str, arrivals: bool = False, steps: int | None = None, flags: tuple[str, ...] = ()) -> str:
    given = [f"--arrivals {TRACE}"] if arrivals else [f"--steps {steps}"]
    return " ".join(["lorafleet simulate", WORKLOAD, *given, *flags, *(f"--set {s}" for s in sets)])


def overhead(sets: tuple[str, ...], steps: int) -> tuple[float, float, float]:
    """(eval GPU-s, steps' GPU-s, the passes' mean busy share) of lorafleet's plan over ``steps`` steps."""
    workload = load_workload(WORKLOAD, list(sets))
    cluster = workload_cluster(workload)
    result = plan_deployment(workload, cluster, workload_cost_model(workload, cluster))
    run = simulate_schedule(workload, result.schedule, result.cost_model, steps)
    return sum(run.eval_gpu_seconds.values()), float(run.gpu_seconds.sum()), pass_busy(workload, result)


def pass_busy(workload: Workload, result) -> float:
    """One joint pass's busy share: Σ_r forward time x GPUs over its makespan x the plan's GPUs."""
    plan, cost_model = result.schedule.phases[0].plan, result.cost_model
    draws = [(k, 0, TaskDraw(held_out_lengths(t, workload.spec.seed), 0, 0)) for k, t in enumerate(workload.tasks)]
    step_plan = dispatch_step(global_batch(0, draws), plan, cost_model)
    busy = [
        cost_model.forward_time(r.config, [mb.shape for mb in w.microbatches])
        for r, w in zip(plan.replicas, step_plan.work)
    ]
    return sum(b * r.config.n_gpus for b, r in zip(busy, plan.replicas)) / (max(busy) * plan.used_gpus)


def plateau_sets(workload: Workload, names: list[str], steps: int, every: int) -> tuple[str, ...]:
    """``--set`` overrides: every task ``steps`` steps, evaluated every ``every`` with patience 2; the tasks
    ``names`` plateau at 40% of their steps' expected tokens (module doc), the others never stop."""
    sets = [f"defaults.steps={steps}", f"defaults.eval.every_steps={every}", "defaults.early_stopping.patience=2"]
    sets += [f"defaults.eval.curve.{k}={v}" for k, v in (("l_inf", L_INF), ("a", A), ("alpha", ALPHA))]
    for name in names:
        low = 0.4 * steps * workload.task(name).expected_tokens / TOKENS_UNIT
        rise = 2 * ALPHA * A * low ** (-ALPHA - 1)
        sets += [f"tasks.{name}.eval.curve.rise_after={low:.4g}", f"tasks.{name}.eval.curve.rise={rise:.4g}"]
    return tuple(sets)


def hand_back(sets: tuple[str, ...], settings: ReplanSettings):
    """The incremental replay with early stops and without, re-planning by ``settings``: (with, without)."""
    workload = load_workload(WORKLOAD, list(sets))
    trace = load_trace(TRACE, workload)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(trace.all_tasks(), cluster)
    options = ArrivalOptions(strategies=(Strategy.INCREMENTAL,), replan=ReplanOptions(settings))
    with_stops = replay_trace(trace, cluster, cost_model, options).runs[0]
    without = replay_trace(trace, cluster, cost_model, replace(options, stops=False))
    return with_stops, without.runs[0]


def print_hand_back(workload: Workload, half: list[str], steps: int, every: int, horizon: int | None = None) -> None:
    """One T4 case: ``half`` plateaus, every task ``steps`` steps evaluated every ``every``, the re-plan's
    ``--replan-horizon`` ``horizon`` (None: its default)."""
    sets = plateau_sets(workload, half, steps, every)
    settings = ReplanSettings() if horizon is None else ReplanSettings(horizon=horizon)
    flags = () if horizon is None else (f"--replan-horizon {horizon}",)
    run, ref = hand_back(sets, settings)
    saved = 1 - run.gpu_s / ref.gpu_s
    missed = [f"saved {100 * (0.25 - saved):.1f} points short"] * (saved < 0.25) + ["no move"] * (run.moves == 0)
    verdict = f"MISSED: {', '.join(missed)}" if missed else "met"
    print(f"  {steps} steps, eval every {every}; plateau: {', '.join(half)}; {settings.objective.value}, "
          f"horizon {settings.horizon}")  # fmt: skip
    stops = ", ".join(f"{n} at {e.stop_step}" for n, e in run.evals.items() if e.stop_step is not None)
    share = sum(ref.tasks[n].gpu_s + ref.tasks[n].eval_gpu_s for n in half) / ref.gpu_s
    print(f"    stopped: {stops or 'none'} (the half's share of the GPU-s without stops: {share:.0%})")
    print(f"    GPU-s {run.gpu_s:,.0f} against {ref.gpu_s:,.0f} without stops: saved {saved:.1%}, "
          f"moves {run.moves} ({run.rebuilt} replicas rebuilt): {verdict}")  # fmt: skip
    for change in run.changes[1:]:
        print(f"      at {change.at_s:,.0f} s, {len(change.tasks)} tasks: {change.plan}, {change.note}")
    print(f"    $ {command(*sets, arrivals=True, flags=flags)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="T4: every task's steps (default 200)")
    parser.add_argument("--every", type=int, default=10, help="T4: evaluate every this many steps (default 10)")
    parser.add_argument(
        "--long-steps", type=int, default=800, help="T4 b: every task's steps, evaluated every 1/20th (default 800)"
    )
    args = parser.parse_args()
    start = time.perf_counter()

    print("T2: evaluating every 50 steps on a 2% split adds at most 3% GPU-seconds (lorafleet's plan, 100 steps)")
    evals, steps_gpu_s, busy = overhead(T2_SETS, 100)
    verdict = "met" if evals / steps_gpu_s <= 0.03 else f"MISSED by {100 * (evals / steps_gpu_s - 0.03):.2f} points"
    print(f"  eval {evals:,.1f} GPU-s / steps {steps_gpu_s:,.1f} GPU-s = {evals / steps_gpu_s:.2%} ({verdict});")
    held = load_workload(WORKLOAD, list(T2_SETS))
    print("  held out: " + ", ".join(f"{t.name} {held_out_rows(t)}" for t in held.tasks), end="")
    print(f" rows; a joint pass keeps the fleet {busy:.0%} busy")
    print(f"    $ {command(*T2_SETS, steps=100)}")

    workload = load_workload(WORKLOAD)
    names = [t.name for t in workload.tasks]
    print("\nT4: half the tenants plateau at 40% of their steps (patience 2): early stopping saves at least 25%")
    print("    of the run's GPU-seconds, the re-plan moving the fleet")
    print(f"  a) {args.steps} steps a task, the re-plan's defaults, the file's first three tenants and its last three:")
    for half in (names[:3], names[3:]):
        print_hand_back(workload, half, args.steps, args.every)
    print(f"  b) {args.long_steps} steps a task, the last three tenants, the re-plan's default horizon, then a horizon")
    print("     covering the steps left after the stop:")
    for horizon in (None, args.long_steps // 2):
        print_hand_back(workload, names[3:], args.long_steps, args.long_steps // 20, horizon)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
