"""The segmented-LoRA cases both kernel tests run: in Triton's interpreter on CPU
(``tests/executor/torch/kernels/interpreted_segment_lora.py``, fp32) and compiled on a GPU
(``tests/gpu/test_segment_lora_cuda.py``, fp32 and bf16), each against the torch backend.

Importing this module imports neither triton nor the kernels (``multi_lora`` loads them on first
use), so the interpreter's file can import it after checking TRITON_INTERPRET.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lorafleet.executor.torch.multi_lora import multi_lora_linear
from lorafleet.executor.torch.routing import LoraBackend, LoraRouting, Segments

# (id, tile cap, K, N, ranks, segments): 2-4 segments, an empty one, odd lengths, padding rows,
# an adapter owning two segments. Each case caps the tiles (BLOCK_M, BLOCK_N) at 16 or 64, so the
# cases cover one-tile and multi-tile code (loops over K, N, rank and a segment's rows).
CASES = [
    ("two-segments", 64, 16, 24, (4, 8), Segments([0, 1], [0, 9], [9, 5])),
    ("empty-and-repeat", 16, 40, 33, (3, 8, 5), Segments([2, 0, 1, 2], [1, 8, 8, 30], [7, 0, 19, 3])),
    ("rank-over-a-tile", 16, 24, 20, (20, 2), Segments([1, 0, 1], [0, 5, 40], [5, 35, 11])),
    ("padding-rows", 64, 64, 64, (16, 16, 7), Segments([0, 1, 2], [3, 20, 41], [13, 17, 11])),
]
CASE_IDS = [c[0] for c in CASES]
CASE_PARAMS = [c[1:] for c in CASES]
"""``(tile, K, N, ranks, segments)`` of every case, for ``pytest.mark.parametrize``."""


@dataclass(frozen=True)
class CaseTensors:
    """One case's operands: ``x (T, K)``, ``W (N, K)``, ``b (N,)``, ``A[a] (r_a, K)``, ``B[a] (N, r_a)``,
    upstream gradient ``grad_y (T, N)``; T = the segments' end + 2 padding rows."""

    x: Tensor
    W: Tensor
    b: Tensor
    A: tuple[Tensor, ...]
    B: tuple[Tensor, ...]
    grad_y: Tensor

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> CaseTensors:
        def move(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype)

        return CaseTensors(
            move(self.x),
            move(self.W),
            move(self.b),
            tuple(map(move, self.A)),
            tuple(map(move, self.B)),
            move(self.grad_y),
        )


def case_tensors(K: int, N: int, ranks: tuple[int, ...], segments: Segments) -> CaseTensors:
    """Seeded random operands of a case, fp32 on the host."""
    gen = torch.Generator().manual_seed(K + N)
    T = segments.end + 2
    x = torch.randn(T, K, generator=gen)
    W, b = torch.randn(N, K, generator=gen) / K**0.5, torch.randn(N, generator=gen)
    A = tuple(torch.randn(r, K, generator=gen) / K**0.5 for r in ranks)
    B = tuple(torch.randn(N, r, generator=gen) for r in ranks)
    return CaseTensors(x, W, b, A, B, torch.randn(T, N, generator=gen))


def case_routing(ranks: tuple[int, ...], segments: Segments, dropout: float) -> LoraRouting:
    """Adapter ``a`` scales by ``1 + a``; every adapter has dropout ``dropout``."""
    return LoraRouting(segments, tuple(1.0 + i for i in range(len(ranks))), (dropout,) * len(ranks))


def result_names(n_adapters: int) -> list[str]:
    """Names of :func:`forward_backward`'s results, in order."""
    return ["y", "dx", *(f"dA{a}" for a in range(n_adapters)), *(f"dB{a}" for a in range(n_adapters))]


def forward_backward(
    backend: LoraBackend, t: CaseTensors, routing: LoraRouting, keep: Tensor | None
) -> list[Tensor | None]:
    """``[y, dx, dA_0.., dB_0..]`` of one forward and backward (None: an adapter with no rows gets no gradient)."""
    leaves = [v.clone().requires_grad_() for v in (t.x, *t.A, *t.B)]
    n = len(t.A)
    y = multi_lora_linear(leaves[0], t.W, t.b, leaves[1 : 1 + n], leaves[1 + n :], routing, keep, backend)
    y.backward(t.grad_y)
    return [y.detach()] + [v.grad for v in leaves]
