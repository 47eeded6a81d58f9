"""Fixtures of the planner tests: LobRA-like cost models and small bucketed batches.

The time model is LobRA's TP1 fit for one Llama2-7B layer on A100-40GB (their Appendix D,
``c2`` clipped to 0), divided by ``tp ** TP_SPEEDUP`` per TP degree so that per-GPU
throughput falls with TP roughly as their Table 3 does (TP8 ~ 0.45 x TP1); M doubles with
TP as in their memory table.
"""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import LayerTimeCoeffs
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.model import MODEL_PRESETS

LOBRA_TP1_MS = (1.29e-7, 0.0, 4.65e-3, 8.4e-4, 3.1e-2, 2.45)
TP_SPEEDUP = 0.62
M_TP1 = 2048


def lobra_like_cost_model(model: str = "llama2-7b", m_tp1: int = M_TP1, max_tp: int = 8) -> CostModel:
    """LobRA's 7B A100 time model for every (tp, pp) with power-of-two tp <= max_tp; M = m_tp1 * tp * pp**0.5 (floored to 256)."""
    spec = MODEL_PRESETS[model]
    layer_time = {}
    table = {}
    tp = 1
    while tp <= max_tp:
        layer_time[tp] = LayerTimeCoeffs(tuple(c / tp**TP_SPEEDUP for c in LOBRA_TP1_MS))
        for pp in range(1, 17):
            if spec.n_layers % pp == 0:
                table[ParallelConfig(tp, pp)] = int(m_tp1 * tp * pp**0.5) // 256 * 256
        tp *= 2
    return CostModel(model=spec, layer_time=layer_time, max_tokens_table=table, source="test:lobra-like")


@pytest.fixture(scope="session")
def cost_model_7b() -> CostModel:
    return lobra_like_cost_model()


@pytest.fixture
def cluster_16() -> ClusterSpec:
    return ClusterSpec(gpu="A100-40GB", nodes=2, gpus_per_node=8)
