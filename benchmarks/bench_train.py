"""Joint multi-LoRA training vs Task-Sequential vs Task-Fused padding: seconds per step, one run.

    python benchmarks/bench_train.py [--model bench-llama|smollm2-135m] [--steps 2] [--batch-scale 4]
                                     [--max-tokens 4096] [--threads 1] [--dropout P]

The demo's four tasks (``examples/demo``, very different lengths) are trained for the same
global batches three ways, in one process on this machine's CPUs (or one GPU):

- **joint** (lorafleet): :class:`TorchExecutor` on one replica, the step dispatched by
  ``lorafleet.dispatch`` (padding-minimising buckets, micro-batches of at most M tokens),
  every task's adapter in one multi-LoRA pass;
- **task-fused padding**: the same executor and operator, but every sequence padded to the
  batch's longest (LobRA's homogeneous baseline without buckets);
- **task-sequential**: each task alone with PEFT, one task after another, its batch padded to
  its own longest, micro-batches of at most M tokens (the usual one-adapter-at-a-time way).

Printed per way: CPU and wall seconds per step (mean over the measured steps, after one
warm-up step), padding ratio, and the speed-up of joint over each baseline in CPU seconds
(steadier than wall time on a shared machine). The demo's batch sizes suit a short CPU
training run; ``--batch-scale`` multiplies them (default 4: 44 sequences, ~9k tokens a step),
closer to a real step, where one task's batch spans more of its length range. The model is a
random-weight Llama (``bench-llama``: 6 layers, width 256, the project's tiny tokenizer) by
default, or SmolLM2-135M from its GGUF (slow on CPU).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import peft
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorafleet.assemble import workload_cluster, workload_cost_model  # noqa: E402
from lorafleet.costmodel.parallel_config import ParallelConfig  # noqa: E402
from lorafleet.data.model_source import (  # noqa: E402
    ModelSource,
    SourceKind,
    load_source_tokenizer,
    resolve_model_source,
)
from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from lorafleet.data.tokenize import IGNORE_INDEX, load_tokenizer  # noqa: E402
from lorafleet.dispatch import DispatchOptions, MicroBatchMode, dispatch_step  # noqa: E402
from lorafleet.executor.torch.base_model import load_causal_lm  # noqa: E402
from lorafleet.executor.torch.optim import build_optimizer, lr_at  # noqa: E402
from lorafleet.executor.torch.peft_export import lora_config  # noqa: E402
from lorafleet.executor.torch.worker import ExecutorConfig, TaskTraining, TorchExecutor  # noqa: E402
from lorafleet.plans import DeploymentPlan, GlobalBatch, MicroBatch, PlanPool, ReplicaSpec, ReplicaWork, StepPlan  # noqa: E402
from lorafleet.runtime.data_stream import DataStreams, prepare_task_data  # noqa: E402
from lorafleet.specs.model import ModelSpec  # noqa: E402
from lorafleet.workload import load_workload  # noqa: E402

#: A random Llama big enough that compute, not Python overhead, dominates a CPU step.
BENCH_LLAMA = ModelSpec(name="bench-llama", n_layers=6, hidden=256, ffn=704, n_heads=8, n_kv_heads=4, vocab=1024)


def _chunks(rows: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """Consecutive rows in micro-batches of at most ``max_tokens`` when each is padded to ``width``."""
    per = max(1, max_tokens // width)
    return [rows[i : i + per] for i in range(0, len(rows), per)]


def fused_padding_plan(batch: GlobalBatch, max_tokens: int) -> StepPlan:
    """Every sequence padded to the batch's longest, rows kept contiguous by task."""
    rows = sorted(range(len(batch)), key=lambda q: (int(batch.task_ids[q]), q))
    width = int(batch.lengths.max())
    mbs = tuple(
        MicroBatch(tuple(c), tuple(int(batch.task_ids[q]) for q in c), tuple(int(batch.lengths[q]) for q in c), width)
        for c in _chunks(rows, width, max_tokens)
    )
    return StepPlan(
        step=batch.step, bucket_boundaries=(width,), work=(ReplicaWork(0, mbs, 0.0),), estimated_makespan_s=0.0
    )


