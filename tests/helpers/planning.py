"""Builders of the planner tests: a LobRA-like cost model, tiny planning problems, small workloads.

The time model is LobRA's TP1 fit for one Llama2-7B layer on A100-40GB (their Appendix D,
``c2`` clipped to 0), divided by ``tp ** TP_SPEEDUP`` per TP degree so that per-GPU
throughput falls with TP roughly as their Table 3 does (TP8 ~ 0.45 x TP1); M doubles with
TP and grows with PP (fewer layers per stage), as in their memory table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import LayerTimeCoeffs
from lorafleet.dispatch import DispatchOptions, DispatchPolicy, MicroBatchMode
from lorafleet.planner.candidates import valid_candidates
from lorafleet.planner.problem import PlanningProblem, build_problem
from lorafleet.plans import GlobalBatch
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.model import MODEL_PRESETS
from lorafleet.workload import Workload, load_workload

LOBRA_TP1_MS = (1.29e-7, 0.0, 4.65e-3, 8.4e-4, 3.1e-2, 2.45)
TP_SPEEDUP = 0.62
M_TP1 = 2048


def lobra_like_cost_model(model: str = "llama2-7b", m_tp1: int = M_TP1, max_tp: int = 8, max_pp: int = 16) -> CostModel:
    """LobRA's 7B A100 time model for every (tp, pp), power-of-two tp <= max_tp;
    M = m_tp1 * tp * sqrt(pp), floored to 256."""
    spec = MODEL_PRESETS[model]
    layer_time, table = {}, {}
    tp = 1
    while tp <= max_tp:
        layer_time[tp] = LayerTimeCoeffs(tuple(c / tp**TP_SPEEDUP for c in LOBRA_TP1_MS))
        for pp in range(1, max_pp + 1):
            if spec.n_layers % pp == 0:
                table[ParallelConfig(tp, pp)] = int(m_tp1 * tp * pp**0.5) // 256 * 256
        tp *= 2
    return CostModel(model=spec, layer_time=layer_time, max_tokens_table=table, source="test:lobra-like")


def skewed_lengths(
    rng: np.random.Generator, n: int, longest: int, median: float = 300.0, sigma: float = 0.9
) -> np.ndarray:
    """Log-normal lengths capped at ``longest``, the first one exactly ``longest``."""
    lengths = np.minimum(np.exp(rng.normal(np.log(median), sigma, n)).astype(np.int64) + 1, longest)
    lengths[0] = longest
    return lengths


def batch_of(lengths: np.ndarray) -> GlobalBatch:
    lengths = np.asarray(lengths, dtype=np.int64)
    return GlobalBatch(
        step=0,
        task_ids=np.zeros(lengths.size, dtype=np.int64),
        sample_ids=np.arange(lengths.size, dtype=np.int64),
        lengths=lengths,
    )


def tiny_problem(
    lengths: np.ndarray,
    cluster: ClusterSpec,
    cost_model: CostModel,
    n_buckets: int = 3,
    configs: tuple[ParallelConfig, ...] | None = None,
    window: int = 1,
) -> PlanningProblem:
    """A planning problem over every valid config (or ``configs``) of ``cluster`` for a batch of ``lengths``,
    its steps padded and streamed in windows of ``window`` steps."""
    candidates = [c for c in valid_candidates(cost_model, cluster) if configs is None or c.config in configs]
    return build_problem(batch_of(lengths), candidates, cost_model, cluster, padded_policy(n_buckets, window))


def padded_policy(n_buckets: int, window: int = 1) -> DispatchPolicy:
    """Padded micro-batches of at most ``n_buckets`` buckets, 1F1B flushed every step unless ``window`` says
    otherwise: the dispatch these planner tests were written against."""
    options = DispatchOptions(n_buckets=n_buckets, microbatch_mode=MicroBatchMode.PADDING)
    return DispatchPolicy(options=options, pipeline_window=window)


def write_workload(
    path: Path,
    tasks: list[dict],
    nodes: int = 2,
    gpus_per_node: int = 8,
    model: str = "llama2-7b",
    seed: int = 0,
    recompute: str = "auto",
) -> Path:
    """A workload YAML whose tasks give ``name``, ``batch_size``, ``context_length`` and a ``histogram``."""
    spec = {
        "model": model,
        "cluster": {"gpu": "A100-40GB", "nodes": nodes, "gpus_per_node": gpus_per_node},
        "recompute": recompute,
        "seed": seed,
        "tasks": [
            {
                "name": t["name"],
                "batch_size": t["batch_size"],
                "context_length": t["context_length"],
                "lengths": {"histogram": t["histogram"]},
            }
            for t in tasks
        ],
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def skewed_histogram(rng: np.random.Generator, median: float, longest: int, n: int = 400) -> dict[int, int]:
    values, counts = np.unique(skewed_lengths(rng, n, longest, median), return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}


def small_workload(tmp_path: Path, seed: int = 0, nodes: int = 2, longest: int = 8192) -> Workload:
    """Three skewed tasks (short, medium, long-tailed), 208 sequences per step."""
    rng = np.random.default_rng(seed)
    tasks = [
        {"name": "chat", "batch_size": 96, "context_length": 2048, "histogram": skewed_histogram(rng, 200, 2048)},
        {"name": "code", "batch_size": 64, "context_length": 4096, "histogram": skewed_histogram(rng, 500, 4096)},
        {
            "name": "summarise",
            "batch_size": 48,
            "context_length": longest,
            "histogram": skewed_histogram(rng, 1200, longest),
        },
    ]
    return load_workload(write_workload(tmp_path / f"workload-{seed}.yaml", tasks, nodes=nodes, seed=seed))


WIDE_WORKLOAD = """\
model: llama2-7b
cluster: {gpu: A100-40GB, nodes: 32, gpus_per_node: 8}
seed: 3
tasks:
  - {name: chat, lengths: {values: [90, 200, 310, 900, 1500]}, batch_size: 512, context_length: 4096}
  - {name: docs, lengths: {values: [1000, 3000, 9000, 15000]}, batch_size: 64, context_length: 16384}
"""
"""Two tasks on 256 GPUs: enough sequences a step for a fleet of hundreds of replicas."""
LINE_WIDTH = 160
"""The most characters a line of ``plan``, ``simulate`` and ``dispatch`` output may take (issue #26)."""


def wide_fleet(directory: Path) -> tuple[Path, Path]:
    """:data:`WIDE_WORKLOAD` and a plan of 188 replicas for it (<1,1> x 144 + <2,1> x 40 + <8,1> x 4, the
    preset fleets' M), written under ``directory``: (workload, plan)."""
    from dataclasses import replace

    from lorafleet.presets import TP1, TP2, TP8, make_plan

    workload, plan = directory / "wide.yaml", directory / "wide-plan.json"
    workload.write_text(WIDE_WORKLOAD)
    fleet = make_plan(((TP1, 144), (TP2, 40), (TP8, 4)), n_tasks=2)
    replace(fleet, tasks=("chat", "docs"), bucket_boundaries=(16384,)).save(plan)
    return workload, plan


def widest_line(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)
