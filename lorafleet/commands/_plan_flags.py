"""The flags every plan-reading command shares (``simulate``, ``dispatch``, ``train``), and the policy
flags of ``plan``.

A plan carries the dispatch policy and the cost model it was judged under; these commands run that
policy by default. A policy flag overrides one field of it, and the command prints what it overrode.
The policy flags are generated from the policy's field table (:func:`lorafleet.specs.dispatch.policy_fields`:
each field's flag, type and doc string), never listed here. ``--gpus``/``--gpu`` name the cluster the
plan was made for, as they do for ``plan``; the plan is then checked against it
(:func:`lorafleet.plan_check.check_plan`).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from enum import Enum

from lorafleet.errors import InputError
from lorafleet.specs.dispatch import DispatchPolicy, PolicyField, flag_error, policy_fields

ARGS = "<args>"
POLICY_DEST = "policy:"
"""Prefix of the argparse destination of a policy field's flag (``policy:n_buckets``)."""


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, help="override the workload's GPU count (as given to `plan`)")
    parser.add_argument("--gpu", help="override the workload's GPU kind (as given to `plan`)")


def add_policy_flags(
    parser: argparse.ArgumentParser, *, defaults: DispatchPolicy | None = None, only: Collection[str] | None = None
) -> argparse._ArgumentGroup:
    """One flag per policy field that has one (``--buckets``, ``--recalibrate/--no-recalibrate``, ...), or only
    for the field keys in ``only``, and ``--profile``. Each defaults to the plan's own value; with ``defaults``
    (``plan``, which makes the policy and has its own ``--profile``) its help names that policy's value
    instead. Returns the flags' group."""
    title = "dispatch policy" if defaults is not None else "dispatch policy (default: the plan's own)"
    group = parser.add_argument_group(title)
    if defaults is None:
        group.add_argument("--profile", help="cost-model profile JSON (default: the one the plan was judged by)")
    for f in policy_fields():
        if f.flag is None or (only is not None and f.key not in only):
            continue
        group.add_argument(f.flag, dest=POLICY_DEST + f.key, default=None, help=_help(f, defaults), **_kind(f))
    return group


def _kind(f: PolicyField) -> dict[str, object]:
    if f.type is bool:  # a switch on by default can be turned off (--no-recalibrate); one off only turned on
        return {"action": argparse.BooleanOptionalAction} if f.default else {"action": "store_const", "const": True}
    if isinstance(f.type, type) and issubclass(f.type, Enum):
        return {"metavar": f.metavar or "|".join(e.value for e in f.type)}
    return {"type": f.type, "metavar": f.metavar}


def _help(f: PolicyField, defaults: DispatchPolicy | None) -> str:
    if defaults is None:
        return f.doc
    value = defaults.value(f.key)
    shown = value.value if isinstance(value, Enum) else value
    return f"{f.doc} (default {'on' if shown is True else 'off' if shown is False else shown})"


def policy_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Policy field key -> value, for the policy flags that were given."""
    given = {key.removeprefix(POLICY_DEST): v for key, v in vars(args).items() if key.startswith(POLICY_DEST)}
    return {key: value for key, value in given.items() if value is not None}


def given_policy_flags(args: argparse.Namespace) -> list[str]:
    """The policy flags that were given, by name (``--buckets``), in table order."""
    given = policy_overrides(args)
    return [f.flag for f in policy_fields() if f.key in given and f.flag is not None]


def flagged_policy(base: DispatchPolicy, args: argparse.Namespace) -> DispatchPolicy:
    """``base`` with the given policy flags applied; a bad value is an InputError naming its flag."""
    try:
        return base.with_overrides(policy_overrides(args))
    except InputError as err:
        raise flag_error(err, ARGS) from None


def planned_run(workload, args: argparse.Namespace):
    """The command's plan (``args.plan``), with its flags applied, its cost model and its check passed."""
    from lorafleet.assemble import prepare_run, workload_cluster

    cluster = workload_cluster(workload, args.gpus, args.gpu)
    return prepare_run(workload, cluster, args.plan, args.profile, policy_overrides(args))
