"""The deployment a planner writes: :class:`DeploymentPlan` (which replicas of which config, on which GPUs, and the
dispatch policy and cost model it was judged under), and its versioned file."""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.errors import InputError
from lorafleet.plans.parts import PLAN_SOURCE, FrontierPoint, PlanPool, PolicyJson, ReplicaSpec
from lorafleet.specs.cluster import ClusterSpec, PoolSpec, first_gpu, named_pool, pool_at, price_too_large
from lorafleet.specs.dispatch import DispatchPolicy
from lorafleet.specs.field_docs import documented
from lorafleet.specs.io import read_json_object, write_text_atomic
from lorafleet.specs.objective import TIE_REL, PlanObjective
from lorafleet.specs.recompute import RecomputePolicy
from lorafleet.specs.typed import adapter, join_path, validate_strict

PLAN_SCHEMA_VERSION = 4
"""2 adds what a plan was judged under: ``policy``, ``cost_model`` and ``recompute``. A version-1
file does not say which micro-batches (padded or packed) or which cost model its figures
assume, so it is refused rather than guessed at (re-run ``lorafleet plan --json``). 3 has
``pools`` (each with its GPU kind, GPUs and cost model) where 2 had one ``gpu``, ``n_gpus``,
``gpus_per_node`` and ``cost_model``, and each replica's ``pool``; a version-2 file is read as a
plan of one unnamed pool (:func:`_from_version_2`). 4 records what the plan was planned for: the
planner's ``objective`` and ``tie_rel``, and each pool's ``price_per_gpu_hour``, which every re-plan of it
honours (``PlannerOptions.replanning``); a version-3 (or 2) file is read as planned by the defaults: the
makespan objective, ``TIE_REL``, pools without a price (:func:`_from_version_3`)."""
PLAN_KIND = "lorafleet.DeploymentPlan"
_REQUIRED = {
    2: ("policy", "cost_model", "recompute"),
    3: ("policy", "pools", "recompute"),
    PLAN_SCHEMA_VERSION: ("policy", "pools", "recompute", "objective", "tie_rel"),
}
"""The fields a plan file of each schema version it may have must hold (the rest have defaults)."""
_UNSET: dict[str, Any] = {"max_step_s": None, "max_step_cost": None, "cost_frontier": []}
"""Fields a plan file holds only when set (their JSON when unset): what the cost objective records."""


