"""A sweep's rules once it runs (``specs.sweep``): its rungs of successive halving and its winner, for training
(``train.evaluation``) and its what-ifs (``simulate``) alike.

**A rung.** After every ``rung_steps`` of the members' own steps, where each member still training is evaluated
whatever its ``every_steps`` (``lorafleet.eval_schedule``), each member ``m`` still training is scored by its
best evaluation loss so far, ``s_m = min_k L_{m,k}`` (a NaN counts as ``+inf``): the adapter it would hand over is
its best-evaluated one (``lorafleet.stopping``), so that is what it is judged by, and one noisy evaluation at the
rung does not drop a member whose best is ahead. The members, ordered by ``(s_m, index_m)``, keep their first

    keep(n) = max(1, floor(n / eta))

of the ``n`` (Jamieson and Talwalkar's successive halving); the others leave the run at that boundary. Ties go
to the member earlier in the sweep's order (the grid's, or the draws'), so the decision is a pure function of the
losses and a resumed run decides exactly as the uninterrupted one.

**The winner** is the member of lowest best evaluation loss over the whole run, by the same order, among all of
the sweep's members (those that left at a rung or stopped early included): ``adapters/<sweep>/`` is its best
adapter.

**Without halving** (:func:`without_halving`), the reference a halving's saving is measured against (``simulate``'s
no-stopping run): the whole grid trained to its end, each member evaluated as a plain task is, after every
``every_steps`` of its own steps and its last, never at a rung boundary (``lorafleet.eval_schedule``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet.specs.workload import TaskSpec


@dataclass(frozen=True)
class Rung:
    """One rung's decision: the members' scores (best eval loss so far) and who goes on."""

    sweep: str
    rung: int
    """1 at the first rung."""
    step: int
    """The boundary it was decided at: the dropped members take no batch from this global step on."""
    scores: dict[str, float]
    kept: tuple[str, ...]
    dropped: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        scores = {n: (None if math.isinf(s) or math.isnan(s) else s) for n, s in self.scores.items()}
        return {"sweep": self.sweep, "rung": self.rung, "step": self.step, "scores": scores,
                "kept": list(self.kept), "dropped": list(self.dropped)}  # fmt: skip

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Rung:
        scores = {n: math.inf if s is None else float(s) for n, s in raw["scores"].items()}
        return cls(raw["sweep"], int(raw["rung"]), int(raw["step"]), scores, tuple(raw["kept"]), tuple(raw["dropped"]))


def sweep_groups(tasks: Iterable[TaskSpec]) -> dict[str, list[TaskSpec]]:
    """The sweeps among ``tasks``: by sweep name, its members present, in the sweep's order."""
    out: dict[str, list[TaskSpec]] = {}
    for task in tasks:
        if task.member_of is not None:
            out.setdefault(task.member_of.sweep, []).append(task)
    return {name: sorted(members, key=lambda t: t.member_of.index) for name, members in out.items()}  # type: ignore[union-attr]


def _rank_key(score: float, index: int) -> tuple[float, int]:
    return (math.inf if math.isnan(score) else score, index)


def decide_rung(sweep: str, rung: int, step: int, scores: Mapping[str, float], order: Mapping[str, int],
                eta: int) -> Rung:  # fmt: skip
    """The rung's decision (module doc) over the members still training, ``scores`` by name; ``order``: their
    indices in the sweep."""
    ranked = sorted(scores, key=lambda n: _rank_key(scores[n], order[n]))
    keep = kept(len(ranked), eta)
    return Rung(sweep, rung, step, dict(scores), tuple(ranked[:keep]), tuple(ranked[keep:]))


def kept(n: int, eta: int) -> int:
    """How many of a rung's ``n`` members go on: ``keep(n) = max(1, floor(n / eta))`` (module doc)."""
    return max(1, n // eta)


def rung_count(members: int, eta: int) -> int:
    """The most rungs a sweep of ``members`` can decide, ``R = min {k : keep^k(members) = 1}``: a rung is decided
    only while two members or more train, and no more than ``keep^k(members)`` train after rung ``k``."""
    rungs = 0
    while members > 1:
        members, rungs = kept(members, eta), rungs + 1
    return rungs


def winner(best: Mapping[str, float], order: Mapping[str, int]) -> str | None:
    """The sweep's winner (module doc) among the members of ``best`` (name -> best eval loss); None when none has
    an evaluation."""
    if not best:
        return None
    return min(best, key=lambda n: _rank_key(best[n], order[n]))


def rungs_due(
    tasks: Iterable[TaskSpec],
    due: Collection[str],
    step: int,
    left: Callable[[str], bool],
    taken: Callable[[str], int],
    last: Callable[[str], int | None],
    best: Callable[[str], float],
) -> list[Rung]:
    """The rungs of successive halving decided at the boundary before global step ``step``, after an evaluation of
    the tasks ``due``: a sweep's, when every member of ``tasks`` that has not ``left`` the run was just evaluated,
    after a multiple of ``rung_steps`` of its own steps (``taken``) short of its ``last``; each member scored by its
    ``best`` eval loss so far (:func:`decide_rung`). Train and simulate alike: they apply the drops."""
    out = []
    for sweep, members in sweep_groups(tasks).items():
        halving = members[0].member_of.halving  # type: ignore[union-attr]
        alive = [m.name for m in members if not left(m.name)]
        if halving is None or len(alive) < 2 or not set(alive) <= set(due):
            continue
        own, end = taken(alive[0]), last(alive[0])
        if own % halving.rung_steps or (end is not None and own >= end):
            continue
        order = {m.name: m.member_of.index for m in members}  # type: ignore[union-attr]
        scores = {name: best(name) for name in alive}
        out.append(decide_rung(sweep, own // halving.rung_steps, step, scores, order, halving.eta))
    return out


def may_leave_early(spec: TaskSpec) -> bool:
    """Whether a task can leave before its last step: it stops early (``early_stopping``) or its sweep halves."""
    return spec.early_stopping is not None or (spec.member_of is not None and spec.member_of.halving is not None)


def without_halving(spec: TaskSpec) -> TaskSpec:
    """``spec`` as its sweep runs without successive halving (module doc): a member's membership without its
    ``halving``, so no rung drops it and none is evaluated; any other task as it is."""
    member = spec.member_of
    if member is None or member.halving is None:
        return spec
    return spec.model_copy(update={"member_of": member.model_copy(update={"halving": None})})
