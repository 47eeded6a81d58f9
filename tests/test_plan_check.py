"""A plan is a contract: schema v2 round trip, the one plan check, and every command refusing a plan that
cannot run as planned (one line naming the plan file and field, exit 2, nothing written)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import yaml

from lorafleet.assemble import plan_cost_model, prepare_run, workload_cluster, workload_cost_model
from lorafleet.cli import main
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.errors import InputError
from lorafleet.plan_check import check_plan
from lorafleet.planner import PlannerOptions, plan_deployment
from lorafleet.plans import DeploymentPlan, PlanPool, ReplicaSpec
from lorafleet.specs.dispatch import DispatchOptions, DispatchPolicy, MicroBatchMode
from lorafleet.specs.recompute import RecomputePolicy
from lorafleet.workload import load_workload
from tests.helpers.pools import pools_fleet
from tests.helpers.repo import REPO, SMALL_WORKLOAD


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The workload file, its plan (padding mode, so the policy differs from every default) and the plan file."""
    tmp = tmp_path_factory.mktemp("contract")
    path = tmp / "w.yaml"
    path.write_text(yaml.safe_dump(SMALL_WORKLOAD))
    workload = load_workload(path)
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster)
    padded = DispatchPolicy(options=DispatchOptions(microbatch_mode=MicroBatchMode.PADDING))
    result = plan_deployment(workload, cluster, cost_model, PlannerOptions(policy=padded, robust_samples=0))
    result.plan.save(tmp / "plan.json")
    return path, workload, result.plan, tmp / "plan.json"


def test_v4_round_trip_keeps_what_the_plan_was_judged_under(planned):
    _, workload, plan, plan_path = planned
    loaded = DeploymentPlan.load(plan_path)
    assert loaded == plan
    assert loaded.policy.options.microbatch_mode is MicroBatchMode.PADDING
    (pool,) = loaded.pools
    assert pool.name == "" and pool.cost_model.kind == "analytic" and pool.cost_model.gpu == "A100-80GB"
    assert loaded.recompute is workload.spec.recompute
    data = json.loads(plan_path.read_text())
    assert data["schema_version"] == 4 and data["policy"]["microbatch_mode"] == "padding"
    assert {r["pool"] for r in data["replicas"]} == {""}
    assert (data["objective"], data["tie_rel"], data["pools"][0]["price_per_gpu_hour"]) == ("makespan", 0.005, None)


def _as_version_3(data: dict) -> dict:
    """A version-4 plan, planned by the default objective on unpriced pools, as version 3 wrote it."""
    assert (data.pop("objective"), data.pop("tie_rel")) == ("makespan", 0.005)
    for pool in data["pools"]:
        assert pool.pop("price_per_gpu_hour") is None
    return {**data, "schema_version": 3}


def test_a_version_3_plan_loads_as_planned_by_the_defaults(planned, tmp_path):
    """Makespan, the default tolerance, no prices: what every version-3 plan was planned by; the new fields in
    a version-3 file are refused."""
    _, _, plan, plan_path = planned
    old = tmp_path / "v3.json"
    data = _as_version_3(json.loads(plan_path.read_text()))
    old.write_text(json.dumps(data))
    assert DeploymentPlan.load(old) == plan
    for broken, field in (
        ({**data, "objective": "cost"}, "objective"),
        ({**data, "pools": [{**data["pools"][0], "price_per_gpu_hour": 1.0}]}, "pools[0].price_per_gpu_hour"),
    ):
        old.write_text(json.dumps(broken))
        with pytest.raises(InputError, match=rf"v3.json: {re.escape(field)}: unknown field \(a version-4 plan's\)"):
            DeploymentPlan.load(old)


def _as_version_2(data: dict) -> dict:
    """A version-4 plan of one unnamed pool, planned by the defaults, as version 2 wrote it."""
    data = _as_version_3(data)
    (pool,) = data.pop("pools")
    for replica in data["replicas"]:
        assert replica.pop("pool") == ""
    return {**data, "schema_version": 2, **{k: pool[k] for k in ("gpu", "n_gpus", "gpus_per_node", "cost_model")}}


