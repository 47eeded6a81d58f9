"""Many LoRA adapters over one frozen linear layer: one base GEMM, one low-rank update per segment.

A micro-batch holds the tokens of several tasks. Flattened to rows ``X (T, K)``, segment ``j``
covers rows ``R_j = [start_j, start_j + L_j)`` and uses adapter ``a = a_j`` with
``A_a (r_a, K)``, ``B_a (N, r_a)``, scaling ``s_a`` and dropout ``p_a``. Rows in no segment
(padding) see only the base layer. With the frozen base weight ``W (N, K)`` and bias ``b``:

    Y       = X W^T + b                        (T, N)    one GEMM for every task
    Xd_j    = X[R_j] ⊙ M_j / (1 - p_a)         (L_j, K)  M_j: keep-mask drawn in the forward
    S_j     = Xd_j A_a^T                       (L_j, r_a) "shrink"
    Y[R_j] += s_a S_j B_a^T                    (L_j, N)  "expand"

and, with ``G = dLoss/dY``:

    dS_j    = s_a G[R_j] B_a                                   (L_j, r_a)
    dX      = G W + Σ_j into rows R_j: (dS_j A_a) ⊙ M_j / (1 - p_a)   one (T, K) buffer
    dA_a    = Σ_{j: a_j = a} dS_j^T Xd_j                       (r_a, K)
    dB_a    = Σ_{j: a_j = a} s_a G[R_j]^T S_j                  (N, r_a)

This is mLoRA's BatchLoRA operator (arXiv 2312.02515 §4) with two fixes: the backward uses the
forward's dropout mask (mLoRA rescales the un-dropped input, so its gradients are exact only in
expectation), and the same adapter may own several segments. The mask is not kept between the
passes where memory binds: above ``MultiLoraLinear.mask_tokens`` rows the backward draws it again from the
generator state the forward drew it from (``dropout.MaskReplay``), uses it and frees it (``mask_memory.py``).

Two implementations share one ``torch.autograd.Function``: a torch loop over runs of segments
(``kernels/torch_lora.py``, any device, the reference) and Triton kernels
(``kernels/segment_lora.py``, CUDA). :class:`~lorafleet.executor.torch.routing.LoraBackend`
picks one; the routing types live in ``routing.py``, the keep-mask ``M`` is drawn (and drawn again) by
``dropout.py``, and this module holds the operator and the ``nn.Module`` around it.

``X`` is saved for ``dA`` alone. On a TP rank of a column-parallel layer only the rank's rows of it are
(``token_split.py``): ``dA`` is then summed over the rank's rows after one reduce-scatter of ``dS`` over the TP
group, a partial over tokens that the adapter-gradient sum over the TP ranks completes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lorafleet.executor.torch import dora, vera
from lorafleet.executor.torch.dropout import MaskReplay, draw_keep_mask
from lorafleet.executor.torch.kernels import torch_lora
from lorafleet.executor.torch.quantized_base import QuantizedLinear
from lorafleet.executor.torch.routing import LoraBackend, LoraRouting, Segments
from lorafleet.executor.torch.token_split import TokenSplit, row_share
from lorafleet.specs.lora import LoraSpec


def multi_lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_A: Sequence[Tensor],
    lora_B: Sequence[Tensor],
    routing: LoraRouting,
    keep: Tensor | None = None,
    backend: LoraBackend = LoraBackend.AUTO,
    vera_tenants: vera.VeraTenants | None = None,
    split: TokenSplit | None = None,
    x_rows: Tensor | None = None,
    replay: MaskReplay | None = None,
) -> Tensor:
    """``Y = X W^T + b`` plus each segment's ``s_a B_a A_a (X ⊙ M / (1-p_a))``; see the module doc.

    Args:
        x: ``(T, K)`` rows of the micro-batch.
        weight: ``(N, K)`` frozen base weight (must not require grad); ``bias``: ``(N,)`` or None.
        lora_A: per adapter ``A_a (r_a, K)``; ``lora_B``: per adapter ``B_a (N, r_a)``; any float dtype
            (fp32 masters over a bf16 ``x``): the low-rank GEMMs run in ``x``'s dtype, the
            gradients come back in each weight's own.
        routing: segments (indexing ``lora_A``) and per-adapter scaling and dropout.
        keep: ``(T, K)`` bool keep-mask (:func:`draw_keep_mask`), or None for no dropout.
        backend: implementation; AUTO is Triton on CUDA, torch elsewhere.
        vera_tenants: the call's VeRA adapters, their own routing over the same rows (``vera.py``: added in place
            after the backend's forward, by torch ops on any device, on the same keep-mask).
        split: a column-parallel layer's TP group (``token_split.py``): then ``x_rows`` (this rank's rows of ``x``,
            ``split.rows_of``) is saved for ``dA`` instead of ``x``, and the backward reduce-scatters ``dS``; None:
            ``x`` is saved whole (one rank).
        replay: how ``keep`` was drawn (:meth:`MaskReplay.next_draw`): then the mask is not saved, the backward
            draws it again; None: ``keep`` itself is saved (a mask the caller made some other way).

    Returns:
        ``(T, N)``. Gradients flow to ``x`` and to every ``A_a``, ``B_a`` (None for an adapter
        that owns no rows) and VeRA ``λ_d``, ``λ_b``, never to ``weight`` or ``bias``.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("multi_lora_linear: the base weight and bias must be frozen (requires_grad=False)")
    if x.dim() != 2 or routing.segments.end > x.shape[0]:
        raise ValueError(f"multi_lora_linear: x {tuple(x.shape)} must be (T, K) with T >= {routing.segments.end}")
    if len(lora_A) != len(routing.scalings) or len(lora_B) != len(routing.scalings):
        raise ValueError(
            f"multi_lora_linear: routing has {len(routing.scalings)} adapters, got {len(lora_A)} A, {len(lora_B)} B"
        )
    backend = LoraBackend(backend)
    if backend is LoraBackend.AUTO:
        backend = LoraBackend.TRITON if x.is_cuda else LoraBackend.TORCH
    vectors = () if vera_tenants is None else (*vera_tenants.lambda_d, *vera_tenants.lambda_b)
    if (split is None) != (x_rows is None):
        raise ValueError("multi_lora_linear: a token split needs its rows of x (split.rows_of), and only it does")
    if replay is not None and keep is None:
        raise ValueError("multi_lora_linear: a mask replay needs the mask it replays (keep)")
    return _MultiLoraFunction.apply(
        x, weight, bias, routing, keep, backend, vera_tenants, split, x_rows, replay, *lora_A, *lora_B, *vectors
    )


