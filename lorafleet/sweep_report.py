"""A run's sweeps as its files record them (``specs.sweep``): each member's values, its evaluations and the score
each rung judged it by, its steps and GPU-seconds, how it left, and the winner. What ``lorafleet sweep-report RUN``
prints, what the winner's model card holds (``train.promote``) and what the HTML report plots.

Read from the run directory only: its tasks (``train.promote.run_tasks``), ``evaluations.json`` and
``metrics.jsonl``, so it works on a finished run, a stopped one and one still running.

**The rungs** are those the run decided, as it recorded them: the metrics row of global step ``b - 1`` names the
rungs decided at boundary ``b`` (``sweep_rung``: sweep -> ``k``) and the evaluation they followed (``eval_loss``: every
member still training, ``sweeps.rungs_due``). Nothing is re-derived from the members' specs as they are now: an
``eval.every_steps`` changed while the run ran, or ``steps`` raised on a resume, changes neither which evaluations
judged a rung nor which rungs there were.
**A rung's score** of a member is the one the rung judged it by (``lorafleet.sweeps``), as that metrics row records it
(``sweep_scores``: with ``early_stopping.min_delta > 0`` the early stopper's best, which a smaller improvement does not
move, can be above the history's minimum); a run recorded before rungs wrote their scores gets its best evaluation loss
over its evaluations through the rung's boundary ``b`` (global steps ``<= b``). A member reached rung ``k`` when that
evaluation evaluated it and did not stop it early (a member whose early stop falls on a rung's boundary leaves
before the rung).
**Accounting:** a sweep is one tenant: its GPU-seconds are the sum of its members' (their steps' and their
evaluations', ``accounting``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.metrics import read_rows, sum_task_gpu_seconds
from lorafleet.rundir import RunDir
from lorafleet.specs.sweep import HalvingSpec, value_label
from lorafleet.specs.workload import TaskSpec
from lorafleet.sweeps import sweep_groups, winner


@dataclass(frozen=True)
class RungRecord:
    """A rung the run decided, as its metrics row records it (module doc)."""

    rung: int
    """1 at the first rung."""
    step: int
    """The boundary it was decided at: after the evaluation of global step ``step``."""
    evaluated: frozenset[str]
    """The members that evaluation evaluated: those still training, which the rung judged, but one that stopped early
    at that evaluation (it left before the rung: ``train.evaluation``)."""
    scores: Mapping[str, float | None]
    """The score the rung ranked each member it judged by (``sweep_scores``; None: no finite loss); empty in a run
    recorded before rungs wrote their scores, whose scores are re-derived from the history."""


@dataclass(frozen=True)
class MemberResult:
    """One member of a sweep, as the run left it."""

    name: str
    index: int
    values: tuple[tuple[str, Any], ...]
    """Its swept keys and values, in the sweep's order."""
    history: tuple[tuple[int, float], ...]
    """Its evaluations: (the global step after which it ran, eval loss)."""
    best_loss: float | None
    best_step: int | None
    rung_scores: tuple[float, ...]
    """The score each rung it reached judged it by (module doc)."""
    steps: int
    """Its own steps taken (global batches it trained on)."""
    gpu_s: float
    """Its GPU-seconds, its evaluations' included."""
    left_at: int | None
    """The boundary it left at by an early stop or a rung (None: it trained to its end)."""
    dropped_rung: int | None

    @property
    def outcome(self) -> str:
        if self.dropped_rung is not None:
            return f"dropped at rung {self.dropped_rung} (step {self.left_at})"
        if self.left_at is not None:
            return f"stopped early at step {self.left_at}"
        return "trained to its end"


