"""Step t+1's dispatch computed on a background thread while step t runs.

The global batch of any step is a pure function of (workload, seed, step) and dispatch is
a pure function of (batch, plan, cost model, options), so the plan computed ahead is the
plan a synchronous call would return: look-ahead changes when a plan is computed, never
what it is. One worker thread keeps the plans in step order; the solvers (numpy,
the CBC/HiGHS/SCIP back ends) spend most of their time outside the GIL.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from lorafleet.costmodel.cost_model import CostModel
from lorafleet.dispatch.options import DispatchOptions
from lorafleet.dispatch.step import DispatchOutcome, solve_step
from lorafleet.errors import SolverFallbackWarning
from lorafleet.plans import DeploymentPlan, GlobalBatch, StepPlan


class LookaheadDispatcher:
    """Hands out step plans, always having started the next one.

    Args:
        batch_for_step: the global batch of a step, deterministic in the step
            (e.g. ``functools.partial(sample_global_batch, workload, seed=seed)``).
        plan, cost_model, options: as for :func:`lorafleet.dispatch.dispatch_step`.

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
    ) -> None:
        self._batch_for_step = batch_for_step
        self._plan = plan
        self._cost_model = cost_model
        self._options = options or DispatchOptions()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lorafleet-lookahead")
        self._pending: dict[int, Future[DispatchOutcome]] = {}

    def _solve(self, step: int) -> DispatchOutcome:
        return solve_step(self._batch_for_step(step), self._plan, self._cost_model, self._options)

    def _ensure(self, step: int) -> Future[DispatchOutcome]:
        if step not in self._pending:
            self._pending[step] = self._pool.submit(self._solve, step)
        return self._pending[step]

    def plan_for(self, step: int) -> StepPlan:
        """Step ``step``'s plan (waiting for it if it is still being computed); starts step + 1's.

        A fallback of the exact solve is warned about here, on the caller's thread.
        """
        for stale in [s for s in self._pending if s not in (step, step + 1)]:
            self._pending.pop(stale).cancel()  # a jump (resume, skip) discards what was planned ahead
        current = self._ensure(step)
        self._ensure(step + 1)
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
