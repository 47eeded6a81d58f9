"""Fixtures of the planner tests (their builders: :mod:`tests.helpers.planning`)."""

from __future__ import annotations

import pytest

from lorafleet.costmodel.cost_model import CostModel
from tests.helpers.planning import lobra_like_cost_model


@pytest.fixture(scope="session")
def cost_model_7b() -> CostModel:
    return lobra_like_cost_model()
