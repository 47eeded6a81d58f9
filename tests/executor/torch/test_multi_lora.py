"""MultiLoraLinear: forward and every gradient equal per-task references, dropout included.

Three references, from strongest to cheapest:
* PEFT's own ``lora.Linear`` run on one task's rows at a time, its dropout replaced by a module
  applying the same keep-mask (so even p > 0 compares exactly);
* ``torch.autograd.gradcheck`` in float64 with a fixed mask;
* a plain autograd loop over segments, under hypothesis-drawn layouts, ranks, dropouts, dtypes.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager

import peft
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft.tuners.lora.layer import Linear as PeftLinear
from torch import nn
from torch.nn import functional as F

from lorafleet.executor.torch import dropout, multi_lora
from lorafleet.executor.torch.dropout import draw_keep_mask
from lorafleet.executor.torch.kernels import torch_lora
from lorafleet.executor.torch.kernels.torch_lora import segment_runs
from lorafleet.executor.torch.multi_lora import MultiLoraLinear, multi_lora_linear
from lorafleet.executor.torch.routing import LoraBackend, LoraRouting, Segments
from lorafleet.specs.lora import LoraSpec

K, N = 24, 20


class FixedMaskDropout(nn.Module):
    """Inverted dropout with a given keep-mask: lets PEFT's layer use lorafleet's mask."""

    def __init__(self, keep: torch.Tensor, p: float) -> None:
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.keep / (1 - self.p)


def make_layer(specs: dict[int, LoraSpec], seed: int = 0, bias: bool = True) -> MultiLoraLinear:
    torch.manual_seed(seed)
    layer = MultiLoraLinear(nn.Linear(K, N, bias=bias), backend=LoraBackend.TORCH)
    for adapter_id, spec in specs.items():
        layer.add_adapter(adapter_id, spec)
    with torch.no_grad():
        for p in [*layer.lora_A.values(), *layer.lora_B.values()]:
            p.normal_(0, 0.3)  # B != 0, or every adapter would be the identity
    return layer


def peft_task_layer(layer: MultiLoraLinear, adapter_id: int) -> PeftLinear:
    """PEFT's layer for one task, holding that task's weights."""
    spec = layer.adapters[adapter_id]
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, use_rslora=spec.use_rslora)
    # peft 0.21 reads dropout and rsLoRA from `config`, rank and alpha from the arguments
    ref = PeftLinear(copy.deepcopy(layer.base_layer), "default", config=config, r=spec.rank, lora_alpha=spec.alpha)
    with torch.no_grad():
        ref.lora_A["default"].weight.copy_(layer.lora_A[str(adapter_id)])
        ref.lora_B["default"].weight.copy_(layer.lora_B[str(adapter_id)])
    return ref


def rows_of(segments: Segments, adapter_id: int) -> torch.Tensor:
    return torch.cat(
        [torch.arange(s, s + n) for a, s, n in segments if a == adapter_id] or [torch.zeros(0, dtype=torch.long)]
    )


def peft_per_task(layer: MultiLoraLinear, x, grad_y, keep):
    """Y, dX and {id: (dA, dB)} from PEFT run task by task on its own rows."""
    y = layer.base_layer(x).detach()
    dx = (grad_y @ layer.base_layer.weight).detach()  # rows of no task: base only
    grads = {}
    for adapter_id, spec in layer.adapters.items():
        rows = rows_of(layer.segments, adapter_id)
        if len(rows) == 0:
            continue
        ref = peft_task_layer(layer, adapter_id).train(layer.training)
        if keep is not None and spec.dropout:
            assert isinstance(ref.lora_dropout["default"], nn.Dropout)
            ref.lora_dropout["default"] = FixedMaskDropout(keep[rows], spec.dropout)
        x_t = x[rows].detach().requires_grad_()
        y_t = ref(x_t)
        y_t.backward(grad_y[rows])
        y[rows], dx[rows] = y_t.detach(), x_t.grad
        grads[adapter_id] = (ref.lora_A["default"].weight.grad, ref.lora_B["default"].weight.grad)
    return y, dx, grads


# (id, adapters {id: spec}, segments, training): rows of a table, PEFT's TEST_CASES style.
CASES = [
    (
        "packed-equal-ranks",  # one bmm run serves all three tasks
        {0: LoraSpec(rank=4, alpha=8), 1: LoraSpec(rank=4, alpha=8), 2: LoraSpec(rank=4, alpha=8)},
        Segments.packed([0, 1, 2], [6, 6, 6]),
        False,
    ),
    (
        "packed-mixed-ranks-rslora",
        {0: LoraSpec(rank=2, alpha=4), 1: LoraSpec(rank=8, alpha=16, use_rslora=True), 2: LoraSpec(rank=5, alpha=3)},
        Segments.packed([1, 0, 2], [5, 9, 3]),
        False,
    ),
    (
        "padded-one-task-two-sequences",  # padding rows, adapter 1 owns two segments
        {0: LoraSpec(rank=3, alpha=6), 1: LoraSpec(rank=6, alpha=6)},
        Segments.padded([1, 0, 1], [4, 7, 2], seq_len=8),
        False,
    ),
    (
        "empty-and-absent",  # an empty segment, and adapter 7 which this layer lacks (= padding)
        {0: LoraSpec(rank=4, alpha=4), 3: LoraSpec(rank=2, alpha=8)},
        Segments([3, 0, 7, 3], [0, 2, 9, 14], [2, 0, 5, 6]),
        False,
    ),
    (
        "dropout",  # exact backward: PEFT is handed the very mask the forward drew
        {
            0: LoraSpec(rank=4, alpha=8, dropout=0.3),
            1: LoraSpec(rank=4, alpha=8),
            2: LoraSpec(rank=6, alpha=8, dropout=0.5),
        },
        Segments.padded([0, 1, 2, 0], [5, 5, 5, 3], seq_len=5),
        True,
    ),
    (
        "dropout-in-eval",  # eval mode: no mask, and no 1 / (1 - p) either
        {0: LoraSpec(rank=4, alpha=8, dropout=0.3), 1: LoraSpec(rank=4, alpha=8, dropout=0.3)},
        Segments.packed([0, 1], [6, 6]),
        False,
    ),
]


@pytest.mark.parametrize("adapters,segments,training", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_layer_matches_peft_task_by_task(adapters, segments, training):
    layer = make_layer(adapters).train(training)
    layer.segments = segments
    x = torch.randn(segments.end + 3, K)
    grad_y = torch.randn(x.shape[0], N)

    # Sanity check first (PEFT's mixed-batch test): the tasks' outputs differ from each other
    # and from the base, so agreement below cannot be vacuous.
    outputs = [peft_task_layer(layer, a).eval()(x).detach() for a in layer.adapters]
    base = layer.base_layer(x).detach()
    for i, out in enumerate(outputs):
        assert not torch.allclose(out, base, atol=1e-3)
        assert all(not torch.allclose(out, other, atol=1e-3) for other in outputs[i + 1 :])

    torch.manual_seed(123)
    keep = draw_keep_mask(x.shape[0], K, layer.routing(), device="cpu") if training else None
    assert (keep is not None) == training
    torch.manual_seed(123)  # the layer draws the same mask
    x_ours = x.clone().requires_grad_()
    y = layer(x_ours)
    y.backward(grad_y)

    y_ref, dx_ref, grads_ref = peft_per_task(layer, x, grad_y, keep)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_ours.grad, dx_ref, rtol=1e-5, atol=1e-5)
    for adapter_id in layer.adapters:
        A, B = layer.lora_A[str(adapter_id)], layer.lora_B[str(adapter_id)]
        if adapter_id not in grads_ref:
            assert A.grad is None and B.grad is None  # owns no rows
            continue
        torch.testing.assert_close(A.grad, grads_ref[adapter_id][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(B.grad, grads_ref[adapter_id][1], rtol=1e-5, atol=1e-5)
    assert layer.base_layer.weight.grad is None and layer.base_layer.bias.grad is None


def test_layer_flattens_leading_dims():
    layer = make_layer({0: LoraSpec(rank=4), 1: LoraSpec(rank=2)})
    layer.segments = Segments.padded([1, 0], [3, 5], seq_len=5)
    x = torch.randn(2, 5, K)
    torch.testing.assert_close(layer(x), layer(x.reshape(10, K)).view(2, 5, N))


def test_gradcheck_float64_with_dropout():
    torch.manual_seed(0)
    T, k, n = 13, 5, 4
    ranks = (2, 3, 2)
    x = torch.randn(T, k, dtype=torch.float64, requires_grad=True)
    W, b = torch.randn(n, k, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    A = [torch.randn(r, k, dtype=torch.float64, requires_grad=True) for r in ranks]
    B = [torch.randn(n, r, dtype=torch.float64, requires_grad=True) for r in ranks]
    # adapter 0 twice (rank 2, like adapter 2, so 0-2-0 forms one run), a gap, an empty segment
    routing = LoraRouting(Segments([0, 2, 1, 0], [0, 3, 6, 10], [3, 3, 0, 3]), (0.5, 2.0, 1.5), (0.4, 0.0, 0.5))
    keep = draw_keep_mask(T, k, routing, device="cpu")
    assert keep is not None and not keep.all()

    def op(x, *lora):
        return multi_lora_linear(x, W, b, lora[:3], lora[3:], routing, keep, LoraBackend.TORCH)

    assert torch.autograd.gradcheck(op, (x, *A, *B))


def plain_reference(x, W, b, A, B, routing: LoraRouting, keep):
    """Ordinary autograd, one segment at a time, no batching, no custom backward."""
    delta = torch.zeros(x.shape[0], W.shape[0], dtype=x.dtype)
    for a, start, length in routing.segments:
        rows = torch.arange(start, start + length)
        xd = x[rows]
        if keep is not None and routing.dropouts[a]:
            xd = xd * keep[rows] / (1 - routing.dropouts[a])
        delta = delta.index_add(0, rows, routing.scalings[a] * (xd @ A[a].T) @ B[a].T)
    return F.linear(x, W, b) + delta


@st.composite
def layouts(draw):
    n_adapters = draw(st.integers(1, 4))
    ranks = draw(st.lists(st.integers(1, 8), min_size=n_adapters, max_size=n_adapters))
    scalings = tuple(draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in range(n_adapters))
    dropouts = tuple(draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])) for _ in range(n_adapters))
    ids, starts, lengths, row = [], [], [], 0
    for _ in range(draw(st.integers(0, 6))):
        row += draw(st.integers(0, 3))  # padding rows before the segment
        ids.append(draw(st.integers(0, n_adapters - 1)))
        starts.append(row)
        lengths.append(draw(st.sampled_from([0, 1, 3, 4, 4, 7])))  # repeats make runs likely
        row += lengths[-1]
    rows = row + draw(st.integers(0, 3))
    return ranks, LoraRouting(Segments(ids, starts, lengths), scalings, dropouts), max(rows, 1)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts(),
    dtypes=st.sampled_from([(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]),
    training=st.booleans(),
    split=st.booleans(),
    tile_bytes=st.sampled_from([torch_lora.TILE_BYTES, 200, 64]),
    seed=st.integers(0, 2**16),
)
def test_matches_plain_autograd_on_any_layout(layout, dtypes, training, split, tile_bytes, seed):
    """These shapes are too small to be split or tiled otherwise, so: ``split`` splits every
    run of mixed ranks by rank; a small ``tile_bytes`` cuts the masked products into tiles of
    3 rows (200) or 1 row (64) of fp32, whole members in bf16; both then meet the oracle.
    ``dtypes`` = (activations and base, adapters): fp32 adapters over bf16 are master weights,
    computed in bf16 and given fp32 gradients."""
    dtype, master = dtypes
    ranks, routing, T = layout
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    k, n = 16, 12
    x, W, b, g = rand(T, k), rand(n, k, scale=k**-0.5), rand(n), rand(T, n)
    A = [rand(r, k, scale=k**-0.5) for r in ranks]
    B = [rand(n, r, scale=0.5) for r in ranks]
    torch.manual_seed(seed)
    keep = draw_keep_mask(T, k, routing, device="cpu") if training else None

    def run(op, dt, adapter_dt):
        leaves = [x.detach().to(dt).requires_grad_()] + [t.detach().to(adapter_dt).requires_grad_() for t in (*A, *B)]
        y = op(leaves[0], W.to(dt), b.to(dt), leaves[1 : 1 + len(A)], leaves[1 + len(A) :], routing, keep)
        y.backward(g.to(dt))
        assert all(t.grad is None or t.grad.dtype == t.dtype for t in leaves)
        return [y] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]

    with patched(SPLIT_BREAK_EVEN=0 if split else torch_lora.SPLIT_BREAK_EVEN, TILE_BYTES=tile_bytes):
        ours = run(lambda *args: multi_lora_linear(*args, backend=LoraBackend.TORCH), dtype, master)
    ref = run(plain_reference, torch.float32, torch.float32)  # the oracle runs in fp32 for every case
    for got, want in zip(ours, ref, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # bf16 keeps 8 mantissa bits: judge the error relative to the tensor's norm
            assert (got.float() - want).norm() <= 2e-2 * want.norm() + 1e-3


def test_equal_segments_form_one_run():
    """Equal lengths at equal spacing need one bmm per GEMM, not one per segment, whatever the
    ranks (padded to the largest), scalings and dropout rates of the adapters."""
    same = LoraRouting(Segments.packed([2, 0, 1, 0], [16] * 4), (2.0,) * 3, (0.0,) * 3)
    assert [r.adapters for r in segment_runs(same, (8, 8, 8), 64)] == [(2, 0, 1, 0)]
    padded = LoraRouting(Segments.padded([0, 1, 0], [5, 5, 5], seq_len=9), (2.0, 2.0), (0.0, 0.0))
    (run,) = segment_runs(padded, (8, 8), 64)
    assert (run.start, run.length, run.spacing) == (0, 5, 9)
    mixed = LoraRouting(Segments.packed([0, 1, 2], [4, 4, 4]), (1.0, 2.0, 0.5), (0.1, 0.0, 0.3))
    (run,) = segment_runs(mixed, (8, 4, 2), 64)
    assert (run.scalings, run.dropouts) == ((1.0, 2.0, 0.5), (0.1, 0.0, 0.3))
    split = LoraRouting(Segments([0, 1, 2, 2], [0, 4, 10, 14], [4, 4, 4, 3]), (1.0,) * 3, (0.0,) * 3)
    assert [r.adapters for r in segment_runs(split, (8, 4, 4), 64)] == [
        (0, 1),
        (2,),
        (2,),
    ]  # spacing, then length change


def test_keep_mask_is_one_random_stream_whatever_the_chunk():
    """The mask is drawn in chunks, but from the same RNG words, in the same order, as one
    full-range ``random_`` per span: a given seed gives one mask (what checkpoint recomputation
    relies on), and the generator ends in the same state. Rows outside the span are all True."""
    routing = LoraRouting(Segments([0, 1, 0], [1, 4, 7], [3, 3, 2]), (1.0, 1.0), (0.25, 0.0))
    T, k = 10, 7  # spans rows 1-3 and 7-8: 21 and 14 int16s, neither a whole number of int64s
    threshold = -(2**15) + round(0.25 * 2**16)
    torch.manual_seed(5)
    want = torch.ones(T, k, dtype=torch.bool)
    for first, end in ((1, 4), (7, 9)):
        n = (end - first) * k
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
        want[first:end] = words.view(torch.int16)[:n].view(end - first, k) >= threshold
    after = torch.rand(4)
    for chunk in (1, 3, dropout._DRAW_CHUNK):
        with patched(_DRAW_CHUNK=chunk):
            torch.manual_seed(5)
            assert torch.equal(draw_keep_mask(T, k, routing, device="cpu"), want)
            assert torch.equal(torch.rand(4), after)
    assert not want[1:4].all()


def test_keep_mask_drops_at_the_rate_asked():
    """P(drop) = round(p 2^16) / 2^16: over 2^22 draws the dropped share is p within 5 sigma."""
    for p in (0.05, 0.1, 0.5):
        routing = LoraRouting(Segments.packed([0], [1024]), (1.0,), (p,))
        keep = draw_keep_mask(1024, 4096, routing, device="cpu")
        dropped = 1.0 - keep.float().mean().item()
        assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / keep.numel()), (p, dropped)


def test_mixed_ranks_split_by_rank_when_padding_costs_more():
    """A wide layer splits a run of cycling ranks into one run per rank (members equally
    spaced, so still one strided view each); a narrow one keeps one zero-padded run."""
    routing = LoraRouting(Segments.packed(range(6), [128] * 6), (2.0,) * 6, (0.1,) * 6)
    ranks = (4, 16, 4, 16, 4, 8)
    (one,) = segment_runs(routing, ranks, 128)
    assert one.adapters == tuple(range(6))
    pieces = segment_runs(routing, ranks, 8192)
    assert [(r.adapters, r.start, r.spacing) for r in pieces] == [
        ((0, 2, 4), 0, 256),
        ((1, 3), 128, 256),
        ((5,), 640, 128),
    ]


@contextmanager
def patched(**constants: int) -> Iterator[None]:
    """Runs with the given ``torch_lora`` or ``dropout`` constants, clearing the caches that depend on them."""
    home = {name: torch_lora if hasattr(torch_lora, name) else dropout for name in constants}
    old = {name: getattr(home[name], name) for name in constants}

    def set_all(values: dict[str, int]) -> None:
        for name, value in values.items():
            setattr(home[name], name, value)
        segment_runs.cache_clear()
        torch_lora._tiles.cache_clear()

    set_all(constants)
    try:
        yield
    finally:
        set_all(old)


@pytest.mark.parametrize(
    "ids,starts,lengths,message",
    [
        ([0, 1], [0], [2], "differ in length"),
        ([0, 1], [0, 2], [3, 1], r"starts\[1\] = 2"),
        ([0, 1], [4, 0], [1, 1], r"starts\[1\] = 0"),
        ([0], [0], [-1], r"lengths\[0\] = -1"),
        ([-2], [0], [1], r"adapter_ids\[0\] = -2"),
    ],
)
def test_segments_reject_bad_layouts(ids, starts, lengths, message):
    with pytest.raises(ValueError, match=message):
        Segments(ids, starts, lengths)


def test_misuse_is_an_error():
    layer = make_layer({0: LoraSpec(rank=2)})
    with pytest.raises(RuntimeError, match="segments_context"):
        layer(torch.randn(3, K))
    layer.segments = Segments.packed([0], [5])
    with pytest.raises(ValueError, match="T >= 5"):
        layer(torch.randn(3, K))
    layer.base_layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen"):
        layer(torch.randn(5, K))
    with pytest.raises(ValueError, match="names an adapter"):
        LoraRouting(Segments.packed([1], [2]), (1.0,), (0.0,))
    lists = LoraRouting(Segments.packed([0], [2]), [1.0], [0.0])  # lists are fine: stored as tuples
    assert hash(lists) == hash(LoraRouting(Segments.packed([0], [2]), (1.0,), (0.0,)))


def test_a_16_bit_base_keeps_fp32_master_adapters():
    """Over a bf16 base the adapters are fp32 parameters (an AdamW step of ~1e-4 relative size
    would round away in bf16) while the output stays bf16; over fp32 they are fp32."""
    layer = MultiLoraLinear(nn.Linear(16, 8).to(torch.bfloat16))
    layer.add_adapter(0, LoraSpec(rank=4, alpha=8, dropout=0.1))
    layer.segments = Segments.packed([0], [5])
    y = layer(torch.randn(5, 16, dtype=torch.bfloat16))
    y.float().sum().backward()
    A, B = layer.lora_A["0"], layer.lora_B["0"]
    assert (A.dtype, B.dtype, y.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    assert (A.grad.dtype, B.grad.dtype) == (torch.float32, torch.float32) and B.grad.abs().sum() > 0
    assert multi_lora.adapter_dtype(torch.float32) is torch.float32
