"""Shared fixtures: paths to the repository, examples and the read-only reference data."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import settings

# No per-example deadline: Hypothesis times each example by the wall clock, and on a 2-core machine
# beside the other test worker's process groups a trivial example can take longer than its 200 ms.
settings.register_profile("lorafleet", deadline=None)
settings.load_profile("lorafleet")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
REFERENCE = REPO.parent / "shared" / "reference"

SMALL_WORKLOAD = yaml.safe_load((EXAMPLES / "two-tenants.yaml").read_text())
"""``examples/two-tenants.yaml`` as a mapping: a short chat task and a long one on 8 x A100-80GB."""


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
