"""A cluster of several GPU kinds (#29): ``cluster: {pools: [...]}``, the flat one-pool shorthand, bad pools
as one line and exit 2, the command-line flags on a cluster of several pools, and the rank layout."""

from __future__ import annotations

import pytest
import yaml

from lorafleet.assemble import workload_cluster, workload_cost_model
from lorafleet.cli import main
from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec, PoolSpec, pool_at
from lorafleet.specs.gpus import CPU_STAGE_LOAD_GBPS, GPU_PRESETS, NODE_STAGE_LOAD_GBPS
from lorafleet.workload import load_workload
from tests.helpers.repo import REPO

TASKS = [{"name": "a", "preset": "dolly"}]
POOLS = [
    {"name": "a100", "gpu": "A100-40GB", "nodes": 2, "gpus_per_node": 8, "price_per_gpu_hour": 1.3},
    {"name": "h100", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 4, "price_per_gpu_hour": 2.5},
]


def write(tmp_path, cluster, name="w.yaml", **top):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": "llama2-7b", "cluster": cluster, "tasks": TASKS, **top}, sort_keys=False))
    return path


def test_pools_and_their_rank_layout(tmp_path):
    cluster = load_workload(write(tmp_path, {"pools": POOLS})).cluster
    assert cluster.pool_names == ("a100", "h100")
    assert cluster.n_gpus == 20 and cluster.first_gpu("h100") == 16
    assert cluster.kinds == ("A100-40GB", "H100-80GB") and cluster.priced
    assert cluster.describe() == "16 x A100-40GB (a100) + 4 x H100-80GB (h100)"
    # ranks number pool after pool: a100's 0-15, then h100's 16-19
    assert [pool_at(cluster.pools, g)[0] for g in (0, 15, 16, 19)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="outside 0..19"):
        pool_at(cluster.pools, 20)
    with pytest.raises(ValueError, match="no one GPU kind"):
        _ = cluster.gpu


def test_the_flat_shorthand_is_one_unnamed_pool_and_is_written_back_flat(tmp_path):
    flat = {"gpu": "a100-40gb", "nodes": 2, "gpus_per_node": 8}
    spec = load_workload(write(tmp_path, flat)).spec
    assert spec.cluster.pools == (PoolSpec(name="", gpu="A100-40GB", nodes=2, gpus_per_node=8),)
    assert (spec.cluster.gpu, spec.cluster.n_gpus, spec.cluster.gpus_per_node) == ("A100-40GB", 16, 8)
    dumped = spec.model_dump(mode="json", exclude_none=True)["cluster"]
    assert dumped == {"gpu": "A100-40GB", "nodes": 2, "gpus_per_node": 8}
    assert ClusterSpec.model_validate(dumped) == spec.cluster
    one = load_workload(write(tmp_path, {"pools": [{"gpu": "cpu", "gpus_per_node": 2}]})).cluster
    assert one.pool_names == ("",) and one.gpu == "cpu"  # one pool of a list may go unnamed too


@pytest.mark.parametrize(
    ("cluster", "field", "words"),
    [
        ({"pools": [POOLS[0], {**POOLS[1], "name": "a100"}]}, "cluster.pools[1].name", "'a100' appears twice"),
        ({"pools": [POOLS[0], {**POOLS[1], "name": ""}]}, "cluster.pools[1].name", "needs a name"),
        ({"pools": [POOLS[0], {**POOLS[1], "gpu": "B200"}]}, "cluster.pools[1].gpu", "unknown GPU 'B200'"),
        ({"pools": [{**POOLS[0], "price_per_gpu_hour": -1}]}, "cluster.pools[0].price_per_gpu_hour", "or equal to 0"),
        ({"pools": [{**POOLS[0], "price_per_gpu_hour": ".nan"}]}, "cluster.pools[0].price_per_gpu_hour", "finite"),
        ({"pools": [{**POOLS[0], "price_per_gpu_hour": ".inf"}]}, "cluster.pools[0].price_per_gpu_hour", "finite"),
        ({"pools": [{**POOLS[0], "price_per_gpu_hour": 1e308}]}, "cluster.pools[0].price_per_gpu_hour", "at most"),
        ({"pools": [{**POOLS[0], "name": "a b"}]}, "cluster.pools[0].name", "not a valid pool name"),
        ({"pools": []}, "cluster.pools", "at least one pool"),
        ({"pools": POOLS, "gpu": "A100-40GB"}, "cluster", "not both"),
        ({"gpu": "A100-40GB", "nodes": 0}, "cluster.nodes", "greater than 0"),
        ({"gpu": "A100-40GB", "price_per_gpu_hour": "cheap"}, "cluster.price_per_gpu_hour", "number"),
        ({"gpu": "A100-40GB", "stage_load_gbps": 0}, "cluster.stage_load_gbps", "greater than 0"),
        ({"pools": [{**POOLS[0], "stage_load_gbps": -2}]}, "cluster.pools[0].stage_load_gbps", "greater than 0"),
        (8, "cluster", "takes a mapping with keys: gpu, nodes, gpus_per_node"),
    ],
)
def test_a_bad_pool_is_one_line_naming_its_field(tmp_path, capsys, cluster, field, words):
    text = yaml.safe_dump({"model": "llama2-7b", "cluster": cluster, "tasks": TASKS}).replace("'.nan'", ".nan")
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("'.inf'", ".inf"))
    with pytest.raises(InputError) as err:
        load_workload(path)
    assert err.value.field == field and words in err.value.msg, str(err.value)
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{field}:" in lines[0]


