"""Which tasks take part in which global step: joins, ends, shares and deadlines.

A task's own steps never change: its k-th update is always its k-th batch (``batch_size``
samples from its stream), whatever global step runs it. What this module decides is *when*
each task takes its next batch, as a pure function of the task list, so a batch drawn ahead
(look-ahead dispatch), a resumed run and a what-if all see the same turns.

Task ``t`` is *eligible* for global step ``k`` when ``joined_t <= k < until_t`` and it has
batches left (``taken_t < batches_t``). Among the eligible:

- a task without a share takes part in every step;
- a task with share ``σ_t`` (its target fraction of every step's tokens) keeps a token credit
  ``c_t``. With ``T`` the step's tokens so far (the unshared and the forced tasks' expected
  tokens, and the shared tasks admitted before it, in order of credit), it takes part when
  ``c_t + σ_t (T + τ_t) >= τ_t`` (its entitlement covers its batch of ``τ_t`` expected tokens);
  after the step every eligible shared task earns ``σ_t T_k`` (``T_k`` the step's expected
  tokens) and each admitted one pays ``τ_t``. Over many steps its tokens are ``≈ σ_t`` of the
  tokens trained (stride scheduling with tokens as the currency);
- a task with a deadline ``d_t`` (the global step by which its last batch must be taken) is
  forced in once it has no slack left, ``batches_t - taken_t >= d_t - k``, whatever its share.

A step with eligible tasks is never empty: if the shares admitted none, the shared task with
the most credit per token takes part.

A share or deadline changed while the job runs (a queued update) takes effect from the step it was
changed at (``TaskTurns.changes``): the turns before it stay what they were, so the batches a task
already took never change.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from lorafleet.specs._base import Float, Int
from lorafleet.specs.field_docs import documented


@dataclass(frozen=True)
class TaskTurns:
    """What decides one task's turns."""

    __pydantic_config__ = documented(extra="forbid")
    """How the queue's typed files (the task ledger, the pending changes) read it back: no unknown keys."""

    tokens: Float
    """τ: expected tokens of one of its batches (only shares use it)."""
    batches: Int | None = None
    """Its steps (None: unbounded)."""
    joined: Int = 0
    """The first global step it may take part in."""
    until: Int | None = None
    """The first global step it is left out of for good (finished, cancelled, stopped); None: never."""
    share: Float | None = None
    """σ in (0, 1]: its target fraction of every step's tokens; None: every step."""
    deadline: Int | None = None
    """The global step by which it must have taken its last batch (forced in when out of slack)."""
    changes: tuple[tuple[Int, Float | None, Int | None], ...] = ()
    """``(step, share, deadline)``, in step order: from that step on, these replace ``share`` and ``deadline``."""

    def __post_init__(self) -> None:
        for share in (self.share, *(c[1] for c in self.changes)):
            if share is not None and not 0 < share <= 1:
                raise ValueError(f"share must be in (0, 1], got {share}")
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens}")

    def at(self, step: int) -> tuple[float | None, int | None]:
        """The share and deadline in effect at ``step``."""
        share, deadline = self.share, self.deadline
        for since, s, d in self.changes:
            if since <= step:
                share, deadline = s, d
        return share, deadline


def turns(tasks: Sequence[TaskTurns], steps: int) -> np.ndarray:
    """``(steps, n)`` booleans: whether task ``t`` takes part in global step ``k`` (module doc)."""
    return TurnDraw(tasks).rows(steps)