@dataclass(frozen=True)
class DeploymentPlan:
    """How many replicas of which config, where they sit, and what the planner expects of them.

    Its file (:meth:`save`, :meth:`load`; ``lorafleet schema plan``) is this dataclass as JSON, typed
    field by field (a pydantic adapter, strict: no unknown key, no string for a number), with
    ``schema_version`` and ``kind`` beside the fields.
    """

    __pydantic_config__ = documented(extra="forbid")

    model: str
    """The base model the plan is for."""
    pools: tuple[PlanPool, ...]
    """The pools of the cluster the plan is for, in rank order: pool p holds the GPUs after those of the
    pools before it."""
    tasks: tuple[str, ...]
    """The workload's tasks, in order."""
    replicas: tuple[ReplicaSpec, ...]
    bucket_boundaries: tuple[int, ...]
    """Planning buckets (ascending upper lengths) the expected dispatch was computed on."""
    expected_makespan_s: float
    """Expected step time: the slowest replica under the expected balanced dispatch."""
    solver: str = ""
    """Which back end produced the plan, and its status (``cbc:optimal``, ``heuristic``, ...)."""
    notes: tuple[str, ...] = ()
    """Human-readable remarks (idle GPUs and why, fallbacks, pruning)."""
    expected_replica_time_s: tuple[float, ...] = ()
    """Expected step time of each replica, in ``replicas`` order."""
    policy: PolicyJson = field(default_factory=DispatchPolicy)
    """How every step of this deployment is dispatched: what the plan was judged under, and what
    ``simulate``, ``dispatch`` and ``train`` run unless told otherwise."""
    recompute: RecomputePolicy = RecomputePolicy.AUTO
    """The workload's activation-recomputation policy the configs were chosen under."""
    objective: PlanObjective = PlanObjective.MAKESPAN
    """The objective the planner chose the plan by (``plan --objective``), which a re-plan chooses by too."""
    tie_rel: float = TIE_REL
    """The makespan tolerance it chose by (``plan --makespan-tolerance``; ``PlannerOptions.tie_rel``)."""
    max_step_s: float | None = None
    """The step-time limit the cost objective chose within (``plan --step-limit``, ``--deadline``;
    ``PlannerOptions.max_step_s``), which a re-plan keeps; None: none. Written only when set."""
    max_step_cost: float | None = None
    """The step-cost cap the cost objective chose within, currency units a step at the pools' prices (``plan
    --max-cost``: its amount over the job's steps; ``PlannerOptions.max_step_cost``), which a re-plan keeps; None:
    none. Written only when set."""
    cost_frontier: tuple[FrontierPoint, ...] = ()
    """Under the cost objective, the cheapest deployments the planner judged at each step time, fastest first
    (``PlanResult.frontier``): what the report plots. Written only when there are some."""

    @property
    def prices(self) -> tuple[tuple[str, float], ...]:
        """``(pool, price per GPU-hour)`` of each of its pools that has a price (``PlannerOptions.prices``)."""
        return tuple((p.name, p.price_per_gpu_hour) for p in self.pools if p.price_per_gpu_hour is not None)

    @property
    def n_gpus(self) -> int:
        """GPUs of the plan's pools (the plan may leave some idle)."""
        return sum(p.n_gpus for p in self.pools)

    def pool(self, name: str) -> PlanPool:
        """The plan's pool ``name`` (KeyError when it has none)."""
        return named_pool(self.pools, name)

    def pool_at(self, gpu: int) -> tuple[int, PlanPool]:
        """The index and pool of global GPU (rank) ``gpu`` (ValueError when no pool of the plan has it)."""
        return pool_at(self.pools, gpu)

    def first_gpu(self, name: str) -> int:
        """The first global GPU index (rank) of the plan's pool ``name``."""
        return first_gpu(self.pools, name)

    @property
    def cost_models(self) -> dict[str, CostModelOrigin | None]:
        """The cost model each pool was judged by, by pool name."""
        return {p.name: p.cost_model for p in self.pools}

    def fleet(self) -> ClusterSpec:
        """The cluster of the plan's pools (their GPUs in whole nodes; no profiles, and no prices: a re-plan is
        given the plan's, :attr:`prices`, in its options)."""
        return ClusterSpec(
            pools=tuple(
                PoolSpec(name=p.name, gpu=p.gpu, nodes=-(-p.n_gpus // p.gpus_per_node), gpus_per_node=p.gpus_per_node)
                for p in self.pools
            )
        )

    def describe_fleet(self) -> str:
        """``16 x A100-40GB``, or ``16 x A100-40GB (a100) + 8 x H100-80GB (h100)``."""
        return " + ".join(p.describe() for p in self.pools)

    @property
    def used_gpus(self) -> int:
        return sum(r.config.n_gpus for r in self.replicas)

    def pool_gpus(self) -> dict[str, int]:
        """GPUs the replicas hold in each of the plan's pools (0 for an idle pool), by pool name."""
        held = dict.fromkeys((p.name for p in self.pools), 0)
        for r in self.replicas:
            held[r.pool] = held.get(r.pool, 0) + r.config.n_gpus
        return held

    @property
    def world_size(self) -> int:
        """Processes a training run of the plan needs: one per rank it names (idle ranks included)."""
        return max(g for r in self.replicas for g in r.gpus) + 1

    @property
    def expected_gpu_seconds(self) -> float:
        """GPU-seconds per step: every allocated GPU is held for the whole makespan."""
        return self.expected_makespan_s * self.used_gpus

    def config_counts(self) -> dict[ParallelConfig, int]:
        """Replicas per config, sorted by pool (in the plan's order), then config."""
        order = {p.name: k for k, p in enumerate(self.pools)}
        counts = Counter(r.config for r in self.replicas)
        return dict(sorted(counts.items(), key=lambda item: (order.get(item[0].pool, len(order)), item[0])))

    def describe(self) -> str:
        """``<1,1> x 6 + <2,1> x 1 + <8,1> x 1``; in a fleet of named pools ``<1,2>@a100 x 3 + <2,1>@h100 x 2``."""
        return " + ".join(f"{c} x {n}" for c, n in self.config_counts().items())

    @property
    def placements(self) -> tuple[tuple[ParallelConfig, tuple[int, ...]], ...]:
        """Each replica's :attr:`ReplicaSpec.placement` (its config on its GPUs), in replica order: two plans of
        equal placements run the same replicas in the same order (a recalibrator's or a dispatcher's state holds)."""
        return tuple(r.placement for r in self.replicas)

    def same_deployment(self, other: DeploymentPlan) -> bool:
        """Whether ``other`` runs this plan's replicas, each the same replica (:attr:`ReplicaSpec.placement`),
        whatever their order: moving from one to the other rebuilds nothing."""
        return set(self.placements) == set(other.placements)

    def replica_ids_in(self, other: DeploymentPlan) -> tuple[int | None, ...]:
        """For each of this plan's replicas, in order, the id of the same replica (:attr:`ReplicaSpec.placement`)
        in ``other``; None where ``other`` has none (a replica new to, or torn down from, ``other``)."""
        ids = {r.placement: r.replica_id for r in other.replicas}
        return tuple(ids.get(r.placement) for r in self.replicas)

    @property
    def largest_max_tokens(self) -> int:
        """The largest M of its replicas (0 without replicas): a sequence longer than it fits no replica."""
        return max((r.max_tokens for r in self.replicas), default=0)

    def holds(self, length: int) -> bool:
        """Whether a sequence of ``length`` tokens fits some replica: ``length <= max_r M_r``."""
        return length <= self.largest_max_tokens

    @property
    def loop_window(self) -> int:
        """The steps a window of the step loop runs (``lorafleet.loop.run_loop``'s ``window``, every caller's): the
        policy's ``pipeline_window`` W when a replica is pipelined (pp > 1), else 1. Only a pipelined replica
        streams across a step boundary (``Executor.run_steps``: a window's steps without a drain between them);
        without one a window of one step loses nothing, and each step is reported (its log line, its
        recalibration: the next step is dispatched at the speeds it measured) as it ends."""
        pipelined = any(r.config.pp > 1 for r in self.replicas)
        return self.policy.pipeline_window if pipelined else 1

    def to_json(self) -> dict[str, Any]:
        """The plan file's object: every field (typed as the adapter dumps it), its schema version and kind. The
        cost objective's ``max_step_s``, ``max_step_cost`` and ``cost_frontier`` are left out when unset, so a plan
        of another objective writes what it wrote before they were added."""
        data = adapter(DeploymentPlan).dump_python(self, mode="json")
        for name, unset in _UNSET.items():
            if data.get(name) == unset:
                del data[name]
        return {**data, **_header()}

    def save(self, path: str | Path) -> None:
        """Write atomically: a reader never sees half a plan (an InputError when ``path`` is unwritable)."""
        write_text_atomic(path, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str, where: str = "") -> DeploymentPlan:
        """The plan of a plan file's object (``to_json``); an InputError names ``source`` and the field path
        (``replicas[3].gpus``) when it is not one, an unknown key too."""
        data = dict(data)
        at = functools.partial(join_path, where)
        if data.pop("kind", None) != PLAN_KIND:
            raise InputError(source, at("kind"), "not a lorafleet deployment plan")
        version = data.pop("schema_version", None)
        if version == 1:
            raise InputError(
                source,
                at("schema_version"),
                "a version-1 plan does not record the dispatch policy and cost model "
                f"it was judged under; re-run `lorafleet plan --json` to write a version-{PLAN_SCHEMA_VERSION} plan",
            )
        if version not in _REQUIRED:
            raise InputError(
                source, at("schema_version"), f"expected {PLAN_SCHEMA_VERSION} (or 3 or 2), got {version!r}"
            )
        for name in _REQUIRED[version]:
            if name not in data:
                raise InputError(source, at(name), "missing")
        if version == 2:
            data = _from_version_2(data, source, at)
        if version in (2, 3):
            data = _from_version_3(data, source, at)
        try:
            plan = validate_strict(cls, data, source, where)
        except InputError as err:
            if err.path != PLAN_SOURCE:
                raise
            raise InputError(source, at(join_path("policy", err.field)), err.msg) from None
        if not (np.isfinite(plan.expected_makespan_s) and plan.expected_makespan_s >= 0):
            raise InputError(
                source, at("expected_makespan_s"), f"must be a finite number >= 0, got {plan.expected_makespan_s}"
            )
        if not 0 <= plan.tie_rel < 1:
            raise InputError(source, at("tie_rel"), f"must be in [0, 1), got {plan.tie_rel}")
        for k, pool in enumerate(plan.pools):
            if pool.price_per_gpu_hour is not None and not pool.price_per_gpu_hour >= 0:
                raise InputError(
                    source, at(f"pools[{k}].price_per_gpu_hour"), f"must be >= 0, got {pool.price_per_gpu_hour}"
                )
            if pool.price_per_gpu_hour is not None and price_too_large(pool.price_per_gpu_hour):
                raise InputError(source, at(f"pools[{k}].price_per_gpu_hour"), price_too_large(pool.price_per_gpu_hour))
        return plan

    @classmethod
    def load(cls, path: str | Path) -> DeploymentPlan:
        """Read a plan JSON; an InputError names the file and field when it is not one."""
        return cls.from_json(read_json_object(path), str(path))


def _from_version_2(data: dict[str, Any], source: str, at: Any) -> dict[str, Any]:
    """A version-2 plan's object as version 3: its ``gpu``, ``n_gpus``, ``gpus_per_node`` and ``cost_model``
    are its one pool's, unnamed (what a flat ``cluster`` is), and every replica is on it."""
    pool = {}
    for name in ("gpu", "n_gpus", "gpus_per_node", "cost_model"):
        if name not in data:
            raise InputError(source, at(name), "missing")
        pool[name] = data.pop(name)
    if "pools" in data:
        raise InputError(source, at("pools"), "unknown field (pools are a version-3 plan's)")
    return {**data, "pools": [{"name": "", **pool}]}


def _from_version_3(data: dict[str, Any], source: str, at: Any) -> dict[str, Any]:
    """A version-3 plan's object as version 4: planned by the defaults (its ``objective`` and ``tie_rel`` left
    out, its pools without a price); either field in a version-3 file is refused, as unknown."""
    for name in ("objective", "tie_rel"):
        if name in data:
            raise InputError(source, at(name), "unknown field (a version-4 plan's)")
    for k, pool in enumerate(data.get("pools", ())):
        if isinstance(pool, dict) and "price_per_gpu_hour" in pool:
            raise InputError(source, at(f"pools[{k}].price_per_gpu_hour"), "unknown field (a version-4 plan's)")
    return data


def _header() -> dict[str, Any]:
    return {"schema_version": PLAN_SCHEMA_VERSION, "kind": PLAN_KIND}


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file (``lorafleet schema plan``), generated from :class:`DeploymentPlan`."""
    schema = adapter(DeploymentPlan).json_schema(mode="serialization")
    schema["properties"]["schema_version"] = {"const": PLAN_SCHEMA_VERSION}
    schema["properties"]["kind"] = {"const": PLAN_KIND}
    required = {*schema.get("required", ()), "schema_version", "kind", *_REQUIRED[PLAN_SCHEMA_VERSION]}
    schema["required"] = sorted(required)
    return schema