@dataclass(frozen=True)
class SweepResult:
    """A sweep of the run: its members in the sweep's order, and its winner (``lorafleet.sweeps.winner``)."""

    name: str
    members: tuple[MemberResult, ...]
    winner: str | None
    """None when no member has a finite evaluation (a sweep without ``eval`` has no winner)."""
    halving: HalvingSpec | None
    keep_members: bool
    rungs: tuple[RungRecord, ...] = ()
    """The rungs the run decided, in order (module doc)."""

    @property
    def gpu_s(self) -> float:
        """The sweep's GPU-seconds, as one tenant: its members' sum."""
        return sum(m.gpu_s for m in self.members)

    def member(self, name: str) -> MemberResult:
        return next(m for m in self.members if m.name == name)

    def table(self) -> list[list[str]]:
        """The members' table, a header row first: values, each rung's score, best eval loss, steps, GPU-seconds,
        outcome (the winner marked)."""
        keys = [key for key, _ in self.members[0].values]
        rungs = len(self.rungs)
        rows = [["member", *keys, *(f"rung {k + 1}" for k in range(rungs)), "best eval loss", "steps", "GPU-s", ""]]
        for m in self.members:
            scores = [_loss(s) for s in m.rung_scores[:rungs]] + [""] * (rungs - len(m.rung_scores[:rungs]))
            mark = "winner" if m.name == self.winner else m.outcome
            rows.append([m.name, *(value_label(v) for _, v in m.values), *scores, _loss(m.best_loss),
                         str(m.steps), f"{m.gpu_s:.4g}", mark])  # fmt: skip
        return rows

    def markdown(self) -> str:
        """:meth:`table` as a Markdown table, with the sweep's GPU-seconds under it."""
        rows = self.table()
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        lines.append(f"\nThe sweep's GPU-seconds (one tenant: its members' sum): {self.gpu_s:.4g}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep": self.name,
            "winner": self.winner,
            "gpu_s": self.gpu_s,
            "halving": self.halving.model_dump() if self.halving else None,
            "rungs": [{"rung": r.rung, "step": r.step} for r in self.rungs],
            "members": [
                {
                    "name": m.name,
                    "values": m.values,
                    "history": [list(h) for h in m.history],
                    "best_loss": m.best_loss,
                    "best_step": m.best_step,
                    "rung_scores": list(m.rung_scores),
                    "steps": m.steps,
                    "gpu_s": m.gpu_s,
                    "left_at": m.left_at,
                    "dropped_rung": m.dropped_rung,
                }  # fmt: skip
                for m in self.members
            ],
        }


def _loss(value: float | None) -> str:
    return "" if value is None or math.isinf(value) else f"{value:.4f}"


def sweep_results(run_dir: RunDir, tasks: Sequence[TaskSpec]) -> list[SweepResult]:
    """The sweeps of the run in ``run_dir`` (module doc) among ``tasks``, every task it has had
    (``train.promote.run_tasks``)."""
    groups = sweep_groups(tasks)
    if not groups:
        return []
    evaluations: Mapping[str, Any] = {}
    if run_dir.evaluations.is_file():
        evaluations = json.loads(run_dir.evaluations.read_text(encoding="utf-8"))
    rows = read_rows(run_dir.metrics_jsonl) if run_dir.metrics_jsonl.is_file() else []
    gpu_s = sum_task_gpu_seconds([*(row.get("task_gpu_s", {}) for row in rows),
                                  *(row.get("eval_gpu_s", {}) for row in rows)])  # fmt: skip
    steps: dict[str, int] = {}
    for row in rows:
        for name in row.get("losses", {}):
            steps[name] = steps.get(name, 0) + 1
    rungs = recorded_rungs(rows)
    return [_result(name, members, evaluations, gpu_s, steps, rungs.get(name, ())) for name, members in groups.items()]


def recorded_rungs(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[RungRecord, ...]]:
    """By sweep, the rungs the metrics ``rows`` record, in order (module doc)."""
    out: dict[str, list[RungRecord]] = {}
    for row in rows:
        evaluated = frozenset(row.get("eval_loss", {}))
        scores = row.get("sweep_scores", {})
        for sweep, rung in row.get("sweep_rung", {}).items():
            out.setdefault(sweep, []).append(RungRecord(int(rung), int(row["step"]) + 1, evaluated, scores))
    return {sweep: tuple(rungs) for sweep, rungs in out.items()}


