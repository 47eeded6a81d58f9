"""Step time per token against the micro-batch size M: one step's sequences packed into micro-batches of at most M.

    .venv/bin/python benchmarks/bench_microbatch.py [--sizes 1024,2048,4096,8192] [--rows 4] [--rounds 3]

The torch executor's own replica (``profiling.replica.ProfiledReplica``: SmolLM2-135M in fp32, random weights, one
adapter per member of ``bench_sweep``'s 3 x 3 grid, ranks 4, 8 and 16 on every projection) runs the same step
over and over: every member's ``--rows`` sequences, lengths drawn from the demo's ``docsum`` histogram (as the
sweep's members share one data order), packed by the dispatcher (first fit decreasing) into micro-batches of at
most M tokens, each holding several members. A step is ``run_rank_step`` (every
micro-batch forward and backward) and every member's clipped optimizer step.

The sizes are interleaved in every round, in one process; a size's figure is its median over the rounds, in
process CPU seconds (``--threads`` torch threads), printed per 1,000 tokens and over the best size, beside what
the cost model of a 1 x cpu cluster predicts (its stage time over the same micro-batches, over its best size's):
the time model has to see the curve for the planner to stop M where a token costs least.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.build import analytic_cost_model
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.dispatch.microbatch import packed_microbatches
from lorafleet.executor.torch.step import run_rank_step
from lorafleet.plans import MicroBatch
from lorafleet.profiling.device import ProfileDevice
from lorafleet.profiling.replica import ProfiledReplica, inverse_counts, random_examples
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.lora import LoraSpec
from lorafleet.specs.model import MODEL_PRESETS

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo" / "workload.yaml"
SPEC = MODEL_PRESETS["smollm2-135m"]
RANKS = (4, 8, 16) * 3  # bench_sweep's grid: 3 learning rates x these ranks


def step_lengths(rows: int, seed: int) -> list[tuple[int, int]]:
    """(member, length) of one step: ``rows`` docsum lengths, the same for every member (one data order)."""
    task = next(t for t in yaml.safe_load(DEMO.read_text())["tasks"] if t["name"] == "docsum")
    histogram = {int(k): v for k, v in task["lengths"]["histogram"].items()}
    drawn = random.Random(seed).choices(list(histogram), weights=list(histogram.values()), k=rows)
    return [(member, min(n, task["context_length"])) for member in range(len(RANKS)) for n in drawn]


def packed(sequences: list[tuple[int, int]], max_tokens: int) -> tuple[MicroBatch, ...]:
    """The dispatcher's packing of the step into micro-batches of at most ``max_tokens`` tokens (first fit
    decreasing, ``dispatch.microbatch.packed_microbatches``)."""
    members, lengths = (np.array(column) for column in zip(*sequences))
    return tuple(packed_microbatches(np.arange(len(sequences)), lengths, members, max_tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096,8192", help="micro-batch sizes M, tokens")
    parser.add_argument("--rows", type=int, default=4, help="sequences per member a step (default 4, the demo's)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2, as bench_sweep)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ProfileDevice().join(0, 1, str(Path(tmp) / "store"))
        torch.set_num_threads(args.threads)
        adapters = AdapterLoad.from_specs([LoraSpec(rank=r, alpha=16) for r in RANKS])
        replica = ProfiledReplica(SPEC, adapters, tp=1, rank=0, busy=1, world=1)
        replica.prime()
        sequences = step_lengths(args.rows, seed=0)
        layouts = {m: packed(sequences, m) for m in sizes}
        examples = random_examples(layouts[sizes[0]], SPEC.vocab, random.Random(0))
        inv = inverse_counts(layouts[sizes[0]], examples, len(RANKS))
        r = replica.replica
        cpu: dict[int, list[float]] = {m: [] for m in sizes}
        loads = []
        for round_ in range(args.rounds + 1):  # round 0 warms every size's allocations up, and is not kept
            for m in sizes[round_ % len(sizes) :] + sizes[: round_ % len(sizes)]:
                start = time.process_time()
                run_rank_step(r.model, r.role, r.neighbours, layouts[m], examples, inv)
                norms = r.grad_sync.squared_norms(len(RANKS), range(len(RANKS)))
                for t, opt in enumerate(replica.optimizers):
                    opt.step(float(norms[t]) ** 0.5)
                if round_:
                    cpu[m].append(time.process_time() - start)
                    print(f"  round {round_} M {m}: {cpu[m][-1]:.1f} CPU s", flush=True)
            loads.append(os.getloadavg()[0])
    cluster = ClusterSpec.model_validate({"gpu": "cpu", "nodes": 1, "gpus_per_node": 1})
    cost_model = analytic_cost_model(SPEC, cluster, adapters)
    tokens = sum(n for _, n in sequences)
    median = {m: statistics.median(cpu[m]) for m in sizes}
    predicted = {m: sum(cost_model.shape_time(ParallelConfig(1, 1), MicroBatchShape.packed(mb.lengths))
                        for mb in layouts[m]) for m in sizes}  # fmt: skip
    best, best_predicted = min(median.values()), min(predicted.values())
    print(f"SmolLM2-135M fp32, {len(RANKS)} members x {args.rows} docsum rows = {tokens:,} tokens a step; "
          f"{args.threads} thread(s), {args.rounds} round(s), load {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    print(f"{'M':>6} {'micro-batches':>13} {'CPU ms/1K tok':>14} {'/ best':>7} {'predicted / best':>17}")
    for m in sizes:
        print(f"{m:>6} {len(layouts[m]):>13} {1e6 * median[m] / tokens:>14.0f} {median[m] / best:>7.2f} "
              f"{predicted[m] / best_predicted:>17.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
