"""LobRA's A100-40GB Llama2-7B reference data as the tests use it (read from ../shared/reference)."""

from __future__ import annotations

import csv
from pathlib import Path

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.profile_format import CsvRow, read_layer_csv

LAYER_TIME_CSV = "lobra_a100_40gb_llama2_7b_layer_time.csv"
MAX_TOKENS_CSV = "lobra_a100_40gb_llama2_7b_max_tokens.csv"
#: The adapters of LobRA's 7B runs: 6 tasks, rank 16 on every projection, AdamW.
LOBRA_ADAPTERS = AdapterLoad.uniform(6, 16)


def layer_rows(reference_dir: Path) -> list[CsvRow]:
    return read_layer_csv(reference_dir / LAYER_TIME_CSV)


def max_tokens(reference_dir: Path) -> dict[ParallelConfig, int]:
    with (reference_dir / MAX_TOKENS_CSV).open() as f:
        return {ParallelConfig(int(r["tp"]), int(r["pp"])): int(r["max_tokens"]) for r in csv.DictReader(f)}
