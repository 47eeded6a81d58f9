"""``--set KEY=VALUE``, shared by every command that reads a workload (``validate``, ``plan``,
``simulate``, ``whatif``, ``dispatch``, ``train``): it overrides a field of the workload file before
it is validated (:func:`lorafleet.workload.apply_overrides`; docs/workload.md, "Overriding fields")."""

from __future__ import annotations

import argparse


def add_set_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload field before validation (repeatable): a dotted KEY, tasks by name or index "
        "(tasks.dolly.lora.rank=32, tasks.0.batch_size=8, defaults.optimizer.lr=2e-4, cluster.nodes=1); "
        "VALUE is YAML",
    )


def workload_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``--set`` items of a parsed command line, in order."""
    return tuple(getattr(args, "sets", None) or ())
