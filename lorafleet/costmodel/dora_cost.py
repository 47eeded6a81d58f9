"""What DoRA adds to a LoRA block's time: the analytic model's DoRA terms (``analytic.analytic_layer_time``).

The operator (``executor/torch/dora.py``) keeps the one base GEMM and the segmented low-rank GEMMs of LoRA and adds,
per block and device (TP degree ``tp``), for a DoRA adapter targeting the projections ``𝒯`` with
``P_𝒯 = Σ_{t∈𝒯} in_t out_t`` weights and ``O_𝒯 = Σ_{t∈𝒯} out_t`` outputs:

    per token      the rescale ``Y + (g - 1) ⊙ (Y - b + D)`` and its backward: memory-bound passes over the token's
                   outputs, :data:`RESCALE_PASSES` · O_𝒯 · dtype / tp bytes
                 + with adapter dropout, ``D = (Xd - X) W^T`` and its input gradient: 4 P_𝒯 / tp FLOPs, as much as the
                   frozen base's own forward and input gradient (PEFT's DoRA runs the same second base GEMM)
    per micro-batch, for each DoRA adapter in it
                   the norm ``||W + s B A||_c`` as ``||W||² + 2s rowsum(B ⊙ W A^T) + s² rowsum(B A A^T ⊙ B)``:
                   the GEMM ``W A^T`` reads the weights once, 2 r P_𝒯 / tp FLOPs and P_𝒯 dtype / tp bytes

A token meets a DoRA adapter with the probability a task is DoRA (:meth:`AdapterLoad.dora_share`, as
``mean_params_per_layer`` averages the LoRA GEMMs); LobRA's ``t(b, s)`` does not know which tasks share a micro-batch,
so the norm is charged as if each micro-batch held one adapter, DoRA in that proportion.

**The factor** (``analytic.analytic_dora_factor``): a block's time with every task DoRA over its time with plain
LoRA, at one micro-batch shape. On Llama-2-7B, A100-40GB, bf16, 4 sequences of 1024 tokens, six rank-16 adapters,
``DEFAULT_CALIBRATION``: 2.03x with adapter dropout, 1.24x without (``tests/costmodel/test_dora_cost.py``). PEFT
PR #1474 measured DoRA at 1.6-2.1x LoRA's step (2.7 s/it against 5.5, 4.5 optimised), with an implementation that
ran the second base GEMM on every step: the dropout case. Without dropout the operator reuses the base output, as
PEFT's current DoRA does too, and the norm and the rescale are all that is left. ``benchmarks/bench_multi_lora.py
--dora`` measures both ratios on CPU (docs/multi_lora.md).
"""

from __future__ import annotations

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.specs.model import ModelSpec

RESCALE_PASSES = 24
"""Reads and writes of a ``(rows, out)`` tensor per DoRA token and projection, forward and backward, counted on the
operator's ops (gather of ``Y``, ``Y - b``, the gathered ``g``, ``(g - 1) ⊙ ·``, the sum, the scatter back, then the
same again for the gradient and ``dm``'s product): an estimate of the memory traffic, not a measurement."""


def _dora_tasks_widths(model: ModelSpec, adapters: AdapterLoad) -> tuple[float, float, float]:
    """Means over the DoRA tasks of (P_𝒯, O_𝒯, r P_𝒯); zeros when no task is DoRA."""
    shapes = model.target_shapes()
    dora = [t for t in adapters.tasks if t.dora]
    if not dora:
        return 0.0, 0.0, 0.0
    weights = [sum(shapes[m][0] * shapes[m][1] for m in t.targets) for t in dora]
    outputs = [sum(shapes[m][1] for m in t.targets) for t in dora]
    rank_weights = [t.rank * w for t, w in zip(dora, weights, strict=True)]
    return sum(weights) / len(dora), sum(outputs) / len(dora), sum(rank_weights) / len(dora)


def dora_terms(
    model: ModelSpec, adapters: AdapterLoad, tp: int, flops: float, bandwidth: float, dtype_bytes: int
) -> tuple[float, float]:
    """DoRA's additions to a block's ``(c3, c6)``, seconds (per token, per micro-batch), on ``tp`` devices that reach
    ``flops`` FLOP/s in GEMMs and ``bandwidth`` bytes/s in memory-bound kernels (see the module doc)."""
    weights, outputs, rank_weights = _dora_tasks_widths(model, adapters)
    share, dropping = adapters.dora_share(), adapters.dora_share(with_dropout=True)
    per_token = share * RESCALE_PASSES * outputs * dtype_bytes / tp / bandwidth
    per_token += dropping * 4 * weights / tp / flops
    per_microbatch = share * (2 * rank_weights / tp / flops + weights * dtype_bytes / tp / bandwidth)
    return per_token, per_microbatch
