"""One process of a run: :func:`train_rank` joins the group and builds this rank's part of the fleet;
rank 0 drives :meth:`Trainer.train`, the others serve it.

    Trainer.train()   restore -> per step {dispatch (one step ahead), run_step, recalibrate, watch for
                      non-finite tasks, metrics, checkpoint every K} -> final checkpoint -> PEFT
                      adapters -> summary

Also here: the probe before the first step (``Trainer._probe``), the checkpoint cadence, the stop at a
step boundary on a signal, and the export of the final adapters out of the last checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import numpy as np

from lorafleet.plans import MicroBatch, StepPlan, StepReport
from lorafleet.train.options import TrainOptions
from lorafleet.train.preflight import Prepared, claim

if TYPE_CHECKING:
    from lorafleet.executor.torch.worker import TorchExecutor
    from lorafleet.metrics import FanOut


def train_rank(options: TrainOptions, prepared: Prepared) -> int:
    """One process of the run: build the fleet; rank 0 drives the loop, the others serve it."""
    import torch.distributed as dist

    from lorafleet.executor.torch.launch import build_torch_executor, init_distributed
    from lorafleet.executor.torch.precision import Precision
    from lorafleet.executor.torch.processes import LOCKED_ENV, check_code, die_with_parent

    die_with_parent()
    check_code()
    device = init_distributed(options.device)
    lock = None
    try:
        if dist.get_rank() == 0 and not os.environ.get(LOCKED_ENV):  # under the user's own torchrun
            lock = claim(options, prepared)
        executor = build_torch_executor(
            prepared.workload.spec,
            prepared.run.plan,
            options.steps,
            device,
            Precision(options.dtype).dtype,
            slowdown=dict(options.slowdown),
        )
        if dist.get_rank() != 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the run stops
            executor.serve()
            return 0
        return Trainer(options, prepared, executor).train()
    finally:
        dist.destroy_process_group()
        if lock is not None:
            lock.release()


class Trainer:
    """Rank 0's loop over the steps of one run (see the module docstring)."""

    def __init__(self, options: TrainOptions, prepared: Prepared, executor: TorchExecutor) -> None:
        from lorafleet.dispatch.recalibration import Recalibrator

        self.options = options
        self.prepared = prepared
        self.executor = executor
        self.plan = prepared.run.plan
        self.names = [t.name for t in prepared.workload.tasks]
        self.out = Path(options.out)
        self.checkpoints = self.out / "checkpoints"
        self.recalibrator = Recalibrator(len(self.plan.replicas), self.plan.policy.recalibration)
        self.reports: list[tuple[StepReport, StepPlan]] = []
        self.nonfinite_streak = dict.fromkeys(self.names, 0)
        self.stopped_tasks: dict[str, int] = {}
        """Task -> the first step it was left out of (``nonfinite_patience`` non-finite updates in a row)."""
        self.signal: int | None = None

    def restore(self) -> int:
        """The first step to run: 0, or the resumed checkpoint's (with its recalibration and stopped tasks);
        the metrics are cut back to it, so nothing replayed is counted twice."""
        from lorafleet.rundir import truncate_metrics

        start = 0
        if self.prepared.resume_step is not None:
            state = self.executor.restore_checkpoint(self.checkpoints)
            if state is not None:
                start = state.step
                self.recalibrator.load_state_dict(state.extra.get("recalibration", {}))
                for name, step in state.extra.get("stopped_tasks", {}).items():
                    self._stop_task(name, int(step), announce=False)
        truncate_metrics(self.out, start)
        return start

    def _stop_requested(self) -> bool:
        from lorafleet.executor.torch.processes import stop_requested

        if self.signal is None:
            self.signal = stop_requested(self.out)
        return self.signal is not None

    def train(self) -> int:
        """Run the steps left to the run's total; 0 when done or stopped by a signal at a step boundary."""
        from lorafleet.dispatch import LookaheadDispatcher
        from lorafleet.loop import run_loop

        def on_signal(signum: int, _frame: FrameType | None) -> None:  # under a user's torchrun: a stop request
            self.signal = signum

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, on_signal)
        start = self.restore()
        steps = range(start, min(self.options.steps, _last_step(self.executor, self.options.steps)))
        if self.plan.policy.recalibration.enabled and len(steps):
            self._probe(start)
        with (
            self._writers(steps) as metrics,
            LookaheadDispatcher(self.executor.next_global_batch, self.plan, self.prepared.run.cost_model) as ahead,
        ):

            def on_report(report: StepReport, step_plan: StepPlan) -> None:
                self.reports.append((report, step_plan))
                self._watch(report)
                tokens = sum(report.task_tokens.values())
                metrics.write(
                    report,
                    tokens_per_s=tokens / report.makespan_s if report.makespan_s else 0.0,
                    predicted_busy_s=tuple(w.estimated_time_s for w in step_plan.work),
                    model_busy_s=tuple(step_plan.base_estimate(r) for r in range(len(step_plan.work))),
                    replica_tokens=tuple(sum(sum(mb.lengths) for mb in w.microbatches) for w in step_plan.work),
                    correction=self.recalibrator.factors or (),
                )
                if (report.step + 1) % self.options.checkpoint_every == 0:
                    self._checkpoint(report.step + 1)

            done = run_loop(ahead, self.executor, steps, on_report, self.recalibrator, stop=self._stop_requested)
        reached = start + len(done)
        if self.signal is not None and reached < steps.stop:
            return self._stopped(reached)
        final = self._checkpoint(reached, wait=True)
        _export_adapters(final, self.names, self.out / "adapters")
        self.executor.close()
        print(self.summary(reached), flush=True)
        return 0

    def _probe(self, step: int) -> None:
        """Before the first step: each replica's first micro-batch of step ``step``'s dispatch, at most
        ``PROBE_TOKENS`` of it, timed twice without training on it (``TorchExecutor.probe``). The first
        pass pays a fresh process's one-time costs; the second is the recalibrator's first observation,
        so the run's first steps are already priced by this machine's speed and by each replica's."""
        from lorafleet.dispatch import dispatch_step

        batch = self.executor.streams.global_batch(step)
        full = dispatch_step(batch, self.plan, self.prepared.run.cost_model)
        cost_model = self.prepared.run.cost_model
        work = []
        for replica, w in zip(self.plan.replicas, full.work, strict=True):
            mbs = w.microbatches[:1]
            if mbs and mbs[0].tokens > PROBE_TOKENS:
                mbs = (_cut(mbs[0], PROBE_TOKENS),)
            work.append(
                replace(
                    w,
                    microbatches=mbs,
                    estimated_time_s=cost_model.replica_time(replica.config, [mb.shape for mb in mbs]) if mbs else 0.0,
                )
            )
        probe = replace(full, work=tuple(work), speed=())
        self.executor.probe(probe, batch)
        self.recalibrator.observe(probe, self.executor.probe(probe, batch))
        # The first real step still meets shapes the probe did not (allocator growth, on CPU up to 2x
        # on one rank and not another): its report is left out too.
        self.recalibrator.skip_next(1)

    def _stopped(self, reached: int) -> int:
        """A stop asked by a signal, at the boundary before step ``reached``: checkpoint (unless told not to)."""
        committed = ""
        if self.options.checkpoint_on_stop:
            committed = f"; checkpoint {self._checkpoint(reached, wait=True).name} committed, continue with --resume"
        self.executor.close()
        print(
            f"lorafleet train: stopped by {signal.Signals(self.signal).name} after {reached} steps{committed}",
            flush=True,
        )
        return 0

    def _watch(self, report: StepReport) -> None:
        """Non-finite updates (skipped by the executor) counted per task; a task skipped
        ``nonfinite_patience`` steps in a row stops; a task whose adapter never moved is warned about."""
        for name in report.losses:
            self.nonfinite_streak[name] = self.nonfinite_streak[name] + 1 if name in report.nonfinite_tasks else 0
        for name in report.nonfinite_tasks:
            streak = self.nonfinite_streak[name]
            print(
                f"lorafleet train: step {report.step}: task {name!r} has a non-finite loss or gradient; its update "
                f"is skipped ({streak} in a row)",
                file=sys.stderr,
                flush=True,
            )
            if streak >= self.options.nonfinite_patience and name not in self.stopped_tasks:
                self._stop_task(name, report.step + 2)  # step + 1 may be drawn already (look-ahead)
        for name in report.unmoved_tasks:
            print(
                f"lorafleet train: warning: task {name!r}: its adapter has not moved after its warm-up; check its "
                "learning rate, alpha and grad_clip",
                file=sys.stderr,
                flush=True,
            )

    def _stop_task(self, name: str, from_step: int, announce: bool = True) -> None:
        self.stopped_tasks[name] = from_step
        self.executor.streams.retire(self.names.index(name), from_step)
        if announce:
            print(
                f"lorafleet train: task {name!r} stopped after {self.options.nonfinite_patience} non-finite steps "
                "in a row; its adapter stays at its last finite update",
                file=sys.stderr,
                flush=True,
            )

    def _checkpoint(self, step: int, wait: bool = False) -> Path:
        """A checkpoint after ``step`` steps, written in the background (committed on return with ``wait``)."""
        extra = {"recalibration": self.recalibrator.state_dict(), "stopped_tasks": dict(self.stopped_tasks)}
        return self.executor.save_checkpoint(self.checkpoints, step, extra, wait=wait)

    def _writers(self, steps: range) -> FanOut:
        from lorafleet.metrics import CsvWriter, FanOut, JsonlWriter, LogLines, ProgressBar, TensorBoardWriter

        writers = [
            JsonlWriter(self.out / "metrics.jsonl"),
            CsvWriter(self.out / "metrics.csv"),
            TensorBoardWriter(self.out / "tensorboard", purge_step=steps.start),
        ]
        if self.options.progress and sys.stdout.isatty():
            writers.append(ProgressBar(steps.stop, start=steps.start))
        else:
            writers.append(LogLines(steps.stop))
        return FanOut(*writers)

    def summary(self, stop: int) -> str:
        """What the run did, predicted against measured, and where its files are."""
        from lorafleet.dispatch.recalibration import summarize_factors

        lines = [
            f"lorafleet train: {stop} steps; adapters in {self.out / 'adapters'}, metrics in "
            f"{self.out / 'metrics.jsonl'} (and .csv, tensorboard/)"
        ]
        if self.reports:
            measured = np.mean([r.makespan_s for r, _ in self.reports])
            predicted = np.mean([p.estimated_makespan_s for _, p in self.reports])
            lines.append(
                f"  step time: measured {measured:.3f} s, predicted {predicted:.3f} s "
                f"(x{measured / predicted:.2f}, mean over {len(self.reports)} steps; "
                f"cost model {self.prepared.run.cost_model.source})"
            )
            if self.plan.policy.recalibration.enabled:
                lines.append(f"  recalibrated: {summarize_factors(self.recalibrator.replicas())}")
        if self.stopped_tasks:
            lines.append(f"  stopped tasks (non-finite updates): {', '.join(self.stopped_tasks)}")
        return "\n".join(lines)


PROBE_TOKENS = 1024
"""The most tokens of a replica's probe micro-batch (``Trainer._probe``): enough to be timed as its
steps are, small next to a step."""


def _cut(mb: MicroBatch, tokens: int) -> MicroBatch:
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


def _last_step(executor: TorchExecutor, steps: int) -> int:
    """The step after which every task has taken all its batches (``steps`` when a task is unbounded)."""
    limits = executor.streams.max_batches
    return steps if any(limit is None for limit in limits) else max(limits)


def _export_adapters(step_dir: Path, names: Sequence[str], target: Path) -> None:
    """The final PEFT adapters, copied out of the last checkpoint; each task's directory appears whole
    (written beside it, then renamed over the old one)."""
    import shutil

    from peft.utils.constants import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        staging = target / f".{name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for file in (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME):
            shutil.copy2(step_dir / name / file, staging / file)
        old = target / f".{name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if (target / name).exists():
            (target / name).rename(old)
        staging.rename(target / name)
        shutil.rmtree(old, ignore_errors=True)
