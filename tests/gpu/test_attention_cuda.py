"""FlashAttention's varlen kernel against the per-document SDPA loop on the same GPU, forward and
backward, in bf16: packed rows (documents of several lengths), right-padded rows (one document a
row), grouped-query heads and a sliding window. CPU twin: the loop itself is what the CPU runs,
checked against the transformers models in ``tests/executor/torch/test_step.py``."""

from __future__ import annotations

import pytest
import torch

from lorafleet.executor.torch import attention

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (CPU twin: the per-document loop, tests/executor/torch/test_step.py)",
    ),
    pytest.mark.skipif(attention.varlen_attn is None, reason="this torch has no torch.nn.attention.varlen"),
]


@pytest.mark.parametrize("rows,bounds", [(1, (0, 37, 38, 101, 160)), (3, (0, 48))], ids=["packed", "padded"])
@pytest.mark.parametrize("window", [None, 16])
def test_varlen_matches_the_loop(rows, bounds, window):
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, d, s = 8, 2, 64, bounds[-1]

    def rand(h):
        return torch.randn(rows, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(rows, s, heads, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    assert attention.uses_varlen(q, 0.0)
    out = attention.varlen_documents(q, k, v, bounds, window, d**-0.5)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    groups = heads // kv_heads
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention.per_document(
        qf, kf.repeat_interleave(groups, 1), vf.repeat_interleave(groups, 1), bounds, window, scaling=d**-0.5
    )
    want = [ref, *torch.autograd.grad(ref, (qf, kf, vf), grad.float())]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert (g.float() - w).norm() <= 2e-2 * w.norm(), name
