"""Analytic cost model: time and memory from model dimensions and a GPU datasheet.

For hardware nobody here has (what-ifs), each term of LobRA's t(b, s) (Eq. 10) is derived
from first principles and divided by a *global* efficiency factor, the same for every TP
degree, model and GPU. Per block, per device, for a micro-batch of b sequences of length s
(T = b*s tokens), with peak FLOP/s F, HBM bandwidth W, NVLink bandwidth N::

    attention   c1 b s^2 : 7 * hq * b s^2 / tp / (F * e_attn)
                 causal FlashAttention: QK^T and PV are 4 s^2 hq FLOPs, halved by the mask;
                 the backward (recompute + dQ, dK, dV) is 2.5x the forward; a model's sliding windows
                 scale it by each sequence's ρ(s) where a stage is priced (``attention_span``)
    projections c3 b s   : (4 P + 6 p_A) * T / tp / (F * e_mm)
                 frozen base: forward 2P and input gradient 2P, *no* weight-gradient GEMMs;
                 LoRA (p_A adapter parameters a token meets): forward 2 p_A, backward 4 p_A; a VeRA
                 token less 2 p_A' (its frozen A's weight gradient, p_A' = Σ r * in: ``adapters``)
              + elementwise bytes (22 h + 4 (hq + hkv) + 9 ffn) / tp * dtype * T / (W * e_mem)
                 RMSNorms and residuals (22 h), RoPE, SwiGLU; split over the TP ranks with sequence
                 parallelism (as LobRA runs), the 22 h replicated on every rank without it
              + TP all-reduces: 4 per block (2 forward, 2 backward) of T*h*dtype bytes, ring over
                 tp ranks inside the node: 2(tp-1)/tp * bytes / (N * e_link)
              + split LoRA inputs (lorafleet's executor at tp > 1, ``memory_model``): each TP rank keeps 1/tp of
                 the rows of a column-parallel projection's LoRA input, so the backward sums the partial dS
                 (T x r) over the TP group: one ring reduce-scatter of T*r_max*dtype bytes per adapted
                 column-parallel projection (q, k, v, gate, up) a LoRA or DoRA task adapts (r_max over those
                 tasks; VeRA's frozen A needs none), (tp-1)/tp * bytes / (N * e_link)
    constant    c6       : weight reads (forward and backward) 2 P dtype / tp / (W * e_mem)
              + 4 * 2(tp-1) link latencies + (tp-1) per dS reduce-scatter + a fixed host/launch time per block
    DoRA tasks add to c3 and c6 (``dora_cost``): the rescale's passes over a token's outputs, with adapter
    dropout a second base-width GEMM, and per micro-batch the weight norm (one read of W)
    a quantized base (``quantize``) adds to c6 its dequantization, forward and backward (bitsandbytes
    dequantizes again for the input gradient): 2 P (q + dtype) / tp / (W * e_mem), q its bytes a weight
    (``memory_model.weight_bytes``), a memory-bound pass that reads the stored weights and writes them whole

c2, c4 and c5 are zero: the datasheet says nothing about them. The LM head, the pipeline
transfers, the adapters' gradient all-reduce and the optimizer step, which LobRA leaves
out, get the same treatment (``analytic_head_time``, ``analytic_links``,
``analytic_optimizer_time``). ``calibrate`` fits the six time factors to measured
per-layer times; ``DEFAULT_CALIBRATION`` is that fit on LobRA's A100-40GB Llama2-7B
profile (TP1, TP2, TP8; TP4 is predicted, not fitted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.dora_cost import dora_terms
from lorafleet.costmodel.fit import ROBUST_SCALE
from lorafleet.costmodel.memory_model import COLUMN_PARALLEL_GROUPS, MemoryFactors, weight_bytes
from lorafleet.costmodel.time_model import GB, MS_PER_S, AffineTime, LayerTimeCoeffs, Link, MicroBatchShape
from lorafleet.specs.gpus import GPUSpec
from lorafleet.specs.lora import Quantization
from lorafleet.specs.model import ModelSpec

TFLOP = 1e12
US_PER_MS = 1e3
#: TP all-reduces per block and micro-batch: after attention and MLP forward, and of their
#: input gradients backward (Megatron's f and g operators).
TP_ALLREDUCES_PER_BLOCK = 4
#: The projections split by output rows under TP (their LoRA A input is a column-parallel group's, ``memory_model``).
COLUMN_PARALLEL = frozenset(p for group in COLUMN_PARALLEL_GROUPS for p in group)


@dataclass(frozen=True)
class Calibration:
    """Global efficiency factors of the analytic model: one set for every TP degree, model and GPU."""

    matmul: float = 0.6
    """Achieved fraction of peak FLOP/s in the projection GEMMs."""
    attention: float = 0.6
    """Achieved fraction of peak FLOP/s in the attention kernels."""
    memory: float = 0.8
    """Achieved fraction of HBM bandwidth in memory-bound kernels and weight reads."""
    link: float = 0.3
    """Achieved fraction of link bandwidth in collectives and pipeline transfers."""
    layer_overhead_ms: float = 2.0
    """Host and kernel-launch time of one block's forward and backward, ms."""
    link_latency_us: float = 10.0
    """Start-up time of one message on a link, microseconds."""
    memory_factors: MemoryFactors = field(default_factory=MemoryFactors)
    """Global factors of the memory model."""

    @property
    def time_factors(self) -> np.ndarray:
        return np.array(
            [self.matmul, self.attention, self.memory, self.link, self.layer_overhead_ms, self.link_latency_us]
        )

    def with_time_factors(self, x: Sequence[float]) -> Calibration:
        keys = ("matmul", "attention", "memory", "link", "layer_overhead_ms", "link_latency_us")
        return replace(self, **{k: float(v) for k, v in zip(keys, x)})


