"""A token split played rank by rank in one process, and the comparison of a forward and backward's results, for the
backends' tests (``test_token_split.py``, and the Triton interpreter's ``kernels/interpreted_segment_lora.py``):
imports neither triton nor the kernels."""

from __future__ import annotations

from unittest import mock

import torch

from lorafleet.executor.torch.multi_lora import multi_lora_linear
from lorafleet.executor.torch.routing import LoraBackend, LoraRouting
from lorafleet.executor.torch.token_split import TokenSplit
from tests.helpers.segment_lora_cases import CaseTensors, result_names


def _own_rows(self: TokenSplit, buffer: torch.Tensor, total: int) -> torch.Tensor:
    """A rank's rows of the buffer, unsummed: the collective of a group whose other ranks contribute zeros."""
    first, end = self.bounds(total)
    return buffer[first:end]


def split_forward_backward(
    backend: LoraBackend, t: CaseTensors, routing: LoraRouting, keep: torch.Tensor | None, size: int
) -> list[torch.Tensor | None]:
    """``forward_backward``'s ``[y, dx, dA.., dB..]`` under a token split over ``size`` ranks played one after another
    in this process. Each call keeps ``B`` whole, so its ``dS'`` buffer already holds the group's sum and the
    reduce-scatter is replaced by the rank's own rows (:func:`_own_rows`); ``dA`` is then the sum of the ranks'
    partials over their rows (what ``grad_sync`` sums), ``y``, ``dx`` and ``dB`` each rank's (equal)."""
    calls = []
    with mock.patch.object(TokenSplit, "reduce", _own_rows):
        for rank in range(size):
            split = TokenSplit(rank, size, None)
            first, end = split.bounds(t.x.shape[0])
            leaves = [v.clone().requires_grad_() for v in (t.x, *t.A, *t.B)]
            n = len(t.A)
            x_rows = t.x[first:end].clone()
            y = multi_lora_linear(
                leaves[0], t.W, t.b, leaves[1 : 1 + n], leaves[1 + n :], routing, keep, backend, None, split, x_rows
            )
            y.backward(t.grad_y)
            calls.append([y.detach()] + [v.grad for v in leaves])
    n = len(t.A)
    for other in calls[1:]:
        for name, a, b in zip(result_names(n), calls[0], other, strict=True):
            same = (a is None and b is None) if a is None or b is None else torch.equal(a, b)
            assert name.startswith("dA") or same, name  # only dA depends on the rank
    dA = [None if g is None else sum(c[2 + a] for c in calls) for a, g in enumerate(calls[0][2 : 2 + n])]
    return [*calls[0][:2], *dA, *calls[0][2 + n :]]


def assert_results_close(got: list[torch.Tensor | None], want: list[torch.Tensor | None], n: int, tol: float) -> None:
    """``forward_backward``-style results equal within ``tol`` (relative and absolute), None (an adapter with no
    rows: no gradient) where ``want`` has None."""
    for g, w, name in zip(got, want, result_names(n), strict=True):
        if w is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
