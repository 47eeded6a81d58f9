"""The analytic source: calibrated on LobRA's A100 layer times with global factors only."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from lorafleet.costmodel.analytic import DEFAULT_CALIBRATION, analytic_layer_time, calibrate
from lorafleet.costmodel.build import analytic_cost_model
from lorafleet.costmodel.fit import ErrorSummary
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.gpus import GPU_PRESETS
from lorafleet.specs.model import MODEL_PRESETS
from tests.helpers.lobra_data import LOBRA_ADAPTERS, layer_rows

LLAMA7B = MODEL_PRESETS["llama2-7b"]
A100 = GPU_PRESETS["A100-40GB"]


def _lobra(tp, cal=DEFAULT_CALIBRATION):
    """A block as LobRA's executor runs it (whole LoRA inputs, no dS reduce-scatter): what its CSV measured."""
    return analytic_layer_time(LLAMA7B, A100, tp, LOBRA_ADAPTERS, cal, split_lora_inputs=False)


def _calibrate(records):
    return calibrate(records, LLAMA7B, A100, LOBRA_ADAPTERS, split_lora_inputs=False)


def _errors(rows, cal, tp):
    coeffs = _lobra(tp, cal)
    group = [r for r in rows if r.tp == tp]
    return ErrorSummary.of([coeffs.shape(r.shape) for r in group], [r.time for r in group])


def test_default_calibration_within_15_percent_per_tp(reference_dir):
    """Issue bar: median relative error <= 15% on every TP degree of LobRA's CSV."""
    rows = layer_rows(reference_dir)
    for tp in sorted({r.tp for r in rows}):
        err = _errors(rows, DEFAULT_CALIBRATION, tp)
        assert err.median <= 0.15, (tp, err)


def test_default_calibration_is_what_calibrate_finds(reference_dir):
    rows = layer_rows(reference_dir)
    found = _calibrate([(r.tp, r.shape, r.time) for r in rows])
    for tp in (1, 2, 4, 8):
        shapes = [MicroBatchShape.padded(b, s) for b in (1, 4) for s in (256, 4096)]
        ours, refit = _lobra(tp), _lobra(tp, found)
        np.testing.assert_allclose([ours.shape(m) for m in shapes], [refit.shape(m) for m in shapes], rtol=0.02)


def test_a_tp_degree_left_out_of_calibration_is_predicted_from_the_hardware(reference_dir):
    """Calibrate on TP1 and TP8 only; TP2 (like the absent TP4) must follow from the datasheet."""
    rows = layer_rows(reference_dir)
    found = _calibrate([(r.tp, r.shape, r.time) for r in rows if r.tp != 2])
    assert _errors(rows, found, 2).median <= 0.15


def test_tp4_throughput_near_lobra_measurement():
    """LobRA Table 3: <4,1> at 8K sequences runs 3.25K tokens/s/GPU (16 micro-batches of one sequence).
    TP4 is absent from the layer-time CSV, so this is the model's own prediction."""
    cm = analytic_cost_model(LLAMA7B, ClusterSpec.with_gpus(16), LOBRA_ADAPTERS)
    config = ParallelConfig(4, 1)
    step = cm.replica_time(config, [MicroBatchShape.padded(1, 8192)] * 16) - cm.step_overhead(config)
    per_gpu = 16 * 8192 / step / config.n_gpus
    assert per_gpu == pytest.approx(3250, rel=0.15)


def test_frozen_base_counts_no_weight_gradient_gemms():
    """Forward 2P + input gradient 2P per token: doubling the TP degree halves the GEMM time."""
    one = analytic_layer_time(LLAMA7B, A100, 1, LOBRA_ADAPTERS)
    assert one.c[1] == one.c[3] == one.c[4] == 0.0
    tokens = 16384
    gemm_ms = one.c[2] * tokens
    flops = 4 * (LLAMA7B.layer_params - 2 * LLAMA7B.hidden) * tokens
    assert gemm_ms > flops / (A100.bf16_tflops * 1e12) * 1e3  # at most the peak rate
    assert gemm_ms < 2 * flops / (A100.bf16_tflops * 1e12 * DEFAULT_CALIBRATION.matmul) * 1e3  # no 6P (weight grads)


def test_faster_hardware_is_faster():
    h100 = analytic_layer_time(LLAMA7B, GPU_PRESETS["H100-80GB"], 2, LOBRA_ADAPTERS)
    a100 = analytic_layer_time(LLAMA7B, A100, 2, LOBRA_ADAPTERS)
    assert h100(8, 2048) < a100(8, 2048)


