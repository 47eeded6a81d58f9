"""A run's metrics files read back: the rows of ``metrics.jsonl`` (:func:`read_rows`), each task's last loss
(:func:`last_losses`, for the exported adapters' model cards), and both files cut back to a step on resume
(:func:`truncate_metrics`).

The files are every launch's of the run, one row a step (:mod:`lorafleet.metrics.records`); their names are
the run directory's (``lorafleet.rundir``: ``METRICS_JSONL``, ``METRICS_CSV``).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from lorafleet.rundir import METRICS_CSV, METRICS_JSONL
from lorafleet.specs.io import write_text_atomic


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The run's metrics so far, one mapping a step (``metrics.jsonl``: every launch's, cut back on resume;
    no file: none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def last_losses(metrics: Path) -> dict[str, tuple[int, float]]:
    """Task -> (step, loss) of the last step it appeared in, from a run's ``metrics.jsonl`` (a torn or
    unreadable line is skipped; no file: empty)."""
    out: dict[str, tuple[int, float]] = {}
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
            step = int(row["step"])
            out.update({name: (step, float(loss)) for name, loss in row.get("losses", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def truncate_metrics(out: str | Path, step: int) -> None:
    """Keep only the metrics of steps before ``step`` in the run directory ``out`` (a resumed run replays
    from there, so nothing replayed is counted twice).

    Each file is rewritten whole (``specs.io.write_text_atomic``), so a crash here leaves either the old
    file or the truncated one.
    """
    root = Path(out)
    jsonl = root / METRICS_JSONL
    if jsonl.is_file():
        kept = [
            line
            for line in jsonl.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.strip() and _step_of_json(line) < step
        ]
        write_text_atomic(jsonl, "".join(kept))
    table = root / METRICS_CSV
    if table.is_file():
        with table.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        if rows:
            header, body = rows[0], rows[1:]
            at = header.index("step") if "step" in header else None
            kept_rows = [r for r in body if at is None or (len(r) > at and r[at].isdigit() and int(r[at]) < step)]
            text = io.StringIO(newline="")
            csv.writer(text).writerows([header, *kept_rows])
            write_text_atomic(table, text.getvalue())


def _step_of_json(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line (a crash mid-write): dropped
