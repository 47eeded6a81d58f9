"""Step reports to files and to the run's summary: makespan, GPU-seconds, utilisation, padding."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lorafleet.plans import StepReport


@dataclass(frozen=True)
class RunSummary:
    """Aggregates over the steps of one run on one deployment."""

    steps: int
    mean_makespan_s: float
    p95_makespan_s: float
    gpu_seconds: float
    """Σ_steps makespan * allocated GPUs: every GPU is held for the whole step."""
    replica_utilisation: tuple[float, ...]
    """Busy time over wall time, per replica, over the whole run."""
    padding_ratio: float
    """Padding tokens over occupied tokens."""
    tokens: int
    """Real tokens processed."""
    failures: int

    @property
    def mean_utilisation(self) -> float:
        return float(np.mean(self.replica_utilisation)) if self.replica_utilisation else 0.0


def summarize(reports: Sequence[StepReport], n_gpus: int) -> RunSummary:
    """Fold step reports of one deployment with ``n_gpus`` allocated GPUs into a RunSummary."""
    if not reports:
        raise ValueError("no step reports to summarise")
    makespans = np.array([r.makespan_s for r in reports])
    busy = np.array([r.replica_busy_s for r in reports])  # (steps, replicas)
    tokens = sum(sum(r.task_tokens.values()) for r in reports)
    padding = sum(sum(r.task_padding_tokens.values()) for r in reports)
    return RunSummary(
        steps=len(reports),
        mean_makespan_s=float(makespans.mean()),
        p95_makespan_s=float(np.percentile(makespans, 95)),
        gpu_seconds=float(makespans.sum() * n_gpus),
        replica_utilisation=tuple(float(u) for u in busy.sum(axis=0) / makespans.sum()),
        padding_ratio=padding / (tokens + padding) if tokens + padding else 0.0,
        tokens=int(tokens),
        failures=sum(len(r.failed_replicas) for r in reports),
    )


class JsonlWriter:
    """Appends one JSON object per step report to ``path`` (flushed per line, so a crash loses at most one)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, report: StepReport, **extra: object) -> None:
        record = asdict(report) | {"replica_idle_s": report.replica_idle_s, "utilisation": report.utilisation} | extra
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
