"""``lorafleet train WORKLOAD --plan PLAN.json``: train every task's adapter on the plan's replicas.

Parses the command line into :class:`lorafleet.train.options.TrainOptions` and hands it to
:func:`lorafleet.train.launcher.launch` (checks, torchrun, the step loop: see :mod:`lorafleet.train`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lorafleet.errors import InputError

if TYPE_CHECKING:
    from lorafleet.train.options import TrainOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    from lorafleet.commands._plan_flags import add_cluster_flags, add_policy_flags
    from lorafleet.commands._set_flags import add_set_flag
    from lorafleet.runtime.processes import START_TIMEOUT_S

    parser = subparsers.add_parser("train", help="train the workload's adapters on a deployment plan (torch)")
    parser.add_argument("workload", help="workload YAML file (every task needs data)")
    parser.add_argument("--plan", required=True, help="DeploymentPlan JSON (from `lorafleet plan --json`)")
    parser.add_argument("--steps", type=int, default=10, help="the run's total training steps (default 10)")
    parser.add_argument("--out", default="runs/train", help="output directory (default runs/train)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in --out")
    parser.add_argument(
        "--allow-changes",
        action="store_true",
        help="with --resume: train on with task hyperparameters changed since the run started (recorded with "
        "their step in tasks.json, workload.resolved.yaml and the adapter cards); without it they are refused",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an --out a previous run used (its files "
        "are removed); without it, or --resume, a used --out is refused",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart the workers up to K times after a failure, from the last checkpoint (default 0)",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=START_TIMEOUT_S,
        metavar="S",
        help="seconds the workers have to form their process group at each start and restart; a worker that never "
        f"arrives ends the start with one line, and another restart with --max-restarts (default {START_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--no-stop-checkpoint",
        action="store_true",
        help="on SIGINT/SIGTERM stop at the step boundary without committing a checkpoint",
    )
    parser.add_argument(
        "--nonfinite-patience",
        type=int,
        default=3,
        metavar="K",
        help="a task skipped K steps in a row for a non-finite loss or gradient stops (default 3)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=50, metavar="K", help="checkpoint every K steps")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="cuda: NCCL, one GPU per process; cpu: gloo (default: cuda when there are enough GPUs)",
    )
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="of the frozen base model and the activations (default fp32); adapters stay fp32 master "
        "weights over a bf16 base",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (a log line per step instead; so too when stdout is not a terminal)",
    )
    parser.add_argument(
        "--inject-slowdown",
        action="append",
        default=[],
        metavar="REPLICA=FACTOR",
        help="fault injection: replica REPLICA runs FACTOR >= 1 times slower (a straggler; repeatable)",
    )
    parser.add_argument(
        "--logger",
        action="append",
        default=[],
        metavar="wandb|mlflow",
        help="also log the step scalars to Weights & Biases (project lorafleet; WANDB_MODE applies) or MLflow "
        "(MLFLOW_TRACKING_URI, else <out>/mlruns); repeatable; needs pip install 'lorafleet[wandb]' / '[mlflow]'",
    )
    queue = parser.add_argument_group("live task queue (tasks added, finished, cancelled while training)")
    queue.add_argument(
        "--queue",
        metavar="DIR",
        help="the directory of task request files the run watches (default <out>/queue; docs/queue.md)",
    )
    queue.add_argument(
        "--queue-http",
        type=int,
        metavar="PORT",
        help="also take requests over HTTP on 127.0.0.1:PORT (0: a free port), with the token written to "
        "<queue>/.http.json",
    )
    queue.add_argument(
        "--queue-data-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a queued task's data must resolve inside DIR (symlinks followed; repeatable; default: the "
        "directories that hold the workload's own data); a request outside is rejected",
    )
    queue.add_argument(
        "--migration-s",
        type=float,
        default=None,
        metavar="S",
        help="price a change of deployment at a flat S seconds of each torn-down replica's GPUs (default: what "
        "the in-process rebuild costs, measured by the run)",
    )
    queue.add_argument(
        "--replan-objective",
        choices=("makespan", "gpu-s"),
        default="makespan",
        help="what a re-plan minimises: the planner's makespan, a move taken when its GPU-seconds repay its "
        "migration (default), or the GPU-seconds over the horizon, migration included",
    )
    queue.add_argument(
        "--replan-horizon",
        type=int,
        default=200,
        metavar="STEPS",
        help="the most steps a re-plan counts a new deployment's savings over (default 200)",
    )
    queue.add_argument(
        "--replan-after",
        type=int,
        default=1,
        metavar="STEPS",
        help="a change the running deployment can serve is applied on it at once, its re-plan runs beside the "
        "next STEPS steps and a move it finds is applied after them (default 1; 0: the change waits for the "
        "re-plan)",
    )
    add_set_flag(parser)
    add_cluster_flags(parser)
    add_policy_flags(parser)
    parser.set_defaults(func=run)


def _slowdown(items: list[str]) -> tuple[tuple[int, float], ...]:
    import math

    out = []
    for item in items:
        replica, _, factor = item.partition("=")
        try:
            r, f = int(replica), float(factor)
        except ValueError:
            raise InputError("<args>", "--inject-slowdown", f"expected REPLICA=FACTOR, got {item!r}") from None
        if not (math.isfinite(f) and f >= 1):
            raise InputError("<args>", "--inject-slowdown", f"the factor must be a finite number >= 1, got {item!r}")
        out.append((r, f))
    return tuple(out)


def options_of(args: argparse.Namespace) -> TrainOptions:
    """The TrainOptions a parsed command line asks for."""
    from lorafleet.commands._plan_flags import policy_overrides
    from lorafleet.commands._set_flags import workload_overrides
    from lorafleet.train.options import TrainOptions

    return TrainOptions(
        workload=args.workload,
        sets=workload_overrides(args),
        plan=args.plan,
        steps=args.steps,
        out=args.out,
        resume=args.resume,
        allow_changes=args.allow_changes,
        overwrite=args.overwrite,
        max_restarts=args.max_restarts,
        start_timeout_s=args.start_timeout,
        checkpoint_on_stop=not args.no_stop_checkpoint,
        nonfinite_patience=args.nonfinite_patience,
        checkpoint_every=args.checkpoint_every,
        device=args.device,
        dtype=args.dtype,
        gpus=args.gpus,
        gpu=args.gpu,
        profile=args.profile,
        policy_overrides=tuple(policy_overrides(args).items()),
        progress=not args.no_progress,
        slowdown=_slowdown(args.inject_slowdown),
        queue=args.queue,
        queue_http=args.queue_http,
        queue_data_roots=tuple(args.queue_data_root),
        migration_s=args.migration_s,
        replan_horizon=args.replan_horizon,
        replan_objective=args.replan_objective,
        replan_after=args.replan_after,
        loggers=tuple(dict.fromkeys(args.logger)),
    )


def run(args: argparse.Namespace) -> int:
    from lorafleet.train.launcher import launch

    return launch(options_of(args))
