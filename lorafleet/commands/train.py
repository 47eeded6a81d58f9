"""``lorafleet train WORKLOAD --plan PLAN.json``: train every task's adapter on the plan's replicas.

Parses the command line into :class:`lorafleet.train.options.TrainOptions`, whose fields are the command's
flags (``commands._option_flags`` generates them, their help and defaults from its field table), and hands it to
:func:`lorafleet.train.launcher.launch` (checks, torchrun, the step loop: see :mod:`lorafleet.train`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lorafleet.errors import InputError

if TYPE_CHECKING:
    from lorafleet.train.options import TrainOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.commands._option_flags import add_field_flags
    from lorafleet.commands._plan_flags import add_cluster_flags, add_policy_flags
    from lorafleet.commands._set_flags import add_set_flag
    from lorafleet.train.options import TrainOptions

    parser = subparsers.add_parser("train", help="train the workload's adapters on a deployment plan (torch)")
    add_field_flags(parser, TrainOptions)  # its own flags, the queue's and the re-plan's: one a field
    add_set_flag(parser)
    add_cluster_flags(parser)
    add_policy_flags(parser)
    parser.set_defaults(func=run)


def _slowdown(items: list[str]) -> tuple[tuple[int, float], ...]:
    import math

    from lorafleet.specs.fields import ARGS, flag_of
    from lorafleet.train.options import TrainOptions

    where = flag_of(TrainOptions, "slowdown")
    out = []
    for item in items:
        replica, _, factor = item.partition("=")
        try:
            r, f = int(replica), float(factor)
        except ValueError:
            raise InputError(ARGS, where, f"expected REPLICA=FACTOR, got {item!r}") from None
        if not (math.isfinite(f) and f >= 1):
            raise InputError(ARGS, where, f"the factor must be a finite number >= 1, got {item!r}")
        out.append((r, f))
    return tuple(out)


def options_of(args: argparse.Namespace) -> TrainOptions:
    """The TrainOptions a parsed command line asks for: its field table's flags, and the policy's."""
    from lorafleet.commands._option_flags import field_values
    from lorafleet.commands._plan_flags import policy_overrides
    from lorafleet.train.options import TrainOptions

    convert = {"slowdown": _slowdown, "loggers": lambda names: tuple(dict.fromkeys(names))}
    return TrainOptions(
        **field_values(args, TrainOptions, convert=convert), policy_overrides=tuple(policy_overrides(args).items())
    )


def run(args: argparse.Namespace) -> int:
    from lorafleet.train.launcher import launch

    return launch(options_of(args))
