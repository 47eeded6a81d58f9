"""``lorafleet sweep-report RUN``: the sweeps of a training run, finished or still running (``lorafleet.sweep_report``):
per sweep its winner and the members' table (values, each rung's score, best eval loss, steps, GPU-seconds, how
each left); ``--json`` writes the same as JSON, ``--plot`` the members' eval curves with the rungs marked."""

from __future__ import annotations

import argparse
from pathlib import Path

from lorafleet.errors import InputError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sweep-report", help="a training run's sweeps: members, rungs and the winner")
    parser.add_argument("run", help="the run directory (train --out)")
    parser.add_argument("--json", metavar="PATH", help="also write the sweeps' results as JSON")
    parser.add_argument(
        "--plot", metavar="DIR", help="also plot each sweep's eval curves, its rungs marked, as DIR/sweep-<name>.png"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lorafleet.rundir import RunDir
    from lorafleet.sweep_report import plot_sweep, report_text, save_results, sweep_results
    from lorafleet.train.promote import run_tasks

    run_dir = RunDir(Path(args.run))
    tasks = run_tasks(run_dir)
    if not tasks:
        raise InputError(args.run, "", "is no training run (no tasks.json or workload.resolved.yaml)")
    results = sweep_results(run_dir, tasks)
    if not results:
        raise InputError(args.run, "", "the run has no sweep (a task's sweep: docs/workload.md)")
    if args.json:
        save_results(Path(args.json), results)
    if args.plot:
        Path(args.plot).mkdir(parents=True, exist_ok=True)
        for result in results:
            plot_sweep(result, Path(args.plot) / f"sweep-{result.name}.png")
    print(report_text(results))
    return 0
