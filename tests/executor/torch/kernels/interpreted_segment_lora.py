"""Triton kernels against the torch path, in Triton's interpreter (fp32, tiny shapes, CPU).

Not collected by the normal run (the file name does not start with ``test_``):
``test_segment_lora.py`` (beside it) runs it in a subprocess with TRITON_INTERPRET=1 from the start.

``TRITON_INTERPRET=1`` must be set before *triton* is first imported, not just before the
kernels are: ``triton.language``'s own helpers (``tl.zeros``, ...) are ``@jit`` functions
decorated at import, and ``peft`` imports triton (through torch), so in a normal test session
it is too late.

bf16 is not tested here: the interpreter's ``tl.dot`` multiplies bf16 bit patterns (Triton
issues #4972, #11584). Each case caps the tiles at 16 or 64, so the cases cover one-tile and
multi-tile code (loops over K, N, rank and a segment's rows). The cases live in
``tests/helpers/segment_lora_cases.py``, shared with the compiled run on a GPU (``tests/gpu``).
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "run these cases through tests/executor/torch/kernels/test_segment_lora.py (needs TRITON_INTERPRET=1 before "
        "triton loads)"
    )


import pytest
import torch

from lorafleet.executor.torch.dropout import draw_keep_mask
from lorafleet.executor.torch.multi_lora import multi_lora_linear
from lorafleet.executor.torch.routing import LoraBackend, LoraRouting, Segments
from tests.executor.torch.token_split_cases import assert_results_close, split_forward_backward
from tests.helpers.segment_lora_cases import (
    CASE_IDS,
    CASE_PARAMS,
    case_routing,
    case_tensors,
    forward_backward,
)


@pytest.mark.parametrize("split", [0, 3], ids=["whole", "token-split-3"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("tile,K,N,ranks,segments", CASE_PARAMS, ids=CASE_IDS)
def test_triton_matches_torch(tile, K, N, ranks, segments, dropout, split, monkeypatch):
    """Triton's forward and backward equal the torch backend's; with ``split`` its backward under a token split over
    that many ranks (``token_split.py``: ``dA`` from each rank's rows, a rank may own none of an adapter's), played
    rank by rank, sums to the torch backend's whole-input gradients."""
    from lorafleet.executor.torch.kernels import segment_lora

    monkeypatch.setattr(segment_lora, "BLOCK_M", tile)
    monkeypatch.setattr(segment_lora, "BLOCK_N", tile)
    tensors = case_tensors(K, N, ranks, segments)
    routing = case_routing(ranks, segments, dropout)
    torch.manual_seed(0)
    keep = draw_keep_mask(tensors.x.shape[0], K, routing, device="cpu")
    assert (keep is None) == (dropout == 0.0)

    if split:
        got = split_forward_backward(LoraBackend.TRITON, tensors, routing, keep, split)
    else:
        got = forward_backward(LoraBackend.TRITON, tensors, routing, keep)
    want = forward_backward(LoraBackend.TORCH, tensors, routing, keep)
    assert_results_close(got, want, len(ranks), 1e-4)  # an adapter with no rows: no gradient from either


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
    again = segment_lora._tables(
        LoraRouting(Segments([0, 1], [0, 9], [9, 5]), (1.0, 2.0), (0.0, 0.25)), torch.device("cpu")
    )
    assert all(a is b for a, b in zip(first, again))
    ints, floats = first
    assert ints.tolist() == [0, 9, 9, 5, 0, 1, 0, 1, 2, 0, 1]  # starts | lengths | ids | CSR offsets | by adapter
    assert torch.equal(floats, torch.tensor([1.0, 2.0, 1.0, 1 / 0.75]))
