"""The probe before a run's first step: how fast each replica really is on this machine, so that the first
steps are priced by it rather than by the cost model alone (DLRover's node check, on the run's own work).

:func:`probe` runs step ``step``'s dispatch without training on it (``TorchExecutor.probe``): first the
whole step, every replica's every micro-batch at its own shapes, untimed; then each replica's first
micro-batch, at most :data:`PROBE_TOKENS` of it (:func:`probe_plan`), ``PROBE_TIMINGS`` times, timed.

The untimed pass pays what a fresh process's first step would otherwise pay at that step's shapes:
the heap grown to a step's size (on CPU kept by ``host_memory.keep_freed_host_memory``: a page
faulted in once, not every step), the OpenMP and the update thread, first calls and lazy
initialisation. It was a pass of the cut micro-batch until issue #27; the first step then still met
shapes the probe had not, and on the demo took 0.6-1.3 M page faults more than the steps after it.

Of the timed passes, each replica's shortest busy time is the recalibrator's first observation. The
minimum, not one pass: on a shared machine a pass is only ever slowed (a core taken by another
process), and the probe's one observation prices the first steps whole (in a loaded CI, one pass
priced an injected 4x straggler at well under 2x its peer); the steps after it are averaged as
usual. The timed passes are cut so that the probe costs a fraction of a step beyond its warm-up.

Why a module of its own: it runs once, before the loop, and needs only the executor's probe, the dispatcher
and the recalibrator, none of the loop's state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from lorafleet.plans import DeploymentPlan, MicroBatch, StepPlan

if TYPE_CHECKING:
    from lorafleet.costmodel import CostModel
    from lorafleet.dispatch import Recalibrator
    from lorafleet.executor.torch.worker import TorchExecutor

PROBE_TOKENS = 1024
"""The most tokens of a replica's probe micro-batch: enough to be timed as its steps are, small next to a step."""

PROBE_TIMINGS = 2
"""Timed passes of the probe after its warm-up pass; each replica's shortest is observed."""


def first_rows(mb: MicroBatch, tokens: int) -> MicroBatch:
    """The first rows of a micro-batch that fit in ``tokens`` (at least one)."""
    keep = 1
    while (
        keep < len(mb.lengths)
        and replace(
            mb, seq_ids=mb.seq_ids[: keep + 1], task_ids=mb.task_ids[: keep + 1], lengths=mb.lengths[: keep + 1]
        ).tokens
        <= tokens
    ):
        keep += 1
    return replace(mb, seq_ids=mb.seq_ids[:keep], task_ids=mb.task_ids[:keep], lengths=mb.lengths[:keep])


def probe_plan(full: StepPlan, plan: DeploymentPlan, cost_model: CostModel) -> StepPlan:
    """``full``'s dispatch cut to each replica's first micro-batch (its first rows within :data:`PROBE_TOKENS`),
    each replica's time re-estimated by the cost model, uncorrected (no speed factors)."""
    work = []
    for replica, w in zip(plan.replicas, full.work, strict=True):
        mbs = w.microbatches[:1]
        if mbs and mbs[0].tokens > PROBE_TOKENS:
            mbs = (first_rows(mbs[0], PROBE_TOKENS),)
        work.append(
            replace(
                w,
                microbatches=mbs,
                estimated_time_s=cost_model.replica_time(
                    replica.config,
                    [mb.shape for mb in mbs],
                    tasks=[mb.task_ids for mb in mbs],
                    window=plan.policy.pipeline_window,
                )
                if mbs
                else 0.0,
            )
        )
    return replace(full, work=tuple(work), speed=())


def probe(
    executor: TorchExecutor, plan: DeploymentPlan, cost_model: CostModel, recalibrator: Recalibrator, step: int
) -> None:
    """Probe every replica on step ``step``'s batch (module docstring): the whole step untimed, then the
    timed cut passes; ``recalibrator`` observes the fastest of those and leaves out the first real step's
    report."""
    from lorafleet.dispatch import dispatch_step

    batch = executor.streams.global_batch(step)
    full = dispatch_step(batch, plan, cost_model)
    cut = probe_plan(full, plan, cost_model)
    executor.probe(full, batch)  # the warm-up: the first step's whole work, at its shapes
    timed = [executor.probe(cut, batch) for _ in range(PROBE_TIMINGS)]
    fastest = tuple(min(busy) for busy in zip(*(r.replica_busy_s for r in timed), strict=True))
    failed = tuple(sorted({r for report in timed for r in report.failed_replicas}))
    recalibrator.observe(cut, replace(timed[-1], replica_busy_s=fastest, failed_replicas=failed))
    # The first real step's report is still left out: the warm-up paid the one-time costs this machine
    # showed (issue #27), not whatever another device defers to a first step (a first NCCL collective on
    # each gradient-sum group is one), and one step later the averages start from real steps.
    recalibrator.skip_next(1)