def test_a_version_2_plan_loads_as_one_unnamed_pool(planned, tmp_path):
    _, workload, plan, plan_path = planned
    old = tmp_path / "v2.json"
    old.write_text(json.dumps(_as_version_2(json.loads(plan_path.read_text()))))
    assert DeploymentPlan.load(old) == plan
    run = prepare_run(workload, workload_cluster(workload), str(old))
    assert run.plan == plan
    data = json.loads(old.read_text())
    del data["gpus_per_node"]
    old.write_text(json.dumps(data))
    with pytest.raises(InputError, match="v2.json: gpus_per_node: missing"):
        DeploymentPlan.load(old)


def test_version_1_is_refused_naming_the_field(planned, tmp_path):
    _, _, _, plan_path = planned
    data = _as_version_2(json.loads(plan_path.read_text()))
    data["schema_version"] = 1
    for key in ("policy", "cost_model", "recompute"):
        data.pop(key)
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(data))
    with pytest.raises(InputError, match="schema_version: a version-1 plan does not record the dispatch policy"):
        DeploymentPlan.load(old)
    data["schema_version"] = 2
    old.write_text(json.dumps(data))
    with pytest.raises(InputError, match="v1.json: policy: missing"):
        DeploymentPlan.load(old)


@pytest.mark.parametrize(
    "edit,field,words",
    [
        (lambda d: d["replicas"][0].update(gpus=["x"]), "replicas[0].gpus[0]", "whole number"),
        (lambda d: d["replicas"][0].update(max_tokens=2.5), "replicas[0].max_tokens", "whole number"),
        (lambda d: d["replicas"][0].update(config="banana"), "replicas[0].config", "not a parallel config"),
        (lambda d: d["replicas"][0].update(colour="red"), "replicas[0].colour", "unknown field"),
        (lambda d: d.update(expected_makespan_s="fast"), "expected_makespan_s", "number"),
        (lambda d: d.update(extra=1), "extra", "unknown field"),
        (lambda d: d["policy"].update(n_buckets="8"), "policy.n_buckets", "whole number"),
        (lambda d: d["policy"]["recalibration"].update(bound=0.5), "policy.recalibration.bound", ">= 1"),
        (lambda d: d["policy"].update(shuffle=True), "policy.shuffle", "unknown field"),
        (lambda d: d["pools"][0]["cost_model"].update(kind="guessed"), "pools[0].cost_model", "analytic or profile"),
        (lambda d: d["pools"][0]["cost_model"].update(colour="red"), "pools[0].cost_model.colour", "unknown field"),
        (lambda d: d["pools"][0].update(n_gpus=True), "pools[0].n_gpus", "whole number, got a boolean True"),
        (lambda d: d["pools"][0].update(n_gpus=8.0), "pools[0].n_gpus", "whole number, got a number 8.0"),
        (lambda d: d["policy"]["recalibration"].update(enabled=1), "policy.recalibration.enabled", "true or false"),
        (lambda d: d["replicas"][0].update(pool=7), "replicas[0].pool", "string"),
        (lambda d: d.pop("pools"), "pools", "missing"),
        (lambda d: d.update(objective="cheapest"), "objective", "makespan"),
        (lambda d: d.update(tie_rel=1.5), "tie_rel", "[0, 1)"),
        (lambda d: d.pop("tie_rel"), "tie_rel", "missing"),
        (lambda d: d["pools"][0].update(price_per_gpu_hour=-1.0), "pools[0].price_per_gpu_hour", ">= 0"),
        (lambda d: d["pools"][0].update(price_per_gpu_hour=1e308), "pools[0].price_per_gpu_hour", "at most"),
    ],
)
def test_a_broken_plan_file_names_the_field_path(planned, tmp_path, edit, field, words):
    """The plan file is read through its typed model, strictly: one line naming the file and the field path."""
    _, _, _, plan_path = planned
    data = json.loads(plan_path.read_text())
    edit(data)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    with pytest.raises(InputError) as err:
        DeploymentPlan.load(broken)
    assert err.value.path == str(broken) and err.value.field == field and words in err.value.msg, str(err.value)


