"""The Triton kernels compiled for a GPU, against the torch backend on the same GPU: the cases of
``tests/helpers/segment_lora_cases.py`` (CPU twin: the same cases in Triton's interpreter,
``tests/executor/torch/kernels/test_segment_lora.py``) in fp32 and bf16, plus one wide case at the
kernels' own tile sizes; and ``LoraBackend.AUTO`` choosing Triton for CUDA tensors.

bf16 (which the interpreter cannot run) is judged as ``tests/executor/torch/test_multi_lora.py`` judges
the torch backend's bf16: by the error relative to the tensor's norm, against an fp32 oracle
computed from the same bf16-rounded operands.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lorafleet.executor.torch.dropout import draw_keep_mask
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.routing import LoraBackend, Segments
from lorafleet.specs.lora import LoraSpec
from tests.helpers.segment_lora_cases import (
    CASE_IDS,
    CASE_PARAMS,
    case_routing,
    case_tensors,
    forward_backward,
    result_names,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CPU twin: tests/executor/torch/kernels/test_segment_lora.py, in Triton's interpreter)",
)

CUDA = torch.device("cuda")
#: 8 adapters of 128 rows on a 1024-wide layer, at the kernels' own tiles (64): many row and column tiles.
WIDE = ("eight-adapters-wide", 64, 1024, 1024, (16,) * 8, Segments.packed(range(8), [128] * 8))
PARAMS = [*CASE_PARAMS, WIDE[1:]]
IDS = [*CASE_IDS, WIDE[0]]


def _compare(tile, K, N, ranks, segments, dropout, dtype, monkeypatch):
    from lorafleet.executor.torch.kernels import segment_lora

    monkeypatch.setattr(segment_lora, "BLOCK_M", tile)
    monkeypatch.setattr(segment_lora, "BLOCK_N", tile)
    tensors = case_tensors(K, N, ranks, segments).to(CUDA, dtype)
    routing = case_routing(ranks, segments, dropout)
    torch.manual_seed(0)
    keep = draw_keep_mask(tensors.x.shape[0], K, routing, device=CUDA)
    got = forward_backward(LoraBackend.TRITON, tensors, routing, keep)
    torch_backend = forward_backward(LoraBackend.TORCH, tensors, routing, keep)
    oracle = forward_backward(LoraBackend.TORCH, tensors.to(dtype=torch.float32), routing, keep)
    return got, torch_backend, oracle


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("tile,K,N,ranks,segments", PARAMS, ids=IDS)
def test_compiled_triton_matches_torch_fp32(tile, K, N, ranks, segments, dropout, monkeypatch):
    got, want, _ = _compare(tile, K, N, ranks, segments, dropout, torch.float32, monkeypatch)
    wide = K == WIDE[2]
    for g, w, name in zip(got, want, result_names(len(ranks)), strict=True):
        if w is None:  # an adapter with no rows gets no gradient from either backend
            assert g is None, name
        elif not wide:  # the interpreter's tolerance
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        else:  # sums of 128-1024 products of magnitude ~10-100, in another order: fp32 rounding, relative to the norm
            assert (g - w).norm() <= 1e-5 * w.norm(), f"{name}: |error| {(g - w).norm():.3g}, |want| {w.norm():.3g}"


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("tile,K,N,ranks,segments", PARAMS, ids=IDS)
def test_compiled_triton_bf16_meets_the_fp32_oracle(tile, K, N, ranks, segments, dropout, monkeypatch):
    got, torch_bf16, oracle = _compare(tile, K, N, ranks, segments, dropout, torch.bfloat16, monkeypatch)
    for g, t, want, name in zip(got, torch_bf16, oracle, result_names(len(ranks)), strict=True):
        if want is None:
            assert g is None and t is None, name
            continue
        assert g.dtype == torch.bfloat16, name
        for backend, value in (("triton", g), ("torch", t)):  # both backends, so a failure says which strays
            error, bound = (value.float() - want).norm(), 2e-2 * want.norm() + 1e-3
            assert error <= bound, f"{name} ({backend} bf16): |error| {error:.3g} > {bound:.3g}"


def test_no_rows_is_the_base_layer():
    from lorafleet.executor.torch.multi_lora import multi_lora_linear
    from lorafleet.executor.torch.routing import LoraRouting

    x, W = torch.randn(5, 16, device=CUDA), torch.randn(8, 16, device=CUDA)
    A = [torch.randn(4, 16, device=CUDA, requires_grad=True)]
    B = [torch.randn(8, 4, device=CUDA, requires_grad=True)]
    routing = LoraRouting(Segments([0], [2], [0]), (1.0,), (0.0,))
    torch.testing.assert_close(multi_lora_linear(x, W, None, A, B, routing, None, LoraBackend.TRITON), x @ W.T)


def test_auto_is_triton_for_cuda_tensors(monkeypatch):
    """A layer left at its default backend (AUTO) runs the Triton kernels, forward and backward, on CUDA."""
    from lorafleet.executor.torch.kernels import segment_lora

    calls = []
    forward, backward = segment_lora.forward, segment_lora.backward
    monkeypatch.setattr(segment_lora, "forward", lambda *a: calls.append("forward") or forward(*a))
    monkeypatch.setattr(segment_lora, "backward", lambda *a: calls.append("backward") or backward(*a))
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(64, 32)).to(CUDA)
    assert layer.backend is LoraBackend.AUTO
    layer.add_adapter(0, LoraSpec(rank=8, alpha=16))
    layer.add_adapter(1, LoraSpec(rank=4, alpha=4))
    with torch.no_grad():
        for b in layer.lora_B.values():
            b.normal_()  # B != 0: the adapters change the output
    layer.segments = Segments.packed([0, 1], [5, 3])
    x = torch.randn(8, 64, device=CUDA, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert calls == ["forward", "backward"]
    layer.backend = LoraBackend.TORCH
    torch.testing.assert_close(y, layer(x), rtol=1e-4, atol=1e-4)
    assert calls == ["forward", "backward"]  # the torch backend does not touch the kernels