def test_a_profile_of_another_kind_names_the_pools_field(tmp_path, capsys):
    """The shipped CPU profile given to an H100 pool: one line naming the pool's field, exit 2."""
    profile = REPO / "profiles" / "tiny-llama-cpu.json"
    pools = [
        {"name": "cpu", "gpu": "cpu", "gpus_per_node": 2},
        {"name": "h100", "gpu": "H100-80GB", "profile": str(profile)},
    ]
    path = write(tmp_path, {"pools": pools}, model="tiny-llama")
    workload = load_workload(path)
    with pytest.raises(InputError) as err:
        workload_cost_model(workload, workload.cluster)
    assert err.value.path == str(path) and err.value.field == "cluster.pools[1].profile"
    assert "profile is for 'cpu'" in err.value.msg and "H100-80GB" in err.value.msg
    assert main(["plan", str(path)]) == 2
    assert "cluster.pools[1].profile:" in capsys.readouterr().err


def test_a_pools_profile_is_relative_to_the_workload_and_prices_only_that_pool(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "cpu.json").write_bytes((REPO / "profiles" / "tiny-llama-cpu.json").read_bytes())
    pools = [{"name": "measured", "gpu": "cpu", "gpus_per_node": 2, "profile": "profiles/cpu.json"},
             {"name": "datasheet", "gpu": "cpu", "gpus_per_node": 2}]  # fmt: skip
    workload = load_workload(write(tmp_path, {"pools": pools}, model="tiny-llama"))
    assert workload.cluster.pool("measured").profile == str(tmp_path / "profiles" / "cpu.json")
    cm = workload_cost_model(workload, workload.cluster)
    origins = cm.origins()
    assert origins["measured"].kind == "profile" and origins["datasheet"].kind == "analytic"
    assert {c.pool for c in cm.configs} == {"measured", "datasheet"}


@pytest.mark.parametrize(("flags", "flag"), [({"gpus": 8}, "--gpus"), ({"gpu": "H100-80GB"}, "--gpu")])
def test_gpu_flags_on_several_pools_point_at_set(tmp_path, flags, flag):
    workload = load_workload(write(tmp_path, {"pools": POOLS}))
    with pytest.raises(InputError) as err:
        workload_cluster(workload, **flags)
    assert err.value.field == flag and "--set cluster.pools.NAME." in err.value.msg
    with pytest.raises(InputError, match="cluster.pools"):
        workload_cost_model(workload, workload.cluster, profile=REPO / "profiles" / "tiny-llama-cpu.json")


def test_gpu_flags_change_a_one_pool_cluster_keeping_its_name_price_and_load_rate(tmp_path):
    workload = load_workload(write(tmp_path, {"pools": [{**POOLS[1], "stage_load_gbps": 0.5}]}))
    cluster = workload_cluster(workload, gpus=8, gpu="A100-80GB")
    kept = {"price_per_gpu_hour": 2.5, "stage_load_gbps": 0.5}
    assert cluster.pools == (PoolSpec(name="h100", gpu="A100-80GB", nodes=2, gpus_per_node=4, **kept),)


def test_a_pools_stage_load_rate_is_its_own_else_its_gpu_kinds():
    """Every GPU preset loads a stage at the node's NVMe rate, the ``cpu`` preset at this machine's measured one."""
    assert {g.stage_load_gbps for name, g in GPU_PRESETS.items() if name != "cpu"} == {NODE_STAGE_LOAD_GBPS}
    assert PoolSpec(gpu="H100-80GB").stage_load_bytes_per_s == NODE_STAGE_LOAD_GBPS * 1e9 == 2e9
    assert PoolSpec(gpu="cpu").stage_load_bytes_per_s == CPU_STAGE_LOAD_GBPS * 1e9 == 3.3e8
    assert PoolSpec(gpu="H100-80GB", stage_load_gbps=0.1).stage_load_bytes_per_s == 1e8


def test_set_changes_one_pool_by_name(tmp_path):
    path = write(tmp_path, {"pools": POOLS})
    cluster = load_workload(path, ["cluster.pools.h100.nodes=3", "cluster.pools.a100.price_per_gpu_hour=1.0"]).cluster
    assert cluster.pool("h100").nodes == 3 and cluster.pool("a100").price_per_gpu_hour == 1.0
    with pytest.raises(InputError, match="--set cluster.pools.b200.nodes: no item named 'b200'"):
        load_workload(path, ["cluster.pools.b200.nodes=1"])
