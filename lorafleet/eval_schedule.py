"""When a task is evaluated: one rule, a pure function of its spec and its own steps, read by training
(``train.evaluation``) and the what-ifs (``eval_replay``) alike, so the two cannot disagree, and a resumed run
evaluates exactly as the uninterrupted one. (The sweep report reads the rungs a run recorded, not this rule: a
spec changed while the run ran, ``every_steps`` by an update or ``steps`` on a resume, is not the one that
evaluated its past: ``sweep_report``.)

A task with an ``eval`` is evaluated after its own step ``n >= 1`` (the global batches it took part in) when

    n = 0 (mod every_steps),        or        n = k rung_steps  with  1 <= k <= R,

the second for a member of a sweep with successive halving (``specs.sweep``): each rung is judged by an
evaluation at its boundary, whatever ``every_steps`` is (a user may set rungs every 20 steps and evaluate every
100). ``R`` is the most rungs the sweep can decide, the number of halvings that take its ``N`` members to one::

    R = min { k : keep^k(N) = 1 },        keep(n) = max(1, floor(n / eta))        (``lorafleet.sweeps``)

A rung is decided only while two members or more are training, and ``keep`` is non-decreasing, so the members still
training after rung ``k`` are at most ``keep^k(N)`` (an early stop or a cancel only removes more): no rung after
``R`` is ever decided, and the sweep's survivor is not evaluated at the boundaries of rungs that cannot happen. A
membership recorded without its sweep's size (before it was recorded) evaluates at every rung boundary.

Beside the schedule, the callers evaluate a task after its last step (its ``steps`` or ``epochs``) and at the run's
last step: those depend on the run, not on the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.specs.workload import TaskSpec
from lorafleet.sweeps import rung_count


@dataclass(frozen=True)
class EvalSchedule:
    """The own steps a task is evaluated after (module doc)."""

    every_steps: int
    rung_steps: int | None = None
    """Its sweep's steps between two rungs (None: not a member of a sweep with halving)."""
    rungs: int | None = None
    """``R``: the rung boundaries evaluated are ``k rung_steps`` for ``1 <= k <= R`` (None: every one)."""

    @classmethod
    def of(cls, spec: TaskSpec) -> EvalSchedule | None:
        """``spec``'s schedule; None when it has no ``eval``."""
        if spec.eval is None:
            return None
        member = spec.member_of
        if member is None or member.halving is None:
            return cls(spec.eval.every_steps)
        rungs = None if member.members is None else rung_count(member.members, member.halving.eta)
        return cls(spec.eval.every_steps, member.halving.rung_steps, rungs)

    def rung(self, own: int) -> int | None:
        """The rung ``k`` whose boundary is own step ``own`` (None: no rung of the schedule is there)."""
        if self.rung_steps is None or own < 1 or own % self.rung_steps:
            return None
        k = own // self.rung_steps
        return k if self.rungs is None or k <= self.rungs else None

    def evaluates(self, own: int) -> bool:
        """Whether the task is evaluated after its own step ``own`` by its schedule (module doc)."""
        return own >= 1 and (own % self.every_steps == 0 or self.rung(own) is not None)

    def next_after(self, own: int) -> int:
        """The first own step after ``own`` the schedule evaluates after."""
        nxt = (max(own, 0) // self.every_steps + 1) * self.every_steps
        if self.rung_steps is not None:
            rung = (max(own, 0) // self.rung_steps + 1) * self.rung_steps
            if self.rung(rung) is not None:
                nxt = min(nxt, rung)
        return nxt