def _result(
    name: str, members: Sequence[TaskSpec], evaluations: Mapping[str, Any], gpu_s: Mapping[str, float],
    steps: Mapping[str, int], rungs: Sequence[RungRecord],
) -> SweepResult:  # fmt: skip
    first = members[0].member_of
    assert first is not None
    out = []
    for task in members:
        assert task.member_of is not None
        raw = evaluations.get(task.name, {})
        history = tuple((int(s), float(loss)) for s, loss, _ in raw.get("history", ()))
        stopping = raw.get("stopping", {})
        early = raw.get("stopped_at") if raw.get("dropped_rung") is None else None  # left before the rung judged
        judged = [r for r in rungs if task.name in r.evaluated and r.step != early]
        scores = tuple(_score(r, task.name, history) for r in judged)
        out.append(MemberResult(
            task.name, task.member_of.index, task.member_of.values, history, stopping.get("best_loss"),
            stopping.get("best_step"), scores, steps.get(task.name, 0), gpu_s.get(task.name, 0.0),
            raw.get("stopped_at"), raw.get("dropped_rung"),
        ))  # fmt: skip
    order = {m.name: m.index for m in out}
    best = {m.name: m.best_loss for m in out if m.best_loss is not None}
    return SweepResult(name, tuple(out), winner(best, order), first.halving, first.keep_members, tuple(rungs))


def _score(rung: RungRecord, name: str, history: Sequence[tuple[int, float]]) -> float:
    """The score ``rung`` judged member ``name`` by: as the rung recorded it, else its best loss through the rung."""
    if name in rung.scores:
        recorded = rung.scores[name]
        return math.inf if recorded is None else float(recorded)
    return _best([h for h in history if h[0] <= rung.step])


def _best(history: Sequence[tuple[int, float]]) -> float:
    finite = [loss for _, loss in history if not math.isnan(loss)]
    return min(finite, default=math.inf)


def report_text(results: Sequence[SweepResult]) -> str:
    """``lorafleet sweep-report``'s text: per sweep, its winner and its members' table."""
    parts = []
    for result in results:
        head = f"sweep {result.name}: {len(result.members)} members"
        if result.halving is not None:
            head += f", successive halving (eta {result.halving.eta}, a rung every {result.halving.rung_steps} steps)"
        if result.winner is not None:
            values = ", ".join(f"{k}={value_label(v)}" for k, v in result.member(result.winner).values)
            head += f"; winner {result.winner} ({values})"
        else:
            head += "; no winner (no member was evaluated)"
        parts.append(head + "\n" + result.markdown())
    return "\n\n".join(parts)


def plot_sweep(result: SweepResult, out: Path) -> None:
    """The members' eval curves (eval loss against the global step), each rung's boundary a vertical line, the
    members a rung dropped ending in a cross there, the winner's curve bold: ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in result.members:
        if not m.history:
            continue
        steps, losses = zip(*m.history, strict=True)
        winner = m.name == result.winner
        (line,) = ax.plot(steps, losses, marker=".", linewidth=2.5 if winner else 1.0,
                          label=m.name + (" (winner)" if winner else ""))  # fmt: skip
        if m.dropped_rung is not None:
            ax.plot(steps[-1], losses[-1], "x", color=line.get_color(), markersize=9)
    for rung in result.rungs:
        ax.axvline(rung.step, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("global step")
    ax.set_ylabel("eval loss")
    ax.set_title(f"sweep {result.name}: the members' evaluations, rungs dotted")
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def save_results(path: Path, results: Sequence[SweepResult]) -> None:
    """The sweeps' results as JSON (``sweep.json`` beside the winner's adapter)."""
    from lorafleet.specs.io import write_text_atomic

    write_text_atomic(path, json.dumps([r.to_json() for r in results], indent=1) + "\n")
