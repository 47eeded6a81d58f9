"""``lorafleet train WORKLOAD --plan PLAN.json``: train every task's adapter on the plan's replicas.

Started plainly, the command re-runs itself under ``torchrun --standalone`` with one process
per rank of the plan. Started under torchrun (the user's own, e.g. across nodes), each
process joins the group and builds its part of the fleet; rank 0 then runs the step loop:

    per step: global batch (data streams) -> dispatch (one step ahead) -> run_step -> metrics
              -> every --checkpoint-every steps, and at the end, a committed checkpoint

Writes, under ``--out``: ``metrics.jsonl`` and its twin ``metrics.csv`` (one line per step: loss
per task, tokens/s, busy time per replica and the cost model's prediction of it, dispatch solve
time), ``tensorboard/`` (the same as TensorBoard scalars), ``checkpoints/`` (resumable with
``--resume``) and ``adapters/<task>/`` (the final PEFT adapters). Rank 0 shows a progress bar
when stdout is a terminal (``--no-progress`` turns it off).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lorafleet.errors import InputError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train the workload's adapters on a deployment plan (torch)")
    parser.add_argument("workload", help="workload YAML file (every task needs data)")
    parser.add_argument("--plan", required=True, help="DeploymentPlan JSON (from `lorafleet plan --json`)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--out", default="runs/train", help="output directory (default runs/train)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--checkpoint-every", type=int, default=50, metavar="K", help="checkpoint every K steps")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="cuda: NCCL, one GPU per process; cpu: gloo (default: cuda when there are enough GPUs)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                        help="of the frozen base model and the activations (default fp32); adapters stay fp32 master "
                             "weights over a bf16 base")
    parser.add_argument("--profile", help="fitted profile JSON for dispatch (default: the analytic model of the plan's GPU)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none anyway when stdout is not a terminal)")
    parser.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise InputError("<args>", "--steps", f"must be >= 1, got {args.steps}")
    if args.checkpoint_every < 1:
        raise InputError("<args>", "--checkpoint-every", f"must be >= 1, got {args.checkpoint_every}")


def run(args: argparse.Namespace) -> int:
    import subprocess

    from lorafleet.executor.torch.launch import plan_world_size, torchrun_argv, under_torchrun
    from lorafleet.plans import DeploymentPlan

    _check_args(args)
    plan = DeploymentPlan.load(args.plan)
    workload = load_training_workload(args.workload)  # bad input ends here, before any process starts
    if tuple(plan.tasks) != tuple(t.name for t in workload.tasks):
        raise InputError(args.plan, "tasks", f"the plan is for tasks {list(plan.tasks)}, the workload has "
                         f"{[t.name for t in workload.tasks]}")
    if not under_torchrun():
        return subprocess.call(torchrun_argv(plan_world_size(plan), _argv(args)))
    return train_rank(args, plan)


def _argv(args: argparse.Namespace) -> list[str]:
    """The command line that re-creates ``args`` (what each torchrun worker is started with)."""
    argv = ["train", args.workload, "--plan", args.plan, "--steps", str(args.steps), "--out", args.out,
            "--checkpoint-every", str(args.checkpoint_every), "--device", args.device, "--dtype", args.dtype]
    if args.profile:
        argv += ["--profile", args.profile]
    if args.no_progress:
        argv.append("--no-progress")
    return argv + (["--resume"] if args.resume else [])


def load_training_workload(path: str):
    from lorafleet.workload import load_workload

    workload = load_workload(path)
    missing = [t.name for t in workload.tasks if t.spec.data is None]
    if missing:
        raise InputError(path, "tasks", f"training needs data for every task; {', '.join(missing)} has none")
    return workload


def train_rank(args: argparse.Namespace, plan) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it."""
    import torch.distributed as dist

    from lorafleet.assemble import workload_cluster, workload_cost_model
    from lorafleet.dispatch import LookaheadDispatcher
    from lorafleet.executor.torch.checkpoint import latest_step_dir
    from lorafleet.executor.torch.launch import build_torch_executor, init_distributed, plan_world_size
    from lorafleet.executor.torch.precision import Precision
    from lorafleet.loop import run_loop
    from lorafleet.metrics import CsvWriter, FanOut, JsonlWriter, ProgressBar, TensorBoardWriter

    device = init_distributed(args.device)
    try:
        if dist.get_world_size() != plan_world_size(plan):
            raise InputError(args.plan, "replicas", f"the plan needs {plan_world_size(plan)} processes, "
                             f"torchrun started {dist.get_world_size()}")
        workload = load_training_workload(args.workload)
        executor = build_torch_executor(workload.spec, plan, args.steps, device, Precision(args.dtype).dtype)
        if dist.get_rank() != 0:
            executor.serve()
            return 0
        out = Path(args.out)
        checkpoints = out / "checkpoints"
        start = 0
        if args.resume:
            state = executor.restore_checkpoint(checkpoints)
            if state is None:
                raise InputError("<args>", "--resume", f"no committed checkpoint in {checkpoints}")
            start = state.step
        cluster = workload_cluster(workload, gpus=plan.n_gpus, gpu=plan.gpu)
        cost_model = workload_cost_model(workload, cluster, args.profile)
        steps = range(start, min(args.steps, _last_step(executor, args.steps)))
        writers = [JsonlWriter(out / "metrics.jsonl"), CsvWriter(out / "metrics.csv"),
                   TensorBoardWriter(out / "tensorboard")]
        if _show_progress(args):
            writers.append(ProgressBar(steps.stop, start=steps.start))
        with FanOut(*writers) as metrics, \
                LookaheadDispatcher(executor.next_global_batch, plan, cost_model) as dispatcher:
            ahead = _RememberPlans(dispatcher)

            def on_report(report) -> None:
                tokens = sum(report.task_tokens.values())
                step_plan = ahead.plans.pop(report.step, None)
                predicted = tuple(w.estimated_time_s for w in step_plan.work) if step_plan is not None else ()
                metrics.write(report, tokens_per_s=tokens / report.makespan_s if report.makespan_s else 0.0,
                              predicted_busy_s=predicted)
                if (report.step + 1) % args.checkpoint_every == 0:
                    executor.save_checkpoint(checkpoints, report.step + 1)

            run_loop(ahead, executor, steps, on_report)
        executor.save_checkpoint(checkpoints, steps.stop)
        _export_adapters(latest_step_dir(checkpoints), [t.name for t in workload.tasks], out / "adapters")
        executor.close()
        print(f"lorafleet train: {steps.stop} steps; adapters in {out / 'adapters'}, metrics in "
              f"{out / 'metrics.jsonl'} (and .csv, tensorboard/)")
        return 0
    finally:
        dist.destroy_process_group()


def _show_progress(args: argparse.Namespace) -> bool:
    import sys

    return not args.no_progress and sys.stdout.isatty()


class _RememberPlans:
    """A plan source that keeps each step's plan until its report is written (for the predicted busy times)."""

    def __init__(self, source) -> None:
        self.source = source
        self.plans: dict = {}

    def plan_for(self, step: int):
        plan = self.source.plan_for(step)
        self.plans[step] = plan
        return plan


def _last_step(executor, steps: int) -> int:
    """The step after which every task has taken all its batches (``steps`` when a task is unbounded)."""
    streams = executor.streams
    limits = streams.max_batches
    return steps if any(limit is None for limit in limits) else max(limits)


def _export_adapters(step_dir: Path, names: list[str], target: Path) -> None:
    """The final PEFT adapters, copied out of the last checkpoint."""
    import shutil

    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

    for name in names:
        (target / name).mkdir(parents=True, exist_ok=True)
        for file in (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME):
            shutil.copy2(step_dir / name / file, target / name / file)
