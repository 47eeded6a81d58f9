"""The reference NF4 and int8 storage of a frozen base (``executor/torch/quant.py``) against bitsandbytes' own bytes.

``data/quant_golden.safetensors`` holds what bitsandbytes 0.50.2 wrote for seeded weights (``scripts/quant_golden.py``,
run where bitsandbytes imports): the packed NF4 indices, block scales and dequantized values, and int8's CB, SCB and
dequantized values. Ours must equal every byte, on a machine without bitsandbytes too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lorafleet.executor.torch.quant import (
    NF4_CODE,
    dequantize_int8,
    dequantize_nf4,
    quantize_int8,
    quantize_nf4,
)

GOLDEN = Path(__file__).parent / "data" / "quant_golden.safetensors"
NAMES = ("aligned", "ragged", "bf16")


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    with safe_open(str(GOLDEN), "pt") as f:
        assert f.metadata()["bitsandbytes"] == "0.50.2"
    return load_file(str(GOLDEN))


@pytest.mark.parametrize("name", NAMES)
def test_nf4_is_bitsandbytes_byte_for_byte(golden, name):
    weight = golden[f"{name}.weight"]
    ours = quantize_nf4(weight)
    assert torch.equal(ours.packed, golden[f"{name}.nf4.packed"])
    assert torch.equal(ours.absmax, golden[f"{name}.nf4.absmax"])
    back = dequantize_nf4(ours, weight.dtype)  # bitsandbytes dequantizes into the weight's dtype
    assert torch.equal(back, golden[f"{name}.nf4.dequantized"].to(weight.dtype))
    # sanity: a 4-bit code is lossy, within half the widest code step (0.16) of a block's scale
    error = (back.float() - weight.float()).abs().max()
    assert 0 < error <= 0.5 * max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:])) * weight.float().abs().max()


def test_bitsandbytes_cpu_kernel_scales_by_row_where_a_row_is_not_whole_blocks(golden):
    """A finding kept in the golden file: bitsandbytes' native CPU dequantization (F.dequantize_4bit, bf16, last dim
    80) applies the block scales row by row, while its quantization cut flat blocks of 64; its own reference kernel
    and ours agree, and are closer to the weight."""
    weight = golden["bf16.weight"].float()
    native, reference = golden["bf16.nf4.dequantized_cpu_kernel"], golden["bf16.nf4.dequantized"].bfloat16().float()
    assert not torch.equal(native, reference)
    assert (native - weight).abs().max() > 2 * (reference - weight).abs().max()
    for name in ("aligned", "ragged"):  # whole blocks per row, or an odd row (its generic fallback): the same bytes
        assert torch.equal(golden[f"{name}.nf4.dequantized_cpu_kernel"], golden[f"{name}.nf4.dequantized"])


@pytest.mark.parametrize("name", NAMES)
def test_int8_is_bitsandbytes_byte_for_byte(golden, name):
    ours = quantize_int8(golden[f"{name}.weight"])
    assert torch.equal(ours.q, golden[f"{name}.int8.q"]) and torch.equal(ours.scale, golden[f"{name}.int8.scale"])
    assert torch.equal(dequantize_int8(ours), golden[f"{name}.int8.dequantized"])


def test_storage_is_what_the_memory_model_counts():
    """NF4: half a byte a weight and an fp32 scale a block of 64 (0.5625 B); int8: a byte and an fp32 a row."""
    weight = torch.randn(256, 512)
    assert quantize_nf4(weight).nbytes == 256 * 512 * 0.5625
    assert quantize_int8(weight).nbytes == 256 * 512 + 256 * 4
    assert dequantize_nf4(quantize_nf4(weight), torch.bfloat16).dtype == torch.bfloat16
