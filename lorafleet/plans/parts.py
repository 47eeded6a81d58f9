"""The parts a :class:`~lorafleet.plans.DeploymentPlan` is made of: its replicas (:class:`ReplicaSpec`), its pools
(:class:`PlanPool`), and the typed fields its file writes them with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, PlainSerializer, WithJsonSchema

from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.specs.dispatch import DispatchPolicy, policy_json_schema

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
    WithJsonSchema(policy_json_schema()),
]
"""A dispatch policy as a plan records it (:meth:`DispatchPolicy.to_json`, validated by its ``from_json``)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """One model replica of the deployment."""

    __pydantic_config__ = ConfigDict(extra="forbid")

    replica_id: int
    config: ConfigName
    """Its layout; in memory it names the replica's pool too (``config.pool == pool``)."""
    max_tokens: int
    """M: the most tokens (padding included) one micro-batch may hold on this replica."""
    gpus: tuple[int, ...]
    """Global GPU indices (ranks), tp-major within each stage: stage k holds gpus[k*tp:(k+1)*tp]."""
    pool: str = ""
    """The pool whose GPUs the replica runs on (empty: the cluster's one unnamed pool)."""

    def __post_init__(self) -> None:
        """The config and the replica name one pool: either given, the other follows."""
        if self.config.pool == self.pool:
            return
        if self.config.pool and self.pool:
            raise ValueError(f"replica {self.replica_id}: config {self.config} is on another pool than {self.pool!r}")
        if self.pool:
            object.__setattr__(self, "config", self.config.in_pool(self.pool))
        else:
            object.__setattr__(self, "pool", self.config.pool)


@dataclass(frozen=True)
class PlanPool:
    """One pool of the cluster a plan is for: its GPUs (global ranks follow the plan's pools in order)
    and the cost model its replicas were judged by."""

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
        """``16 x A100-40GB`` (with the pool's name when it has one: ``16 x A100-40GB (a100)``)."""
        return f"{self.n_gpus} x {self.gpu}" + (f" ({self.name})" if self.name else "")
