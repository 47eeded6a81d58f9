"""Summing adapter gradients across heterogeneous replicas, and each task's gradient norm.

Every replica trains every task's adapter, so after the backward the gradient of task ``t``
is the sum of what each replica computed from its sequences (``step``'s normalisation makes
that sum the exact ``∂L_t/∂θ_t``):

    g_t = Σ_r g_t^r

Replicas split an adapter differently: a TP2 replica keeps each half of a column-parallel
``B`` on a different rank, a TP1 replica keeps it whole, and PP decides which stage holds a
layer. So the sum runs per *piece* (Hetu's ``SplitAllReduce``, LobRA §8): cut each sharded
dimension at every boundary any replica uses (a fused projection's rows: at every boundary of
every part's slices, ``fused.py``), and all-reduce each block over exactly the ranks that hold it,
one per replica. A factor that TP replicates (``A`` of a column-parallel
layer, ``B`` of a row-parallel one) is held by every TP rank of its stage, each with a
*partial* gradient (``tp.py``), so summing over all of them also completes the TP sum:

    g[piece] = Σ_{rank ∈ holders(piece)} g_rank[piece]

Pieces with the same holders are flattened into one buffer and reduced together, one
collective per holder set, in one global order, so ranks in several sets never wait on each
other in opposite orders.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lorafleet.executor.torch.dora import MAGNITUDE
from lorafleet.executor.torch.fused import cut_points, holder, local_row, output_parts
from lorafleet.executor.torch.inject import module_suffix
from lorafleet.executor.torch.tp import TP_STYLES, adapter_shard_dim
from lorafleet.executor.torch.vera import LAMBDA_B, LAMBDA_D, VECTORS
from lorafleet.runtime.layout import FleetLayout, ModelDims, RankRole, layer_of
from lorafleet.specs.lora import LoraSpec

FACTORS = ("lora_A", "lora_B")


def adapter_factors(spec: LoraSpec) -> tuple[str, ...]:
    """The trained tensors of ``spec``'s adapter on each layer it targets: ``lora_A``, ``lora_B`` and a DoRA
    adapter's ``lora_magnitude_vector``; a VeRA adapter's ``vera_lambda_d`` and ``vera_lambda_b`` alone."""
    if spec.use_vera:
        return VECTORS
    return (*FACTORS, MAGNITUDE) if spec.use_dora else FACTORS


@dataclass(frozen=True)
class AdapterParam:
    """One adapter weight matrix of one task, as the unsplit model has it."""

    task: int
    module: str
    """The injected projection, ``model.layers.3.self_attn.q_proj``."""
    factor: str
    """``lora_A (r, in)``, ``lora_B (out, r)`` or a DoRA ``lora_magnitude_vector (out,)``."""
    shape: tuple[int, ...]
    shard_dim: int | None
    """The dim tensor parallelism splits; None when every TP rank holds it whole."""
    parts: tuple[int, ...] = ()
    """A fused projection's part widths along ``shard_dim`` (each rank holds its slice of each: ``fused.py``);
    empty for one part."""

    @property
    def key(self) -> tuple[int, str, str]:
        return self.task, self.module, self.factor

    @property
    def split_parts(self) -> tuple[int, ...]:
        """The widths TP splits along ``shard_dim``, each into one slice per rank: ``parts``, or the whole."""
        assert self.shard_dim is not None
        return self.parts or (self.shape[self.shard_dim],)


def adapter_params(
    shapes: Mapping[str, tuple[int, int]], adapters: Sequence[LoraSpec], dims: ModelDims
) -> list[AdapterParam]:
    """Every adapter matrix at its whole shape, in model order, then task, then factor: task ``t``'s ``lora_A
    (r, in)``, ``lora_B (out, r)`` (and a DoRA ``lora_magnitude_vector (out,)``) of every projection of
    ``shapes`` (``inject.projection_shapes`` of the whole model) that ``adapters[t]`` targets; a fused projection's
    ``B`` and magnitude with its parts (from ``dims``' head counts). A function of the tasks and the model alone, so
    a fleet that changes its tasks derives it without the whole model (``change.py``)."""
    params = []
    for name, (in_features, out_features) in shapes.items():
        style = TP_STYLES[module_suffix(name)]
        parts = output_parts(module_suffix(name), out_features, dims.n_heads, dims.n_kv_heads)
        for task, spec in enumerate(adapters):
            if module_suffix(name) in spec.target_modules:
                shapes_of = {"lora_A": (spec.rank, in_features), "lora_B": (out_features, spec.rank)}
                shapes_of[MAGNITUDE] = shapes_of[LAMBDA_B] = (out_features,)
                shapes_of[LAMBDA_D] = (spec.rank,)
                for factor in adapter_factors(spec):
                    dim = adapter_shard_dim(style, factor)
                    fused = parts if dim == 0 and len(parts) > 1 else ()
                    params.append(AdapterParam(task, name, factor, shapes_of[factor], dim, fused))
    return params


@dataclass(frozen=True)
class Piece:
    """A block ``[start, stop)`` along the shard dim of one adapter matrix, and who holds it."""

    param: AdapterParam
    start: int
    stop: int
    holders: tuple[int, ...]
    """Sorted ranks holding the block (several per replica when TP replicates the matrix)."""

    def local_view(self, tensor: Tensor, role: RankRole) -> Tensor:
        """The block inside this rank's local shard ``tensor`` (a view)."""
        dim = self.param.shard_dim
        if dim is None:
            return tensor
        local = local_row(self.start, self.param.split_parts, role.tp_rank, role.replica.tp)
        return tensor.narrow(dim, local, self.stop - self.start)

    def full_view(self, tensor: Tensor) -> Tensor:
        """The block inside the whole matrix ``tensor`` (a view)."""
        dim = self.param.shard_dim
        return tensor if dim is None else tensor.narrow(dim, self.start, self.stop - self.start)


def sync_pieces(fleet: FleetLayout, params: Sequence[AdapterParam]) -> tuple[Piece, ...]:
    """Every piece of every adapter matrix over the fleet (see the module doc). Pure: no process group."""
    pieces = []
    for param in params:
        layer = layer_of(param.module)
        stages = [replica.layer_ranks(layer) for replica in fleet.replicas]  # per replica: the stage's TP ranks
        if param.shard_dim is None:
            pieces.append(Piece(param, 0, param.shape[0], tuple(sorted(r for ranks in stages for r in ranks))))
            continue
        parts = param.split_parts
        cuts = cut_points(parts, sorted({len(ranks) for ranks in stages}))
        for start, stop in zip(cuts, cuts[1:]):
            holders = [ranks[holder(start, parts, len(ranks))] for ranks in stages]  # the TP rank whose shard has it
            pieces.append(Piece(param, start, stop, tuple(sorted(holders))))
    return tuple(pieces)


def holder_sets(pieces: Sequence[Piece]) -> list[tuple[int, ...]]:
    """The distinct holder sets of more than one rank, in the one global order every rank uses."""
    return sorted({p.holders for p in pieces if len(p.holders) > 1})


class GradSync:
    """This rank's side of the adapter-gradient sum and of the per-task gradient norms."""

    def __init__(
        self,
        pieces: Sequence[Piece],
        role: RankRole | None,
        params: Mapping[tuple[int, str, str], nn.Parameter],
        groups: Mapping[tuple[int, ...], dist.ProcessGroup],
    ) -> None:
        """
        Args:
            pieces: the fleet's pieces (:func:`sync_pieces`), the same on every rank.
            role: this rank's role; None for an idle rank (it holds nothing).
            params: this rank's local adapter shards by :attr:`AdapterParam.key`.
            groups: a process group per holder set that contains this rank.
        """
        rank = role.rank if role is not None else -1
        self.role = role
        self.params = params
        self.local = [p for p in pieces if rank in p.holders]
        self.groups = groups
        self.buckets: dict[tuple[int, ...], list[Piece]] = {}
        for piece in self.local:
            if len(piece.holders) > 1:
                self.buckets.setdefault(piece.holders, []).append(piece)
        self.buckets = dict(sorted(self.buckets.items()))
        self.owned = [p for p in self.local if p.holders[0] == rank]
        """Pieces this rank counts in norms and writes to checkpoints (the lowest holder)."""

    def _grad_views(self, pieces: Sequence[Piece], tasks: Collection[int]) -> Iterator[Tensor]:
        for piece in pieces:
            if piece.param.task in tasks:
                param = self.params[piece.param.key]
                if param.grad is None:  # this replica got none of the task's sequences
                    param.grad = torch.zeros_like(param)
                yield piece.local_view(param.grad, self.role)

    def all_reduce(self, tasks: Collection[int]) -> None:
        """Sums the gradients of ``tasks``' adapters over the holders of each piece, in place."""
        for holders, pieces in self.buckets.items():
            views = list(self._grad_views(pieces, tasks))
            if not views:
                continue
            flat = torch.cat([v.reshape(-1) for v in views])  # one collective per holder set
            dist.all_reduce(flat, group=self.groups[holders])
            offset = 0
            for view in views:
                view.copy_(flat[offset : offset + view.numel()].view_as(view))
                offset += view.numel()

    def squared_norms(self, n_tasks: int, tasks: Collection[int]) -> Tensor:
        """Per task, this rank's share of ``||g_t||^2`` (fp64, on the host): its owned pieces only,
        so a world all-reduce gives every rank the same full norms, counting each block once.

        One foreach norm per task on the gradients' device (``get_total_norm``, what
        ``clip_grad_norm_`` uses) and one copy to the host: a ``.cpu()`` per piece would
        synchronise a GPU once per adapter matrix (thousands a step on a 7B model)."""
        views: dict[int, list[Tensor]] = defaultdict(list)
        for piece in self.owned:
            if piece.param.task in tasks:
                grad = self.params[piece.param.key].grad
                if grad is not None:
                    views[piece.param.task].append(piece.local_view(grad, self.role))
        sums = torch.zeros(n_tasks, dtype=torch.float64)
        if views:
            order = sorted(views)
            norms = torch.stack([torch.nn.utils.get_total_norm(views[t]).double() for t in order]).cpu()
            sums[order] = norms**2
        return sums
