"""The torch dtype of each precision a run computes in. The vocabulary (``--dtype fp32|bf16``) is torch-free,
:class:`lorafleet.specs.device.Precision` (re-exported here); this module only maps it to torch."""

from __future__ import annotations

import torch

from lorafleet.specs.device import Precision

TORCH_DTYPES: dict[Precision, torch.dtype] = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16}


def torch_dtype(precision: Precision | str) -> torch.dtype:
    """The torch dtype of ``precision`` (a member, or its name: ``bf16``)."""
    return TORCH_DTYPES[Precision(precision)]


__all__ = ["TORCH_DTYPES", "Precision", "torch_dtype"]
