"""The micro-batch knee: a CPU's tokens past K cost 1 + ρ times as much, and the planner's M stops at K."""

from __future__ import annotations

import pytest

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.costmodel import AdapterLoad, ParallelConfig, analytic_cost_model
from lorafleet.costmodel.microbatch_size import MicroBatchKnee
from lorafleet.costmodel.time_model import LayerTimeCoeffs, MicroBatchShape
from lorafleet.errors import InputError
from lorafleet.plan_check import check_plan
from lorafleet.planner.candidates import valid_candidates
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec
from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.gpus import CPU_KNEE_PENALTY, GPU_PRESETS
from lorafleet.specs.lora import LoraSpec
from lorafleet.specs.model import MODEL_PRESETS
from lorafleet.workload import load_workload

SMOLLM2 = MODEL_PRESETS["smollm2-135m"]
CPU = ClusterSpec(gpu="cpu", nodes=1, gpus_per_node=2)
#: bench_sweep's 3 x 3 grid: ranks 4, 8 and 16 at three learning rates.
SWEEP = AdapterLoad.from_specs([LoraSpec(rank=r, alpha=16) for r in (4, 8, 16) * 3])
PLAIN = ParallelConfig(1, 1)


@pytest.fixture(scope="module")
def cpu_model():
    return analytic_cost_model(SMOLLM2, CPU, SWEEP)


def test_the_cpu_plans_smollm2_at_its_knee_not_its_memory(cpu_model):
    """K = 3 GiB over each config's bytes a token: the plan's M, where the memory model alone gave 14,189."""
    chosen = {str(c): (cpu_model.max_tokens(c), cpu_model.memory_tokens(c)) for c in cpu_model.configs}
    assert chosen == {
        "<1,1>": (2039, 14189),
        "<1,1,rc>": (5593, 38907),
        "<1,2>": (2958, 20867),
        "<1,2,rc>": (5843, 41212),
    }
    assert {c.max_tokens for c in valid_candidates(cpu_model, CPU)} == {2039, 5593, 2958, 5843}


def test_gpu_presets_have_no_knee():
    assert all(g.microbatch_knee_gib is None for name, g in GPU_PRESETS.items() if name != "cpu")
    cm = analytic_cost_model(MODEL_PRESETS["llama2-7b"], ClusterSpec(gpu="A100-40GB", gpus_per_node=8), SWEEP)
    assert not cm.knees and all(cm.max_tokens(c) == cm.memory_tokens(c) for c in cm.configs)


def test_a_token_past_the_knee_costs_one_plus_rho(cpu_model):
    """τ' = τ + ρ c3 max(0, S − K) in every pricing call; at or below K, exactly the LobRA form."""
    stage = cpu_model.stage_coeffs(PLAIN)
    knee = cpu_model.knees[PLAIN].tokens
    small, large = MicroBatchShape.packed([128] * 15), MicroBatchShape.packed([128] * 47)  # 1,920 and 6,016 tokens
    assert cpu_model.shape_time(PLAIN, small) == stage.shape(small) / 1e3
    excess = CPU_KNEE_PENALTY * stage.c[2] * (6016 - knee) / 1e3
    assert cpu_model.shape_time(PLAIN, large) == pytest.approx(stage.shape(large) / 1e3 + excess, rel=1e-12)
    assert cpu_model.packed_microbatch_time(PLAIN, [128] * 47) == cpu_model.shape_time(PLAIN, large)
    assert cpu_model.microbatch_time(PLAIN, 1, 6016) == pytest.approx(float(stage(1, 6016)) / 1e3 + excess)
    one = cpu_model.replica_time(PLAIN, [large])
    three = cpu_model.replica_time(PLAIN, [MicroBatchShape.packed([128] * 16)] * 2 + [small])  # 6,016 tokens
    assert round(one, 3) == 79.288 and round(three, 3) == 60.273  # one micro-batch: 1.32x the time of three


@pytest.mark.parametrize(("c6", "expected"), [(10.0, 2048), (100.0, 14189)])
def test_the_knee_caps_m_only_where_a_token_costs_least_there(c6, expected):
    """ρ c3 K = 0.5 * 0.05 * 2048 = 51.2 ms: above c6 the time a token rises past K; below, bigger is cheaper."""
    stage = LayerTimeCoeffs((0.0, 0.0, 0.05, 0.0, 0.0, c6))
    assert MicroBatchKnee(2048, 0.5).efficient_tokens(stage, 14189) == expected
    assert MicroBatchKnee(2048, 0.5).efficient_tokens(stage, 1000) == 1000


def test_a_plan_past_the_knee_is_slower_not_wrong(tmp_path):
    """The plan check holds a plan's M to the memory limit: a CPU plan made before the knee (M at that limit) still
    runs."""
    path = tmp_path / "w.yaml"
    path.write_text(
        "model: smollm2-135m\ncluster: {gpu: cpu, nodes: 1, gpus_per_node: 1}\n"
        "tasks: [{name: a, lengths: {values: [100, 300]}, batch_size: 4, context_length: 384}]\n"
    )
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster)
    memory = cost_model.memory_tokens(PLAIN)
    assert cost_model.max_tokens(PLAIN) < memory

    def plan(m: int) -> DeploymentPlan:
        return DeploymentPlan(
            model=SMOLLM2.name,
            pools=(PlanPool("", "cpu", 1, 1),),
            tasks=("a",),
            replicas=(ReplicaSpec(0, PLAIN, m, (0,)),),
            bucket_boundaries=(384,),
            expected_makespan_s=0.0,
        )

    check_plan(plan(memory), workload, cluster, cost_model, "plan.json")
    with pytest.raises(InputError, match="holds at most"):
        check_plan(plan(memory + 1), workload, cluster, cost_model, "plan.json")
