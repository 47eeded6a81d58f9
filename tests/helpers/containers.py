"""Rows written in each container ``data.readers`` reads, by the library people write it with."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

CONTAINERS = ("jsonl", "json", "parquet", "csv", "txt", "saved")


def write_rows(folder: Path, rows: list[dict], container: str) -> Path:
    """``rows`` written under ``folder`` as ``container`` (one of :data:`CONTAINERS`; ``txt``: each row's
    ``text``, a line each); the path."""
    if container == "jsonl":
        path = folder / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif container == "json":
        path = folder / "rows.json"
        path.write_text(json.dumps(rows, indent=2))
    elif container == "parquet":
        path = folder / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif container == "csv":
        path = folder / "rows.csv"
        with path.open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif container == "txt":
        path = folder / "rows.txt"
        path.write_text("".join(r["text"] + "\n" for r in rows))
    else:
        path = folder / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path
