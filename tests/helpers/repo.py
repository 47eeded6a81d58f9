"""The repository's places that tests read: its root, the examples and the read-only reference data."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DEMO = EXAMPLES / "demo"
REFERENCE = REPO.parent / "shared" / "reference"

SMALL_WORKLOAD = yaml.safe_load((EXAMPLES / "two-tenants.yaml").read_text())
"""``examples/two-tenants.yaml`` as a mapping: a short chat task and a long one on 8 x A100-80GB."""
