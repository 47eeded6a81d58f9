"""Writes tests/executor/torch/data/quant_golden.safetensors: bitsandbytes' own NF4 and int8 bytes for seeded weights.

The reference quantization (``lorafleet.executor.torch.quant``) is held to these bytes by
``tests/executor/torch/test_quant.py``, on any machine. Re-make the file where bitsandbytes imports (its CPU path
runs without a GPU), e.g. with a wheel installed aside, not into the project's environment:

    python -m pip install --no-deps --target /tmp/bnb bitsandbytes==0.50.2
    PYTHONPATH=/tmp/bnb .venv/bin/python scripts/quant_golden.py
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes
import bitsandbytes.functional as F
import torch
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
from bitsandbytes.functional import get_4bit_type
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "executor" / "torch" / "data" / "quant_golden.safetensors"

#: name -> (shape, dtype): a 64-aligned fp32 matrix, one whose size leaves a partial last block and an odd count,
#: and a bf16 one (quantize_4bit casts to fp32 first; Int8Params to fp16).
WEIGHTS = {
    "aligned": ((32, 128), torch.float32),
    "ragged": ((37, 45), torch.float32),
    "bf16": ((16, 80), torch.bfloat16),
}


def main() -> None:
    tensors = {}
    gen = torch.Generator().manual_seed(41)
    for name, (shape, dtype) in WEIGHTS.items():
        weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
        weight[0, :3] = torch.tensor([0.0, 0.3, -0.3]).to(dtype)  # an exact zero and a block's extremes
        packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
        tensors[f"{name}.weight"] = weight
        tensors[f"{name}.nf4.packed"] = packed
        tensors[f"{name}.nf4.absmax"] = state.absmax
        # bitsandbytes' reference dequantization (its default kernel, what every other backend is held to). Its
        # native CPU kernel, which F.dequantize_4bit runs for an even last dim, differs where a row is not a
        # multiple of the block (the bf16 case: 3x the error; docs/multi_lora.md), so it is kept apart.
        tensors[f"{name}.nf4.dequantized"] = _dequantize_4bit_compute(
            packed.reshape(-1), state.absmax, get_4bit_type("nf4", device="cpu"), 64, shape, dtype
        ).float()
        tensors[f"{name}.nf4.dequantized_cpu_kernel"] = F.dequantize_4bit(packed, state).float()
        cb, scb, _ = F.int8_vectorwise_quant(weight.contiguous().to(torch.float16))
        tensors[f"{name}.int8.q"] = cb
        tensors[f"{name}.int8.scale"] = scb
        tensors[f"{name}.int8.dequantized"] = F.int8_vectorwise_dequant(cb, scb)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, OUT, metadata={"bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__})
    print(f"wrote {OUT} (bitsandbytes {bitsandbytes.__version__})")


if __name__ == "__main__":
    main()
