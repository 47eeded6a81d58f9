"""The decomposition against exhaustive enumeration on small instances (the MINLP: test_joint_minlp).

Each plan is judged the same way: the dispatcher's balance of the expected batch on it.
The decomposition (proposal, aggregated MILP, branches, Theorem-1 filter) must come within
1 % of the best deployment of *every* valid config found by enumeration.
"""

from __future__ import annotations

import numpy as np
import pytest

from lorafleet.planner import PlannerMode, PlannerOptions
from lorafleet.planner.candidates import propose_candidates, valid_candidates
from lorafleet.dispatch import DispatchOptions
from lorafleet.planner.problem import build_problem
from lorafleet.planner.search import search
from lorafleet.specs.cluster import ClusterSpec

from .conftest import batch_of, lobra_like_cost_model, skewed_lengths

OPTIONS = PlannerOptions(robust_samples=0)


def problems(seed: int):
    rng = np.random.default_rng(seed)
    cm = lobra_like_cost_model(max_pp=4)
    cluster = ClusterSpec(nodes=1, gpus_per_node=8)
    longest = int(rng.choice([4096, 8192]))
    batch = batch_of(skewed_lengths(rng, int(rng.integers(60, 200)), longest, median=float(rng.uniform(150, 700))))
    valid = valid_candidates(cm, cluster)
    dispatch = DispatchOptions(n_buckets=8)
    return (build_problem(batch, propose_candidates(valid, longest), cm, cluster, dispatch),
            build_problem(batch, valid, cm, cluster, dispatch))


@pytest.mark.parametrize("seed", range(4))
def test_decomposition_within_one_percent_of_exhaustive(seed):
    proposed, everything = problems(seed)
    _, decomposed = search(proposed, OPTIONS)
    _, exhaustive = search(everything, PlannerOptions(mode=PlannerMode.EXHAUSTIVE, robust_samples=0))
    assert decomposed[0].expected_makespan <= exhaustive[0].expected_makespan * 1.01
