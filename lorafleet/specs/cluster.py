"""The hardware a workload runs on: GPU kind, nodes, GPUs per node."""

from __future__ import annotations

from pydantic import Field, field_validator

from lorafleet.specs._base import Int, Spec
from lorafleet.specs.gpus import GPU_PRESETS, GPUSpec

MAX_NODES = 4096
"""The most nodes a cluster may have (``ClusterSpec.nodes``; ``plan --gpus auto --max-nodes`` is capped by it)."""
MAX_GPUS_PER_NODE = 64
"""The most GPUs a node may hold."""


class ClusterSpec(Spec):
    """Homogeneous nodes of one GPU kind; a TP group never spans two nodes."""

    gpu: str = "A100-40GB"
    """GPU preset name (see ``lorafleet.specs.gpus.GPU_PRESETS``)."""
    nodes: Int = Field(1, gt=0, le=MAX_NODES)
    """Number of nodes."""
    gpus_per_node: Int = Field(8, gt=0, le=MAX_GPUS_PER_NODE)
    """GPUs in each node."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        for key in GPU_PRESETS:
            if key.lower() == value.lower():
                return key
        raise ValueError(f"unknown GPU {value!r}; choose from {', '.join(GPU_PRESETS)}")

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_spec(self) -> GPUSpec:
        return GPU_PRESETS[self.gpu]

    @classmethod
    def with_gpus(cls, n_gpus: int, gpu: str = "A100-40GB", gpus_per_node: int = 8) -> ClusterSpec:
        """N GPUs packed into full nodes of ``gpus_per_node`` (fewer on one node when N is smaller)."""
        per_node = min(gpus_per_node, n_gpus)
        if n_gpus % per_node:
            raise ValueError(f"{n_gpus} GPUs do not fill nodes of {gpus_per_node}")
        return cls(gpu=gpu, nodes=n_gpus // per_node, gpus_per_node=per_node)
