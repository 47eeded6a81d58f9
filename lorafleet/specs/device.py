"""Where a run computes and in what precision, as the commands name them (``train --device``, ``--dtype``;
``profile --dtype``): the vocabulary, torch-free, so the training options and the run file hold it without
torch. The torch side maps it (``executor.torch.precision.torch_dtype``, ``executor.torch.launch``)."""

from __future__ import annotations

from enum import StrEnum


class Device(StrEnum):
    """The device of ``lorafleet train``'s ranks."""

    AUTO = "auto"
    """CUDA when there are enough GPUs for the local ranks, else the CPU."""
    CPU = "cpu"
    """Every rank on a CPU, gloo."""
    CUDA = "cuda"
    """One GPU per local rank, NCCL."""


class Precision(StrEnum):
    """The dtype of the frozen base model and the activations (over bf16 the adapters are fp32 master weights,
    ``executor.torch.multi_lora.adapter_dtype``), in training and in profiling alike."""

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def bytes(self) -> int:
        """Bytes of one value (of a base weight: ``planner.incremental.MigrationModel.dtype_bytes``)."""
        return _BYTES[self]


_BYTES = {Precision.FP32: 4, Precision.BF16: 2}
