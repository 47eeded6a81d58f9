"""Triton kernels against the torch path, in Triton's interpreter (fp32, tiny shapes, CPU).

Not collected by the normal run (the file name does not start with ``test_``):
``test_segment_lora_kernels.py`` runs it in a subprocess with TRITON_INTERPRET=1 from the start.

``TRITON_INTERPRET=1`` must be set before *triton* is first imported, not just before the
kernels are: ``triton.language``'s own helpers (``tl.zeros``, ...) are ``@jit`` functions
decorated at import, and ``peft`` imports triton (through torch), so in a normal test session
it is too late.

bf16 is not tested here: the interpreter's ``tl.dot`` multiplies bf16 bit patterns (Triton
issues #4972, #11584). Each case caps the tiles at 16 or 64, so the cases cover one-tile and
multi-tile code (loops over K, N, rank and a segment's rows).
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run these cases through tests/executor/test_segment_lora_kernels.py (needs TRITON_INTERPRET=1 before triton loads)")


import pytest
import torch

from lorafleet.executor.torch.multi_lora import LoraBackend, LoraRouting, Segments, draw_keep_mask, multi_lora_linear


# (id, tile cap, K, N, ranks, segments): 2-4 segments, an empty one, odd lengths, padding rows,
# an adapter owning two segments.
CASES = [
    ("two-segments", 64, 16, 24, (4, 8), Segments([0, 1], [0, 9], [9, 5])),
    ("empty-and-repeat", 16, 40, 33, (3, 8, 5), Segments([2, 0, 1, 2], [1, 8, 8, 30], [7, 0, 19, 3])),
    ("rank-over-a-tile", 16, 24, 20, (20, 2), Segments([1, 0, 1], [0, 5, 40], [5, 35, 11])),
    ("padding-rows", 64, 64, 64, (16, 16, 7), Segments([0, 1, 2], [3, 20, 41], [13, 17, 11])),
]


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("tile,K,N,ranks,segments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_triton_matches_torch(tile, K, N, ranks, segments, dropout, monkeypatch):
    from lorafleet.executor.torch.kernels import segment_lora

    monkeypatch.setattr(segment_lora, "BLOCK_M", tile)
    monkeypatch.setattr(segment_lora, "BLOCK_N", tile)
    gen = torch.Generator().manual_seed(K + N)
    T = segments.end + 2
    x = torch.randn(T, K, generator=gen)
    W, b = torch.randn(N, K, generator=gen) / K**0.5, torch.randn(N, generator=gen)
    A = [torch.randn(r, K, generator=gen) / K**0.5 for r in ranks]
    B = [torch.randn(N, r, generator=gen) for r in ranks]
    grad_y = torch.randn(T, N, generator=gen)
    routing = LoraRouting(segments, tuple(1.0 + i for i in range(len(ranks))), (dropout,) * len(ranks))
    torch.manual_seed(0)
    keep = draw_keep_mask(T, K, routing, device="cpu")
    assert (keep is None) == (dropout == 0.0)

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in (x, *A, *B)]
        y = multi_lora_linear(leaves[0], W, b, leaves[1 : 1 + len(A)], leaves[1 + len(A) :], routing, keep, backend)
        y.backward(grad_y)
        return [y.detach()] + [t.grad for t in leaves]

    names = ["y", "dx", *(f"dA{a}" for a in range(len(A))), *(f"dB{a}" for a in range(len(B)))]
    for got, want, name in zip(run(LoraBackend.TRITON), run(LoraBackend.TORCH), names, strict=True):
        if want is None:  # an adapter with no rows gets no gradient from either backend
            assert got is None, name
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_no_rows_is_the_base_layer():
    x, W = torch.randn(5, 16), torch.randn(8, 16)
    A, B = [torch.randn(4, 16, requires_grad=True)], [torch.randn(8, 4, requires_grad=True)]
    routing = LoraRouting(Segments([0], [2], [0]), (1.0,), (0.0,))
    y = multi_lora_linear(x, W, None, A, B, routing, None, LoraBackend.TRITON)
    torch.testing.assert_close(y, x @ W.T)


def test_tables_are_copied_once_per_routing():
    """Every layer of a micro-batch shares a routing, so its device tables are built once."""
    from lorafleet.executor.torch.kernels import segment_lora

    routing = LoraRouting(Segments([0, 1], [0, 9], [9, 5]), (1.0, 2.0), (0.0, 0.25))
    first = segment_lora._tables(routing, torch.device("cpu"))
    again = segment_lora._tables(LoraRouting(Segments([0, 1], [0, 9], [9, 5]), (1.0, 2.0), (0.0, 0.25)), torch.device("cpu"))
    assert all(a is b for a, b in zip(first, again))
    ints, floats = first
    assert ints.tolist() == [0, 9, 9, 5, 0, 1, 0, 1, 2, 0, 1]  # starts | lengths | ids | CSR offsets | by adapter
    assert torch.equal(floats, torch.tensor([1.0, 2.0, 1.0, 1 / 0.75]))
