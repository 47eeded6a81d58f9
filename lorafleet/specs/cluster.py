"""The hardware a workload runs on: one or more pools, each of nodes of one GPU kind.

A workload's ``cluster`` is either one pool written flat (``{gpu, nodes, gpus_per_node}``, the
shorthand every workload used before pools) or a list of named pools::

    cluster:
      pools:
        - {name: a100, gpu: A100-40GB, nodes: 2, gpus_per_node: 8, price_per_gpu_hour: 1.3}
        - {name: h100, gpu: H100-80GB, nodes: 1, gpus_per_node: 8, price_per_gpu_hour: 2.5}

The fleet's GPUs (training ranks) are numbered pool after pool, node after node: pool p's GPUs are
``first_gpu(p) .. first_gpu(p) + n_gpus(p) - 1``. A TP group never spans two nodes, and a replica
never spans two pools.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from pydantic import Field, ValidationError, field_validator, model_serializer, model_validator

from lorafleet.specs._base import FieldError, Float, Int, Spec
from lorafleet.specs.gpus import GPU_PRESETS, GPUSpec

MAX_NODES = 4096
"""The most nodes a pool may have (``PoolSpec.nodes``; ``plan --gpus auto --max-nodes`` is capped by it)."""
MAX_GPUS_PER_NODE = 64
"""The most GPUs a node may hold."""
MAX_PRICE_PER_GPU_HOUR = 1e9
"""The largest ``price_per_gpu_hour`` a pool may have, in any currency (a GPU-hour costs a few units in most,
some millions in the weakest). It keeps every cost the planner computes a finite number: the largest fleet
(4,096 nodes of 64 GPUs) at this price costs about 7e10 a second, so a step, a job and their sums stay far
below the largest float (1.8e308) that a price of 1e308 overflows to ``inf`` (and ``inf - inf`` to ``nan``)."""
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
SHORTHAND_KEYS = ("gpu", "nodes", "gpus_per_node", "price_per_gpu_hour", "profile", "stage_load_gbps")
"""The keys of a cluster written as its one pool (the shorthand): a pool's, less its name."""


class PoolSpec(Spec):
    """Homogeneous nodes of one GPU kind, with their price and cost model."""

    name: str = ""
    """Names the pool in plans and reports (letters, digits, ``_ . -``); empty only for a cluster's one pool."""
    gpu: str = "A100-40GB"
    """GPU preset name (see ``lorafleet.specs.gpus.GPU_PRESETS``)."""
    nodes: Int = Field(1, gt=0, le=MAX_NODES)
    """Number of nodes."""
    gpus_per_node: Int = Field(8, gt=0, le=MAX_GPUS_PER_NODE)
    """GPUs in each node."""
    price_per_gpu_hour: Float | None = Field(None, ge=0)
    """What one GPU of the pool costs an hour, in any currency (the same for every pool), 0 (a pool already
    owned) up to :data:`MAX_PRICE_PER_GPU_HOUR`; none: unpriced."""
    profile: str | None = Field(None, min_length=1)
    """A measured profile of the pool's GPU kind (relative to the workload file); none: the kind's analytic model."""
    stage_load_gbps: Float | None = Field(None, gt=0)
    """GB/s at which a rank of the pool loads its stage of the base model when a move rebuilds it
    (``planner.incremental.MigrationModel``); none: its GPU kind's (``GPUSpec.stage_load_gbps``)."""

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str) -> str:
        for key in GPU_PRESETS:
            if key.lower() == value.lower():
                return key
        raise ValueError(f"unknown GPU {value!r}; choose from {', '.join(GPU_PRESETS)}")

    @field_validator("price_per_gpu_hour")
    @classmethod
    def _finite_cost(cls, value: float | None) -> float | None:
        why = None if value is None else price_too_large(value)
        if why:
            raise ValueError(why)
        return value

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if value and not _POOL_NAME.match(value):
            raise ValueError(f"{value!r} is not a valid pool name (letters, digits, _ . -; at most 64)")
        return value

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_spec(self) -> GPUSpec:
        return GPU_PRESETS[self.gpu]

    @property
    def stage_load_bytes_per_s(self) -> float:
        """Bytes a second a rank of the pool loads its stage at: its ``stage_load_gbps``, else its GPU kind's."""
        return 1e9 * (self.stage_load_gbps or self.gpu_spec.stage_load_gbps)

    def describe(self) -> str:
        """``16 x A100-40GB (a100)`` (:func:`describe_pool`)."""
        return describe_pool(self)


