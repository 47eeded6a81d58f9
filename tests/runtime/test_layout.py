"""Degrees arithmetic and gradient-sum pieces, without any process group."""

from __future__ import annotations

import pytest

from lorafleet.executor.torch.grad_sync import AdapterParam, holder_sets, sync_pieces
from lorafleet.executor.torch.groups import ordered_rank_sets
from lorafleet.executor.torch.window import microbatch_seed
from lorafleet.runtime.layout import FleetLayout, ModelDims, ReplicaLayout, layer_of
from tests.helpers import fleet_harness as h

DIMS = ModelDims(n_layers=4, n_heads=4, n_kv_heads=2, ffn=176)


@pytest.mark.parametrize(
    "layers,pp,expected",
    [
        (4, 2, [range(0, 2), range(2, 4)]),
        (5, 2, [range(0, 3), range(3, 5)]),
        (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
        (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
    ],
)
def test_stage_layers_are_a_balanced_contiguous_split(layers, pp, expected):
    replica = ReplicaLayout(0, 1, pp, tuple(range(pp)), layers)
    assert [replica.stage_layers(k) for k in range(pp)] == expected
    assert [replica.stage_of_layer(i) for i in range(layers)] == [k for k, r in enumerate(expected) for _ in r]


def test_roles_of_a_tp2_pp2_replica():
    fleet = FleetLayout.of(h.plan_of((1, 1), (2, 2)), DIMS, world_size=6)
    # replica 1 on ranks 1..4: stage 0 = (1, 2), stage 1 = (3, 4)
    role = fleet.role(4)
    assert (role.replica.replica_id, role.stage, role.tp_rank) == (1, 1, 1)
    assert role.prev_rank == 2 and role.next_rank is None and role.is_last_stage
    assert fleet.role(2).next_rank == 4 and fleet.role(2).prev_rank is None
    assert list(fleet.role(1).layers) == [0, 1] and list(role.layers) == [2, 3]
    assert fleet.role(5) is None  # idle
    # a stage's TP ranks share their micro-batch seeds (window.microbatch_seed), the stages and replicas do not
    assert [fleet.role(r).stage_leader for r in range(5)] == [0, 1, 1, 3, 3]
    seeds = [microbatch_seed(7, 2, fleet.role(r).stage_leader, 0) for r in range(5)]
    assert seeds[1] == seeds[2] and seeds[3] == seeds[4] and len(set(seeds)) == 3


@pytest.mark.parametrize(
    "replicas,world,message",
    [
        (((4, 1),), 4, "does not divide the model's 2 KV heads"),
        (((1, 5),), 5, "exceeds the model's 4 layers"),
        (((1, 1), (2, 1)), 2, "outside the world"),
    ],
)
def test_layout_errors_name_the_replica_and_degree(replicas, world, message):
    with pytest.raises(ValueError, match=message):
        FleetLayout.of(h.plan_of(*replicas), DIMS, world)


def test_layer_of():
    assert layer_of("model.layers.12.self_attn.q_proj") == 12
    with pytest.raises(ValueError):
        layer_of("lm_head")


def _param(module: str, factor: str, shape, dim):
    return AdapterParam(0, module, factor, shape, dim)


def test_pieces_of_a_heterogeneous_fleet():
    """tp1 (rank 0) + tp2 (ranks 1,2) + tp2 x pp2 (ranks 3..6): each block of a sharded matrix is
    held once per replica; a replicated matrix by every TP rank of the stage holding its layer."""
    fleet = FleetLayout.of(h.plan_of((1, 1), (2, 1), (2, 2)), DIMS, world_size=7)
    sharded = _param("model.layers.3.self_attn.q_proj", "lora_B", (64, 4), 0)  # column: B split on outputs
    replicated = _param("model.layers.0.self_attn.q_proj", "lora_A", (4, 64), None)  # column: A whole
    pieces = sync_pieces(fleet, [sharded, replicated])
    blocks = [(p.start, p.stop, p.holders) for p in pieces if p.param is sharded]
    assert blocks == [(0, 32, (0, 1, 5)), (32, 64, (0, 2, 6))]  # layer 3 is on stage 1 (ranks 5, 6)
    (whole,) = [p for p in pieces if p.param is replicated]
    assert (whole.start, whole.stop, whole.holders) == (0, 4, (0, 1, 2, 3, 4))
    assert holder_sets(pieces) == [(0, 1, 2, 3, 4), (0, 1, 5), (0, 2, 6)]


def test_pieces_cut_at_every_replicas_boundary():
    """tp2 and tp4 replicas of a 176-wide matrix: blocks of 44, each with one holder per replica."""
    dims = ModelDims(n_layers=2, n_heads=4, n_kv_heads=4, ffn=176)
    fleet = FleetLayout.of(h.plan_of((2, 1), (4, 1)), dims, world_size=6)
    pieces = sync_pieces(fleet, [_param("model.layers.0.mlp.down_proj", "lora_A", (4, 176), 1)])
    assert [(p.start, p.stop) for p in pieces] == [(0, 44), (44, 88), (88, 132), (132, 176)]
    assert [p.holders for p in pieces] == [(0, 2), (0, 3), (1, 4), (1, 5)]


def test_group_creation_order_is_deterministic_and_deduplicated():
    fleet = FleetLayout.of(h.plan_of((2, 1)), DIMS, world_size=2)
    pieces = sync_pieces(fleet, [_param("model.layers.0.mlp.up_proj", "lora_A", (4, 64), None)])
    # The replicated A's holder set has the TP group's ranks, but a group of its own: the update
    # thread sums gradients on it while the main thread's TP collectives run.
    assert ordered_rank_sets(fleet, holder_sets(pieces) * 2) == ([(0, 1)], [(0, 1)])
