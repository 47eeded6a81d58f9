"""``lorafleet whatif``: re-plan and re-simulate a workload across GPU counts, kinds, models, tasks, R."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.commands._set_flags import add_set_flag

    parser = subparsers.add_parser("whatif", help="sweep GPU count/kind, model, tasks or R; CSV and plots")
    parser.add_argument("workload", help="workload YAML file")
    parser.add_argument(
        "--vary",
        action="append",
        required=True,
        metavar="AXIS=V1,V2",
        help="gpus=16,32 | gpu=A100-40GB,H100-80GB | model=llama2-7b,... | tasks=none,+xsum,-billsum | R=4,8,16 "
        "| quantize=none,nf4 (repeatable: the Cartesian product is swept)",
    )
    parser.add_argument("--steps", type=int, default=8, help="simulated steps per point (default 8)")
    parser.add_argument("--profile", help="fitted profile JSON (default: analytic per GPU kind)")
    parser.add_argument(
        "--out", default="whatif", help="output directory for whatif.csv and PNG plots (default ./whatif)"
    )
    add_set_flag(parser)
    parser.set_defaults(func=run)


def _plots(rows: list[dict], axes: list[str], out) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [f"vary_{a}" for a in axes]
    points = list(dict.fromkeys(" ".join(str(r[k]) for k in keys) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    written = []
    for metric, label in (("gpu_s_per_step", "GPU-seconds per step"), ("step_s", "step time (s)")):
        # 1.8 in more for the legend, right of the axes: inside them it would cover the tallest bars.
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(points)) + 1.8, 3.8))
        width = 0.8 / len(methods)
        for m, method in enumerate(methods):
            values = [
                next(r[metric] for r in rows if r["method"] == method and " ".join(str(r[k]) for k in keys) == p)
                for p in points
            ]
            ax.bar([i + m * width for i in range(len(points))], values, width, label=method)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(points))], points, rotation=20, fontsize=8)
        ax.set(ylabel=label, xlabel=" / ".join(axes), title=f"{label} across the sweep")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def run(args: argparse.Namespace) -> int:
    import csv
    import io
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from lorafleet.commands._set_flags import workload_overrides
    from lorafleet.errors import InputError
    from lorafleet.specs.io import check_writable, write_text_atomic
    from lorafleet.whatif import Variation, sweep
    from lorafleet.workload import load_workload

    if args.steps < 1:
        raise InputError("<args>", "--steps", f"must be >= 1, got {args.steps}")
    check_writable(args.out, directory=True)
    variations = [Variation.parse(v) for v in args.vary]
    axes = [v.axis for v in variations]
    if len(set(axes)) != len(axes):
        raise InputError("<args>", "--vary", "each axis may be varied once")
    console = Console(width=160)
    rows = sweep(
        load_workload(args.workload, workload_overrides(args)),
        variations,
        args.steps,
        args.profile,
        on_skip=lambda note: console.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table_text = io.StringIO()
    writer = csv.DictWriter(table_text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(out / "whatif.csv", table_text.getvalue())
    plots = _plots(rows, axes, out)
    table = Table(title=f"what-if over {', '.join(axes)} ({args.steps} simulated steps per point)")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()])
    console.print(table)
    console.print(f"wrote {out / 'whatif.csv'} and {', '.join(str(p) for p in plots)}")
    return 0