def price_too_large(price: float) -> str | None:
    """Why ``price`` (a GPU-hour's) is refused: above :data:`MAX_PRICE_PER_GPU_HOUR`; None when it is not."""
    if not price > MAX_PRICE_PER_GPU_HOUR:
        return None
    return (
        f"must be at most {MAX_PRICE_PER_GPU_HOUR:.0e} a GPU-hour (specs.cluster.MAX_PRICE_PER_GPU_HOUR), so that "
        f"a plan's cost is a finite number; got {price:g}"
    )


class Pooled(Protocol):
    """A pool as a cluster or a plan lists it: a name, its GPU kind and its GPUs."""

    @property
    def name(self) -> str: ...

    @property
    def gpu(self) -> str: ...

    @property
    def n_gpus(self) -> int: ...


def describe_pool(pool: Pooled) -> str:
    """A pool as a cluster (``PoolSpec``) or a plan (``PlanPool``) describes it: ``16 x A100-40GB``, with the
    pool's name when it has one (``16 x A100-40GB (a100)``)."""
    return f"{pool.n_gpus} x {pool.gpu}" + (f" ({pool.name})" if pool.name else "")


P = TypeVar("P", bound=Pooled)


def named_pool(pools: Sequence[P], name: str) -> P:
    """The pool of ``pools`` called ``name`` (KeyError if none is)."""
    for pool in pools:
        if pool.name == name:
            return pool
    raise KeyError(name)


def first_gpu(pools: Sequence[Pooled], name: str) -> int:
    """The first global GPU index (rank) of pool ``name``: ranks number pool after pool, in ``pools``' order."""
    first = 0
    for pool in pools:
        if pool.name == name:
            return first
        first += pool.n_gpus
    raise KeyError(name)


def pool_at(pools: Sequence[P], gpu: int) -> tuple[int, P]:
    """The index and pool of global GPU (rank) ``gpu`` (ValueError when none of ``pools`` has it)."""
    first = 0
    for k, pool in enumerate(pools):
        if first <= gpu < first + pool.n_gpus:
            return k, pool
        first += pool.n_gpus
    raise ValueError(f"GPU {gpu} is outside 0..{first - 1}")