class TaskSequential:
    """Each task alone with its own PEFT model and optimizer, one after another."""

    def __init__(self, base: torch.nn.Module, tasks: tuple[TaskTraining, ...], streams: DataStreams, max_tokens: int):
        self.tasks, self.streams, self.max_tokens = tasks, streams, max_tokens
        self.models = [peft.get_peft_model(copy.deepcopy(base), lora_config(t.lora)) for t in tasks]
        self.optimizers = [
            build_optimizer(t.optimizer, [p for p in m.parameters() if p.requires_grad])
            for t, m in zip(tasks, self.models, strict=True)
        ]

    def run_step(self, batch: GlobalBatch) -> tuple[int, int]:
        """Trains every task on its sequences of ``batch``; returns (real, padded) tokens."""
        real = padded = 0
        for t, (task, model, optimizer) in enumerate(zip(self.tasks, self.models, self.optimizers, strict=True)):
            rows = [q for q in range(len(batch)) if batch.task_ids[q] == t]
            examples = self.streams.examples(batch.task_ids[rows], batch.sample_ids[rows])
            width = max(len(e) for e in examples)
            n_tokens = sum(sum(1 for label in e.labels[1:] if label != IGNORE_INDEX) for e in examples)
            for chunk in _chunks(list(range(len(examples))), width, self.max_tokens):
                part = [examples[i] for i in chunk]
                ids = torch.tensor([list(e.input_ids) + [0] * (width - len(e)) for e in part])
                labels = torch.tensor([list(e.labels) + [IGNORE_INDEX] * (width - len(e)) for e in part])
                mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in part])
                logits = model(ids, attention_mask=mask).logits
                loss = (
                    torch.nn.functional.cross_entropy(
                        logits[:, :-1].flatten(0, 1),
                        labels[:, 1:].flatten(),
                        reduction="sum",
                        ignore_index=IGNORE_INDEX,
                    )
                    / n_tokens
                )
                loss.backward()
                real += sum(len(e) for e in part)
                padded += width * len(part)
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], task.optimizer.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(task.optimizer, batch.step, task.total_steps)
            optimizer.step()
            optimizer.zero_grad()
        return real, padded


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-llama", help="bench-llama (random, tiny tokenizer) or smollm2-135m")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up (default 2)")
    parser.add_argument("--batch-scale", type=int, default=4, help="multiply every task's batch size (default 4)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="M: tokens per micro-batch, padding included")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--dropout", type=float, help="override every task's LoRA dropout (the demo's is 0.05)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    workload = load_workload(REPO / "examples" / "demo" / "workload.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "bench-llama":
            source = ModelSource(kind=SourceKind.RANDOM, name="bench-llama", spec=BENCH_LLAMA, seed=0)
            tokenizer = load_tokenizer(str(build_tiny_tokenizer(Path(tmp) / "tok")), "bench", "tokenizer")
        else:
            source = resolve_model_source(args.model)
            tokenizer = load_source_tokenizer(source)
        data = [prepare_task_data(t.spec, tokenizer, "bench") for t in workload.tasks]
        streams = DataStreams(data, [t.batch_size * args.batch_scale for t in workload.tasks], workload.spec.seed)
        total = args.steps + 1
        loras = [
            t.spec.lora if args.dropout is None else t.spec.lora.model_copy(update={"dropout": args.dropout})
            for t in workload.tasks
        ]
        tasks = tuple(
            TaskTraining(name=t.name, lora=lora, optimizer=t.spec.optimizer, total_steps=total)
            for t, lora in zip(workload.tasks, loras, strict=True)
        )
        plan = DeploymentPlan(
            model=workload.spec.model,
            pools=(PlanPool("", workload.cluster.gpu, 1, 1),),
            tasks=tuple(t.name for t in tasks),
            replicas=(ReplicaSpec(0, ParallelConfig(1, 1), args.max_tokens, (0,)),),
            bucket_boundaries=(),
            expected_makespan_s=0.0,
        )
        cost_model = workload_cost_model(workload, workload_cluster(workload, gpus=1))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        base = load_causal_lm(source)
        config = ExecutorConfig(plan=plan, tasks=tasks, seed=0, base_model=args.model)
        executors = {name: TorchExecutor(config, copy.deepcopy(base), streams, device) for name in ("joint", "fused")}
        sequential = TaskSequential(base, tasks, streams, args.max_tokens)
        results: dict[str, list[tuple[float, float, float]]] = {"joint": [], "fused": [], "sequential": []}
        for step in range(total):
            for name, executor in executors.items():
                batch = executor.next_global_batch(step)
                step_plan = (
                    dispatch_step(batch, plan, cost_model, DispatchOptions(microbatch_mode=MicroBatchMode.PADDING))
                    if name == "joint"
                    else fused_padding_plan(batch, args.max_tokens)
                )
                wall, cpu = _timed(functools.partial(executor.run_step, replace(step_plan)))
                if step:
                    results[name].append((wall, cpu, step_plan.padding_ratio))
            box = []
            wall, cpu = _timed(lambda: box.append(sequential.run_step(streams.global_batch(step))))  # noqa: B023 (called here)
            if step:
                real, padded = box[0]
                results["sequential"].append((wall, cpu, 1 - real / padded))
        dist.destroy_process_group()

    print(
        f"model {args.model}, {len(tasks)} tasks, batch {sum(streams.batch_sizes)} sequences, M = {args.max_tokens}, "
        f"LoRA dropout {tasks[0].lora.dropout}, {args.steps} steps after a warm-up, "
        f"torch threads {torch.get_num_threads()}, device {device}"
    )
    means = {k: [sum(col) / len(col) for col in zip(*v, strict=True)] for k, v in results.items()}
    print(f"{'way':<12}{'cpu s/step':>12}{'wall s/step':>12}{'padding':>10}{'joint speed-up (cpu)':>22}")
    for name, label in (("joint", "joint"), ("fused", "fused-pad"), ("sequential", "sequential")):
        wall, cpu, padding = means[name]
        print(f"{label:<12}{cpu:>12.2f}{wall:>12.2f}{padding:>10.1%}{cpu / means['joint'][1]:>21.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
