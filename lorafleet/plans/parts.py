"""The parts a :class:`~lorafleet.plans.DeploymentPlan` is made of: its replicas (:class:`ReplicaSpec`), its pools
(:class:`PlanPool`), and the typed fields its file writes them with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    ConfigDict,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    PlainSerializer,
    WithJsonSchema,
)
from pydantic_core import core_schema

from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.specs.cluster import describe_pool
from lorafleet.specs.dispatch import DispatchPolicy, policy_json_schema
from lorafleet.specs.field_docs import documented

PLAN_SOURCE = "<plan>"
"""The source an error of a plan's nested policy names while it is validated (replaced by the file's)."""


def _config_of(value: Any) -> Any:
    return ParallelConfig.parse(value) if isinstance(value, str) else value


ConfigName = Annotated[
    ParallelConfig,
    BeforeValidator(_config_of),
    PlainSerializer(lambda c: c.layout.name, return_type=str),
    WithJsonSchema({"type": "string", "description": "a parallel config: tp2_pp1, tp2_pp1_rc"}),
]
"""A replica's parallel config as a plan file writes it, without its pool (the replica's ``pool`` says it):
``tp2_pp1``; :meth:`ParallelConfig.parse` reads any spelling."""


def _policy_of(value: Any) -> Any:
    return value if isinstance(value, DispatchPolicy) else DispatchPolicy.from_json(value, PLAN_SOURCE, "")


PolicyJson = Annotated[
    DispatchPolicy,
    BeforeValidator(_policy_of),
    PlainSerializer(lambda p: p.to_json(), return_type=dict),
    GetPydanticSchema(get_pydantic_json_schema=lambda _core, _handler: policy_json_schema()),  # when asked for
]
"""A dispatch policy as a plan records it (:meth:`DispatchPolicy.to_json`, validated by its ``from_json``)."""


def stage_gpus(gpus: Sequence[int], tp: int, stage: int) -> tuple[int, ...]:
    """The rule of which GPUs a stage holds: a replica of TP degree ``tp`` on ``gpus`` (tp-major within each stage)
    puts pipeline stage ``k`` on ``gpus[k·tp : (k+1)·tp]``, TP rank ``j`` of it on ``gpus[k·tp + j]``."""
    return tuple(gpus[stage * tp : (stage + 1) * tp])


def stage_position(gpus: Sequence[int], tp: int, gpu: int) -> tuple[int, int]:
    """The inverse of :func:`stage_gpus`: the stage and TP rank of ``gpu``, ``divmod(gpus.index(gpu), tp)``."""
    return divmod(gpus.index(gpu), tp)


@dataclass(frozen=True)
class ReplicaSpec:
    """One model replica of the deployment. Its file form is :class:`ReplicaJson` (its config without its pool,
    and the pool beside it); in memory the pool is its config's."""

    replica_id: int
    config: ParallelConfig
    """Its layout on its pool (``config.pool``)."""
    max_tokens: int
    """M: the most tokens (padding included) one micro-batch may hold on this replica."""
    gpus: tuple[int, ...]
    """Global GPU indices (ranks), tp-major within each stage (:func:`stage_gpus`)."""

    @property
    def pool(self) -> str:
        """The pool whose GPUs the replica runs on (empty: the cluster's one unnamed pool): its config's."""
        return self.config.pool

    def stage_gpus(self, stage: int) -> tuple[int, ...]:
        """The GPUs (ranks) of pipeline stage ``stage``, in TP order: ``gpus[stage·tp : (stage+1)·tp]``."""
        return stage_gpus(self.gpus, self.config.tp, stage)

    @property
    def stages(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each of its ``pp`` stages, in stage order (:meth:`stage_gpus`)."""
        return tuple(self.stage_gpus(k) for k in range(self.config.pp))

    @property
    def placement(self) -> tuple[ParallelConfig, tuple[int, ...]]:
        """What makes it the same replica as one of another plan: the same config (its pool included) on the same
        GPUs, in the same order (so every rank holds the same stage and TP shard); its id and M aside."""
        return self.config, self.gpus

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        """Validated and written as its file form, :class:`ReplicaJson`."""
        entry = handler.generate_schema(ReplicaJson)
        return core_schema.no_info_after_validator_function(
            ReplicaJson.spec,
            entry,
            serialization=core_schema.plain_serializer_function_ser_schema(ReplicaJson.of, return_schema=entry),
        )


@dataclass(frozen=True)
class ReplicaJson:
    """One model replica of the deployment, as a plan file records it."""

    __pydantic_config__ = ConfigDict(extra="forbid", title="ReplicaSpec")

    replica_id: int
    config: ConfigName
    max_tokens: int
    gpus: tuple[int, ...]
    pool: str = ""

    @classmethod
    def of(cls, replica: ReplicaSpec) -> ReplicaJson:
        return cls(replica.replica_id, replica.config, replica.max_tokens, replica.gpus, replica.pool)

    def spec(self) -> ReplicaSpec:
        """The replica, its config on ``pool`` (ValueError when the config names another pool)."""
        if self.config.pool not in ("", self.pool):
            raise ValueError(f"replica {self.replica_id}: config {self.config} is on another pool than {self.pool!r}")
        return ReplicaSpec(self.replica_id, self.config.in_pool(self.pool), self.max_tokens, self.gpus)


@dataclass(frozen=True)
class PlanPool:
    """One pool of the cluster a plan is for: its GPUs (global ranks follow the plan's pools in order)
    and the cost model its replicas were judged by."""

    __pydantic_config__ = documented(extra="forbid")

    name: str
    """The cluster's name of the pool (empty: a cluster's one unnamed pool)."""
    gpu: str
    """Its GPU kind."""
    n_gpus: int
    """Its GPUs (the plan may leave some idle)."""
    gpus_per_node: int
    cost_model: CostModelOrigin | None = None
    """The cost model the pool's replicas were judged by (analytic preset, or a profile and its content hash)."""
    price_per_gpu_hour: float | None = None
    """What one of its GPUs cost an hour when the plan was made (the cluster's ``price_per_gpu_hour``); None:
    unpriced."""

    def describe(self) -> str:
        """``16 x A100-40GB (a100)`` (``specs.cluster.describe_pool``)."""
        return describe_pool(self)


@dataclass(frozen=True)
class FrontierPoint:
    """One point of a plan's cost frontier (``plan --objective cost``): a deployment the planner judged on the
    expected batch that no other it judged beats on both step time and cost (``planner.frontier.pareto``)."""

    __pydantic_config__ = documented(extra="forbid")

    makespan_s: float
    """Its expected step time: the dispatcher's estimate on the expected batch."""
    cost_per_step: float
    """What a step costs on it at the pools' prices: the makespan x what its replicas cost a second."""
    gpus: int
    """The GPUs its replicas hold."""
    deployment: str
    """Its replicas, as ``DeploymentPlan.describe`` writes them (``<1,1>@h100 x 4 + <2,2>@h100 x 1``)."""
