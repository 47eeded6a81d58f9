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
   (67%);
b) ``--long-steps`` (800) a task, evaluated every 1/20th of them (the stop again at half the steps), the last
   three tenants, the re-plan's defaults.

A move is priced by the rebuild (``planner.incremental.MigrationModel``): every rebuilt rank loads its stage at
its pool's rate, the A100's 2 GB/s by default (``specs.gpus.NODE_STAGE_LOAD_GBPS``; it was the CPU development
machine's 0.33 GB/s, at which case a's last three kept the fleet). The re-plan prices a move on the expected
batch (``--replan-samples K``: on K sampled batches); so each case that moves is replayed once more with no move
(``--migration-s 1e12``), and the script prints what the move saved on the batches the replay draws beside what
the expected batch promised.

    python benchmarks/bench_eval.py [--steps 200] [--every 10] [--long-steps 800] [--replan-samples 0]

Each figure is printed with the ``lorafleet`` command that prints it too.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from lorafleet.arrivals import ArrivalOptions, Strategy, StrategyRun, load_trace, replay_trace
from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.dispatch import dispatch_step
from lorafleet.eval_replay import held_out_lengths, held_out_rows
from lorafleet.loss_curve import TOKENS_UNIT
from lorafleet.planner import PlannerOptions, plan_deployment, replan_incremental
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
NO_MOVE = 1e12
"""``--migration-s`` of the replay that keeps the fleet: no saving repays a move at this price."""


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


def replay(sets: tuple[str, ...], settings: ReplanSettings, stops: bool = True) -> StrategyRun:
    """The incremental replay of the workload with ``sets``, re-planning by ``settings``, with early stops or
    without."""
    workload = load_workload(WORKLOAD, list(sets))
    trace = load_trace(TRACE, workload)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(trace.all_tasks(), cluster)
    options = ArrivalOptions(strategies=(Strategy.INCREMENTAL,), replan=ReplanOptions(settings), stops=stops)
    return replay_trace(trace, cluster, cost_model, options).runs[0]


def print_hand_back(workload: Workload, half: list[str], steps: int, every: int, samples: int = 0) -> bool:
    """One T4 case: ``half`` plateaus, every task ``steps`` steps evaluated every ``every``, the re-plan's
    defaults but ``--replan-samples`` ``samples``; whether T4 is met. A case that moves is replayed once more
    keeping the fleet (module doc)."""
    sets, settings = plateau_sets(workload, half, steps, every), ReplanSettings(samples=samples)
    flags = (f"--replan-samples {samples}",) if samples else ()
    run, ref = replay(sets, settings), replay(sets, settings, stops=False)
    saved = 1 - run.gpu_s / ref.gpu_s
    missed = [f"saved {100 * (0.25 - saved):.1f} points short"] * (saved < 0.25) + ["no move"] * (run.moves == 0)
    verdict = f"MISSED: {', '.join(missed)}" if missed else "met"
    print(f"  {steps} steps, eval every {every}; plateau: {', '.join(half)}; {settings.objective.value}, "
          f"horizon {settings.horizon}")  # fmt: skip
    stopped = {n: e.stop_step for n, e in run.evals.items() if e.stop_step is not None}
    share = sum(ref.tasks[n].gpu_s + ref.tasks[n].eval_gpu_s for n in half) / ref.gpu_s
    print(f"    stopped: {', '.join(f'{n} at {s}' for n, s in stopped.items()) or 'none'} (the half's share of the "
          f"GPU-s without stops: {share:.0%})")  # fmt: skip
    print(f"    GPU-s {run.gpu_s:,.0f} against {ref.gpu_s:,.0f} without stops: saved {saved:.1%}, "
          f"moves {run.moves} ({run.rebuilt} replicas rebuilt): {verdict}")  # fmt: skip
    for change in run.changes[1:]:
        print(f"      at {change.at_s:,.0f} s, {len(change.tasks)} tasks: {change.plan}, {change.note}")
    print(f"    $ {command(*sets, arrivals=True, flags=flags)}")
    if run.moves and stopped:
        print_against_keeping(sets, run, steps - max(stopped.values()) - settings.after)
    return not missed


def print_against_keeping(sets: tuple[str, ...], run: StrategyRun, after_move: int) -> None:
    """``run``'s moves against the same replay keeping the fleet: on the sampled batches, the GPU-seconds the
    moves saved net of their migration, and per step after them (``after_move`` steps), against what the rule
    expected of them on the expected batch, ``Σ (T_keep G_keep - T_move G_move)`` a step."""
    kept = replay(sets, ReplanSettings(migration_s=NO_MOVE))
    moves = [c for c in run.changes[1:] if c.moved]
    migration = sum(c.migration_gpu_s for c in moves)
    expected = sum(c.keep_step_gpu_s - c.step_gpu_s for c in moves)
    sampled = (kept.gpu_s - run.gpu_s + migration) / after_move
    print(f"    kept instead: {kept.gpu_s:,.0f} GPU-s, so the move saved {kept.gpu_s - run.gpu_s:,.0f} net of "
          f"its migration {migration:,.0f} (the rule expected {expected * after_move - migration:,.0f} over the "
          f"{after_move} steps after it); a step after it saved {sampled:.2f} GPU-s on sampled batches, "
          f"{expected:.2f} expected ({sampled / expected:.0%})")  # fmt: skip
    print(f"    $ {command(*sets, arrivals=True, flags=(f'--migration-s {NO_MOVE:g}',))}")


def print_replan_cost(workload: Workload, samples: int) -> None:
    """CPU seconds of case a's second departure re-plan (the last three tenants leave the plan of all six) on the
    expected batch and on ``samples`` sampled batches, in this process, each side the least of three."""
    names = [t.name for t in workload.tasks]
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster)
    planner = PlannerOptions(robust_samples=0, baselines=False)  # the replay's (``ArrivalOptions.planner``)
    running = plan_deployment(workload, cluster, cost_model, planner).plan
    left = replace(workload, tasks=tuple(t for t in workload.tasks if t.name in names[:3]))
    cpu = {}
    for k in (0, samples):
        options = ReplanOptions(ReplanSettings(samples=k))
        times = []
        for _ in range(3):
            start = time.process_time()
            replan_incremental(running, left, cluster, cost_model, planner, options, 100)
            times.append(time.process_time() - start)
        cpu[k] = min(times)
    print(f"  the departure's re-plan: {cpu[0]:.2f} CPU-s on the expected batch, {cpu[samples]:.2f} on {samples} "
          f"sampled batches ({cpu[samples] / cpu[0]:.2f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="T4: every task's steps (default 200)")
    parser.add_argument("--every", type=int, default=10, help="T4: evaluate every this many steps (default 10)")
    parser.add_argument(
        "--long-steps", type=int, default=800, help="T4 b: every task's steps, evaluated every 1/20th (default 800)"
    )
    parser.add_argument(
        "--replan-samples", type=int, default=0, help="T4: price a move on K sampled batches (default 0: expected)"
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
    met = [print_hand_back(workload, h, args.steps, args.every, args.replan_samples) for h in (names[:3], names[3:])]
    print(f"  b) {args.long_steps} steps a task, the last three tenants, the re-plan's defaults:")
    met.append(print_hand_back(workload, names[3:], args.long_steps, args.long_steps // 20, args.replan_samples))
    print(f"  T4 at the defaults: met by {sum(met)} of {len(met)} cases")
    if args.replan_samples:
        print_replan_cost(workload, args.replan_samples)
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
