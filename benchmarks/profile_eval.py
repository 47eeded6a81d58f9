"""Where an evaluation pass's time goes, against a training step's, per token (issue #39's pass, #40's rungs).

    python benchmarks/profile_eval.py [--steps 3] [--warmup 1] [--threads 1] [--split 0.05] [--ops]

One process, ``--threads`` threads, its freed heap kept as a CPU rank's is (``host_memory``), the demo's four
tasks with ``eval: {split: --split}`` on the one-replica plan ``lorafleet plan --gpus 1 --gpu cpu`` makes, the
executor itself (:class:`TorchExecutor`). After ``--warmup`` steps and one untimed evaluation, each of ``--steps``
rounds times, in process CPU seconds:

- **step**: a training step (``run_step``: forward, backward, optimizer) over its ``T_s`` tokens;
- **step fwd**: the same step's rows, on the step's own micro-batches, run by the evaluation's code
  (``evaluate.run_evaluation``, no_grad, the loss and the argmax): the forward-only share of that step;
- **eval**: an evaluation of every task's held-out rows (``executor.evaluate``, dispatched by
  ``eval_replay.dispatch_evaluation``), ``T_e`` tokens; and that dispatch alone (rank 0's work before a pass).

Printed per pass, the medians: wall and CPU seconds, tokens, loss tokens (the LM head's rows), ``Σ s_i^2 / Σ s_i`` (the
mean sequence length a token attends over: attention's work a token), CPU seconds a 1,000 tokens, and the cost
model's time (``replica_time`` for the step, ``forward_time`` for the two forward passes). The forward's cost a
token in a step's rows and in the held-out rows then says whether the pass is slower a token than training's
forward, or only longer. ``--ops`` also charges each pass's aten ops to the groups of ``profile_step.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_peer import prepare_workload  # noqa: E402
from profile_step import OpClock, group_of  # noqa: E402

from lorafleet.assemble import workload_cluster, workload_cost_model  # noqa: E402
from lorafleet.dispatch import dispatch_step  # noqa: E402
from lorafleet.eval_replay import dispatch_evaluation, forward_seconds  # noqa: E402
from lorafleet.executor.torch.evaluate import EvalRun, run_evaluation  # noqa: E402
from lorafleet.executor.torch.launch import build_torch_executor  # noqa: E402
from lorafleet.planner import PlannerOptions, plan_deployment  # noqa: E402
from lorafleet.plans import GlobalBatch, StepPlan  # noqa: E402
from lorafleet.runtime.data_stream import loss_tokens  # noqa: E402
from lorafleet.runtime.host_memory import keep_freed_host_memory  # noqa: E402
from lorafleet.workload import load_workload  # noqa: E402


def shape_of(step_plan: StepPlan, examples: list) -> tuple[int, int, float]:
    """Tokens, loss tokens and ``Σ s^2 / Σ s`` of a pass's rows."""
    lengths = np.array([len(e) for e in examples], dtype=np.float64)
    return int(lengths.sum()), sum(loss_tokens(e) for e in examples), float((lengths**2).sum() / lengths.sum())


