"""#29: a rank refuses a device that is not its pool's GPU kind (on CPU the kind is ``cpu``): rank 0 says so in
one line naming the rank, its pool and the device found; the other ranks exit 2 without a word."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lorafleet.executor.torch.launch as launch
from lorafleet.errors import InputError
from lorafleet.executor.torch.launch import check_device_kinds, device_kind
from lorafleet.plans import PlanPool
from tests.helpers import fleet_harness as h

CPU = torch.device("cpu")
A100 = ("A100-40GB", "NVIDIA A100-SXM4-40GB (39.4 GiB)")


def _world(monkeypatch, rank: int, devices: list[tuple[str | None, str]]) -> None:
    """This process as ``rank`` of a world whose ranks found ``devices`` (no process group needed)."""
    monkeypatch.setattr(launch.dist, "get_world_size", lambda: len(devices))
    monkeypatch.setattr(launch.dist, "get_rank", lambda: rank)

    def gather(out: list, mine: object) -> None:
        assert mine == device_kind(CPU)
        out[:] = devices

    monkeypatch.setattr(launch.dist, "all_gather_object", gather)


def test_a_cpu_is_of_kind_cpu():
    assert device_kind(CPU) == ("cpu", "cpu")


def test_ranks_on_their_pools_kinds_pass(monkeypatch):
    pools = (PlanPool("cpu", "cpu", 1, 1), PlanPool("a100", "A100-40GB", 1, 1))
    plan = replace(h.plan_of((1, 1), (1, 1)), pools=pools)
    _world(monkeypatch, 0, [("cpu", "cpu"), A100])
    check_device_kinds(plan, CPU, "plan.json")


def test_a_gpu_kind_plan_on_cpu_is_refused_by_rank_0(monkeypatch):
    _world(monkeypatch, 0, [("cpu", "cpu")])
    with pytest.raises(InputError) as err:
        check_device_kinds(h.plan_of((1, 1), gpu="A100-40GB"), CPU, "plan.json")
    assert err.value.field == "pools[0].gpu"
    assert "rank 0 is in the cluster of A100-40GB GPUs, but its device is cpu" in err.value.msg
    assert "(--gpu cpu)" in err.value.msg


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pools_node_of_another_kind_names_the_pool_and_the_device(monkeypatch, rank):
    """Rank 1 is in pool h100 but found an A100 (its node joined in another pool's place): rank 0 names it,
    rank 1 itself exits 2 without a word."""
    pools = (PlanPool("cpu", "cpu", 1, 1), PlanPool("h100", "H100-80GB", 1, 1))
    plan = replace(h.plan_of((1, 1), (1, 1)), pools=pools)
    _world(monkeypatch, rank, [("cpu", "cpu"), A100])
    if rank == 1:
        with pytest.raises(SystemExit) as quiet:
            check_device_kinds(plan, CPU, "plan.json")
        assert quiet.value.code == 2
        return
    with pytest.raises(InputError) as err:
        check_device_kinds(plan, CPU, "plan.json")
    assert err.value.field == "pools[1].gpu"
    assert err.value.msg.startswith(
        "rank 1 is in pool 'h100' of H100-80GB GPUs, but its device is NVIDIA A100-SXM4-40GB (39.4 GiB): "
        "start each pool's nodes in the plan's pool order"
    )