#: ``calibrate`` on ../shared/reference/lobra_a100_40gb_llama2_7b_layer_time.csv (Llama2-7B,
#: 6 tasks of rank 16 on every projection, bf16, A100-40GB), rounded; tests/costmodel re-runs it.
#: The memory factors put the A100-40GB max-tokens table inside LobRA's power-of-two brackets.
DEFAULT_CALIBRATION = Calibration(
    matmul=0.579,
    attention=0.669,
    memory=1.0,
    link=0.254,
    layer_overhead_ms=2.50,
    link_latency_us=0.0,
    memory_factors=MemoryFactors(reserve_gib=2.5, activation_overhead=1.36),
)


def _widths(model: ModelSpec) -> tuple[int, int, int]:
    """(hq, hkv, projection parameters P of one block)."""
    hq = model.n_heads * model.d_head
    hkv = model.n_kv_heads * model.d_head
    return hq, hkv, model.layer_params - 2 * model.hidden


def analytic_layer_time(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int,
    adapters: AdapterLoad,
    cal: Calibration = DEFAULT_CALIBRATION,
    dtype_bytes: int = 2,
    sequence_parallel: bool = True,
    quantize: Quantization | None = None,
    split_lora_inputs: bool = True,
) -> LayerTimeCoeffs:
    """LobRA's t(b, s) of one block on ``tp`` devices, ms, from the hardware (see the module docstring); over a base
    stored as ``quantize``, with its dequantization.

    With sequence parallelism the TP all-reduce becomes a reduce-scatter and an all-gather of
    the same total volume, so only the elementwise term changes. ``split_lora_inputs=False`` models LobRA's executor
    (whole LoRA inputs on every TP rank, no dS reduce-scatter), as the checks against its measured times do.
    """
    h, f = model.hidden, model.ffn
    hq, hkv, p = _widths(model)
    flops = gpu.bf16_tflops * TFLOP
    hbm = gpu.hbm_gbps * GB
    tp_link = Link(cal.link_latency_us / US_PER_MS, gpu.intra_node_gbps * cal.link)
    c1 = 7 * hq / tp / (flops * cal.attention) * MS_PER_S
    low_rank = 6 * adapters.mean_params_per_layer(model) - 2 * adapters.mean_skipped_gemm_params_per_layer(model)
    gemm = (4 * p + low_rank) / tp / (flops * cal.matmul)
    model_width = 22 * h / (tp if sequence_parallel else 1)
    elementwise = (model_width + (4 * (hq + hkv) + 9 * f) / tp) * dtype_bytes / (hbm * cal.memory)
    allreduce = tp_link.allreduce(tp)  # ms vs bytes; a token carries h * dtype bytes
    c3 = (gemm + elementwise) * MS_PER_S + TP_ALLREDUCES_PER_BLOCK * allreduce.slope * h * dtype_bytes
    weights = 2 * p * dtype_bytes / tp / (hbm * cal.memory) * MS_PER_S
    c6 = weights + TP_ALLREDUCES_PER_BLOCK * allreduce.fixed + cal.layer_overhead_ms
    trained_a = [task for task in adapters.tasks if not task.vera]  # a VeRA-only call saves no input: no collective
    if split_lora_inputs and trained_a:  # the backward's dS reduce-scatters, T x r_max each (module docstring)
        ds = tp_link.reduce_scatter(tp)
        adapted = len(COLUMN_PARALLEL & {t for task in trained_a for t in task.targets})
        c3 += adapted * ds.slope * max(task.rank for task in trained_a) * dtype_bytes
        c6 += adapted * ds.fixed
    dora_token, dora_microbatch = dora_terms(model, adapters, tp, flops * cal.matmul, hbm * cal.memory, dtype_bytes)
    c3 += dora_token * MS_PER_S
    c6 += dora_microbatch * MS_PER_S
    if quantize is not None:  # dequantize forward and backward: read the stored bytes, write dtype
        stored = weight_bytes(model, quantize, dtype_bytes) - 2 * h * dtype_bytes  # the projections' bytes
        c6 += 2 * (stored + p * dtype_bytes) / tp / (hbm * cal.memory) * MS_PER_S
    return LayerTimeCoeffs((c1, 0.0, c3, 0.0, 0.0, c6))


