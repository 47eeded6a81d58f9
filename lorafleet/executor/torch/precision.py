"""The precision a run computes in, as the commands name it (``--dtype fp32|bf16``)."""

from __future__ import annotations

from enum import StrEnum

import torch


class Precision(StrEnum):
    """The dtype of the frozen base model and the activations (over bf16 the adapters are fp32
    master weights, ``multi_lora.adapter_dtype``), in training and in profiling alike."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self is Precision.FP32 else torch.bfloat16

    @property
    def bytes(self) -> int:
        return torch.finfo(self.dtype).bits // 8
