"""Planning and sizing stay bounded on huge fleets (#38).

- A plan never needs more replicas than a step has sequences: on two pools of 4,096 nodes x 64 GPUs, two tiny
  tasks get a problem of a few replicas (not 262,144 of each config), a MILP whose answer is usable, and a plan
  in a bounded amount of work (it ran past 400 s, CBC's answers unusable, the heuristic filling every GPU).
- ``plan --gpus auto`` over several pools searches the pools' node counts instead of planning (and first
  listing) every combination of them: 4,097 x 4,097 clusters for ``--max-nodes 4096`` grew to 24 GB.

Work is bounded by deterministic counts (``lorafleet.work``, the mixes planned), not by the clock; the
timeouts are only a safety net against the unbounded behaviour.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import yaml

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.errors import SolverFallbackWarning
from lorafleet.planner import Deadline, PlannerOptions, SizingObjective, plan_deployment, size_fleet
from lorafleet.planner.candidates import propose_candidates, valid_candidates
from lorafleet.planner.deployment_ilp import solve_root
from lorafleet.planner.expected import expected_global_batch
from lorafleet.planner.fallback import heuristic_deployment
from lorafleet.planner.problem import build_problem
from lorafleet.work import counting
from lorafleet.workload import load_workload
from tests.helpers.pools import pools_fleet
from tests.helpers.repo import REPO

FAST = PlannerOptions(robust_samples=0, baselines=False, time_limit_s=5.0, search_rounds=1, polish_evaluations=0)
"""Each mix planned by one round of branching and no polish: the sizing test checks which mixes the search plans
and the one it chooses among them, not how good each mix's plan is (3.2x less work than three rounds and a polish,
the same mix chosen)."""

HUGE_POOLS = [
    {"name": "a100", "gpu": "A100-80GB", "nodes": 4096, "gpus_per_node": 64, "price_per_gpu_hour": 1.8},
    {"name": "h100", "gpu": "H100-80GB", "nodes": 4096, "gpus_per_node": 64, "price_per_gpu_hour": 2.5},
]
TINY_TASKS = [
    {
        "name": "chat",
        "lengths": {"mean": 100, "skewness": 1.0, "kurtosis": 3.0},
        "batch_size": 2,
        "context_length": 512,
    },
    {
        "name": "docs",
        "lengths": {"mean": 300, "skewness": 1.0, "kurtosis": 3.0},
        "batch_size": 2,
        "context_length": 1024,
    },
]


@pytest.fixture(scope="module")
def huge(tmp_path_factory):
    """Two tiny tasks (4 sequences a step) on two pools of 4,096 nodes x 64 GPUs."""
    path = tmp_path_factory.mktemp("huge") / "huge.yaml"
    path.write_text(yaml.safe_dump({"model": "smollm2-135m", "cluster": {"pools": HUGE_POOLS}, "tasks": TINY_TASKS}))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    return workload, cluster, workload_cost_model(workload, cluster)


def test_a_huge_fleet_offers_no_more_replicas_than_a_step_has_sequences(huge):
    """The GPU budget of 524,288 GPUs allows 262,144 replicas of a config; 4 sequences use at most 4. The
    budget rows say so, the heuristic stops there, and the MILP's fixed point starts where it has an answer."""
    workload, cluster, cost_model = huge
    expected = expected_global_batch(workload)
    candidates = propose_candidates(valid_candidates(cost_model, cluster), int(expected.lengths.max()))
    problem = build_problem(expected, candidates, cost_model, cluster, PlannerOptions().policy)
    assert len(expected) == 4
    assert problem.max_replicas().max() <= len(expected)
    replicas, _ = heuristic_deployment(problem)
    assert 1 <= replicas.sum() <= len(expected)
    root, solves = solve_root(problem, tie_rel=0.005, solver="cbc", time_limit_s=30)
    assert root is not None, solves[-1].unusable_note("the deployment MILP", "")
    assert root.replicas.sum() <= len(expected)


