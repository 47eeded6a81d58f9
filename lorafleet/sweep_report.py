"""A run's sweeps as its files record them (``specs.sweep``): each member's values, its evaluations and the score
each rung judged it by, its steps and GPU-seconds, how it left, and the winner. What ``lorafleet sweep-report RUN``
prints, what the winner's model card holds (``train.promote``) and what the HTML report plots.

Read from the run directory only: its tasks (``train.promote.run_tasks``), ``evaluations.json`` and
``metrics.jsonl``, so it works on a finished run, a stopped one and one still running.

**A rung's score** of a member is the one the rung judged it by (``lorafleet.sweeps``): its best evaluation loss
over its evaluations up to the rung: at rung ``k``, after its own step ``s_k = k rung_steps``, the first
``count_through(s_k)`` of them, as many as its schedule holds there (``lorafleet.eval_schedule``: the one rule
``train`` evaluated it by, whatever ``every_steps`` is). A member reached rung ``k`` when its schedule has it, it took
``s_k`` steps and ``s_k`` is short of its last (``steps``).
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

from lorafleet.eval_schedule import EvalSchedule
from lorafleet.metrics import read_rows, sum_task_gpu_seconds
from lorafleet.rundir import RunDir
from lorafleet.specs.sweep import HalvingSpec, value_label
from lorafleet.specs.workload import TaskSpec
from lorafleet.sweeps import sweep_groups, winner


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
        rungs = max((m.dropped_rung or 0 for m in self.members), default=0)  # every rung drops at least one
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
    return [_result(name, members, evaluations, gpu_s, steps) for name, members in groups.items()]


def _result(
    name: str, members: Sequence[TaskSpec], evaluations: Mapping[str, Any], gpu_s: Mapping[str, float],
    steps: Mapping[str, int],
) -> SweepResult:  # fmt: skip
    first = members[0].member_of
    assert first is not None
    out = []
    for task in members:
        assert task.member_of is not None
        raw = evaluations.get(task.name, {})
        history = tuple((int(s), float(loss)) for s, loss, _ in raw.get("history", ()))
        stopping = raw.get("stopping", {})
        scores = _rung_scores(task, history, steps.get(task.name, 0))
        reached = scores if raw.get("dropped_rung") is None else scores[: raw["dropped_rung"]]
        out.append(MemberResult(
            task.name, task.member_of.index, task.member_of.values, history, stopping.get("best_loss"),
            stopping.get("best_step"), reached, steps.get(task.name, 0), gpu_s.get(task.name, 0.0),
            raw.get("stopped_at"), raw.get("dropped_rung"),
        ))  # fmt: skip
    order = {m.name: m.index for m in out}
    best = {m.name: m.best_loss for m in out if m.best_loss is not None}
    return SweepResult(name, tuple(out), winner(best, order), first.halving, first.keep_members)


def _rung_scores(task: TaskSpec, history: Sequence[tuple[int, float]], taken: int) -> tuple[float, ...]:
    """The score of each rung the member ``task`` reached, having taken ``taken`` of its own steps (module doc)."""
    schedule = EvalSchedule.of(task)
    if schedule is None or schedule.rung_steps is None:
        return ()
    scores = []
    own = schedule.rung_steps
    while own <= taken and schedule.rung(own) is not None and (task.steps is None or own < task.steps):
        scores.append(_best(history[: schedule.count_through(own)]))
        own += schedule.rung_steps
    return tuple(scores)


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
    for step in sorted({m.left_at for m in result.members if m.dropped_rung is not None and m.left_at}):
        ax.axvline(step, color="grey", linestyle=":", linewidth=1)
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
