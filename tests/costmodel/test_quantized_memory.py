"""A quantized shared base in the memory model (``memory_model.weight_bytes``): what it frees, and M against Vertex AI's
published QLoRA batch for a 7B model on A100-40GB (2 -> 24)."""

from __future__ import annotations

import json

import pytest
import yaml

from lorafleet.assemble import workload_cost_model
from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.analytic import DEFAULT_CALIBRATION, analytic_layer_time
from lorafleet.costmodel.build import load_cost_model
from lorafleet.costmodel.memory_model import stage_memory, weight_bytes
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.errors import InputError
from lorafleet.specs.gpus import resolve_gpu
from lorafleet.specs.lora import Quantization
from lorafleet.specs.model import MODEL_PRESETS
from lorafleet.workload import load_workload
from tests.helpers.repo import SMALL_WORKLOAD

LLAMA7B, A100 = MODEL_PRESETS["llama2-7b"], resolve_gpu("a100-40gb")
VERTEX_BATCH_RATIO = 24 / 2
"""Vertex AI's QLoRA page: a 7B model's batch on A100-40GB goes from 2 to 24."""


def max_tokens(quantize, dtype_bytes=2, recompute=True, config=(1, 1)) -> int:
    line = stage_memory(
        LLAMA7B, ParallelConfig(*config, recompute), AdapterLoad.uniform(1), A100.memory_bytes, dtype_bytes,
        DEFAULT_CALIBRATION.memory_factors, quantize=quantize,
    )  # fmt: skip
    return line.max_tokens()


def test_weight_bytes_of_a_block():
    shapes = LLAMA7B.target_shapes().values()
    projections = sum(i * o for i, o in shapes)
    norms = LLAMA7B.layer_params - projections
    assert norms == 2 * LLAMA7B.hidden
    assert weight_bytes(LLAMA7B, None, 2) == 2 * LLAMA7B.layer_params
    assert weight_bytes(LLAMA7B, Quantization.NF4, 2) == pytest.approx(projections * 0.5625 + 2 * norms)
    assert weight_bytes(LLAMA7B, Quantization.INT8, 2) == projections + 4 * sum(o for _, o in shapes) + 2 * norms


@pytest.mark.parametrize("recompute", [False, True])
def test_a_quantized_base_raises_m(recompute):
    """Over bf16 the base is 12.6 GiB of the budget: NF4 frees ~8.6 GiB (its one dequantized projection included),
    int8 ~6 GiB; M rises by the freed bytes over bytes_per_token, the same ratio with or without recomputation."""
    bf16, int8, nf4 = (max_tokens(q, recompute=recompute) for q in (None, Quantization.INT8, Quantization.NF4))
    assert bf16 < int8 < nf4
    assert nf4 / bf16 == pytest.approx(1.35, abs=0.02)
    assert max_tokens(Quantization.NF4, config=(2, 1)) > max_tokens(None, config=(2, 1))


def test_m_against_vertexs_published_batch_ratio():
    """NOT MET, recorded: Vertex's 12x is not what a quantized base frees. From a bf16 base the model gives 1.35x, 8.9x
    short of it; from a base held in fp32 (28 GB of the 40), 5.5x (4.8x with recomputation), still 2.2x short. Vertex
    does not publish its sequence length, recomputation or baseline precision; docs/multi_lora.md says so. The
    asserts pin the model's figures and the size of the gap, so a change to either is seen."""
    bf16, nf4 = max_tokens(None, recompute=False), max_tokens(Quantization.NF4, recompute=False)
    assert nf4 / bf16 == pytest.approx(1.35, abs=0.02) and VERTEX_BATCH_RATIO / (nf4 / bf16) > 8
    fp32 = max_tokens(None, dtype_bytes=4, recompute=False)
    assert nf4 / fp32 == pytest.approx(5.5, abs=0.1) and VERTEX_BATCH_RATIO / (nf4 / fp32) > 2


def test_the_time_model_prices_the_dequantization():
    """A quantized base adds its dequantization, forward and backward, to a block's fixed time: a memory-bound pass
    (read the stored bytes, write bf16). Llama-2-7B on A100-40GB: +12% at one 512-token sequence, +3% at 4x1024;
    int8 reads more than NF4. Vertex's "about 66% lower speed" is not this: it is bitsandbytes' kernels, which a
    profile on a GPU would measure (not done here)."""
    load = AdapterLoad.uniform(6)
    for shape, nf4_factor in ((MicroBatchShape.padded(1, 512), 1.12), (MicroBatchShape.padded(4, 1024), 1.03)):
        plain = analytic_layer_time(LLAMA7B, A100, 1, load).shape(shape)
        nf4 = analytic_layer_time(LLAMA7B, A100, 1, load, quantize=Quantization.NF4).shape(shape)
        int8 = analytic_layer_time(LLAMA7B, A100, 1, load, quantize=Quantization.INT8).shape(shape)
        assert nf4 / plain == pytest.approx(nf4_factor, abs=0.01) and int8 > nf4


def test_a_workloads_quantize_reaches_its_cost_model(tmp_path):
    """``quantize: nf4`` in a workload: every config of its analytic cost model holds more tokens and its layers take
    longer (the dequantization); a profile (measured over an unquantized base) cannot price it: one line."""
    raw = json.loads(json.dumps(SMALL_WORKLOAD))
    models = {}
    for kind in (None, "nf4"):
        path = tmp_path / f"{kind}.yaml"
        path.write_text(yaml.safe_dump({**raw, "quantize": kind}))
        models[kind] = workload_cost_model(load_workload(path), load_workload(path).spec.cluster)
    plain, nf4 = models[None], models["nf4"]
    assert plain.max_tokens_table.keys() == nf4.max_tokens_table.keys()
    assert all(nf4.max_tokens_table[c] > m for c, m in plain.max_tokens_table.items())
    shape = MicroBatchShape.padded(2, 512)
    config = next(iter(plain.max_tokens_table))
    assert nf4.layer_time[config.tp].shape(shape) > plain.layer_time[config.tp].shape(shape)
    with pytest.raises(InputError, match="quantize: nf4: a profile is measured over an unquantized base"):
        load_cost_model("any.json", LLAMA7B, None, None, quantize=Quantization.NF4)
