"""What activation recomputation costs: one executor stage's forward+backward with and without it.

The cost model charges a recomputing block ``c_i * (1 + FORWARD_SHARE_i)`` (its forward run
again in the backward; ``lorafleet.costmodel.time_model``). This measures the factor on this
CPU for the torch executor's own stage (``stage_forward`` over tiny-llama with every task's
adapter, packed micro-batches of one task), both variants interleaved in one process, CPU
time of one thread, and prints the measured ratio per micro-batch next to the one the fitted
CPU profile (``profiles/tiny-llama-cpu.json``) predicts, with the bytes autograd keeps for
the backward (what recomputation is for).

    .venv/bin/python benchmarks/bench_recompute.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lorafleet.costmodel.build import load_cost_model
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import FORWARD_SHARE
from lorafleet.data.model_source import ModelSource, SourceKind
from lorafleet.data.tokenize import Example
from lorafleet.executor.torch.attention import use_document_attention
from lorafleet.executor.torch.base_model import load_causal_lm
from lorafleet.executor.torch.inject import inject_multi_lora, multi_lora_layers
from lorafleet.executor.torch.pipeline import split_for_pipeline
from lorafleet.executor.torch.step import build_inputs, stage_forward
from lorafleet.plans import DeploymentPlan, MicroBatch, PlanPool, ReplicaSpec
from lorafleet.runtime.layout import FleetLayout, ModelDims
from lorafleet.specs.lora import LoraSpec
from lorafleet.specs.model import MODEL_PRESETS

SPEC = MODEL_PRESETS["tiny-llama"]
PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "tiny-llama-cpu.json"


def role(recompute: bool, model: torch.nn.Module):
    plan = DeploymentPlan(
        model=SPEC.name,
        pools=(PlanPool("", "cpu", 1, 1),),
        tasks=("a",),
        replicas=(ReplicaSpec(0, ParallelConfig(1, 1, recompute), 1 << 20, (0,)),),
        bucket_boundaries=(),
        expected_makespan_s=0.0,
    )
    return FleetLayout.of(plan, ModelDims.of(model.config), 1).role(0)


def step_cpu_s(model, the_role, inputs) -> tuple[float, int]:
    """CPU seconds of one forward+backward, and the bytes saved for the backward."""
    saved = []
    start = time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        loss = stage_forward(model, the_role, None, inputs).float().logsumexp(-1).mean()
    loss.backward()
    return time.process_time() - start, sum(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_causal_lm(ModelSource(kind=SourceKind.RANDOM, name=SPEC.name, spec=SPEC, seed=0))
    inject_multi_lora(model, [LoraSpec(rank=16, alpha=16, dropout=0.05)])
    for _, layer in multi_lora_layers(model):
        layer.train()
    use_document_attention(model)
    roles = {rc: role(rc, model) for rc in (False, True)}
    split_for_pipeline(model, roles[False])  # one stage of every layer: the same split for both

    cost_model = load_cost_model(PROFILE, SPEC, None, None)
    print(
        f"{'tokens':>7} {'plain ms':>9} {'rc ms':>8} {'ratio':>6} {'predicted':>9} {'saved MB plain':>15} "
        f"{'saved MB rc':>12}"
    )
    rng = torch.Generator().manual_seed(0)
    for lengths in ([256] * 4, [512] * 4, [1024] * 2, [2048]):
        ids = [tuple(int(x) for x in torch.randint(3, SPEC.vocab, (n,), generator=rng)) for n in lengths]
        mb = MicroBatch(tuple(range(len(ids))), (0,) * len(ids), tuple(lengths), None)
        inputs = build_inputs(mb, [Example(i, i) for i in ids], [1.0], torch.device("cpu"))
        times = {False: [], True: []}
        saved = {}
        for _ in range(args.repeats):
            for rc in (False, True):
                model.zero_grad(set_to_none=True)
                t, saved[rc] = step_cpu_s(model, roles[rc], inputs)
                times[rc].append(t)
        plain, rc = statistics.median(times[False]), statistics.median(times[True])
        predicted = cost_model.packed_microbatch_time(
            ParallelConfig(1, 1, True), lengths
        ) / cost_model.packed_microbatch_time(ParallelConfig(1, 1), lengths)
        print(
            f"{sum(lengths):>7} {1e3 * plain:>9.1f} {1e3 * rc:>8.1f} {rc / plain:>6.2f} {predicted:>9.2f} "
            f"{saved[False] / 2**20:>15.1f} {saved[True] / 2**20:>12.1f}"
        )
    lo, hi = 1 + min(FORWARD_SHARE), 1 + max(FORWARD_SHARE)
    print(
        f"cost model: each block term grows by its forward share, x{lo:.2f} (attention) to x{hi:.2f} (the rest); "
        "the LM head and loss run once"
    )


if __name__ == "__main__":
    main()
