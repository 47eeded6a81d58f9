"""Degrees arithmetic: which rank holds which replica, pipeline stage, TP shard and layers.

Pure and validated, with no process group (torchtitan's ``ParallelDims``), so it is tested
on its own and every rank derives the same answers from the same :class:`DeploymentPlan`.

A replica with degrees ``(tp, pp)`` on ranks ``gpus`` puts stage ``k`` on
``gpus[k*tp:(k+1)*tp]`` (TP rank ``j`` of stage ``k`` is ``gpus[k*tp + j]``; the plan's rule,
:func:`lorafleet.plans.parts.stage_gpus`). Its ``L`` decoder layers are split into ``pp``
contiguous runs, the first ``L mod pp`` one layer longer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lorafleet.plans import DeploymentPlan
from lorafleet.plans.parts import stage_gpus, stage_position

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(module_name: str) -> int:
    """The decoder layer a module belongs to: ``model.layers.3.mlp.up_proj`` -> 3."""
    match = _LAYER.search(module_name)
    if match is None:
        raise ValueError(f"{module_name!r} is not inside a decoder layer")
    return int(match.group(1))


@dataclass(frozen=True)
class ModelDims:
    """The dimensions that constrain how a model can be split."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int

    @classmethod
    def of(cls, hf_config) -> ModelDims:
        """From a transformers config (Llama, Qwen2, Mistral)."""
        return cls(
            n_layers=hf_config.num_hidden_layers,
            n_heads=hf_config.num_attention_heads,
            n_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
            ffn=hf_config.intermediate_size,
        )


@dataclass(frozen=True)
class ReplicaLayout:
    """One replica's ranks, stages and layer split."""

    replica_id: int
    tp: int
    pp: int
    gpus: tuple[int, ...]
    n_layers: int
    recompute: bool = False
    """Activation recomputation: every block keeps its input only and re-runs in the backward."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"replica {self.replica_id}: tp={self.tp} and pp={self.pp} must be >= 1")
        if len(self.gpus) != self.tp * self.pp:
            raise ValueError(
                f"replica {self.replica_id}: tp*pp = {self.tp * self.pp} but {len(self.gpus)} gpus {self.gpus}"
            )
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"replica {self.replica_id}: gpus {self.gpus} repeat a rank")
        if self.pp > self.n_layers:
            raise ValueError(f"replica {self.replica_id}: pp={self.pp} exceeds the model's {self.n_layers} layers")

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The TP ranks of one stage, in TP order (``plans.parts.stage_gpus``)."""
        return stage_gpus(self.gpus, self.tp, stage)

    def stage_of_rank(self, rank: int) -> int:
        return stage_position(self.gpus, self.tp, rank)[0]

    def tp_rank(self, rank: int) -> int:
        return stage_position(self.gpus, self.tp, rank)[1]

    def stage_layers(self, stage: int) -> range:
        """Layers of ``stage``: a balanced contiguous split, the first ``L mod pp`` stages one longer."""
        base, extra = divmod(self.n_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def stage_of_layer(self, layer: int) -> int:
        for stage in range(self.pp):
            if layer in self.stage_layers(stage):
                return stage
        raise ValueError(f"layer {layer} is not in a model of {self.n_layers} layers")

    def layer_ranks(self, layer: int) -> tuple[int, ...]:
        """The TP ranks that hold ``layer``."""
        return self.stage_ranks(self.stage_of_layer(layer))

    def peer(self, rank: int, stage: int) -> int:
        """The rank with the same TP rank as ``rank`` in ``stage`` (its pipeline neighbour)."""
        return self.stage_ranks(stage)[self.tp_rank(rank)]


@dataclass(frozen=True)
class RankRole:
    """What one rank does: its replica, stage and TP rank."""

    rank: int
    replica: ReplicaLayout
    stage: int
    tp_rank: int

    @property
    def stage_leader(self) -> int:
        """The first TP rank of this rank's stage (this rank itself at TP 1): what the stage's ranks share."""
        return self.replica.stage_ranks(self.stage)[0]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.replica.pp - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.replica.peer(self.rank, self.stage - 1)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.replica.peer(self.rank, self.stage + 1)

    @property
    def layers(self) -> range:
        return self.replica.stage_layers(self.stage)


@dataclass(frozen=True)
class FleetLayout:
    """Every replica of a deployment plan over a world of ``world_size`` ranks."""

    replicas: tuple[ReplicaLayout, ...]
    world_size: int

    def __post_init__(self) -> None:
        used = [g for r in self.replicas for g in r.gpus]
        if len(set(used)) != len(used):
            raise ValueError(f"a rank is in two replicas: {sorted(g for g in used if used.count(g) > 1)}")
        outside = [g for g in used if not 0 <= g < self.world_size]
        if outside:
            raise ValueError(f"ranks {outside} are outside the world of {self.world_size} processes")
        ids = [r.replica_id for r in self.replicas]
        if ids != list(range(len(ids))):
            raise ValueError(f"replica ids must be 0..{len(ids) - 1} in order, got {ids}")

    @classmethod
    def of(cls, plan: DeploymentPlan, dims: ModelDims, world_size: int) -> FleetLayout:
        """The layout of ``plan``; ValueError naming the replica and degree that cannot split the model."""
        replicas = []
        for spec in plan.replicas:
            tp = spec.config.tp
            for what, n in (("attention heads", dims.n_heads), ("KV heads", dims.n_kv_heads), ("FFN width", dims.ffn)):
                if n % tp:
                    raise ValueError(f"replica {spec.replica_id}: tp={tp} does not divide the model's {n} {what}")
            replicas.append(
                ReplicaLayout(
                    spec.replica_id, tp, spec.config.pp, tuple(spec.gpus), dims.n_layers, spec.config.recompute
                )
            )
        return cls(tuple(replicas), world_size)

    def role(self, rank: int) -> RankRole | None:
        """The role of ``rank``; None for a rank the plan leaves idle."""
        for replica in self.replicas:
            if rank in replica.gpus:
                return RankRole(rank, replica, replica.stage_of_rank(rank), replica.tp_rank(rank))
        return None
