"""Parallel configurations ⟨TP, PP⟩ of one model replica, with or without activation
recomputation, and their validity."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lorafleet.specs.cluster import ClusterSpec
from lorafleet.specs.model import ModelSpec


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """A replica layout: ``tp``-way tensor parallel inside a node, ``pp`` pipeline stages."""

    tp: int
    """Tensor-parallel degree (GPUs sharing every layer's weights)."""
    pp: int = 1
    """Pipeline-parallel degree (stages, each holding L / pp layers)."""
    recompute: bool = False
    """Full activation recomputation: every block keeps only its input for the backward and
    runs its forward again there (``torch.utils.checkpoint``), trading about half a forward
    more time per block for a micro-batch many times longer (see ``memory_model``)."""

    pool: str = ""
    """The pool whose GPUs the replica runs on (``ClusterSpec.pools``), which prices it; empty: the
    cluster's one pool, when it is unnamed (a workload's flat ``cluster``)."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp}, pp={self.pp}")
        if "@" in self.pool:
            raise ValueError(f"a pool name has no '@', got {self.pool!r}")

    @property
    def n_gpus(self) -> int:
        """GPUs one replica occupies: tp * pp."""
        return self.tp * self.pp

    @property
    def name(self) -> str:
        """Identifier safe for solver variable names and JSON keys: ``tp2_pp1``, ``tp2_pp1_rc``, and in a
        named pool ``tp2_pp1@h100``."""
        return f"tp{self.tp}_pp{self.pp}" + ("_rc" if self.recompute else "") + self._at

    def __str__(self) -> str:
        return f"<{self.tp},{self.pp}" + (",rc>" if self.recompute else ">") + self._at

    @property
    def _at(self) -> str:
        return f"@{self.pool}" if self.pool else ""

    @property
    def layout(self) -> ParallelConfig:
        """The same layout outside any pool: what a one-kind cost model's tables are keyed by."""
        return replace(self, pool="") if self.pool else self

    def with_recompute(self, recompute: bool = True) -> ParallelConfig:
        """The same layout with activation recomputation switched on (or off)."""
        return replace(self, recompute=recompute)

    def in_pool(self, pool: str) -> ParallelConfig:
        """The same layout on pool ``pool``'s GPUs."""
        return replace(self, pool=pool)

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Inverse of ``name`` and ``str``: accepts ``tp2_pp1``, ``<2,1>``, ``2x1``, ``2,1``, each with a
        recompute suffix (``tp2_pp1_rc``, ``<2,1,rc>``, ``2x1rc``) and then a pool (``tp2_pp1@h100``)."""
        layout, at, pool = text.partition("@")
        if at and not pool.strip():
            raise ValueError(f"not a parallel config: {text!r} (a pool name follows '@')")
        return replace(cls._parse_layout(layout, text), pool=pool.strip())

    @classmethod
    def _parse_layout(cls, layout: str, text: str) -> ParallelConfig:
        cleaned = layout.strip().lower().strip("<>").replace("tp", "").replace("_pp", ",").replace("x", ",")
        recompute = cleaned.endswith("rc")
        cleaned = cleaned.removesuffix("rc").rstrip("_, ")
        parts = [p for p in cleaned.split(",") if p.strip()]
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"not a parallel config: {text!r} (expected e.g. tp2_pp1, <2,1> or tp2_pp1_rc)")
        return cls(int(parts[0]), int(parts[1]) if len(parts) == 2 else 1, recompute)


def config_problems(config: ParallelConfig, model: ModelSpec, cluster: ClusterSpec) -> list[str]:
    """Why ``config`` cannot run ``model`` on ``cluster``; empty when it can.

    Rules: the config's pool is one of the cluster's; tp divides the query and the KV heads
    (Megatron shards whole heads); the pp stages get a balanced split, so pp divides the layers;
    a TP group stays inside one node of its pool; the replica fits its pool.
    """
    try:
        pool = cluster.pool(config.pool)
    except KeyError:
        return [f"the cluster has no pool {config.pool!r} (its pools: {', '.join(map(repr, cluster.pool_names))})"]
    problems = []
    if model.n_heads % config.tp or model.n_kv_heads % config.tp:
        problems.append(f"tp={config.tp} does not divide {model.n_heads} heads / {model.n_kv_heads} KV heads")
    if model.n_layers % config.pp:
        problems.append(f"pp={config.pp} does not divide {model.n_layers} layers")
    of_pool = f" of pool {pool.name!r}" if pool.name else ""
    if config.tp > pool.gpus_per_node:
        problems.append(f"tp={config.tp} exceeds {pool.gpus_per_node} GPUs per node{of_pool}")
    if config.n_gpus > pool.n_gpus:
        problems.append(
            f"needs {config.n_gpus} GPUs, {f'pool {pool.name!r}' if pool.name else 'cluster'} has {pool.n_gpus}"
        )
    return problems


def enumerate_configs(model: ModelSpec, cluster: ClusterSpec, max_gpus: int | None = None) -> list[ParallelConfig]:
    """Every valid ⟨tp, pp⟩ with power-of-two tp and any pp in each pool of ``cluster``, at most ``max_gpus``
    GPUs each, sorted."""
    out = []
    for pool in cluster.pools:
        limit = min(pool.n_gpus, max_gpus or pool.n_gpus)
        tp = 1
        while tp <= min(pool.gpus_per_node, limit):
            for pp in range(1, limit // tp + 1):
                config = ParallelConfig(tp, pp, pool=pool.name)
                if not config_problems(config, model, cluster):
                    out.append(config)
            tp *= 2
    return sorted(out)
