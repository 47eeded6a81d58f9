"""Pipeline parallelism: split a causal LM into stages, run micro-batches 1F1B across them.

**Split.** Stage ``k`` keeps the decoder layers of its range (in a ``ModuleDict`` keyed by the
original index, so ``model.layers.5.mlp.up_proj`` keeps its name for checkpoints and PEFT
export); stage 0 also keeps the token embedding, the last stage the final norm and LM head.
Every stage keeps the rotary embedding (no weights, only ``inv_freq``).

**Transport.** Activations ``(B, S, H)`` go forward to the next stage, their gradients back,
by point-to-point ``isend``/``irecv`` between the ranks of equal TP rank in neighbouring
stages. No shape header is sent: every rank holds the whole StepPlan, so the receiver knows
each micro-batch's ``(B, S)`` already (:func:`microbatch_shape`), which saves one message and
one synchronisation per transfer; variable-length micro-batches need nothing more.

**Schedule.** 1F1B (PipeDream-flush, as in Megatron-LM): stage ``k`` of ``P`` runs
``w = min(P - k - 1, n)`` warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards. At most ``P - k`` micro-batches' activations are alive
on stage ``k``, against ``n`` for GPipe. Sends and receives that happen together (forward
out, gradient in) are posted as one batch, so two neighbours never wait on each other.
Because every task's loss is normalised by its *global* token count before the step, the
gradients of the ``n`` micro-batches simply accumulate: no flush-time rescaling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lorafleet.executor.torch.layout import RankRole
from lorafleet.plans import MicroBatch


def microbatch_shape(mb: MicroBatch) -> tuple[int, int]:
    """``(B, S)`` of a micro-batch's token grid: one row per sequence (padded) or one packed row."""
    if mb.padded_len is None:
        return 1, sum(mb.lengths)
    return len(mb.lengths), mb.padded_len


def split_for_pipeline(model: nn.Module, role: RankRole) -> None:
    """Drops, in place, every part of an HF causal LM that ``role``'s stage does not run."""
    inner = model.model
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in role.layers})
    if not role.is_first_stage:
        inner.embed_tokens = None
    if not role.is_last_stage:
        inner.norm = None
        model.lm_head = None


@dataclass(frozen=True)
class Neighbours:
    """The pipeline peers of one rank and the activation layout they exchange."""

    prev: int | None
    next: int | None
    hidden: int
    dtype: torch.dtype
    device: torch.device

    def buffer(self, mb: MicroBatch) -> Tensor:
        """An empty activation (or activation-gradient) tensor for micro-batch ``mb``: ``(B, S, H)``."""
        return torch.empty((*microbatch_shape(mb), self.hidden), dtype=self.dtype, device=self.device)


def _exchange(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> None:
    """Posts every send and receive at once and waits for all of them."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def run_1f1b(
    microbatches: tuple[MicroBatch, ...],
    role: RankRole,
    neighbours: Neighbours,
    forward: Callable[[int, Tensor | None], Tensor],
) -> None:
    """Runs forward and backward of every micro-batch on this rank's stage, 1F1B order.

    Args:
        microbatches: the replica's micro-batches (every stage of it gets the same tuple).
        role: this rank's stage.
        neighbours: peers and activation layout.
        forward: ``forward(i, x)`` runs micro-batch ``i`` on this stage; ``x`` is the received
            activation ``(B, S, H)`` (None on the first stage). It returns the activation to
            send on, or, on the last stage, the scalar loss to differentiate.
    """
    n = len(microbatches)
    first, last = role.is_first_stage, role.is_last_stage
    inputs: dict[int, Tensor | None] = {}
    outputs: dict[int, Tensor] = {}

    def recv_input(i: int) -> Tensor | None:
        if first:
            return None
        x = neighbours.buffer(microbatches[i])
        _exchange([], [(x, neighbours.prev)])
        return x

    def run_forward(i: int, x: Tensor | None) -> Tensor:
        if x is not None:
            x.requires_grad_(True)
        inputs[i], outputs[i] = x, forward(i, x)
        return outputs[i]

    def run_backward(i: int, grad: Tensor | None) -> Tensor | None:
        """Backward of micro-batch ``i``; returns the gradient of its input (None on stage 0)."""
        x, y = inputs.pop(i), outputs.pop(i)
        if y.requires_grad:  # a first stage whose layers hold no adapter has nothing to differentiate
            torch.autograd.backward(y, None if last else grad)
        return None if x is None else x.grad

    def send_output_recv_grad(y: Tensor, j: int) -> Tensor | None:
        """Send micro-batch's output on; receive the gradient of micro-batch ``j``'s output."""
        if last:
            return None
        grad = neighbours.buffer(microbatches[j])
        _exchange([(y.detach(), neighbours.next)], [(grad, neighbours.next)])
        return grad

    def send_grad_recv_input(dx: Tensor | None, i: int | None) -> Tensor | None:
        """Send a gradient back; receive micro-batch ``i``'s input (when ``i`` is not None)."""
        x = None if (first or i is None) else neighbours.buffer(microbatches[i])
        sends = [] if first else [(dx, neighbours.prev)]
        _exchange(sends, [] if x is None else [(x, neighbours.prev)])
        return x

    warmup = min(role.replica.pp - role.stage - 1, n)
    for i in range(warmup):
        y = run_forward(i, recv_input(i))
        if not last:
            _exchange([(y.detach(), neighbours.next)], [])
    x = recv_input(warmup) if warmup < n else None
    for j in range(n - warmup):  # steady state: forward i = warmup + j, backward j
        i = warmup + j
        grad = send_output_recv_grad(run_forward(i, x), j)
        dx = run_backward(j, grad)
        x = send_grad_recv_input(dx, i + 1 if i + 1 < n else None)
    for j in range(n - warmup, n):  # cool-down: the backwards still owed
        grad = None
        if not last:
            grad = neighbours.buffer(microbatches[j])
            _exchange([], [(grad, neighbours.next)])
        send_grad_recv_input(run_backward(j, grad), None)