class _MultiLoraFunction(torch.autograd.Function):
    """Autograd glue: the keep-mask's replay (or a caller's mask), one dX buffer, per-backend forward/backward, then
    the VeRA tenants' (``vera.update``, ``vera.update_backward``) in the same ``Y`` and ``dX``.

    The input is saved only for the LoRA and DoRA tenants' ``dA`` (VeRA's backward needs none: its ``S0`` is saved):
    whole, or under a token split this rank's rows of it (``token_split.py``), and not at all when no such tenant
    owns rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, routing, keep, backend, tenants, split, x_rows, replay, *factors):
        n = len(routing.scalings)
        lora = factors[: 2 * n]  # then the VeRA tenants' vectors: autograd's inputs, read through ``tenants``
        y, saved = _implementation(backend).forward(x, weight, bias, lora[:n], lora[n:], routing, keep)
        vera_saved = () if tenants is None else vera.update(x, y, keep, tenants)
        # Only the adapters this call routes rows to are saved (and so version-checked in the
        # backward): another task's adapter may be stepped in place while this micro-batch is in
        # flight (the streamed pipeline, costmodel.schedule), and it gets no gradient from here.
        used = sorted({a for a, length in zip(routing.segments.adapter_ids, routing.segments.lengths) if length})
        ctx.routing, ctx.backend, ctx.used, ctx.tenants = routing, backend, used, tenants
        ctx.n_vera_saved = len(vera_saved)
        ctx.unused = [None if a in used else (lora[a], lora[n + a]) for a in range(n)]  # shapes only
        ctx.split, ctx.total, ctx.replay = split, x.shape[0], replay
        lora_used = (*(lora[a] for a in used), *(lora[n + a] for a in used))
        x_saved = (x if split is None else x_rows) if used else None
        # With a replay the (T, K) mask is dropped here and drawn again in the backward (dropout.py)
        ctx.save_for_backward(x_saved, weight, keep if replay is None else None, *lora_used, *saved, *vera_saved)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, keep, *rest = ctx.saved_tensors
        if ctx.replay is not None:
            keep = ctx.replay.mask()  # the forward's mask, bit for bit; freed when this backward returns
        used = ctx.used
        lora_A = [None if pair is None else pair[0] for pair in ctx.unused]
        lora_B = [None if pair is None else pair[1] for pair in ctx.unused]
        for j, a in enumerate(used):
            lora_A[a], lora_B[a] = rest[j], rest[len(used) + j]
        saved = rest[2 * len(used) : len(rest) - ctx.n_vera_saved]
        n = len(lora_A)
        need_x, need_lora = ctx.needs_input_grad[0], any(ctx.needs_input_grad[10 : 10 + 2 * n])
        impl = _implementation(ctx.backend)
        share = None
        if ctx.split is not None and x is not None:  # x: this rank's rows (token_split.py)
            share, x = row_share(ctx.split, x, ctx.total, keep, ctx.routing), None
        dx, dA, dB = impl.backward(
            grad_y, x, weight, lora_A, lora_B, ctx.routing, keep, saved, need_x, need_lora, share
        )
        dA = [g if g is None else g.to(w.dtype) for g, w in zip(dA, lora_A, strict=True)]  # compute -> master dtype
        dB = [g if g is None else g.to(w.dtype) for g, w in zip(dB, lora_B, strict=True)]
        d_grads, b_grads = [], []
        if ctx.tenants is not None:
            vera_saved = rest[len(rest) - ctx.n_vera_saved :]
            d_grads, b_grads = vera.update_backward(grad_y, dx, keep, ctx.tenants, vera_saved)
        return dx, None, None, None, None, None, None, None, None, None, *dA, *dB, *d_grads, *b_grads


def _implementation(backend: LoraBackend) -> ModuleType:
    """The backend's module: ``kernels.torch_lora`` or ``kernels.segment_lora``, each with a
    ``forward(x, weight, bias, lora_A, lora_B, routing, keep) -> (Y, saved)`` and a
    ``backward(grad_y, x, weight, lora_A, lora_B, routing, keep, saved, need_x, need_lora, share)
    -> (dX, dA, dB)`` (``share``: a TP rank's :class:`~token_split.RowShare`, then ``x`` is None)."""
    if backend is LoraBackend.TORCH:
        return torch_lora
    # Imported on first use, not at module import, so CPU-only runs never import triton (and
    # never fix TRITON_INTERPRET for the process: triton.jit reads it when it decorates, and
    # triton.language decorates its own helpers when triton is first imported).
    from lorafleet.executor.torch.kernels import segment_lora

    return segment_lora


# ---- the module ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _layer_routing(
    segments: Segments, ids: tuple[int, ...], scalings: tuple[float, ...], dropouts: tuple[float, ...]
) -> LoraRouting:
    """Routing of a layer holding adapters ``ids``; cached because every layer of a model with the
    same adapters asks for the same one in each step (and equal routings share ``torch_lora.segment_runs``)."""
    return LoraRouting(segments.relabel({a: i for i, a in enumerate(ids)}), scalings, dropouts)


