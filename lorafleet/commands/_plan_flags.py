"""The flags every plan-reading command shares (``simulate``, ``dispatch``, ``train``), and what they do.

A plan carries the dispatch policy and the cost model it was judged under; these commands
run that policy by default. A flag below overrides one part of it, and the command prints
what it overrode. ``--gpus``/``--gpu`` name the cluster the plan was made for, as they do for
``plan``; the plan is then checked against it (:func:`lorafleet.plan_check.check_plan`).
"""

from __future__ import annotations

import argparse

from lorafleet.assemble import POLICY_FLAGS
from lorafleet.errors import InputError

ARGS = "<args>"


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, help="override the workload's GPU count (as given to `plan`)")
    parser.add_argument("--gpu", help="override the workload's GPU kind (as given to `plan`)")


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    """Flags overriding parts of the plan's dispatch policy; each defaults to the plan's."""
    group = parser.add_argument_group("dispatch policy (default: the plan's own)")
    group.add_argument("--profile", help="cost-model profile JSON (default: the one the plan was judged by)")
    group.add_argument("--microbatch", help="padding or packing micro-batches")
    group.add_argument("--buckets", type=int, help="R, the most buckets per step")
    group.add_argument("--alignment", type=int, help="bucket boundaries are multiples of this")
    group.add_argument("--method", help="fast, exact (MILP) or length (LobRA's baseline)")
    group.add_argument("--solver", help="MILP back end of --method exact: cbc, scip or highs")
    group.add_argument("--time-limit", type=float, help="seconds per exact solve")
    group.add_argument("--gap", type=float, help="relative gap an exact solve may stop at")
    group.add_argument(
        "--choose-buckets-by-makespan",
        action="store_const",
        const=True,
        help="pick the bucket count <= R with the least estimated makespan, not the least padding",
    )
    group.add_argument(
        "--recalibrate",
        action=argparse.BooleanOptionalAction,
        help="correct the cost model from measured replica times between steps",
    )
    group.add_argument(
        "--pipeline-window",
        type=int,
        metavar="N",
        help="steps a pipelined replica streams before it drains (1: 1F1B flushed every step)",
    )


def policy_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Policy field -> value, for the flags that were given."""
    values = {
        "microbatch_mode": args.microbatch,
        "n_buckets": args.buckets,
        "bucket_alignment": args.alignment,
        "method": args.method,
        "solver": args.solver,
        "time_limit_s": args.time_limit,
        "gap_rel": args.gap,
        "choose_buckets_by_makespan": args.choose_buckets_by_makespan,
        "recalibration": args.recalibrate,
        "pipeline_window": args.pipeline_window,
    }
    return {k: v for k, v in values.items() if v is not None}


def planned_run(workload, args: argparse.Namespace):
    """The command's plan (``args.plan``), with its flags applied, its cost model and its check passed."""
    from lorafleet.assemble import prepare_run, workload_cluster

    cluster = workload_cluster(workload, args.gpus, args.gpu)
    try:
        return prepare_run(workload, cluster, args.plan, args.profile, policy_overrides(args))
    except InputError as err:
        if err.path != "<dispatch options>":
            raise
        flag = POLICY_FLAGS.get(err.field.removeprefix("recalibration."), err.field)
        raise InputError(ARGS, flag, err.msg) from None
