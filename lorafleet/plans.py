"""The typed objects every stage passes on: DeploymentPlan, GlobalBatch, StepPlan, StepReport.

- The planner writes a :class:`DeploymentPlan` (which replicas of which config, on which
  GPUs, and the dispatch policy and cost model it was judged under); ``simulate``,
  ``dispatch`` and ``train`` read it back from versioned JSON and check it
  (:mod:`lorafleet.plan_check`) before any work.
- Each step, dispatch turns a :class:`GlobalBatch` into a :class:`StepPlan`: every sequence
  assigned to one replica and one micro-batch, rows contiguous by task.
- An executor runs the StepPlan and returns a :class:`StepReport`.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import BeforeValidator, ConfigDict, PlainSerializer, WithJsonSchema

from lorafleet.costmodel.cost_model import CostModelOrigin
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.errors import InputError
from lorafleet.specs.cluster import ClusterSpec, PoolSpec, first_gpu, named_pool, pool_at
from lorafleet.specs.dispatch import DispatchPolicy, policy_json_schema
from lorafleet.specs.io import read_json_object, write_text_atomic
from lorafleet.specs.recompute import RecomputePolicy
from lorafleet.specs.typed import adapter, join_path, validate_strict

PLAN_SCHEMA_VERSION = 3
"""2 adds what a plan was judged under: ``policy``, ``cost_model`` and ``recompute``. A version-1
file does not say which micro-batches (padded or packed) or which cost model its figures
assume, so it is refused rather than guessed at (re-run ``lorafleet plan --json``). 3 has
``pools`` (each with its GPU kind, GPUs and cost model) where 2 had one ``gpu``, ``n_gpus``,
``gpus_per_node`` and ``cost_model``, and each replica's ``pool``; a version-2 file is read as a
plan of one unnamed pool (:func:`_from_version_2`)."""
PLAN_KIND = "lorafleet.DeploymentPlan"
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

    def describe(self) -> str:
        """``16 x A100-40GB`` (with the pool's name when it has one: ``16 x A100-40GB (a100)``)."""
        return f"{self.n_gpus} x {self.gpu}" + (f" ({self.name})" if self.name else "")


@dataclass(frozen=True)
class DeploymentPlan:
    """How many replicas of which config, where they sit, and what the planner expects of them.

    Its file (:meth:`save`, :meth:`load`; ``lorafleet schema plan``) is this dataclass as JSON, typed
    field by field (a pydantic adapter, strict: no unknown key, no string for a number), with
    ``schema_version`` and ``kind`` beside the fields.
    """

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
        """The cluster of the plan's pools (their GPUs in whole nodes; no prices or profiles)."""
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

    def to_json(self) -> dict[str, Any]:
        """The plan file's object: every field (typed as the adapter dumps it), its schema version and kind."""
        return {**adapter(DeploymentPlan).dump_python(self, mode="json"), **_header()}

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
        if version not in (2, PLAN_SCHEMA_VERSION):
            raise InputError(source, at("schema_version"), f"expected {PLAN_SCHEMA_VERSION} (or 2), got {version!r}")
        for name in ("policy", "cost_model", "recompute") if version == 2 else ("policy", "pools", "recompute"):
            if name not in data:
                raise InputError(source, at(name), "missing")
        if version == 2:
            data = _from_version_2(data, source, at)
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


def _header() -> dict[str, Any]:
    return {"schema_version": PLAN_SCHEMA_VERSION, "kind": PLAN_KIND}


def plan_json_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file (``lorafleet schema plan``), generated from :class:`DeploymentPlan`."""
    schema = adapter(DeploymentPlan).json_schema(mode="serialization")
    schema["properties"]["schema_version"] = {"const": PLAN_SCHEMA_VERSION}
    schema["properties"]["kind"] = {"const": PLAN_KIND}
    schema["required"] = sorted({*schema.get("required", ()), "schema_version", "kind", "policy", "recompute"})
    return schema


@dataclass(frozen=True)
class GlobalBatch:
    """One step's sequences, all tasks together; sequence i is (task_ids[i], sample_ids[i], lengths[i])."""

    step: int
    task_ids: np.ndarray
    """Index into the workload's tasks, per sequence (int64)."""
    sample_ids: np.ndarray
    """Which sample of its task's data stream (int64): what the torch executor loads."""
    lengths: np.ndarray
    """Token length after the task's overflow policy (int64)."""
    truncated: int = 0
    """Sequences cut to their context length to build this batch."""
    rejected: int = 0
    """Sequences dropped (and replaced by the next sample) for exceeding their context length."""

    def __len__(self) -> int:
        return int(self.lengths.size)


@dataclass(frozen=True)
class MicroBatch:
    """Sequences one replica processes together, ordered so each task's rows are contiguous."""

    seq_ids: tuple[int, ...]
    """Positions in the step's GlobalBatch."""
    task_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    padded_len: int | None
    """Every row padded to this length; ``None`` when the sequences are packed end to end."""

    @property
    def tokens(self) -> int:
        """Tokens the micro-batch occupies, padding included (what must fit in M)."""
        return self.padded_len * len(self.lengths) if self.padded_len is not None else sum(self.lengths)

    @property
    def padding_tokens(self) -> int:
        return self.tokens - sum(self.lengths)

    @property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """``(task_id, first_row, n_rows)`` per contiguous run of one task's sequences."""
        runs: list[tuple[int, int, int]] = []
        for row, task in enumerate(self.task_ids):
            if runs and runs[-1][0] == task:
                runs[-1] = (task, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((task, row, 1))
        return tuple(runs)

    @property
    def shape(self) -> MicroBatchShape:
        return MicroBatchShape(seq_lens=self.lengths, padded_len=self.padded_len)


@dataclass(frozen=True)
class ReplicaWork:
    """One replica's share of a step."""

    replica_id: int
    microbatches: tuple[MicroBatch, ...]
    estimated_time_s: float


@dataclass(frozen=True)
class StepPlan:
    """Every sequence of one global batch placed on a replica and in a micro-batch."""

    step: int
    bucket_boundaries: tuple[int, ...]
    work: tuple[ReplicaWork, ...]
    """One entry per replica of the deployment, in replica order (possibly with no micro-batches)."""
    estimated_makespan_s: float
    method: str = ""
    """Dispatch method and status (``lpt``, ``milp:optimal``, ``milp-timeout->lpt``)."""
    solve_s: float = 0.0
    """Wall time spent computing this plan (bucketing, assignment, micro-batches)."""
    truncated: int = 0
    rejected: int = 0
    speed: tuple[float, ...] = ()
    """Per replica, the factor the dispatcher multiplied the cost model's times by (online
    recalibration, :mod:`lorafleet.dispatch.recalibration`); empty: 1 for every replica."""

    def base_estimate(self, position: int) -> float:
        """The uncorrected cost model's estimate of replica ``position``'s time (its estimate over its speed factor)."""
        estimate = self.work[position].estimated_time_s
        return estimate / self.speed[position] if self.speed else estimate

    @property
    def n_seqs(self) -> int:
        return sum(len(mb.lengths) for w in self.work for mb in w.microbatches)

    @property
    def tokens(self) -> int:
        return sum(sum(mb.lengths) for w in self.work for mb in w.microbatches)

    @property
    def padding_tokens(self) -> int:
        return sum(mb.padding_tokens for w in self.work for mb in w.microbatches)

    @property
    def padding_ratio(self) -> float:
        """Padding tokens over all occupied tokens (LobRA's padding ratio)."""
        total = self.tokens + self.padding_tokens
        return self.padding_tokens / total if total else 0.0

    def task_token_counts(self, names: Sequence[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Each task's real tokens and padding tokens in this step, keyed ``names[task_id]`` (every name, 0 for a
        task without a sequence here): a padded row pads up to its micro-batch's length, a packed micro-batch
        has no padding. What an executor reports (``StepReport.task_tokens``, ``task_padding_tokens``)."""
        tokens = dict.fromkeys(names, 0)
        padding = dict.fromkeys(names, 0)
        for work in self.work:
            for mb in work.microbatches:
                for task, length in zip(mb.task_ids, mb.lengths, strict=True):
                    tokens[names[task]] += length
                    padding[names[task]] += mb.padded_len - length if mb.padded_len is not None else 0
        return tokens, padding


@dataclass(frozen=True)
class StepReport:
    """What an executor measured (or simulated) for one step."""

    step: int
    replica_busy_s: tuple[float, ...]
    """Busy time per replica, in deployment order."""
    makespan_s: float
    """Wall time of the step: the slowest replica plus synchronisation."""
    task_tokens: dict[str, int] = field(default_factory=dict)
    """Real (non-padding) tokens per task."""
    task_padding_tokens: dict[str, int] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    """Mean token loss per task (real executors only)."""
    estimated_makespan_s: float = 0.0
    dispatch_solve_s: float = 0.0
    failed_replicas: tuple[int, ...] = ()
    rank_cpu_s: tuple[float, ...] = ()
    """Process CPU seconds of each rank during the step (torch executor; the CPU analogue of GPU-seconds)."""
    nonfinite_tasks: tuple[str, ...] = ()
    """Tasks whose update this step was skipped: a non-finite loss or gradient norm."""
    unmoved_tasks: tuple[str, ...] = ()
    """Tasks found, at this step, not to have moved their adapter at all since their warm-up began."""

    @property
    def replica_idle_s(self) -> tuple[float, ...]:
        return tuple(self.makespan_s - b for b in self.replica_busy_s)

    @property
    def utilisation(self) -> float:
        """Mean busy fraction over replicas."""
        if not self.replica_busy_s or self.makespan_s <= 0:
            return 0.0
        return float(np.mean(self.replica_busy_s) / self.makespan_s)