def step_rows_as_eval(executor, step_plan: StepPlan, batch: GlobalBatch) -> tuple[SimpleNamespace, EvalRun, list]:
    """A step's rows as an evaluation of them on the step's own micro-batches: ``run_evaluation`` reads the rows
    ``streams.streams[t].data.eval_examples[k]``, so each task's rows of the step stand in for its held-out ones."""
    examples = executor.streams.examples(batch.task_ids, batch.sample_ids)
    per_task: list[list] = [[] for _ in executor.names]
    sample_ids = []
    for t, example in zip(batch.task_ids, examples, strict=True):
        sample_ids.append(len(per_task[int(t)]))
        per_task[int(t)].append(example)
    streams = SimpleNamespace(streams=[SimpleNamespace(data=SimpleNamespace(eval_examples=rows)) for rows in per_task])
    run = EvalRun(step_plan, tuple(int(t) for t in batch.task_ids), tuple(sample_ids))
    return streams, run, examples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--workload", default=str(REPO / "examples" / "demo" / "workload.yaml"))
    parser.add_argument("--tasks", default="")
    parser.add_argument("--batch-scale", type=int, default=1)
    parser.add_argument("--split", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ops", action="store_true", help="charge each pass's aten ops to profile_step's groups")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_host_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0")
    os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    cpu: dict[str, list[float]] = {"step": [], "step fwd": [], "eval": []}
    wall: dict[str, list[float]] = {k: [] for k in (*cpu, "dispatch")}
    shapes: dict[str, list[tuple[int, int, float]]] = {k: [] for k in cpu}
    modelled: dict[str, list[float]] = {k: [] for k in cpu}
    ops: dict[str, Counter] = {k: Counter() for k in cpu}
    with tempfile.TemporaryDirectory(prefix="profile-eval-") as tmp:
        workload = load_workload(prepare_workload(args, Path(tmp)), [f"defaults.eval.split={args.split}"])
        cluster = workload_cluster(workload, gpus=1, gpu="cpu")
        cost_model = workload_cost_model(workload, cluster)
        plan = plan_deployment(workload, cluster, cost_model, PlannerOptions()).plan
        replica = plan.replicas[0].config
        executor = build_torch_executor(workload.spec, plan, args.warmup + args.steps, torch.device("cpu"))
        names = list(executor.names)
        held_out = executor.eval_batch(0, names)
        eval_plan = dispatch_evaluation(held_out, plan, cost_model)
        rows = [executor.streams.streams[int(t)].data.eval_examples[int(k)]
                for t, k in zip(held_out.task_ids, held_out.sample_ids, strict=True)]  # fmt: skip

        def timed(name: str, measured: bool, fn, *fn_args) -> None:
            clock = OpClock() if args.ops and measured else None
            start, began = time.process_time(), time.perf_counter()
            with clock if clock is not None else contextlib.nullcontext():
                fn(*fn_args)
            if measured:
                cpu.setdefault(name, []).append(time.process_time() - start)
                wall[name].append(time.perf_counter() - began)
                if clock is not None:
                    ops[name].update(clock.seconds)

        executor.evaluate(eval_plan, held_out)  # untimed: the first pass's shapes
        for step in range(args.warmup + args.steps):
            measured = step >= args.warmup
            batch = executor.next_global_batch(step)
            step_plan = dispatch_step(batch, plan, cost_model)
            streams, run, examples = step_rows_as_eval(executor, step_plan, batch)
            timed("step fwd", measured, run_evaluation, executor.replica, streams, executor.device, run, names)
            timed("step", measured, executor.run_step, step_plan)
            timed("eval", measured, executor.evaluate, eval_plan, held_out)
            timed("dispatch", measured, dispatch_evaluation, held_out, plan, cost_model)
            if measured:
                shapes["step"].append(shape_of(step_plan, examples))
                shapes["step fwd"].append(shape_of(step_plan, examples))
                shapes["eval"].append(shape_of(eval_plan, rows))
                mb_shapes = [mb.shape for mb in step_plan.work[0].microbatches]
                modelled["step"].append(cost_model.replica_time(replica, mb_shapes))
                modelled["step fwd"].append(cost_model.forward_time(replica, mb_shapes))
                modelled["eval"].append(forward_seconds(eval_plan, plan, cost_model)[0])
    dist.destroy_process_group()
    report(args, cpu, wall, shapes, modelled, ops, eval_plan)
    return 0


def report(args, cpu, wall, shapes, modelled, ops, eval_plan: StepPlan) -> None:
    """The medians of each pass (module doc)."""
    print(f"{args.steps} rounds, {args.threads} thread(s), split {args.split}; the evaluation's micro-batches: "
          f"{[mb.tokens for mb in eval_plan.work[0].microbatches]} tokens")  # fmt: skip
    print(f"{'pass':<10}{'wall s':>8}{'CPU s':>8}{'tokens':>8}{'loss tok':>9}{'Σs²/Σs':>8}{'CPU s/1k tok':>13}"
          f"{'model s':>9}{'CPU/model':>10}")  # fmt: skip
    per_k = {}
    dispatch = cpu.pop("dispatch")
    for name, seconds in cpu.items():
        s = statistics.median(seconds)
        tokens, loss, attended = (statistics.median(x[i] for x in shapes[name]) for i in range(3))
        m = statistics.median(modelled[name])
        per_k[name] = 1000 * s / tokens
        print(f"{name:<10}{statistics.median(wall[name]):>8.2f}{s:>8.2f}{tokens:>8.0f}{loss:>9.0f}{attended:>8.0f}"
              f"{per_k[name]:>13.3f}{m:>9.2f}{s / m:>10.2f}")  # fmt: skip
    print(f"the forward's share of a step: {per_k['step fwd'] / per_k['step']:.3f}; an evaluation's token over a "
          f"step's forward token: {per_k['eval'] / per_k['step fwd']:.2f}x; the evaluation's dispatch (rank 0): "
          f"{1000 * statistics.median(dispatch):.1f} ms CPU")  # fmt: skip
    if args.ops:
        for name, counter in ops.items():
            groups: Counter = Counter()
            for (site_name, op), t in counter.items():
                groups[group_of(site_name, op)] += t / args.steps
            total = sum(groups.values())
            print(f"\n{name}: {total:.2f} s in ops a pass")
            for group, t in groups.most_common():
                print(f"  {group:<56}{t:>8.3f}{t / total:>8.1%}")
            for (site_name, op), t in counter.most_common(8):
                print(f"    {(site_name + ' / ' + op)[:54]:<54}{t / args.steps:>8.3f}")


if __name__ == "__main__":
    sys.exit(main())