@functools.lru_cache(maxsize=1024)
def _split_routing(routing: LoraRouting, is_vera: tuple[bool, ...]) -> tuple[LoraRouting, LoraRouting]:
    """A layer routing's LoRA and DoRA adapters and its VeRA ones (``is_vera[a]``), each kind's renumbered by its
    position among that kind, as the operator takes them; cached as :func:`_layer_routing` is."""

    def part(ids: list[int]) -> LoraRouting:
        segments = routing.segments.relabel({a: k for k, a in enumerate(ids)})
        return LoraRouting(segments, tuple(routing.scalings[a] for a in ids), tuple(routing.dropouts[a] for a in ids))

    return part([a for a, v in enumerate(is_vera) if not v]), part([a for a, v in enumerate(is_vera) if v])


def adapter_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype adapters are kept in over a base of ``base_dtype``: fp32 over a 16-bit base
    (master weights, as PEFT's ``autocast_adapter_dtype``: optimizer updates of ~1e-4 relative
    size would round away in bf16's 8-bit mantissa), the base's own otherwise. The low-rank
    GEMMs still run in the activations' dtype (the stacked copies are cast, the gradients cast
    back), so a bf16 step costs bf16 GEMMs and fp32 only for the tiny weights."""
    return torch.float32 if base_dtype in (torch.bfloat16, torch.float16) else base_dtype


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` (kept as ``base_layer``) plus any number of LoRA adapters.

    Adapters are keyed by integer id (a task slot); ``lora_A[str(id)]`` is ``(r, in_features)``
    and ``lora_B[str(id)]`` is ``(out_features, r)``, as in PEFT's ``lora_A.<name>.weight``; a DoRA
    adapter also has ``lora_magnitude_vector[str(id)]`` ``(out_features,)`` (``dora.py``). A VeRA adapter has
    no ``A`` or ``B`` of its own: ``vera_lambda_d[str(id)]`` ``(r,)``, ``vera_lambda_b[str(id)]``
    ``(out_features,)`` and the model's shared frozen projections ``vera_projections[str(id)]`` (``vera.py``). A
    forward needs :attr:`segments` (set for every layer of a model by
    ``inject.segments_context``) to know which rows use which adapter; segments naming an id
    this layer lacks (a task that does not target this module) are treated as padding.

    Example:
        >>> layer = MultiLoraLinear(nn.Linear(64, 32))
        >>> layer.add_adapter(0, LoraSpec(rank=8, alpha=16))
        >>> layer.add_adapter(1, LoraSpec(rank=4, alpha=4, dropout=0.1))
        >>> layer.segments = Segments.packed([0, 1], [5, 3])
        >>> layer(torch.randn(8, 64)).shape
        torch.Size([8, 32])
    """

    def __init__(self, base_layer: nn.Linear | QuantizedLinear, *, backend: LoraBackend = LoraBackend.AUTO) -> None:
        super().__init__()
        if not isinstance(base_layer, (nn.Linear, QuantizedLinear)):
            raise TypeError(f"MultiLoraLinear wraps nn.Linear or QuantizedLinear, got {type(base_layer).__name__}")
        self.base_layer = base_layer.requires_grad_(False)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.lora_magnitude_vector = nn.ParameterDict()
        """DoRA adapters' magnitudes ``m (out_features,)`` by id (``dora.py``)."""
        self.vera_lambda_d = nn.ParameterDict()
        self.vera_lambda_b = nn.ParameterDict()
        """VeRA adapters' trained vectors ``λ_d (r,)`` and ``λ_b (out_features,)`` by id (``vera.py``)."""
        self.vera_projections = nn.ModuleDict()
        """VeRA adapters' frozen ``A``, ``B`` by id: one :class:`~vera.VeraProjections` shared by every layer."""
        self.vera_slice = vera.ProjectionSlice.whole(base_layer.in_features, base_layer.out_features)
        """The rows of ``B`` and columns of ``A`` this layer uses (TP narrows them: ``tp.py``)."""
        self.mask_tokens = 0
        """The most rows (a micro-batch's tokens) at which a call keeps its dropout keep-mask for the backward; above
        it the backward draws the mask again (``dropout.MaskReplay``). Set from the memory model for the replica
        (``mask_memory.py``); 0: always drawn again."""
        self.token_split: TokenSplit | None = None
        """The TP group over which this layer's output features are split (column-parallel, set by ``tp.py``): each
        rank saves its rows of the input for ``dA`` (``token_split.py``). None: the input is saved whole."""
        self.norm_group: dist.ProcessGroup | None = None
        """The TP group over which this layer's input features are split (row-parallel, set by ``tp.py``):
        a DoRA norm sums its squares over it. None: this rank holds whole rows of ``W``."""
        self.adapters: dict[int, LoraSpec] = {}
        """Spec of each adapter id present in this layer."""
        self._weight_sq: tuple[Tensor, Tensor] | None = None
        """(the base weight, its ``dora.row_squares``): every DoRA norm's frozen part, kept while the weight is."""
        self.backend = LoraBackend(backend)
        self.segments: Segments | None = None
        """Row segments of the current forward; None outside a segments context."""

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def add_adapter(
        self,
        adapter_id: int,
        spec: LoraSpec,
        weights: tuple[Tensor, Tensor] | None = None,
        magnitude: Tensor | None = None,
        projections: vera.VeraProjections | None = None,
    ) -> None:
        """Creates (or replaces) adapter ``adapter_id``.

        Without ``weights`` it is initialised as PEFT does: A Kaiming-uniform (a = sqrt(5)),
        B zero, so the adapter starts as the identity update. With ``weights = (A, B)`` they are
        copied into the adapter dtype (:func:`adapter_dtype`) on the base layer's device. A base
        on the ``meta`` device (the skeleton of per-stage loading, materialised later) gets real
        adapters on the host: they are small, and every rank must draw the same whole ones.

        A DoRA adapter (``spec.use_dora``) also gets its magnitude: ``magnitude`` copied, or as PEFT initialises it,
        ``m = ||W + s B A||_c`` (``dora.weight_norms``, summed over :attr:`norm_group`); over a meta base it is NaN
        until :meth:`init_magnitudes` runs on the loaded weights.

        A VeRA adapter (``spec.use_vera``) needs its model's shared ``projections``; its vectors start as PEFT's
        (``λ_d = d_initial``, ``λ_b = 0``) or, with ``weights = (λ_d, λ_b)``, are copied.
        """
        base = self.base_layer.weight
        device = torch.device("cpu") if base.is_meta else base.device
        self.remove_adapter(adapter_id)  # a replaced adapter may change kind: drop every factor it had
        if spec.use_vera:
            self._add_vera(adapter_id, spec, weights, projections, device, adapter_dtype(base.dtype))
            return
        shape_A, shape_B = (spec.rank, self.in_features), (self.out_features, spec.rank)
        A = torch.empty(shape_A, dtype=adapter_dtype(base.dtype), device=device)
        B = torch.zeros(shape_B, dtype=adapter_dtype(base.dtype), device=device)
        if weights is None:
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
        else:
            if tuple(weights[0].shape) != shape_A or tuple(weights[1].shape) != shape_B:
                raise ValueError(
                    f"adapter {adapter_id}: weights {tuple(weights[0].shape)}, {tuple(weights[1].shape)} "
                    f"do not match A {shape_A}, B {shape_B}"
                )
            A.copy_(weights[0])
            B.copy_(weights[1])
        key = str(adapter_id)
        self.lora_A[key], self.lora_B[key] = nn.Parameter(A), nn.Parameter(B)
        self.adapters[adapter_id] = spec
        if spec.use_dora:
            m = torch.full((self.out_features,), float("nan"), dtype=A.dtype, device=device)
            if magnitude is not None:
                m.copy_(magnitude)
            elif not base.is_meta:
                m.copy_(dora.weight_norms(base, [A], [B], [spec.scaling], self.norm_group)[0])
            self.lora_magnitude_vector[key] = nn.Parameter(m)

    def _add_vera(
        self,
        adapter_id: int,
        spec: LoraSpec,
        vectors: tuple[Tensor, Tensor] | None,
        projections: vera.VeraProjections | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """A VeRA adapter's vectors (:meth:`add_adapter`) and its reference to the shared projections."""
        if projections is None:
            raise ValueError(f"VeRA adapter {adapter_id} needs its model's shared projections")
        A, B = projections.vera_A, projections.vera_B
        if A.shape[0] != spec.rank or A.shape[1] < self.in_features or B.shape[0] < self.out_features:
            raise ValueError(
                f"VeRA adapter {adapter_id}: projections A {tuple(A.shape)}, B {tuple(B.shape)} cannot serve a "
                f"({self.out_features}, {self.in_features}) layer at rank {spec.rank}"
            )
        start = vera.initial_vectors(spec.rank, self.out_features, spec.vera_d_initial, dtype)
        if vectors is not None:
            for (name, want), given in zip(start.items(), vectors, strict=True):
                if tuple(given.shape) != tuple(want.shape):
                    raise ValueError(f"adapter {adapter_id}: {name} {tuple(given.shape)}, needs {tuple(want.shape)}")
                want.copy_(given)
        key = str(adapter_id)
        self.vera_lambda_d[key] = nn.Parameter(start[vera.LAMBDA_D].to(device))
        self.vera_lambda_b[key] = nn.Parameter(start[vera.LAMBDA_B].to(device))
        self.vera_projections[key] = projections.to(device)  # in place: every layer sharing it sees it moved
        self.adapters[adapter_id] = spec

    def init_magnitudes(self) -> None:
        """Sets each DoRA magnitude still NaN (added over a meta base) to ``||W + s B A||_c`` of the loaded base;
        collective over :attr:`norm_group` when some layer of the model has one (all its TP ranks call it)."""
        pending = [a for a in self.adapters if str(a) in self.lora_magnitude_vector]
        pending = [a for a in pending if self.lora_magnitude_vector[str(a)].isnan().any()]
        if not pending:
            return
        norms = dora.weight_norms(
            self.base_layer.weight,
            [self.lora_A[str(a)] for a in pending],
            [self.lora_B[str(a)] for a in pending],
            [self.adapters[a].scaling for a in pending],
            self.norm_group,
        )
        with torch.no_grad():
            for a, n in zip(pending, norms, strict=True):
                self.lora_magnitude_vector[str(a)].copy_(n)

    def factors(self, adapter_id: int) -> dict[str, nn.Parameter]:
        """Adapter ``adapter_id``'s trained tensors by factor name: ``lora_A``, ``lora_B`` and, for DoRA,
        ``lora_magnitude_vector``; for VeRA ``vera_lambda_d`` and ``vera_lambda_b`` (PEFT's names)."""
        key = str(adapter_id)
        if key in self.vera_lambda_d:
            return {vera.LAMBDA_D: self.vera_lambda_d[key], vera.LAMBDA_B: self.vera_lambda_b[key]}
        out = {"lora_A": self.lora_A[key], "lora_B": self.lora_B[key]}
        if key in self.lora_magnitude_vector:
            out[dora.MAGNITUDE] = self.lora_magnitude_vector[key]
        return out

    def remove_adapter(self, adapter_id: int) -> None:
        """Drops adapter ``adapter_id`` from this layer if present."""
        if self.adapters.pop(adapter_id, None) is not None:
            key = str(adapter_id)
            for store in (*self._factor_stores(), self.vera_projections):
                if key in store:
                    del store[key]

    def _factor_stores(self) -> tuple[nn.ParameterDict, ...]:
        """Every dict of trained tensors, by factor name's attribute."""
        return self.lora_A, self.lora_B, self.lora_magnitude_vector, self.vera_lambda_d, self.vera_lambda_b

    def relabel(self, new_ids: dict[int, int]) -> None:
        """Keeps the adapters ``new_ids`` names (old id -> new id), renamed and in new-id order, and drops the
        others (a task that left a running fleet: ``change.py``). The kept parameters stay the same objects,
        so an optimizer's state keyed by them carries over."""
        kept = sorted((new, old) for old, new in new_ids.items() if old in self.adapters)
        shared = dict(self.vera_projections.items())  # a VeRA adapter's frozen pair, by its key
        pairs = [(self.factors(old), self.adapters[old], shared.get(str(old))) for _, old in kept]
        self.lora_A, self.lora_B, self.adapters = nn.ParameterDict(), nn.ParameterDict(), {}
        self.lora_magnitude_vector = nn.ParameterDict()
        self.vera_lambda_d, self.vera_lambda_b, self.vera_projections = (
            nn.ParameterDict(),
            nn.ParameterDict(),
            nn.ModuleDict(),
        )
        for (new, _), (factors, spec, projections) in zip(kept, pairs, strict=True):
            for factor, param in factors.items():
                getattr(self, factor)[str(new)] = param
            if projections is not None:
                self.vera_projections[str(new)] = projections
            self.adapters[new] = spec

    def routing(self) -> LoraRouting:
        """The current segments in this layer's terms: adapter ``i`` is the i-th of :attr:`adapters`."""
        if self.segments is None:
            raise RuntimeError(
                "MultiLoraLinear needs row segments: run the model inside "
                "segments_context(model, segments), or set layer.segments"
            )
        specs = self.adapters.values()
        return _layer_routing(
            self.segments, tuple(self.adapters), tuple(s.scaling for s in specs), tuple(s.dropout for s in specs)
        )

    def forward(self, x: Tensor) -> Tensor:
        """``x (..., in_features) -> (..., out_features)``; leading dims flatten to the segment rows."""
        routing = self.routing()
        x2 = x.reshape(-1, self.in_features)  # (T, K), T = prod(leading dims)
        # the mask, kept for the backward up to mask_tokens rows (mask_memory.py); above, its generator state first:
        # the backward draws it again from there
        redraw = self.training and x2.shape[0] > self.mask_tokens
        replay = MaskReplay.next_draw(*x2.shape, routing, x2.device) if redraw else None
        keep = draw_keep_mask(*x2.shape, routing, device=x2.device) if self.training else None
        weight = self.base_layer.weight  # a quantized base dequantizes it here, once a call
        # The dicts' own parameter maps, in the order of the LoRA and DoRA adapters among self.adapters (add_adapter
        # inserts into both alike): ParameterDict.__getitem__ costs ~0.7 us a key, every call.
        lora_A, lora_B = list(self.lora_A._parameters.values()), list(self.lora_B._parameters.values())
        lora_routing, tenants = (routing, None) if not self.vera_lambda_d else self._vera_tenants(routing)
        bias = self.base_layer.bias
        # nothing is saved without autograd, nor x without a LoRA or DoRA tenant's rows
        split = self.token_split if torch.is_grad_enabled() and any(lora_routing.segments.lengths) else None
        x_rows = None if split is None else split.rows_of(x, x2)
        y = multi_lora_linear(
            x2, weight, bias, lora_A, lora_B, lora_routing, keep, self.backend, tenants, split, x_rows, replay
        )
        if self.lora_magnitude_vector:
            y = self._dora(y, x2, keep, replay, routing, weight)
        return y.view(*x.shape[:-1], self.out_features)  # (..., N)

    def _vera_tenants(self, routing: LoraRouting) -> tuple[LoraRouting, vera.VeraTenants]:
        """The routing of this call's LoRA and DoRA adapters, and its VeRA adapters as the operator takes them: each
        with its projections' slices (``vera_slice``) and vectors, over their own routing (``_split_routing``)."""
        keys = list(map(str, self.adapters))
        lora_routing, vera_routing = _split_routing(routing, tuple(k in self.vera_lambda_d for k in keys))
        slices = [self.vera_slice.of(self.vera_projections[k]) for k in keys if k in self.vera_lambda_d]
        A, B = [a for a, _ in slices], [b for _, b in slices]
        d, b = list(self.vera_lambda_d._parameters.values()), list(self.vera_lambda_b._parameters.values())
        return lora_routing, vera.VeraTenants(vera_routing, A, B, d, b)

    def _row_squares(self) -> Tensor:
        """``||W||²_c`` of the base weight, computed once per weight (TP slicing or loading replaces it)."""
        base = self.base_layer
        key = base.frozen_key if isinstance(base, QuantizedLinear) else base.weight
        if self._weight_sq is None or self._weight_sq[0] is not key:
            self._weight_sq = (key, dora.row_squares(base.weight))
        return self._weight_sq[1]

    def _dora(
        self, y: Tensor, x: Tensor, keep: Tensor | None, replay: MaskReplay | None, routing: LoraRouting, weight: Tensor
    ) -> Tensor:
        """The DoRA rescale (``dora.py``) of the rows of this call's DoRA adapters that own rows."""
        ids = list(self.adapters)
        with_rows = {a for a, length in zip(routing.segments.adapter_ids, routing.segments.lengths) if length}
        used = tuple(i for i, a in enumerate(ids) if i in with_rows and str(a) in self.lora_magnitude_vector)
        if not used:
            return y
        keys = [str(ids[i]) for i in used]
        norms = dora.weight_norms(
            weight,
            [self.lora_A[k] for k in keys],
            [self.lora_B[k] for k in keys],
            [routing.scalings[i] for i in used],
            self.norm_group,
            self._row_squares(),
        )  # (D, N), detached
        scale = torch.stack([self.lora_magnitude_vector[k] for k in keys]) / norms  # g = m / n
        bias = self.base_layer.bias
        dropouts = [routing.dropouts[i] for i in used]
        return dora.rescale(y, x, keep, weight, bias, routing.segments, used, scale, dropouts, replay)

    def extra_repr(self) -> str:
        kinds = {i: "" if s.kind == "LoRA" else f", {s.kind}" for i, s in self.adapters.items()}
        ranks = ", ".join(f"{i}: r={s.rank}{kinds[i]}" for i, s in self.adapters.items())
        return f"adapters={{{ranks}}}, backend={self.backend.value}"
