"""The one summary of a run's steps, :class:`RunSummary`, whatever ran them: a simulated schedule
(``simulate.ScheduleRun.summary``, its phases one after another within each step), a training run (built
from its ``metrics.jsonl`` rows: :func:`summarize_rows`), or any deployment's step reports (:func:`summarize`).

Per step, with ``p`` the deployments (phases) that ran in it, ``M_p`` the makespan of ``p``'s part, ``g_r``
the GPUs of replica ``r`` and ``b_r`` its busy time::

    makespan = Σ_p M_p        GPU-seconds = Σ_p M_p * Σ_{r in p} g_r        busy GPU-seconds = Σ_p Σ_r b_r * g_r

and over the run ``utilisation`` = Σ busy GPU-seconds / Σ GPU-seconds (the fleet is held for the whole
step, idle or not) and ``padding_ratio`` = padding tokens / (real + padding tokens).

Why one type built from step reports (rather than one per caller): the simulator's table, the report's
rows and the training run's closing lines are the same aggregates of the same records, so they are
computed once, here, and only formatted by their callers (as torchtitan's ``MetricsProcessor`` computes
and its loggers only write).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lorafleet.metrics.records import step_report
from lorafleet.plans import StepReport


@dataclass(frozen=True)
class DeploymentSteps:
    """The steps one deployment ran (a schedule's phase, a training run), as :func:`summarize_phases` reads them."""

    reports: Sequence[StepReport]
    replica_gpus: Sequence[int] | None
    """Each replica's GPUs, in the reports' replica order; None when not known (a training run's rows may
    span a re-plan): the summary's GPU figures are then nan."""
    task_gpu_s: Sequence[Mapping[str, float]] = field(default=())
    """Per step, the GPU-seconds each task owes (``lorafleet.accounting.task_gpu_seconds``): the same steps
    as ``reports``, or none."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RunSummary:
    """Aggregates over the steps of one run (module docstring): per-step arrays and run totals."""

    makespan_s: np.ndarray
    """Per step: measured wall time, Σ over the deployments (phases) that ran in it."""
    estimated_makespan_s: np.ndarray
    """Per step: the dispatcher's estimate of it, Σ over the deployments."""
    gpu_seconds_per_step: np.ndarray
    """Per step: Σ over the deployments of makespan x the GPUs it holds (nan where they are not known)."""
    busy_gpu_seconds: float
    """Σ over steps, deployments and replicas of busy time x the replica's GPUs (nan where not known)."""
    task_tokens: dict[str, int]
    """Each task's real tokens, tasks in the order first seen."""
    padding_tokens: int
    failures: int
    """Replica failures, over all steps."""
    task_gpu_seconds_per_step: tuple[dict[str, float], ...]
    """Per step: each task's GPU-seconds, Σ over the deployments (sums to ``gpu_seconds_per_step``; empty
    mappings where none were given)."""

    @property
    def steps(self) -> int:
        return len(self.makespan_s)

    @property
    def mean_makespan_s(self) -> float:
        return self.makespan_s.mean()

    @property
    def p95_makespan_s(self) -> float:
        return float(np.percentile(self.makespan_s, 95))

    @property
    def mean_estimated_makespan_s(self) -> float:
        return self.estimated_makespan_s.mean()

    @property
    def gpu_seconds(self) -> float:
        """Σ_steps of the GPU-seconds: every GPU is held for the whole step."""
        return float(self.gpu_seconds_per_step.sum())

    @property
    def mean_gpu_seconds(self) -> float:
        """GPU-seconds per step, on average."""
        return float(self.gpu_seconds_per_step.mean())

    @property
    def tokens(self) -> int:
        """Real tokens processed."""
        return sum(self.task_tokens.values())

    @property
    def padding_ratio(self) -> float:
        """Padding tokens over occupied tokens."""
        real, pad = self.tokens, self.padding_tokens
        return pad / (real + pad) if real + pad else 0.0

    @property
    def utilisation(self) -> float:
        """Busy GPU-time over held GPU-time, over all deployments and steps."""
        held = self.gpu_seconds_per_step.sum()
        return float(self.busy_gpu_seconds / held) if held else 0.0

    @property
    def task_gpu_seconds(self) -> dict[str, float]:
        """Each task's GPU-seconds over all steps (sums to ``gpu_seconds``; empty where none were given)."""
        return sum_task_gpu_seconds(self.task_gpu_seconds_per_step)


def sum_task_gpu_seconds(per_step: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Per-task totals over steps (or phases): Σ of the mappings, tasks in the order first seen."""
    totals: dict[str, float] = {}
    for step in per_step:
        for task, seconds in step.items():
            totals[task] = totals.get(task, 0.0) + float(seconds)
    return totals


def summarize_phases(phases: Sequence[DeploymentSteps]) -> RunSummary:
    """The summary of deployments that ran one after another within each step (a schedule's phases; a
    single one for most runs). Every phase has the same steps; ValueError otherwise, or when a phase's
    ``task_gpu_s`` covers other steps than its reports."""
    for p in phases:
        if p.task_gpu_s and len(p.task_gpu_s) != len(p.reports):
            raise ValueError(f"task GPU-seconds for {len(p.task_gpu_s)} steps, {len(p.reports)} step reports")
    if len({len(p.reports) for p in phases}) > 1:
        raise ValueError(f"phases of {sorted({len(p.reports) for p in phases})} steps: each must run every step")
    steps = len(phases[0].reports) if phases else 0
    held = [sum(p.replica_gpus) if p.replica_gpus is not None else np.nan for p in phases]
    if all(p.replica_gpus is not None for p in phases):
        busy = sum(
            b * g for p in phases for r in p.reports for b, g in zip(r.replica_busy_s, p.replica_gpus, strict=True)
        )
    else:
        busy = np.nan
    task_tokens: dict[str, int] = {}
    for p in phases:
        for r in p.reports:
            for task, n in r.task_tokens.items():
                task_tokens[task] = task_tokens.get(task, 0) + int(n)
    return RunSummary(
        makespan_s=np.sum([[r.makespan_s for r in p.reports] for p in phases], axis=0),
        estimated_makespan_s=np.sum([[r.estimated_makespan_s for r in p.reports] for p in phases], axis=0),
        gpu_seconds_per_step=np.sum([[r.makespan_s * g for r in p.reports] for p, g in zip(phases, held)], axis=0),
        busy_gpu_seconds=float(busy),
        task_tokens=task_tokens,
        padding_tokens=sum(sum(r.task_padding_tokens.values()) for p in phases for r in p.reports),
        failures=sum(len(r.failed_replicas) for p in phases for r in p.reports),
        task_gpu_seconds_per_step=tuple(
            sum_task_gpu_seconds(p.task_gpu_s[s] for p in phases if p.task_gpu_s) for s in range(steps)
        ),
    )


def summarize(
    reports: Sequence[StepReport], gpus: int | Sequence[int], task_gpu_s: Sequence[Mapping[str, float]] = ()
) -> RunSummary:
    """The summary of one deployment's step reports.

    ``gpus``: each replica's GPUs, in the reports' replica order, or, for replicas of one size, their
    number all told. ``task_gpu_s``: per step, what each task owes (``lorafleet.accounting.task_gpu_seconds``),
    the same steps as ``reports`` or none; their per-task sums are ``RunSummary.task_gpu_seconds``."""
    if not reports:
        raise ValueError("no step reports to summarise")
    if isinstance(gpus, int):
        replicas = len(reports[0].replica_busy_s)
        if gpus % replicas:
            raise ValueError(f"{gpus} GPUs do not make {replicas} replicas of one size: give each replica's")
        gpus = (gpus // replicas,) * replicas
    return summarize_phases([DeploymentSteps(reports, tuple(gpus), task_gpu_s)])


def summarize_rows(rows: Sequence[Mapping[str, Any]]) -> RunSummary:
    """The summary of a run's ``metrics.jsonl`` rows (``lorafleet.metrics.files.read_rows``: every launch's
    steps, across restarts and re-plans, so the replicas' GPUs are not known and the GPU figures are nan)."""
    reports = [step_report(row) for row in rows]
    return summarize_phases([DeploymentSteps(reports, None, [row.get("task_gpu_s", {}) for row in rows])])
