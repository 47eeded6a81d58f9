"""Named fleets built in code, for tests, benchmarks and notebooks: a LobRA-like 7B cost model, plans, batches.

The cost model is LobRA's TP1 fit (ms per layer) with scaled variants per TP degree: the
work terms shrink with TP at 85% efficiency per doubling, the fixed term grows. Max tokens
follow LobRA's 7B A100-40GB table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import LayerTimeCoeffs
from lorafleet.plans import DeploymentPlan, GlobalBatch, PlanPool, ReplicaSpec
from lorafleet.specs.dispatch import DispatchOptions, DispatchPolicy, MicroBatchMode
from lorafleet.specs.model import MODEL_PRESETS

LOBRA_TP1 = (1.29e-7, 0.0, 4.65e-3, 8.4e-4, 3.1e-2, 2.45)
MAX_TOKENS = {1: 2048, 2: 4096, 4: 8192, 8: 16384}

TP1, TP2, TP4, TP8 = (ParallelConfig(tp) for tp in (1, 2, 4, 8))
TP2_PP2 = ParallelConfig(2, 2)
LOBRA_7B_PLAN = ((TP1, 6), (TP2, 1), (TP8, 1))
"""LobRA's 7B plan: <1,1> x 6 + <2,1> x 1 + <8,1> x 1 on 16 GPUs."""


def scaled_coeffs(tp: int) -> LayerTimeCoeffs:
    doublings = math.log2(tp)
    work = 1.0 / (tp * 0.85**doublings)
    c1, c2, c3, c4, c5, c6 = LOBRA_TP1
    return LayerTimeCoeffs((c1 * work, c2, c3 * work, c4, c5 * work, c6 * (1 + 0.2 * doublings)))


def lobra_7b_cost_model() -> CostModel:
    configs = [ParallelConfig(tp, pp) for tp in MAX_TOKENS for pp in (1, 2, 4)]
    return CostModel(
        model=MODEL_PRESETS["llama2-7b"],
        layer_time={tp: scaled_coeffs(tp) for tp in MAX_TOKENS},
        max_tokens_table={c: MAX_TOKENS[c.tp] for c in configs},
        source="preset:lobra-7b-scaled",
    )


FLUSHED_PADDING = DispatchPolicy(options=DispatchOptions(microbatch_mode=MicroBatchMode.PADDING), pipeline_window=1)
"""The policy these plans run unless told: padded micro-batches, 1F1B flushed every step (LobRA's dispatch,
which the tests here were written against; ``DispatchPolicy()`` packs and streams 8-step windows)."""


def make_plan(
    layout: Sequence[tuple[ParallelConfig, int]], n_tasks: int = 6, policy: DispatchPolicy = FLUSHED_PADDING
) -> DeploymentPlan:
    """Replicas in ``layout`` order, GPUs numbered consecutively, running ``policy``."""
    replicas = []
    gpu = 0
    for config, count in layout:
        for _ in range(count):
            replicas.append(
                ReplicaSpec(len(replicas), config, MAX_TOKENS[config.tp], tuple(range(gpu, gpu + config.n_gpus)))
            )
            gpu += config.n_gpus
    return DeploymentPlan(
        model="llama2-7b",
        pools=(PlanPool(name="", gpu="A100-40GB", n_gpus=gpu, gpus_per_node=8),),
        tasks=tuple(f"task{k}" for k in range(n_tasks)),
        replicas=tuple(replicas),
        bucket_boundaries=(),
        expected_makespan_s=0.0,
        policy=policy,
    )


def make_batch(lengths: Sequence[int], task_ids: Sequence[int], step: int = 0) -> GlobalBatch:
    lengths = np.asarray(lengths, dtype=np.int64)
    return GlobalBatch(
        step=step,
        task_ids=np.asarray(task_ids, dtype=np.int64),
        sample_ids=np.arange(lengths.size, dtype=np.int64),
        lengths=lengths,
    )


LOBRA_7B_TASKS = ((207, 256), (702, 128), (526, 128), (663, 128), (3622, 64), (269, 128))
"""(mean length, batch size) of LobRA's six 7B tasks: dolly, evol-instruct, xsum, commitpackft, meetingbank, python."""


def lognormal_batch(
    step: int, tasks: Sequence[tuple[int, int]] = LOBRA_7B_TASKS, scale: float = 1.0, max_len: int = 16384
) -> GlobalBatch:
    """A skewed multi-task batch: lognormal lengths (sigma 1) with the tasks' means, ``scale`` x batch sizes."""
    rng = np.random.default_rng(step)
    lengths, task_ids = [], []
    for k, (mean, size) in enumerate(tasks):
        n = max(1, int(size * scale))
        drawn = rng.lognormal(math.log(mean) - 0.5, 1.0, n).astype(np.int64) + 1
        lengths.append(np.minimum(drawn, max_len))
        task_ids.append(np.full(n, k))
    return make_batch(np.concatenate(lengths), np.concatenate(task_ids), step)
