"""What evaluation costs and what early stopping saves, in simulation (issue #39, targets T2 and T4).

**T2, overhead.** ``examples/lobra-7b.yaml`` (6 tenants, Llama2-7B, 16 x A100-40GB), every task evaluated every
50 of its steps on a 2% split (``defaults.eval``), 100 steps of lorafleet's plan in ``simulate``: the
evaluations' GPU-seconds over the steps'. The presets know no row counts, so a what-if holds out ``max_rows``
(512) rows a task (``eval_replay.held_out_rows``); the script also prints the figure with the held-out rows
that a 2% split of each dataset's published size gives, and how busy the fleet is during a pass.

**T4, hand-back.** The same tenants, each with ``steps`` (``--set defaults.steps``), evaluated every
``--every`` steps with ``early_stopping: {patience: 2}``, replayed by ``simulate --arrivals`` with no events
(``examples/eval/no-arrivals.yaml``) under the incremental re-plan. Half the tenants have a curve whose minimum
is at 40% of their steps' expected tokens (``rise_after`` there, ``rise`` twice the power law's slope there);
the other half's curves fall for ever (no ``rise``: they never stop). The saving is against the same replay
with no stop (``ArrivalOptions(stops=False)``), every task trained to its ``steps``. Both halves are printed:
the first three tenants in the file's order and the last three.

    python benchmarks/bench_eval.py [--steps 200] [--every 10]

Each figure is printed with the ``lorafleet`` command that prints it too.
"""

from __future__ import annotations

import argparse
import time

from lorafleet.arrivals import ArrivalOptions, Strategy, load_trace, replay_trace
from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.dispatch import dispatch_step
from lorafleet.eval_replay import held_out_lengths
from lorafleet.loss_curve import TOKENS_UNIT
from lorafleet.planner import plan_deployment
from lorafleet.sampling import TaskDraw, global_batch
from lorafleet.simulate import simulate_schedule
from lorafleet.workload import Workload, load_workload

WORKLOAD = "examples/lobra-7b.yaml"
TRACE = "examples/eval/no-arrivals.yaml"
T2_SETS = ("defaults.eval.every_steps=50", "defaults.eval.split=0.02")
PUBLISHED_ROWS = {"dolly": 15_011, "meetingbank": 6_892, "python-code": 18_612}
"""Published sizes of the datasets whose 2% is under 512 rows (databricks-dolly-15k, MeetingBank's segments,
python_code_instructions_18k); the other three datasets have over 25,600 rows."""
L_INF, A, ALPHA = 1.0, 0.5, 0.5
"""Every tenant's power law (n in M tokens): the plateau, the excess at 1 M tokens, the exponent."""


def command(*sets: str, arrivals: bool = False, steps: int | None = None) -> str:
    flags = [f"--arrivals {TRACE}"] if arrivals else [f"--steps {steps}"]
    return " ".join(["lorafleet simulate", WORKLOAD, *flags, *(f"--set {s}" for s in sets)])


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


def hand_back(sets: tuple[str, ...]):
    """The incremental replay with early stops and without: (with, without)."""
    workload = load_workload(WORKLOAD, list(sets))
    trace = load_trace(TRACE, workload)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(trace.all_tasks(), cluster)
    options = ArrivalOptions(strategies=(Strategy.INCREMENTAL,))
    with_stops = replay_trace(trace, cluster, cost_model, options).runs[0]
    without = replay_trace(trace, cluster, cost_model, ArrivalOptions(strategies=options.strategies, stops=False))
    return with_stops, without.runs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="T4: every task's steps (default 200)")
    parser.add_argument("--every", type=int, default=10, help="T4: evaluate every this many steps (default 10)")
    args = parser.parse_args()
    start = time.perf_counter()

    print("T2: evaluating every 50 steps on a 2% split adds at most 3% GPU-seconds (lorafleet's plan, 100 steps)")
    evals, steps_gpu_s, busy = overhead(T2_SETS, 100)
    verdict = "met" if evals / steps_gpu_s <= 0.03 else f"MISSED by {100 * (evals / steps_gpu_s - 0.03):.2f} points"
    print(f"  eval {evals:,.1f} GPU-s / steps {steps_gpu_s:,.1f} GPU-s = {evals / steps_gpu_s:.2%} ({verdict});")
    print(f"  a joint pass keeps the fleet {busy:.0%} busy (512 rows a task)")
    print(f"    $ {command(*T2_SETS, steps=100)}")
    rows = tuple(f"tasks.{n}.eval.max_rows={round(0.02 * r)}" for n, r in PUBLISHED_ROWS.items())
    evals, steps_gpu_s, busy = overhead(T2_SETS + rows, 100)
    print(f"  with 2% of the published row counts held out: {evals / steps_gpu_s:.2%} (pass {busy:.0%} busy)")
    print(f"    $ {command(*T2_SETS, *rows, steps=100)}")

    workload = load_workload(WORKLOAD)
    names = [t.name for t in workload.tasks]
    print(f"\nT4: half the tenants plateau at 40% of {args.steps} steps (eval every {args.every}, patience 2):")
    print("    early stopping saves at least 25% of the run's GPU-seconds, the re-plan moving the fleet")
    for half in (names[:3], names[3:]):
        sets = plateau_sets(workload, half, args.steps, args.every)
        run, ref = hand_back(sets)
        saved = 1 - run.gpu_s / ref.gpu_s
        verdict = "met" if saved >= 0.25 else f"MISSED by {100 * (0.25 - saved):.1f} points"
        print(f"  plateau: {', '.join(half)}")
        stops = ", ".join(f"{n} at {e.stop_step}" for n, e in run.evals.items() if e.stop_step is not None)
        print(f"    stopped: {stops or 'none'}")
        print(f"    GPU-s {run.gpu_s:,.0f} against {ref.gpu_s:,.0f} without stops: saved {saved:.1%} ({verdict})")
        print(f"    re-plans {run.plans - 1}, moves {run.moves} ({run.rebuilt} replicas rebuilt):")
        for change in run.changes[1:]:
            print(f"      at {change.at_s:,.0f} s, {len(change.tasks)} tasks: {change.plan}, {change.note}")
        print(f"    $ {command(*sets, arrivals=True)}")
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
