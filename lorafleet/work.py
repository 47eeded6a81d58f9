"""Deterministic work counters: what planning, dispatching or reading data did, counted where the work is done.

CPU seconds depend on the machine and its load; these counts depend only on the inputs. The
planner opens a :func:`counting` scope around a whole plan (``plan_deployment``) and reports the
counts in the plan's notes and in ``lorafleet plan --stats``; tests pin their upper bounds on the
shipped examples, so a change that doubles the work fails on any machine. Tests open scopes of their
own around the other work counted: the datasets a launch, a rank or a queued task tokenizes
(``tokenizations``: tests/train/test_run_file.py, tests/train/test_changes.py).

Each counter has one home, the function that does the work (:data:`WORK`), which calls
:func:`count`; outside a scope it does nothing. A scope also holds memos that must start empty
for the counts to be reproducible (:func:`memo`: the pipeline stall's timelines, keyed by what
decides them): within one scope a result is computed once, and the count says how often.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


def cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the CBC solves run as subprocesses):
    the figure a benchmark of planning time reads, beside the counts."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


WORK: dict[str, tuple[str, str]] = {
    "deployments_judged": ("deployments judged", "on the expected batch, by the dispatcher (planner.evaluation)"),
    "dispatches": ("dispatches", "a batch dispatched on a deployment (dispatch.step.solve_step)"),
    "balances": ("balances", "a load model balanced, fast or length-based (dispatch.balance)"),
    "lp_solves": ("LPs", "HiGHS LPs: a balance's start, a fluid bound (dispatch.balance)"),
    "milp_solves": ("MILPs", "the deployment MILP, an exact dispatch (solvers.solve)"),
    "batches_raced": ("batches raced", "a sampled batch dispatched in the robust race (planner.objective)"),
    "replicas_priced": ("replica steps priced", "one replica's micro-batches timed (CostModel.replica_time)"),
    "stall_timelines": ("stall timelines", "a pipeline schedule's span built for a stall (costmodel.schedule)"),
    "tokenizations": ("datasets tokenized", "a dataset's rows tokenized, all of them (data.tokenize.tokenize_rows)"),
}
"""Every counter, in report order: its label, and what one of it is (where it is counted)."""


@dataclass
class WorkCounts:
    """The counters of one scope (see :data:`WORK`), and its memos."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WORK, 0))
    memos: dict[str, dict] = field(default_factory=dict, repr=False)

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def describe(self) -> str:
        """``12 deployments judged, 40 dispatches, ...``: every non-zero counter, in :data:`WORK` order."""
        return ", ".join(f"{n} {WORK[name][0]}" for name, n in self.counts.items() if n)


_SCOPE: ContextVar[WorkCounts | None] = ContextVar("lorafleet_work", default=None)


@contextmanager
def counting() -> Iterator[WorkCounts]:
    """A scope whose work is counted (and whose memos start empty); a scope inside another adds its
    counts to the outer one when it ends."""
    outer = _SCOPE.get()
    work = WorkCounts()
    token = _SCOPE.set(work)
    try:
        yield work
    finally:
        _SCOPE.reset(token)
        work.memos.clear()  # only the scope's own work may use them
        if outer is not None:
            for name, n in work.counts.items():
                outer.counts[name] += n


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of the current scope (nothing outside a scope)."""
    work = _SCOPE.get()
    if work is not None:
        work.counts[name] += n


def memo(name: str) -> dict | None:
    """The current scope's memo ``name`` (created empty), or None outside a scope."""
    work = _SCOPE.get()
    return None if work is None else work.memos.setdefault(name, {})


def by_identity(memo: dict, owner: object, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` once per ``memo`` for ``owner`` (an unhashable or costly-to-hash object, a cost model, taken by
    identity) and ``key``: the entry holds ``owner``, so while it lives no other object can have its id."""
    entry = (id(owner), key)
    if entry not in memo:
        memo[entry] = (owner, compute())
    return memo[entry][1]
