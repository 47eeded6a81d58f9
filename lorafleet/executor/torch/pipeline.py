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

**Schedule.** The order of a stage's forwards and backwards comes from
``costmodel.schedule.stream_order`` (1F1B over a window of steps; one step is 1F1B flushed, as in
Megatron-LM): :func:`run_stream` only carries it out. Sends are posted without waiting (each
message has its own tag, the micro-batch's position in the window and its direction, and is
waited for at the end of the window), receives are waited for when the op needs them, so a stage
never blocks on a neighbour that is busy elsewhere in its order. Because every task's loss is
normalised by its *global* token count before the step, the gradients of a step's micro-batches
simply accumulate: no flush-time rescaling.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lorafleet.costmodel.schedule import FORWARD
from lorafleet.plans import MicroBatch
from lorafleet.runtime.layout import RankRole


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


def run_stream(
    microbatches: Sequence[MicroBatch],
    order: Sequence[tuple[str, int]],
    role: RankRole,
    neighbours: Neighbours,
    forward: Callable[[int, Tensor | None], Tensor],
    after_op: Callable[[str, int, float], None] = lambda kind, i, seconds: None,
) -> None:
    """Runs this stage's forwards and backwards of ``microbatches`` in ``order``.

    Args:
        microbatches: the replica's micro-batches of the window, in stream order (every stage of it
            gets the same sequence).
        order: ``("F", i)`` / ``("B", i)`` ops (``costmodel.schedule.stream_order`` of this stage); a micro-batch
            without a backward in it (an evaluation's, forward only) keeps neither its input nor its output.
        role: this rank's stage.
        neighbours: peers and activation layout.
        forward: ``forward(i, x)`` runs micro-batch ``i`` on this stage; ``x`` is the received
            activation ``(B, S, H)`` (None on the first stage). It returns the activation to
            send on, or, on the last stage, the scalar loss to differentiate.
        after_op: called with ``(kind, i, seconds)`` after each op; ``seconds`` is its compute time,
            from its input's arrival to its output's send (what ``costmodel.schedule.timeline``
            replays).
    """
    first, last = role.is_first_stage, role.is_last_stage
    backward = {i for kind, i in order if kind != FORWARD}  # forward-only ops (an evaluation's) keep nothing
    inputs: dict[int, Tensor | None] = {}
    outputs: dict[int, Tensor] = {}
    sends: list[tuple[dist.Work, Tensor]] = []  # kept alive until sent

    def send(tensor: Tensor, peer: int | None, tag: int) -> None:
        tensor = tensor.contiguous()
        sends.append((dist.isend(tensor, peer, tag=tag), tensor))

    def recv(i: int, peer: int | None, tag: int) -> Tensor:
        buffer = neighbours.buffer(microbatches[i])
        dist.irecv(buffer, peer, tag=tag).wait()
        return buffer

    for kind, i in order:
        if kind == FORWARD:
            x = None if first else recv(i, neighbours.prev, 2 * i)
            start = time.perf_counter()
            if x is not None and i in backward:
                x.requires_grad_(True)
            y = forward(i, x)
            if i in backward:
                inputs[i], outputs[i] = x, y
            if not last:
                send(y.detach(), neighbours.next, 2 * i)
        else:
            grad = None if last else recv(i, neighbours.next, 2 * i + 1)
            start = time.perf_counter()
            x, y = inputs.pop(i), outputs.pop(i)
            if y.requires_grad:  # a first stage whose layers hold no adapter has nothing to differentiate
                torch.autograd.backward(y, grad)
            if not first:
                send(x.grad, neighbours.prev, 2 * i + 1)
        after_op(kind, i, time.perf_counter() - start)
    for work, _ in sends:
        work.wait()
