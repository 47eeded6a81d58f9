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

**The forward probe** (:func:`probe_forward`). A step's speed is no evaluation's: an evaluation runs forward only
(``no_grad``), packed micro-batches of held-out rows, and how a pass splits between forward and backward is the
cost model's guess. So the probe also times one evaluation-shaped pass, right after the step's: the held-out rows
of every task with an ``eval``, dispatched as an evaluation is (``eval_replay.dispatch_evaluation``), each
replica's first micro-batch of it cut to :data:`PROBE_TOKENS` as the step's is (:func:`first_microbatches`), run
by the executor's evaluation ``PROBE_TIMINGS`` times. Replica ``r``'s forward runs at ``phi_r``, its shortest busy
time over the cost model's forward-only time of that micro-batch, against ``c_r``, the step's recalibrated speed
the probe just measured on its cut, of at most as many tokens::

    phi_r = min_k m_r,k / T_F,r(mb_r),        rho_r = phi_r / c_r

and the first evaluation is predicted at ``c_r' rho_r`` (``train.evaluation``: ``max_r c_r' rho_r T_F,r``, with
``c_r'`` the steps' speed by then), as each later one is at ``c_r'`` times the evaluation before it's measured
over predicted time. The ratio, not ``phi_r`` alone: the machine's speed moves between the launch and the first
evaluation (a shared machine's load), and the steps' recalibration follows it; and the two passes ``rho_r``
compares are cut alike, so what a full micro-batch's size costs (a CPU's knee) is in neither: ``c_r'`` measures it
on the real steps. It costs ``PROBE_TIMINGS`` forward passes of at most :data:`PROBE_TOKENS` tokens a replica and
moves no state (an evaluation moves none).

Why a module of its own: it runs once, before the loop, and needs only the executor's probe, the dispatcher
and the recalibrator, none of the loop's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lorafleet.plans import DeploymentPlan, GlobalBatch, MicroBatch, StepPlan

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
    cost_model = cost_model.spanning(r.config.pool for r in plan.replicas)
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


@dataclass(frozen=True)
class ForwardProbe:
    """The launch probe's evaluation-shaped forward pass (module doc), per replica of :attr:`plan` in its order."""

    plan: DeploymentPlan
    """The deployment it was measured on: its speeds are no other's."""
    measured_s: tuple[float, ...]
    """``min_k m_r,k``: the replica's shortest forward busy time over the timed passes (0: it had no rows)."""
    predicted_s: tuple[float, ...]
    """``T_F,r``: the uncorrected cost model's forward-only time of the same micro-batch."""
    step_speed: tuple[float, ...]
    """``c_r``: the steps' recalibrated speed when it ran (the step probe's)."""

    @property
    def relative_speed(self) -> tuple[float, ...]:
        """``rho_r = phi_r / c_r``, ``phi_r = measured / predicted``; 1 for a replica the pass gave nothing to."""
        return tuple(
            m / p / c if p > 0 and m > 0 else 1.0
            for m, p, c in zip(self.measured_s, self.predicted_s, self.step_speed, strict=True)
        )

    def describe(self) -> str:
        """The start-up line of it (``train.phases``): each replica's measured and modelled forward time, their ratio
        ``phi_r`` and the step's ``c_r``."""
        each = "; ".join(
            f"{m:.3g} s measured, {p:.3g} s modelled: x{m / p if p > 0 else 1.0:.3g} against the step's x{c:.3g}"
            for m, p, c in zip(self.measured_s, self.predicted_s, self.step_speed, strict=True)
        )
        return f"probed an evaluation's forward, one micro-batch a replica: {each}"


def first_microbatches(step_plan: StepPlan, batch: GlobalBatch, tokens: int) -> tuple[StepPlan, GlobalBatch]:
    """``step_plan`` cut to each replica's first micro-batch, its first rows within ``tokens`` (:func:`first_rows`),
    with the batch of just those rows (their positions renumbered): the cut covers its batch exactly, as an
    evaluation's plan must (``check_step_plan``)."""
    firsts = [tuple(first_rows(mb, tokens) for mb in w.microbatches[:1]) for w in step_plan.work]
    rows = [q for mbs in firsts for mb in mbs for q in mb.seq_ids]
    position = {q: i for i, q in enumerate(rows)}
    work = tuple(
        replace(w, microbatches=tuple(replace(mb, seq_ids=tuple(position[q] for q in mb.seq_ids)) for mb in mbs))
        for w, mbs in zip(step_plan.work, firsts, strict=True)
    )
    cut = GlobalBatch(batch.step, batch.task_ids[rows], batch.sample_ids[rows], batch.lengths[rows])
    return replace(step_plan, work=work), cut


def probe_forward(
    executor: TorchExecutor,
    plan: DeploymentPlan,
    cost_model: CostModel,
    speed: Sequence[float] | None,
    step: int,
    names: Sequence[str],
) -> ForwardProbe | None:
    """Time each replica's first micro-batch of an evaluation of ``names`` (the tasks with an ``eval``), dispatched
    at the steps' recalibrated ``speed`` (None: 1), forward only, ``PROBE_TIMINGS`` times (module doc); None when
    ``names`` is empty."""
    from lorafleet.eval_replay import dispatch_evaluation, forward_seconds

    if not names:
        return None
    full = executor.eval_batch(step, names)
    cut, rows = first_microbatches(dispatch_evaluation(full, plan, cost_model, speed), full, PROBE_TOKENS)
    timed = [executor.evaluate(cut, rows).replica_busy_s for _ in range(PROBE_TIMINGS)]
    fastest = tuple(min(busy) for busy in zip(*timed, strict=True))
    steps = tuple(speed) if speed is not None else (1.0,) * len(plan.replicas)
    return ForwardProbe(plan, fastest, forward_seconds(cut, plan, cost_model), steps)
