"""Shared fixtures: paths to the repository, examples and the read-only reference data."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
REFERENCE = REPO.parent / "shared" / "reference"

# A small two-task llama2-7b workload on one node of 8 x A100-80GB: a short chat task and a long one.
SMALL_WORKLOAD = {
    "model": "llama2-7b",
    "cluster": {"gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8},
    "tasks": [
        {
            "name": "chat",
            "lengths": {"mean": 300, "skewness": 3.0, "kurtosis": 15.0},
            "batch_size": 48,
            "context_length": 4096,
        },
        {
            "name": "docs",
            "lengths": {"mean": 2500, "skewness": 1.0, "kurtosis": 1.0},
            "batch_size": 8,
            "context_length": 8192,
        },
    ],
}


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """``../shared/reference`` (LobRA's published data); tests that need it skip without it."""
    if not REFERENCE.is_dir():
        pytest.skip("../shared/reference is absent (LobRA reference data is not part of the repository)")
    return REFERENCE


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's own small BPE tokenizer, built once per test session."""
    from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