@pytest.mark.timeout(120)
def test_planning_a_huge_fleet_takes_bounded_work(huge):
    """The whole plan (search, race, baselines) of the tiny workload on the huge fleet: no fallback to the
    heuristic, a plan of at most 4 replicas, and as little work as a one-node fleet's plan."""
    workload, cluster, cost_model = huge
    with counting() as work, warnings.catch_warnings():
        warnings.simplefilter("error", SolverFallbackWarning)
        result = plan_deployment(workload, cluster, cost_model, PlannerOptions())
    assert len(result.plan.replicas) <= 4
    assert all(len(phase.plan.replicas) <= 4 * len(cluster.pools) for b in result.baselines for phase in b.phases)
    assert work["replicas_priced"] <= 5_000 and work["deployments_judged"] <= 200, work.describe()


MIXES_PLANNED = 64
"""The most mixes a sizing over pools may plan (``planner.sizing_pools.MAX_MIXES_PLANNED``)."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """``examples/two-tenants.yaml``'s tasks on 1 node of 8 A100s and 2 nodes of 4 H100s, priced."""
    workload, cluster, _, _ = pools_fleet(tmp_path_factory.mktemp("pools"))
    return workload, cluster


def _sized(workload, cluster, objective, max_nodes):
    """``size_fleet`` with FAST options, failing as soon as it plans more mixes than a search may."""

    def progress(row, planned):
        assert planned <= MIXES_PLANNED, f"planned a {planned}th mix ({row.nodes}): the mixes were not searched"

    return size_fleet(
        workload,
        cluster,
        lambda c: workload_cost_model(workload, c),
        FAST,
        objective,
        max_nodes=max_nodes,
        progress=progress,
    )


def test_a_deadline_over_pools_is_searched_for_not_swept(fleet):
    """Up to 8 nodes of each pool (80 mixes, more than the 64 a sweep plans each of): the cheapest mix found
    that meets a deadline one node of either pool misses, after a few mixes along each pool's chain."""
    workload, cluster = fleet
    one = _sized(workload, cluster, SizingObjective(), 1)  # 3 mixes, every one planned
    deadline = Deadline(1000, 0.9 * min(r.step_s for r in one.rows) * 1000 / 3600)
    sized = _sized(workload, cluster, SizingObjective(deadline=deadline), 8)
    chosen = sized.chosen_row
    assert chosen.meets(sized.objective)
    assert "of the 80 mixes of the pools' nodes planned: a search along 2 chains" in sized.stopped
    # galloping and bisection along 2 chains of J = 16 mixes: at most 2 log2(J) + 1 mixes each
    assert len(sized.rows) <= 2 * (2 * 4 + 1), [r.nodes for r in sized.rows]
    meeting = [r for r in sized.rows if r.meets(sized.objective)]
    assert chosen.cost_per_step == min(r.cost_per_step for r in meeting)


BOUNDED_MEMORY = """
import json, resource, tempfile
from pathlib import Path

from lorafleet.assemble import workload_cost_model
from lorafleet.errors import InputError
from lorafleet.planner import Deadline, PlannerOptions, SizingError, SizingObjective, size_fleet
from lorafleet.planner.sizing_search import candidate_clusters
from tests.helpers.pools import pools_fleet

workload, cluster, _, _ = pools_fleet(Path(tempfile.mkdtemp()))
with open("/proc/self/statm") as f:  # a safety net: 2 GB more than now, a MemoryError where the mixes are listed
    size = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 2 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
out = {}
try:
    candidate_clusters(cluster, 4096)
except InputError as err:
    out["candidates"] = [err.field, err.msg]
try:
    size_fleet(
        workload, cluster, lambda c: workload_cost_model(workload, c), PlannerOptions(robust_samples=0),
        SizingObjective(deadline=Deadline(1000, 1e-6)), max_nodes=4096,
    )
except SizingError as err:
    out["sizing"] = [err.field, err.msg, len(err.sweep.rows)]
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_the_largest_pools_are_searched_in_bounded_memory():
    """``--max-nodes 4096`` on two pools: 16.8 million mixes, which a list of clusters held in 24 GB before
    any was planned. The search lists none (a deadline no mix can meet is refused by the bounds, before any
    planning); ``candidate_clusters``, which lists every one, refuses in one line naming ``max_nodes``. In a
    process of its own, whose memory is capped."""
    run = subprocess.run([sys.executable, "-c", BOUNDED_MEMORY], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    field, msg = out["candidates"]
    assert field == "max_nodes" and "16,785,408 mixes" in msg
    field, msg, rows = out["sizing"]
    assert field == "deadline" and rows == 0
    assert "even every pool whole (49152 GPUs) takes at least" in msg
