"""How long a checkpoint holds training up: written in the background (flash) against written in place.

    python benchmarks/bench_checkpoint.py [--tasks 8] [--rank 64] [--repeats 5]

One gloo process trains a random Llama (``bench-llama``: 6 layers, width 256) with ``--tasks``
adapters of rank ``--rank`` on every projection (AdamW: weights and two moments per parameter).
After a step, each checkpoint is taken both ways, alternating, ``--repeats`` times:

- **synchronous**: ``save_checkpoint(wait=True)``: gather to host, write the files, commit;
- **background**: ``save_checkpoint()``: gather to host, hand the write to the checkpoint thread;
  the stall is the time until training may go on (the write then overlaps the next steps; it is
  flushed before the next checkpoint and is not part of the stall).

Prints the median stall of each, the ratio, and the checkpoint's size on disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lorafleet.costmodel.parallel_config import ParallelConfig  # noqa: E402
from lorafleet.data.model_source import ModelSource, SourceKind  # noqa: E402
from lorafleet.data.tokenize import IGNORE_INDEX, Example  # noqa: E402
from lorafleet.executor.torch.base_model import load_causal_lm  # noqa: E402
from lorafleet.executor.torch.worker import ExecutorConfig, TaskTraining, TorchExecutor  # noqa: E402
from lorafleet.plans import DeploymentPlan, MicroBatch, PlanPool, ReplicaSpec, ReplicaWork, StepPlan  # noqa: E402
from lorafleet.runtime.data_stream import DataStreams, TaskData  # noqa: E402
from lorafleet.specs.lora import LoraSpec, OptimizerSpec  # noqa: E402
from lorafleet.specs.model import ModelSpec  # noqa: E402

BENCH_LLAMA = ModelSpec(name="bench-llama", n_layers=6, hidden=256, ffn=704, n_heads=8, n_kv_heads=4, vocab=1024)


def _executor(tasks: int, rank: int) -> TorchExecutor:
    rng = np.random.default_rng(0)
    data = [
        TaskData(
            f"t{k}",
            tuple(
                Example(tuple(ids), (IGNORE_INDEX, *ids[1:]))
                for ids in (rng.integers(3, BENCH_LLAMA.vocab, 32).tolist() for _ in range(8))
            ),
        )
        for k in range(tasks)
    ]
    names = tuple(d.name for d in data)
    plan = DeploymentPlan(
        model="bench-llama",
        pools=(PlanPool("", "cpu", 1, 1),),
        tasks=names,
        replicas=(ReplicaSpec(0, ParallelConfig(1, 1), 4096, (0,)),),
        bucket_boundaries=(32,),
        expected_makespan_s=0.0,
    )
    lora = LoraSpec(
        rank=rank,
        alpha=2 * rank,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    config = ExecutorConfig(
        plan=plan,
        seed=0,
        base_model="bench-llama",
        tasks=tuple(TaskTraining(name=n, lora=lora, optimizer=OptimizerSpec(lr=1e-3), total_steps=100) for n in names),
    )
    model = load_causal_lm(ModelSource(kind=SourceKind.RANDOM, name="bench-llama", spec=BENCH_LLAMA, seed=0))
    return TorchExecutor(config, model, DataStreams(data, [2] * tasks, 0), torch.device("cpu"))


def _step(executor: TorchExecutor, step: int) -> None:
    batch = executor.next_global_batch(step)
    rows = tuple(range(len(batch)))
    mb = MicroBatch(rows, tuple(int(t) for t in batch.task_ids), tuple(int(n) for n in batch.lengths), 32)
    executor.run_step(
        StepPlan(step=step, bucket_boundaries=(32,), work=(ReplicaWork(0, (mb,), 0.0),), estimated_makespan_s=0.0)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        executor = _executor(args.tasks, args.rank)
        _step(executor, 0)
        stalls: dict[str, list[float]] = {"synchronous": [], "background": []}
        for k in range(args.repeats):
            for name in stalls:
                executor.flush_checkpoints()
                start = time.perf_counter()
                path = executor.save_checkpoint(Path(tmp) / name, k + 1, wait=name == "synchronous")
                stalls[name].append(time.perf_counter() - start)
        executor.close()
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        dist.destroy_process_group()
    sync, background = (statistics.median(stalls[n]) for n in ("synchronous", "background"))
    print(f"checkpoint of {args.tasks} adapters of rank {args.rank} (bench-llama, AdamW): {size / 2**20:.1f} MiB")
    print(
        f"  stall per checkpoint, median of {args.repeats}: synchronous {sync * 1e3:.1f} ms, "
        f"background {background * 1e3:.1f} ms ({sync / background:.1f}x less)"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