class TurnDraw:
    """The turns drawn step after step from step 0 (module doc): :meth:`rows` gives the next ones, so a caller
    that needs only a summary of many steps holds one block of them at a time."""

    def __init__(self, tasks: Sequence[TaskTurns]) -> None:
        self.tasks = tuple(tasks)
        self.step = 0
        """The next step :meth:`rows` draws."""
        self.taken = np.zeros(len(self.tasks), dtype=np.int64)
        self.credit = np.zeros(len(self.tasks))

    @property
    def exhausted(self) -> bool:
        """No task can take part in a step from :attr:`step` on (each has left or has taken its batches)."""
        return all(
            (task.until is not None and self.step >= task.until)
            or (task.batches is not None and self.taken[t] >= task.batches)
            for t, task in enumerate(self.tasks)
        )

    def rows(self, count: int) -> np.ndarray:
        """``(count, n)`` booleans: the turns of the next ``count`` steps."""
        tasks, taken, credit = self.tasks, self.taken, self.credit
        out = np.zeros((count, len(tasks)), dtype=bool)
        for row in range(count):
            k = self.step + row
            eligible = [
                t
                for t, task in enumerate(tasks)
                if task.joined <= k
                and (task.until is None or k < task.until)
                and (task.batches is None or taken[t] < task.batches)
            ]
            now = {t: tasks[t].at(k) for t in eligible}
            shared = [t for t in eligible if now[t][0] is not None]
            forced = {
                t
                for t in shared
                if now[t][1] is not None
                and tasks[t].batches is not None
                and tasks[t].batches - taken[t] >= now[t][1] - k  # type: ignore[operator]
            }
            admitted = [t for t in eligible if t not in shared or t in forced]
            total = sum(tasks[t].tokens for t in admitted)
            for t in sorted((t for t in shared if t not in forced), key=lambda t: -credit[t]):
                share, tokens = now[t][0], tasks[t].tokens
                if credit[t] + share * (total + tokens) >= tokens:  # type: ignore[operator]
                    admitted.append(t)
                    total += tokens
            if eligible and not admitted:
                best = max(shared, key=lambda t: (credit[t] + 1.0) / max(tasks[t].tokens, 1.0))
                admitted.append(best)
                total += tasks[best].tokens
            for t in shared:
                credit[t] += now[t][0] * total  # type: ignore[operator]
            for t in admitted:
                out[row, t] = True
                taken[t] += 1
                if t in shared:
                    credit[t] -= tasks[t].tokens
        self.step += count
        return out


DRAW_BLOCK = 1024
"""Steps :func:`last_step` draws at a time: its memory is a block's, whatever the horizon."""


def last_step(tasks: Sequence[TaskTurns], horizon: int) -> int:
    """The step after the last one within ``horizon`` in which some task takes part (0: none does).

    A task without an end (no ``batches``, no ``until``) that joins before ``horizon`` is eligible in every
    step from its join, and a step with an eligible task is never empty: then it is ``horizon``, drawn from
    nothing. Otherwise the turns are drawn a block of :data:`DRAW_BLOCK` steps at a time until every task has
    ended, so a run told ``--steps 1000000000000`` holds one block, not a row per step of the run.
    """
    if any(t.batches is None and t.until is None and t.joined < horizon for t in tasks):
        return horizon
    draw, last = TurnDraw(tasks), 0
    while draw.step < horizon and not draw.exhausted:
        first = draw.step
        took = np.flatnonzero(draw.rows(min(DRAW_BLOCK, horizon - first)).any(axis=1))
        if took.size:
            last = first + int(took[-1]) + 1
    return last


T = TypeVar("T", bound=Hashable)

DEPARTURE_WINDOW = 8
"""The most steps a task that has taken all its batches waits for other tasks that end soon after it, so that
their departures are one change of the running fleet (one checkpoint, one re-plan, at most one move) rather
than one each. A finished task takes no batch: waiting costs only its adapter slot's memory and, for a move
the re-plan would make, its saving over those steps, which a move's horizon (``--replan-horizon``, 200 by
default) dwarfs."""


def departures(
    ends: Mapping[T, int], step: int, now: bool = False, window: int = DEPARTURE_WINDOW
) -> tuple[list[T], int | None]:
    """The tasks that depart at the boundary before ``step``, and the next step to look again at (None: no
    task has an end ahead). ``ends``: the step each task with a bounded number of batches is done at (the step
    after its last batch; ``DataStreams.end_steps``); ``now``: other changes are applied at this boundary.

    The tasks done by ``step`` depart now, unless another task is done within ``window`` steps of the
    earliest of them and nothing else happens here: then they wait for it, and the run ends a window there.
    So departures within ``window`` steps of the first are applied at one boundary, a finished task waits at
    most ``window`` steps, and the rule depends on the turns and on this boundary's other changes only."""
    done = [t for t, end in ends.items() if end <= step]
    later = sorted(end for end in ends.values() if end > step)
    if done and not now:
        soon = [end for end in later if end <= min(ends[t] for t in done) + window]
        if soon:
            return [], soon[0]
    return done, (later[0] if later else None)