def test_costmodel_never_imports_torch():
    code = "import sys, lorafleet.costmodel, lorafleet.costmodel.check; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_vera_token_is_priced_without_its_frozen_a_weight_gradient():
    """VeRA runs LoRA's rank-r GEMMs but for ``dA`` (its A is frozen): 2 r * in FLOPs a projection less a token, and
    nothing else moves; a LoRA load's coefficients are what they were (no VeRA term)."""
    from lorafleet.costmodel.adapters import AdapterLoad, TaskAdapter
    from lorafleet.specs.lora import LLAMA_TARGET_MODULES

    model, gpu = MODEL_PRESETS["llama2-7b"], GPU_PRESETS["A100-40GB"]
    lora = AdapterLoad((TaskAdapter(16, LLAMA_TARGET_MODULES),))
    vera = AdapterLoad((TaskAdapter(16, LLAMA_TARGET_MODULES, vera=True),))
    # whole inputs: the LoRA load's dS reduce-scatter, which VeRA does not run, is tested apart (below)
    t_lora, t_vera = (analytic_layer_time(model, gpu, 2, load, split_lora_inputs=False) for load in (lora, vera))
    skipped = sum(16 * i for i, _ in model.adapter_shapes(LLAMA_TARGET_MODULES).values())
    flops = gpu.bf16_tflops * 1e12 * DEFAULT_CALIBRATION.matmul
    assert t_lora.c[2] - t_vera.c[2] == pytest.approx(2 * skipped / 2 / flops * 1e3, rel=1e-9)
    assert t_lora.c[:2] == t_vera.c[:2] and t_lora.c[3:] == t_vera.c[3:]
    assert lora.mean_skipped_gemm_params_per_layer(model) == 0


@pytest.mark.parametrize("tp", [2, 8])
def test_split_lora_inputs_add_one_ds_reduce_scatter_per_adapted_column_parallel_projection(tp):
    """At tp > 1 the backward reduce-scatters each adapted column-parallel projection's partial dS (T x r_max) over
    the TP group: (tp-1)/tp of T r_max dtype bytes a rank on the node's link, the only difference from LobRA's
    executor's block. Five such projections (q, k, v, gate, up) at rank 16, bf16."""
    split = analytic_layer_time(LLAMA7B, A100, tp, LOBRA_ADAPTERS)
    whole = analytic_layer_time(LLAMA7B, A100, tp, LOBRA_ADAPTERS, split_lora_inputs=False)
    link = A100.intra_node_gbps * 1e9 * DEFAULT_CALIBRATION.link
    tokens = 8192
    seconds = 5 * (tp - 1) / tp * tokens * 16 * 2 / link
    assert (split.c[2] - whole.c[2]) * tokens / 1e3 == pytest.approx(seconds, rel=1e-9)
    assert split.c[:2] == whole.c[:2] and split.c[3:] == whole.c[3:]  # the calibration has no link latency
    # about 1/100 of the block's four TP all-reduces of T x h, at any tp: 5 r / (4 * 2 h)
    allreduces = 4 * 2 * (tp - 1) / tp * tokens * LLAMA7B.hidden * 2 / link
    assert seconds / allreduces == pytest.approx(5 * 16 / (8 * LLAMA7B.hidden))


def test_ds_reduce_scatter_counts_adapted_column_parallel_targets_and_the_largest_rank():
    from lorafleet.costmodel.adapters import AdapterLoad, TaskAdapter

    def extra(load):
        return (
            analytic_layer_time(LLAMA7B, A100, 4, load).c[2]
            - analytic_layer_time(LLAMA7B, A100, 4, load, split_lora_inputs=False).c[2]
        )

    qv = AdapterLoad((TaskAdapter(8, ("q_proj", "v_proj")), TaskAdapter(32, ("q_proj", "o_proj"))))
    one = AdapterLoad((TaskAdapter(32, ("q_proj",)),))
    row_only = AdapterLoad((TaskAdapter(32, ("o_proj", "down_proj")),))
    assert extra(qv) == pytest.approx(2 * extra(one))  # q and v at r_max 32; o is row-parallel
    assert extra(row_only) == 0.0


def test_tp1_blocks_are_the_same_split_or_whole():
    assert analytic_layer_time(LLAMA7B, A100, 1, LOBRA_ADAPTERS) == analytic_layer_time(
        LLAMA7B, A100, 1, LOBRA_ADAPTERS, split_lora_inputs=False
    )


def test_link_reduce_scatter_is_half_the_ring_allreduce():
    from lorafleet.costmodel.time_model import Link

    link = Link(latency_ms=0.01, gb_per_s=100.0)
    rs, ar = link.reduce_scatter(8), link.allreduce(8)
    assert rs.fixed == pytest.approx(7 * 0.01) and rs.slope == pytest.approx(7 / 8 / 100e9 * 1e3)
    assert ar.fixed == pytest.approx(2 * rs.fixed) and ar.slope == pytest.approx(2 * rs.slope)
    assert link.reduce_scatter(1)(1e9) == 0.0


def test_a_vera_only_load_runs_no_ds_reduce_scatter():
    from lorafleet.costmodel.adapters import AdapterLoad, TaskAdapter
    from lorafleet.specs.lora import LLAMA_TARGET_MODULES

    vera = AdapterLoad((TaskAdapter(16, LLAMA_TARGET_MODULES, vera=True),))
    assert analytic_layer_time(LLAMA7B, A100, 8, vera) == analytic_layer_time(
        LLAMA7B, A100, 8, vera, split_lora_inputs=False
    )
