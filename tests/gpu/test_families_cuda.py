"""Every newer model family's stage forward on a GPU in bf16 (FlashAttention's varlen kernel for Qwen3, Gemma 3 and
Phi-3; Gemma 2's soft-capped layers per document in transformers' eager form, which varlen cannot soft-cap) against
the family's own transformers model run one sequence at a time with that sequence's adapter. CPU twins, exact in
fp64: ``tests/executor/torch/test_step.py::test_stage_forward_equals_the_hf_model`` (Gemma 2) and the families' runs
of ``tests/executor/torch/test_joint_training.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from lorafleet.executor.torch.attention import use_document_attention
from lorafleet.executor.torch.inject import adapter_parameters, inject_multi_lora, segments_context
from lorafleet.executor.torch.pipeline import split_for_pipeline
from lorafleet.executor.torch.routing import LoraBackend, Segments
from lorafleet.executor.torch.step import build_inputs, stage_forward
from lorafleet.plans import MicroBatch
from lorafleet.runtime.layout import FleetLayout, ModelDims
from tests.helpers import fleet_harness as h

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CPU twins: test_step.py and test_joint_training.py, fp64)",
)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_a_packed_stage_is_the_families_own_model_per_sequence(family):
    worst = stage_against_the_model(family, torch.device("cuda"), torch.bfloat16)
    assert worst <= 2e-2, family


def stage_against_the_model(family: str, device: torch.device, dtype: torch.dtype) -> float:
    """The largest relative error, over the sequences of one packed micro-batch of a global batch (contiguous by
    task), of the stage's logits against the family's model run on that sequence alone with its adapter."""
    model = h.build_model(family, dtype).to(device)
    inject_multi_lora(model, [t.lora for t in h.model_tasks(family)], backend=LoraBackend.TORCH)
    with torch.no_grad():
        for p in adapter_parameters(model):
            p.normal_(0.0, 0.1, generator=torch.Generator(device=device).manual_seed(p.numel()))
    reference = copy.deepcopy(model)
    role = FleetLayout.of(h.plan_of((1, 1)), ModelDims.of(model.config), 1).role(0)
    split_for_pipeline(model, role)
    use_document_attention(model)
    streams = h.synthetic_streams()
    batch = streams.global_batch(0)
    examples = streams.examples(batch.task_ids, batch.sample_ids)
    order = sorted(range(len(batch)), key=lambda q: int(batch.task_ids[q]))
    tasks = tuple(int(batch.task_ids[q]) for q in order)
    mb = MicroBatch(tuple(order), tasks, tuple(int(batch.lengths[q]) for q in order), None)  # packed
    inputs = build_inputs(mb, [examples[q] for q in order], [1.0] * len(h.TASKS), device)
    worst, offset = 0.0, 0
    with torch.no_grad():
        logits = stage_forward(model, role, None, inputs)[0].float()  # (S, V)
        for q, task in zip(order, tasks, strict=True):
            ids = torch.tensor([examples[q].input_ids], device=device)
            with segments_context(reference, Segments.packed([task], [ids.numel()])):
                want = reference(ids).logits[0].float()
            got = logits[offset : offset + ids.numel()]
            offset += ids.numel()
            worst = max(worst, float((got - want).norm() / want.norm()))
    return worst
