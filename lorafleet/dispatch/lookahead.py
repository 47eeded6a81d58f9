"""The next steps' dispatch computed on a background thread while step t runs.

The global batch of any step is a pure function of (workload, seed, step) and dispatch is
a pure function of (batch, plan, cost model, options, speed factors), so the plan computed
ahead is the plan a synchronous call with the same factors would return: look-ahead changes
when a plan is computed, never what it is. The factors of online recalibration are taken
when a plan is *started*: step t+d's plan is started during ``plan_for(t)`` (d the depth, 1 by
default; a pipeline window's length in training, so the next window's plans are computed while one
runs), so it prices replicas by what the steps reported by then measured. One worker
thread keeps the plans in step order; the solvers (numpy, the CBC/HiGHS/SCIP back ends)
spend most of their time outside the GIL.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch.policy import policy_with, solve_policy
from lorafleet.dispatch.step import DispatchOutcome
from lorafleet.errors import SolverFallbackWarning
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan
from lorafleet.specs.dispatch import DispatchOptions


class LookaheadDispatcher:
    """Hands out step plans, always having started the next one.

    Args:
        batch_for_step: the global batch of a step, deterministic in the step
            (e.g. ``functools.partial(sample_global_batch, workload, seed=seed)``).
        plan, cost_model, options: as for :func:`lorafleet.dispatch.dispatch_step` (the plan's own
            policy when ``options`` is None).
        depth: how many steps after the one asked for are started.

    Example::

        with LookaheadDispatcher(partial(sample_global_batch, workload), plan, cost_model) as ahead:
            for step in range(n_steps):
                executor.run_step(ahead.plan_for(step))  # step + 1 is being planned meanwhile
    """

    def __init__(
        self,
        batch_for_step: Callable[[int], GlobalBatch],
        plan: DeploymentPlan,
        cost_model: CostModel,
        options: DispatchOptions | None = None,
        depth: int = 1,
    ) -> None:
        self._depth = max(1, depth)
        self._batch_for_step = batch_for_step
        self._plan = plan
        self._cost_model = cost_model
        self._policy = policy_with(plan, options)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafleet-lookahead")
        self._pending: dict[int, Future[DispatchOutcome]] = {}
        self._started_until = 0

    def _solve(self, step: int, speed: tuple[float, ...] | None) -> DispatchOutcome:
        return solve_policy(self._batch_for_step(step), self._plan, self._cost_model, self._policy, speed)

    def _ensure(self, step: int, speed: tuple[float, ...] | None) -> Future[DispatchOutcome]:
        if step not in self._pending:
            self._pending[step] = self._pool.submit(self._solve, step, speed)
            self._started_until = max(self._started_until, step + 1)
        return self._pending[step]

    @property
    def started_until(self) -> int:
        """The step after the last one whose plan has been started (its global batch drawn or about to be):
        a change to the data streams keyed from this step on reaches no plan already under way. A function
        of the ``plan_for`` calls made, not of the worker thread's progress."""
        return self._started_until

    def plan_for(self, step: int, speed: Sequence[float] | None = None) -> StepPlan:
        """Step ``step``'s plan (waiting for it if it is still being computed); starts the next
        ``depth`` steps', pricing replicas at ``speed`` (a snapshot: later changes do not reach them).

        A fallback of the exact solve is warned about here, on the caller's thread.
        """
        snapshot = tuple(float(f) for f in speed) if speed is not None else None
        for stale in [s for s in self._pending if not step <= s <= step + self._depth]:
            self._pending.pop(stale).cancel()  # a jump (resume, skip) discards what was planned ahead
        current = self._ensure(step, snapshot)
        for ahead in range(step + 1, step + self._depth + 1):
            self._ensure(ahead, snapshot)
        outcome = current.result()
        del self._pending[step]
        if outcome.fallback:
            warnings.warn(outcome.fallback, SolverFallbackWarning, stacklevel=2)
        return outcome.plan

    def close(self) -> None:
        """Drop plans computed ahead and stop the worker thread."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LookaheadDispatcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