def analytic_dora_factor(
    model: ModelSpec,
    gpu: GPUSpec,
    adapters: AdapterLoad,
    shape: MicroBatchShape,
    tp: int = 1,
    cal: Calibration = DEFAULT_CALIBRATION,
    dropout: bool = True,
) -> float:
    """DoRA's factor on a block's time (``dora_cost``): ``t(b, s)`` with every task of ``adapters`` DoRA (with adapter
    dropout, or without) over ``t(b, s)`` with them plain LoRA, at ``shape`` on ``tp`` devices of ``gpu``."""
    lora = AdapterLoad(tuple(replace(t, dora=False, dora_dropout=False) for t in adapters.tasks), adapters.optimizer)
    dora = AdapterLoad(tuple(replace(t, dora=True, dora_dropout=dropout) for t in adapters.tasks), adapters.optimizer)
    base = analytic_layer_time(model, gpu, tp, lora, cal).shape(shape)
    return analytic_layer_time(model, gpu, tp, dora, cal).shape(shape) / base


def analytic_head_time(
    model: ModelSpec, gpu: GPUSpec, tp: int, cal: Calibration = DEFAULT_CALIBRATION, dtype_bytes: int = 2
) -> AffineTime:
    """Embedding, final norm, vocab-parallel LM head and loss, forward and input gradient, ms vs tokens.

    Per token 4 h V / tp FLOPs (forward and input gradient; the head is frozen) and the logits'
    traffic (written in the compute dtype, read and written in fp32 for softmax and its
    gradient: dtype + 12 bytes per vocabulary entry); fixed: two reads of the head matrix.
    """
    flops = gpu.bf16_tflops * TFLOP * cal.matmul
    hbm = gpu.hbm_gbps * GB * cal.memory
    per_token = 4 * model.hidden * model.vocab / tp / flops + model.vocab / tp * (dtype_bytes + 12) / hbm
    fixed = 2 * model.vocab * model.hidden * dtype_bytes / tp / hbm
    return AffineTime(fixed * MS_PER_S, per_token * MS_PER_S)


def analytic_links(gpu: GPUSpec, cal: Calibration = DEFAULT_CALIBRATION) -> tuple[Link, Link]:
    """(inside a node, across nodes) links of one GPU: datasheet bandwidth times the link efficiency."""
    latency = cal.link_latency_us / US_PER_MS
    return Link(latency, gpu.intra_node_gbps * cal.link), Link(latency, gpu.inter_node_gbps * cal.link)


def analytic_optimizer_time(
    gpu: GPUSpec, adapters: AdapterLoad, cal: Calibration = DEFAULT_CALIBRATION, dtype_bytes: int = 2
) -> AffineTime:
    """The optimizer step, ms vs adapter parameters on one device: memory-bound, it reads every
    state of a parameter and writes all but the gradient back."""
    traffic = 2 * adapters.state_bytes_per_param(dtype_bytes) - dtype_bytes
    return AffineTime(0.0, traffic / (gpu.hbm_gbps * GB * cal.memory) * MS_PER_S)


def calibrate(
    records: Sequence[tuple[int, MicroBatchShape, float]],
    model: ModelSpec,
    gpu: GPUSpec,
    adapters: AdapterLoad,
    start: Calibration = DEFAULT_CALIBRATION,
    split_lora_inputs: bool = True,
) -> Calibration:
    """Fit the six global time factors to measured per-layer times ``(tp, shape, ms)``.

    Bounded least squares on relative errors with the soft-L1 loss, as in ``fit``; the
    efficiencies stay in (0, 1], the overheads non-negative. Every TP degree shares the same
    factors, so a degree missing from the records is predicted from the hardware alone.
    ``split_lora_inputs`` says which executor measured them (``analytic_layer_time``): False for LobRA's.
    """
    tps = np.array([r[0] for r in records])
    measured = np.array([r[2] for r in records])

    def residuals(x: np.ndarray) -> np.ndarray:
        cal = start.with_time_factors(x)
        coeffs = {
            tp: analytic_layer_time(model, gpu, int(tp), adapters, cal, split_lora_inputs=split_lora_inputs)
            for tp in np.unique(tps)
        }
        pred = np.array([coeffs[tp].shape(mb) for tp, mb, _ in records])
        return pred / measured - 1.0

    lower = [0.02, 0.02, 0.02, 0.01, 0.0, 0.0]
    upper = [1.0, 1.0, 1.0, 1.0, 100.0, 1000.0]
    x0 = np.clip(start.time_factors, lower, upper)
    from scipy.optimize import least_squares  # here: planning never imports scipy.optimize (0.15 s)

    result = least_squares(residuals, x0, bounds=(lower, upper), loss="soft_l1", f_scale=ROBUST_SCALE)
    return start.with_time_factors(result.x)