class ClusterSpec(Spec):
    """The fleet: pools of homogeneous nodes; a TP group never spans two nodes, a replica never two pools."""

    pools: tuple[PoolSpec, ...] = (PoolSpec(),)
    """The pools, in rank order; one unnamed pool when the cluster is written flat."""

    @model_validator(mode="wrap")
    @classmethod
    def _shorthand(cls, raw: Any, handler: Any) -> ClusterSpec:
        """A cluster written as its one pool (``{gpu, nodes, gpus_per_node, ...}``) is that pool, unnamed; its
        errors name the keys as written (``cluster.nodes``, not ``cluster.pools[0].nodes``)."""
        if isinstance(raw, dict) and "pools" not in raw:
            if "name" in raw:
                raise ValueError("a cluster written as one pool has no name; name pools in a pools: list")
            try:
                return handler({"pools": (raw,)})
            except ValidationError as err:
                errors = [{**e, "loc": e["loc"][2:]} for e in err.errors()]
                raise ValidationError.from_exception_data(err.title, errors) from None  # type: ignore[arg-type]
        if isinstance(raw, dict) and set(raw) & set(SHORTHAND_KEYS):
            both = ", ".join(k for k in SHORTHAND_KEYS if k in raw)
            raise ValueError(f"set pools, or one pool's keys ({both}), not both: each pool has its own")
        if not isinstance(raw, dict | ClusterSpec):
            kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
            got = kind.get(type(raw), "nothing" if raw is None else f"a {type(raw).__name__}")
            if isinstance(raw, int | float | str):
                got += f" {raw!r}"
            raise ValueError(f"takes a mapping with keys: {', '.join(SHORTHAND_KEYS)} (one pool), or pools; got {got}")
        if isinstance(raw, dict) and isinstance(raw.get("pools"), list):
            raw = {**raw, "pools": tuple(raw["pools"])}  # a JSON array is a tuple to strict validation
        return handler(raw)

    @field_validator("pools")
    @classmethod
    def _named_pools(cls, pools: tuple[PoolSpec, ...]) -> tuple[PoolSpec, ...]:
        if not pools:
            raise ValueError("needs at least one pool")
        seen: set[str] = set()
        for i, pool in enumerate(pools):
            if len(pools) > 1 and not pool.name:
                raise FieldError((i, "name"), "a pool of a cluster of several needs a name")
            if pool.name in seen:
                raise FieldError((i, "name"), f"pool name {pool.name!r} appears twice")
            seen.add(pool.name)
        return pools

    @model_serializer(mode="wrap")
    def _as_written(self, handler: Any) -> Any:
        """One unnamed pool is written flat, as the shorthand it came from."""
        data = handler(self)
        if len(self.pools) == 1 and not self.pools[0].name and isinstance(data, dict):
            flat = dict(data["pools"][0])
            flat.pop("name", None)
            return flat
        return data

    @property
    def n_gpus(self) -> int:
        """GPUs of every pool."""
        return sum(p.n_gpus for p in self.pools)

    @property
    def pool_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)

    def pool(self, name: str) -> PoolSpec:
        """The pool called ``name`` (KeyError if none is)."""
        return named_pool(self.pools, name)

    def first_gpu(self, name: str) -> int:
        """The first global GPU index (rank) of pool ``name``: the pools before it hold the ones below."""
        return first_gpu(self.pools, name)

    def only(self, name: str) -> ClusterSpec:
        """The one-pool cluster of pool ``name`` (what a pool's cost model is built for)."""
        return ClusterSpec(pools=(self.pool(name),))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The pools' GPU kinds, in pool order, each once."""
        return tuple(dict.fromkeys(p.gpu for p in self.pools))

    @property
    def priced(self) -> bool:
        """Every pool has a price (costs can be printed)."""
        return all(p.price_per_gpu_hour is not None for p in self.pools)

    def describe(self) -> str:
        """``16 x A100-40GB``, or ``16 x A100-40GB (a100) + 8 x H100-80GB (h100)``."""
        return " + ".join(p.describe() for p in self.pools)

    @property
    def _one(self) -> PoolSpec:
        if len(self.pools) != 1:
            raise ValueError(f"a cluster of {len(self.pools)} pools has no one GPU kind; ask its pools")
        return self.pools[0]

    @property
    def gpu(self) -> str:
        """The GPU kind of a one-pool cluster (ValueError for several pools)."""
        return self._one.gpu

    @property
    def nodes(self) -> int:
        """The nodes of a one-pool cluster (ValueError for several pools)."""
        return self._one.nodes

    @property
    def gpus_per_node(self) -> int:
        """The GPUs per node of a one-pool cluster (ValueError for several pools)."""
        return self._one.gpus_per_node

    @property
    def gpu_spec(self) -> GPUSpec:
        """The datasheet of a one-pool cluster's GPU kind (ValueError for several pools)."""
        return self._one.gpu_spec

    @classmethod
    def with_gpus(cls, n_gpus: int, gpu: str = "A100-40GB", gpus_per_node: int = 8, **pool: Any) -> ClusterSpec:
        """One pool of N GPUs packed into full nodes of ``gpus_per_node`` (fewer on one node when N is smaller);
        ``pool``: its other fields (name, price, profile)."""
        per_node = min(gpus_per_node, n_gpus)
        if n_gpus % per_node:
            raise ValueError(f"{n_gpus} GPUs do not fill nodes of {gpus_per_node}")
        return cls(pools=(PoolSpec(gpu=gpu, nodes=n_gpus // per_node, gpus_per_node=per_node, **pool),))