def test_the_plan_schema_validates_a_plan_the_planner_wrote(planned):
    import jsonschema

    from lorafleet.commands.schema import SCHEMAS

    _, _, _, plan_path = planned
    jsonschema.Draft202012Validator(SCHEMAS["plan"]()).validate(json.loads(plan_path.read_text()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMAS["plan"]()).validate({**json.loads(plan_path.read_text()), "x": 1})


def _replica(plan: DeploymentPlan, k: int, **change) -> DeploymentPlan:
    replicas = list(plan.replicas)
    replicas[k] = replace(replicas[k], **change)
    return replace(plan, replicas=tuple(replicas))


def _pool(plan: DeploymentPlan, **change) -> DeploymentPlan:
    return replace(plan, pools=(replace(plan.pools[0], **change),))


def _broken(plan: DeploymentPlan):
    """(name, broken plan, field, words in the message): one per rule of plan_check."""
    first = plan.replicas[0]
    two = next(r for r in plan.replicas if r.config.n_gpus >= 1)
    yield "tasks", replace(plan, tasks=plan.tasks[::-1]), "tasks", "the plan is for tasks"
    yield "model", replace(plan, model="llama2-13b"), "model", "'llama2-13b'"
    yield "gpu", _pool(plan, gpu="H100-80GB"), "pools[0].gpu", "H100-80GB"
    yield "per node", _pool(plan, gpus_per_node=4), "pools[0].gpus_per_node", "4 GPUs per node"
    yield "recompute", replace(plan, recompute=RecomputePolicy.ON), "recompute", "recompute: on"
    yield "too many gpus", _pool(plan, n_gpus=16), "pools[0].n_gpus", "16 GPUs"
    yield "pool", _pool(plan, name="h100"), "pools[0].name", "the plan has pool 'h100', the cluster has not"
    yield (
        "replica pool",
        _replica(plan, 0, config=first.config.in_pool("h100")),
        "replicas[0].pool",
        "no pool 'h100'",
    )
    yield "ids", _replica(plan, 0, replica_id=5), "replicas[0].replica_id", "has id 5"
    yield (
        "gpu count",
        _replica(plan, 0, config=ParallelConfig(first.config.tp * 2, first.config.pp)),
        "replicas[0].gpus",
        "GPUs, the replica holds",
    )
    yield (
        "duplicate",
        _replica(plan, 1, gpus=first.gpus[:1] + plan.replicas[1].gpus[1:]),
        "replicas[1].gpus",
        f"GPU {first.gpus[0]} is also in replica 0",
    )
    yield "range", _replica(plan, 0, gpus=(99,) + first.gpus[1:]), "replicas[0].gpus", "GPU 99 is outside"
    yield "max tokens", _replica(plan, 0, max_tokens=10**9), "replicas[0].max_tokens", "holds at most"
    yield (
        "illegal tp",
        _replica(plan, 0, config=ParallelConfig(3, 1), gpus=(0, 1, 2)),
        "replicas[0].config",
        "tp=3 does not divide",
    )
    yield "buckets", replace(plan, bucket_boundaries=(512, 256, 8192)), "bucket_boundaries", "strictly increasing"
    yield "coverage", replace(plan, bucket_boundaries=(512, 1024)), "bucket_boundaries", "does not cover"
    yield (
        "holder",
        replace(plan, replicas=tuple(replace(r, max_tokens=1000) for r in plan.replicas)),
        "replicas",
        "no replica holds task",
    )
    del two


def test_every_rule_names_its_field(planned):
    _, workload, plan, plan_path = planned
    cluster = workload_cluster(workload)
    cost_model, _ = plan_cost_model(workload, cluster, plan, str(plan_path))
    check_plan(plan, workload, cluster, cost_model, "plan.json")  # the real plan passes
    for name, broken, field, words in _broken(plan):
        with pytest.raises(InputError) as err:
            check_plan(broken, workload, cluster, cost_model, "plan.json")
        assert err.value.path == "plan.json" and err.value.field == field, name
        assert words in err.value.msg, (name, err.value.msg)


def test_a_tp_group_across_nodes_is_refused(planned):
    _, workload, _, _ = planned
    cluster = workload_cluster(workload, gpus=16)
    cost_model = workload_cost_model(workload, cluster)
    config = ParallelConfig(2, 1)
    plan = DeploymentPlan(
        model="llama2-7b",
        pools=(PlanPool(name="", gpu="A100-80GB", n_gpus=16, gpus_per_node=8),),
        tasks=("chat", "docs"),
        replicas=(ReplicaSpec(0, config, 4096, (7, 8)),),
        bucket_boundaries=(8192,),
        expected_makespan_s=1.0,
        recompute=workload.spec.recompute,
    )
    with pytest.raises(InputError, match="spans nodes"):
        check_plan(plan, workload, cluster, cost_model, "p")


@pytest.mark.parametrize("name", ["tasks", "model", "gpu", "too many gpus", "duplicate", "gpu count"])
@pytest.mark.parametrize("command", ["simulate", "dispatch", "train"])
def test_commands_refuse_a_plan_before_any_work(planned, tmp_path, capsys, command, name):
    path, _, plan, _ = planned
    broken, field, _ = next((b, f, w) for n, b, f, w in _broken(plan) if n == name)
    bad = tmp_path / "bad.json"
    broken.save(bad)
    out = tmp_path / "out"
    extra = {
        "simulate": ["--report", str(out)],
        "dispatch": ["--json", str(out / "d.json")],
        "train": ["--out", str(out)],
    }
    argv = [command, str(path), "--plan", str(bad), *extra[command]]
    if command == "train":  # training needs data; the plan is checked after the workload
        argv[1] = str(_with_data(path, tmp_path))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"bad.json: {field}:" in err
    assert not out.exists()


def _with_data(path, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": "a b c d " * (k + 3)}) + "\n" for k in range(8)))
    data = yaml.safe_load(path.read_text())
    for task in data["tasks"]:
        task["data"] = {"path": str(rows)}
    out = tmp_path / "with-data.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_the_plans_policy_runs_by_default_and_a_flag_says_it_overrides(planned, capsys):
    path, workload, plan, plan_path = planned
    run = prepare_run(workload, workload_cluster(workload), str(plan_path))
    assert run.plan.policy == plan.policy and run.overrides == ()
    assert main(["dispatch", str(path), "--plan", str(plan_path)]) == 0
    printed = capsys.readouterr().out
    assert "override" not in printed and "padding, R=16" in printed
    assert main(["dispatch", str(path), "--plan", str(plan_path), "--microbatch", "packing", "--no-recalibrate"]) == 0
    printed = capsys.readouterr().out
    assert (
        "override: policy packing, R=16, alignment 16, fast, not recalibrated, pipeline window 8 "
        "(overriding the plan's: padding" in printed
    )
    assert main(["dispatch", str(path), "--plan", str(plan_path), "--pipeline-window", "1"]) == 0
    printed = capsys.readouterr().out
    assert "override: policy padding, R=16, alignment 16, fast, recalibrated, pipeline window 1 (overriding" in printed
    run = prepare_run(workload, workload_cluster(workload), str(plan_path), policy_overrides={"pipeline_window": 1})
    assert run.plan.policy.pipeline_window == 1
    assert main(["dispatch", str(path), "--plan", str(plan_path), "--pipeline-window", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--pipeline-window: must be >= 1 step, got 0")


def test_a_plan_without_a_window_was_judged_flushed_every_step(planned, tmp_path):
    """A schema-2 plan written before the window existed records no ``pipeline_window``: it was judged
    under 1F1B flushed every step, so it reads (and is priced) as W = 1, not as today's default."""
    _, workload, _, plan_path = planned
    data = json.loads(plan_path.read_text())
    assert data["policy"]["pipeline_window"] == 8
    del data["policy"]["pipeline_window"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    run = prepare_run(workload, workload_cluster(workload), str(old))
    assert run.plan.policy.pipeline_window == 1


def test_simulate_plan_runs_the_plan_as_made(planned, capsys):
    path, _, plan, plan_path = planned
    assert main(["simulate", str(path), "--plan", str(plan_path), "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"plan: {plan.describe()}" in printed and "padding, R=16" in printed
    assert main(["simulate", str(path), "--microbatch", "packing"]) == 2
    assert "--plan: policy flags" in capsys.readouterr().err


def test_profile_plans_record_their_file_and_refuse_a_changed_one(tmp_path, capsys):
    from tests.helpers.repo import REPO

    profile = tmp_path / "tiny.json"
    profile.write_bytes((REPO / "profiles" / "tiny-llama-cpu.json").read_bytes())
    work = tmp_path / "w.yaml"
    work.write_text(
        yaml.safe_dump(
            {
                "model": "tiny-llama",
                "cluster": {"gpu": "cpu", "nodes": 1, "gpus_per_node": 4},
                "tasks": [{"name": "a", "lengths": {"values": [100, 900]}, "batch_size": 8, "context_length": 1024}],
            }
        )
    )
    plan = tmp_path / "plan.json"
    assert main(["plan", str(work), "--profile", str(profile), "--json", str(plan), "--samples", "0"]) == 0
    assert "lower bound of the expected step" in capsys.readouterr().out
    recorded = DeploymentPlan.load(plan).pools[0].cost_model
    assert recorded.kind == "profile" and recorded.profile == str(profile) and len(recorded.sha256) == 64
    assert main(["simulate", str(work), "--plan", str(plan), "--steps", "1"]) == 0
    capsys.readouterr()
    profile.write_text(profile.read_text().replace('"command"', '"command" ', 1))
    assert main(["simulate", str(work), "--plan", str(plan), "--steps", "1"]) == 2
    assert "plan.json: pools[0].cost_model.sha256: " in capsys.readouterr().err
    assert main(["simulate", str(work), "--plan", str(plan), "--steps", "1", "--profile", str(profile)]) == 0
    assert "override: cost model profile:" in capsys.readouterr().out
    profile.unlink()
    assert main(["dispatch", str(work), "--plan", str(plan)]) == 2
    assert "plan.json: pools[0].cost_model.profile: " in capsys.readouterr().err


# --- pools (#29) --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    return pools_fleet(tmp_path_factory.mktemp("pools"))


def test_a_plan_on_two_pools_passes_and_round_trips(pools, tmp_path):
    workload, cluster, cost_model, plan = pools
    check_plan(plan, workload, cluster, cost_model, "p")
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert [(r["config"], r["pool"]) for r in data["replicas"]] == [
        ("tp2_pp1", "a100"),
        ("tp2_pp1", "h100"),
        ("tp1_pp1", "h100"),
        ("tp2_pp2", "h100"),
    ]
    assert [(p["name"], p["cost_model"]["gpu"]) for p in data["pools"]] == [
        ("a100", "A100-40GB"),
        ("h100", "H100-80GB"),
    ]
    loaded = DeploymentPlan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.replicas[3].config == ParallelConfig(2, 2, pool="h100")
    assert plan.describe() == "<2,1>@a100 x 1 + <1,1>@h100 x 1 + <2,1>@h100 x 1 + <2,2>@h100 x 1"
    assert plan.pool_gpus() == {"a100": 2, "h100": 7}
    assert plan.describe_fleet() == "8 x A100-40GB (a100) + 8 x H100-80GB (h100)"
    # the same config prices differently on each pool: the H100's model
    a100, h100 = ParallelConfig(1, 1, pool="a100"), ParallelConfig(1, 1, pool="h100")
    assert cost_model.microbatch_time(h100, 4, 1024) < cost_model.microbatch_time(a100, 4, 1024)
    assert cost_model.max_tokens(h100) > cost_model.max_tokens(a100)


def _pools_broken(plan: DeploymentPlan):
    """(name, broken plan, field, words): the pool rules."""
    h100 = plan.pools[1]
    yield (
        "pool missing from the cluster",
        replace(plan, pools=(plan.pools[0], replace(h100, name="b200"))),
        "pools[1].name",
        "the cluster has not",
    )
    yield (
        "kind mismatch",
        replace(plan, pools=(plan.pools[0], replace(h100, gpu="A100-80GB"))),
        "pools[1].gpu",
        "a kind mismatch",
    )
    yield "pool order", replace(plan, pools=plan.pools[::-1]), "pools[1].name", "not in the cluster's order"
    yield (
        "more gpus",
        replace(plan, pools=(plan.pools[0], replace(h100, n_gpus=12))),
        "pools[1].n_gpus",
        "needs 12 GPUs in pool 'h100'",
    )
    yield (
        "unknown pool",
        _replica(plan, 2, config=ParallelConfig(1, 1, pool="l40s")),
        "replicas[2].pool",
        "no pool 'l40s'",
    )
    yield (
        "gpus of another pool",
        _replica(plan, 2, gpus=(3,)),
        "replicas[2].gpus",
        "GPU 3 is not pool 'h100''s: its GPUs are 8..15",
    )
    yield (
        "across a pool's nodes",
        _replica(plan, 3, gpus=(11, 12, 13, 14)),
        "replicas[3].gpus",
        "spans nodes [0, 1] of pool 'h100'",
    )


def test_every_pool_rule_names_its_field(pools):
    workload, cluster, cost_model, plan = pools
    for name, broken, field, words in _pools_broken(plan):
        with pytest.raises(InputError) as err:
            check_plan(broken, workload, cluster, cost_model, "plan.json")
        assert err.value.field == field and words in err.value.msg, (name, str(err.value))


def test_simulate_refuses_a_plan_on_a_pool_of_another_kind(pools, tmp_path, capsys):
    """The kind mismatch as a command meets it: one line, exit 2, before the plan's cost model is built."""
    workload, _, _, plan = pools
    _, broken, field, _ = next(b for b in _pools_broken(plan) if b[0] == "kind mismatch")
    broken.save(tmp_path / "bad.json")
    assert main(["simulate", workload.path, "--plan", str(tmp_path / "bad.json"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"bad.json: {field}: the plan is for A100-80GB GPUs in pool 'h100'" in err


def test_lobras_published_2_8_at_8k_passes_the_plan_check(tmp_path):
    """#29: LobRA's 7B experiment ran <2,8> at 8K tokens a micro-batch on A100-40GB (its Appendix Table 9);
    the plan check refused it while the memory model held 8,029 tokens there."""
    workload = load_workload(REPO / "examples" / "lobra-7b.yaml")
    cluster = workload_cluster(workload)
    cost_model = workload_cost_model(workload, cluster)
    (pool,) = cluster.pools
    plan = DeploymentPlan(
        model="llama2-7b",
        pools=(PlanPool(pool.name, pool.gpu, pool.n_gpus, pool.gpus_per_node, cost_model.origin),),
        tasks=tuple(t.name for t in workload.tasks),
        replicas=(ReplicaSpec(0, ParallelConfig(2, 8), 8192, tuple(range(16))),),
        bucket_boundaries=(8192, workload.max_length),
        expected_makespan_s=10.6,
        recompute=workload.spec.recompute,
    )
    longest = workload.max_length
    with pytest.raises(InputError, match="no replica holds task"):  # 16K sequences need another replica
        check_plan(plan, workload, cluster, cost_model, "p")
    workload = load_workload(REPO / "examples" / "lobra-7b.yaml", ["defaults.context_length=8192"])
    plan = replace(plan, bucket_boundaries=(8192,))
    check_plan(plan, workload, cluster, cost_model, "p")
    assert longest > 8192
