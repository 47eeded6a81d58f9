"""Accelerator datasheet figures: the only place hardware numbers live.

Figures are public datasheet values for the SXM/OAM parts unless noted; bandwidths are per
GPU and per direction. ``cpu`` describes this repository's 2-core development machine in
the same units, nominally, so the analytic model can be run against local measurements.
"""

from __future__ import annotations

from pydantic import Field

from lorafleet.errors import InputError
from lorafleet.specs._base import Float, Spec

GIB = 1024**3
#: The CPU's micro-batch knee (``GPUSpec.microbatch_knee_gib``, ``microbatch_knee_penalty``): on this machine a
#: step of SmolLM2-135M in fp32 costs the least CPU time a token in micro-batches of about 2,048 tokens, 3 GiB of
#: activations by the (nominally bf16) memory model, and every token past them about 1 + ρ times as much
#: (``benchmarks/bench_microbatch.py``, docs/costmodel.md).
CPU_KNEE_GIB = 3.0
CPU_KNEE_PENALTY = 0.5
#: GB/s at which a GPU node's rank loads its stage of the base model in a move (``GPUSpec.stage_load_gbps``):
#: the checkpoint read from the node's local NVMe, 2 GB/s (DLRover's Flash Checkpoint figures for GPT-2 1.5B on
#: 2 x A100: "NAS 100 MB/s, NVMe 2 GB/s"), the conservative end of a node-local load: the page cache (the node
#: read the same checkpoint at start-up) and the host-to-device copy (PCIe gen4 x16, about 25 GB/s peak) are
#: faster. A fleet that loads from a shared filesystem is slower (DLRover's Megatron loads from CPFS: 18 GB in
#: 205 s, 0.09 GB/s) and sets its pool's ``stage_load_gbps`` (docs/arrivals.md, "Migration").
NODE_STAGE_LOAD_GBPS = 2.0
#: The same on this machine, measured: ``benchmarks/bench_queue.py``'s 330 MB/s (a random 88M-parameter Llama's
#: stage from a safetensors file, gloo; 2026-12-04, the 2-core machine).
CPU_STAGE_LOAD_GBPS = 0.33


class GPUSpec(Spec):
    """One accelerator kind."""

    name: str
    """Preset name."""
    memory_gib: Float = Field(gt=0)
    """Device memory in GiB."""
    bf16_tflops: Float = Field(gt=0)
    """Dense bf16 tensor-core peak, TFLOP/s (no sparsity)."""
    hbm_gbps: Float = Field(gt=0)
    """Device memory bandwidth, GB/s."""
    intra_node_gbps: Float = Field(gt=0)
    """GPU-to-GPU bandwidth inside a node (NVLink, else PCIe), GB/s per direction."""
    inter_node_gbps: Float = Field(gt=0)
    """Network bandwidth per GPU across nodes (InfiniBand/RoCE NIC), GB/s per direction."""
    microbatch_knee_gib: Float | None = Field(default=None, gt=0)
    """A micro-batch's activations (by the memory model, GiB) past which each further token costs
    ``1 + microbatch_knee_penalty`` times as much (``costmodel.microbatch_size``), measured; None: a token costs the
    same in any micro-batch (every GPU preset)."""
    microbatch_knee_penalty: Float = Field(default=0.0, ge=0)
    """ρ: the extra share of a token's time past the knee."""
    stage_load_gbps: Float = Field(gt=0)
    """GB/s at which one rank loads its stage of the base model when a move rebuilds it
    (``planner.incremental.MigrationModel``): :data:`NODE_STAGE_LOAD_GBPS` for every GPU, measured for ``cpu``
    (:data:`CPU_STAGE_LOAD_GBPS`); a pool may set its own (``PoolSpec.stage_load_gbps``)."""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


def _gpu(
    name: str,
    mem: float,
    tflops: float,
    hbm: float,
    intra: float,
    inter: float,
    knee: tuple[float, float] | None = None,
    stage_load: float = NODE_STAGE_LOAD_GBPS,
) -> GPUSpec:
    gib, penalty = knee or (None, 0.0)
    return GPUSpec(
        name=name,
        memory_gib=mem,
        bf16_tflops=tflops,
        hbm_gbps=hbm,
        intra_node_gbps=intra,
        inter_node_gbps=inter,
        microbatch_knee_gib=gib,
        microbatch_knee_penalty=penalty,
        stage_load_gbps=stage_load,
    )


GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        # NVLink 3: 600 GB/s total = 300 GB/s per direction; HDR InfiniBand 200 Gb/s per GPU.
        _gpu("A100-40GB", 40, 312, 1555, 300, 25),
        _gpu("A100-80GB", 80, 312, 2039, 300, 25),
        # Export variant of the A100: NVLink capped at 400 GB/s total.
        _gpu("A800-80GB", 80, 312, 2039, 200, 25),
        # NVLink 4: 900 GB/s total; NDR InfiniBand 400 Gb/s per GPU.
        _gpu("H100-80GB", 80, 989, 3350, 450, 50),
        _gpu("H200-141GB", 141, 989, 4800, 450, 50),
        # PCIe cards: RTX A6000 (NVLink bridge pairs only, PCIe 4.0 x16 otherwise), L40S (no NVLink).
        _gpu("A6000-48GB", 48, 155, 768, 32, 12.5),
        _gpu("L40S", 48, 362, 864, 32, 25),
        # This machine: 2 cores, fp32 through oneDNN; gloo over shared memory; its micro-batch knee measured by
        # benchmarks/bench_microbatch.py (SmolLM2-135M in fp32), its stage load by benchmarks/bench_queue.py.
        _gpu("cpu", 24, 0.1, 20, 5, 1, knee=(CPU_KNEE_GIB, CPU_KNEE_PENALTY), stage_load=CPU_STAGE_LOAD_GBPS),
    )
}


def gpu_preset_for(device_name: str, memory_bytes: int) -> str | None:
    """The ``GPU_PRESETS`` name of a device as CUDA names it (``"NVIDIA H200"``, 139.8 GiB ->
    ``"H200-141GB"``): the presets whose model (the name before the first ``-``) appears in the
    device name, the one nearest in memory; None when no preset's model does."""
    name = device_name.upper()
    models = [g for g in GPU_PRESETS.values() if g.name != "cpu" and g.name.split("-")[0].upper() in name]
    if not models:
        return None
    return min(models, key=lambda g: abs(g.memory_gib * GIB - memory_bytes)).name


def resolve_gpu(name: str, source: str = "<args>", field: str = "gpu") -> GPUSpec:
    """Look up a preset (case-insensitive), else an InputError naming ``source: field``."""
    for key, spec in GPU_PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise InputError(source, field, f"unknown GPU {name!r}; choose from {', '.join(GPU_PRESETS)}")
