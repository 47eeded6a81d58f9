"""The small workload planned once per test module (the simulation tests' common input)."""

from __future__ import annotations

import pytest

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.planner import plan_deployment
from lorafleet.workload import load_workload
from tests.conftest import SMALL_WORKLOAD


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(workload, cost model, planning result) of ``SMALL_WORKLOAD``; the cost model is the one the plan was
    judged by (its pipeline window)."""
    import yaml

    path = tmp_path_factory.mktemp("w") / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL_WORKLOAD))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    result = plan_deployment(workload, cluster, workload_cost_model(workload, cluster))
    return workload, result.cost_model, result
