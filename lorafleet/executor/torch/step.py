"""One rank's share of a training step: micro-batch tensors, stage forward, per-task loss.

**Loss normalisation.** Task ``t`` owns ``N_t`` loss tokens in the *whole* global batch
(labels after the causal shift that are not ignored), counted on the host from the examples
before any forward, the way torchtitan divides by the global count of valid tokens. The step
minimises

    L = Σ_t L_t,        L_t = (1 / N_t) Σ_{i ∈ tokens of t} ℓ_i,      ℓ_i = -log p(y_i | y_<i)

Each token carries the weight ``1 / N_t`` of its task, so a replica's partial loss
``Σ_{i on r} ℓ_i / N_{t(i)}`` differentiates to its share of every ``∂L_t/∂θ_t``, and the
sum over replicas (``grad_sync``) is exactly the gradient of training task ``t`` alone on its
sequences. Adapter ``θ_t`` sees only task ``t``'s rows and attention never crosses sequences,
so ``∂L/∂θ_t = ∂L_t/∂θ_t``: tasks do not leak into each other's gradients.

**Token grid.** A padded micro-batch is ``(B, padded_len)``, one sequence a row, right-padded;
a packed one is ``(1, Σ lengths)``. A token attends to earlier tokens of its own sequence (and
within a sliding window when the layer has one): in a packed row per sequence slice
(``document_attention``), in a padded one causally over the whole row, with no mask. That is
exact: the padding comes after the sequence, so causality alone keeps every real token from
seeing it; padding tokens see their row's tokens, but take no loss, and nothing real attends
to them, so every gradient through them is exactly zero. No ``(B, S, S)`` mask is built (at
16K tokens one would be 512 MiB in bf16, and it would keep SDPA off its flash kernels).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from lorafleet.costmodel.schedule import StreamMicroBatch, stream_order
from lorafleet.data.tokenize import IGNORE_INDEX, Example
from lorafleet.executor.torch.attention import uses_document_attention
from lorafleet.executor.torch.families import final_logits, rotary_tables
from lorafleet.executor.torch.inject import segments_context
from lorafleet.executor.torch.pipeline import Neighbours, microbatch_shape, run_stream
from lorafleet.executor.torch.routing import Segments
from lorafleet.executor.torch.transfer import to_device
from lorafleet.plans import MicroBatch
from lorafleet.runtime.data_stream import loss_tokens
from lorafleet.runtime.layout import RankRole
from lorafleet.specs.architecture import layer_window


def inverse_token_counts(task_ids: Sequence[int], examples: Sequence[Example], n_tasks: int) -> list[float]:
    """``1 / N_t`` of every task, ``N_t`` the loss tokens of its sequences in the whole global
    batch (the weight of each of its tokens); 0 for a task with none (it does not step)."""
    counts = [0] * n_tasks
    for task, example in zip(task_ids, examples, strict=True):
        counts[int(task)] += loss_tokens(example)
    return [1.0 / c if c else 0.0 for c in counts]


def attention_window(config, layer_index: int) -> int | None:
    """The sliding window of one decoder layer of a transformers config, or None for full causal attention
    (``architecture.layer_window``: the rule the cost model prices too)."""
    return layer_window(getattr(config, "sliding_window", None), getattr(config, "layer_types", None), layer_index)


@dataclass(frozen=True)
class MicroBatchInputs:
    """The tensors of one micro-batch, on the rank's device. Shapes are ``(B, S)`` unless noted."""

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    """The next token to predict, ``IGNORE_INDEX`` where no loss is taken (labels shifted left)."""
    weights: Tensor
    """``1 / N_t`` on loss tokens of task ``t``, 0 elsewhere (fp64: the weighted sum is a few
    hundred values; its dtype decides only how exactly each token's share is applied)."""
    token_task: Tensor
    """Task of each token (0 on padding; its weight is 0)."""
    segments: Segments
    """Adapter rows of the flattened ``(B*S)`` grid: one segment per run of a task's sequences."""
    document_bounds: tuple[int, ...]
    """Where each row's documents start and end: packed, [0, s_1, s_1 + s_2, ..., S] (each
    sequence's slice of the one row); padded, [0, S] (the row, padding after the sequence)."""
    loss_rows: Tensor
    """``(n,)`` the positions of the flattened ``(B*S)`` grid that have a target, ascending: the only
    rows the LM head runs on (:func:`weighted_losses`)."""

    def attention(self, window: int | None) -> dict[str, Any]:
        """A decoder layer's attention arguments for ``document_attention`` (Σ s_i^2 work)."""
        return {"attention_mask": None, "document_bounds": self.document_bounds, "document_window": window}


def build_inputs(
    mb: MicroBatch, examples: Sequence[Example], inv_tokens: Sequence[float], device: torch.device
) -> MicroBatchInputs:
    """Lays out ``mb``'s sequences (``examples[i]`` is its i-th sequence) as the token grid."""
    b, s = microbatch_shape(mb)
    ids = torch.zeros((b, s), dtype=torch.long)
    positions = torch.zeros((b, s), dtype=torch.long)
    targets = torch.full((b, s), IGNORE_INDEX, dtype=torch.long)
    weights = torch.zeros((b, s), dtype=torch.float64)
    token_task = torch.zeros((b, s), dtype=torch.long)
    starts = []  # flattened first row of each sequence
    for k, (task, example) in enumerate(zip(mb.task_ids, examples, strict=True)):
        n = len(example)
        if n != mb.lengths[k]:
            raise ValueError(f"sequence {mb.seq_ids[k]} has {n} tokens, the plan says {mb.lengths[k]}")
        row, col = (0, sum(mb.lengths[:k])) if mb.padded_len is None else (k, 0)
        span = slice(col, col + n)
        ids[row, span] = torch.tensor(example.input_ids)
        positions[row, span] = torch.arange(n)
        next_labels = torch.tensor(example.labels[1:] + (IGNORE_INDEX,))  # label of token i+1 at i
        targets[row, span] = next_labels
        weights[row, span] = (next_labels != IGNORE_INDEX).double() * inv_tokens[task]
        token_task[row, span] = task
        starts.append(row * s + col)
    ends = [starts[k] + (s if mb.padded_len is not None else mb.lengths[k]) for k in range(len(starts))]
    segments = Segments(
        tuple(task for task, _, _ in mb.segments),
        tuple(starts[first] for _, first, _ in mb.segments),
        # A padded task run covers its rows' padding too: those rows get no loss and nothing
        # real attends to them, so their adapter gradient is exactly zero, and one segment per
        # run is cheaper than one per sequence.
        tuple(ends[first + count - 1] - starts[first] for _, first, count in mb.segments),
    )
    bounds = (0, s) if mb.padded_len is not None else tuple(int(x) for x in itertools.accumulate(mb.lengths, initial=0))
    tensors = (to_device(t, device) for t in (ids, positions, targets, weights, token_task))
    loss_rows = to_device(torch.nonzero(targets.view(-1) != IGNORE_INDEX).view(-1), device)
    return MicroBatchInputs(*tensors, segments, bounds, loss_rows)


def stage_forward(
    model: nn.Module, role: RankRole, x: Tensor | None, inputs: MicroBatchInputs, *, head_rows: Tensor | None = None
) -> Tensor:
    """This rank's stage on one micro-batch: ``(B, S)`` ids or ``(B, S, H)`` activations in,
    ``(B, S, H)`` activations or ``(B, S, V)`` logits out; with ``head_rows`` (positions of the
    flattened ``(B*S)`` grid) a last stage's norm and LM head run on those rows only: ``(n, V)``.

    With ``role.replica.recompute`` every block runs under ``torch.utils.checkpoint``
    (non-reentrant): autograd keeps the block's input only and re-runs its forward in the
    backward, with the RNG state of the first run, so the adapters' dropout masks and hence
    the gradients are the same as without recomputation.
    """
    if not uses_document_attention(model):
        raise ValueError("the stage must attend with document_attention: call use_document_attention(model)")
    inner = model.model
    with segments_context(model, inputs.segments):
        h = inner.embed_tokens(inputs.input_ids) if role.is_first_stage else x  # (B, S, H)
        rotary = rotary_tables(model, h, inputs.position_ids)  # layer -> (cos, sin), each (B, S, head_dim)
        for index, layer in inner.layers.items():
            attention = inputs.attention(attention_window(model.config, int(index)))
            table = rotary(int(index))

            def block(
                hidden: Tensor, layer: nn.Module = layer, attention: dict[str, Any] = attention, table=table
            ) -> Tensor:
                # The backward's re-run happens outside this function's ``with``: route rows again.
                with segments_context(layer, inputs.segments):
                    return layer(hidden, position_ids=inputs.position_ids, position_embeddings=table, **attention)

            h = checkpoint(block, h, use_reentrant=False) if role.replica.recompute else block(h)
        if not role.is_last_stage:
            return h
        if head_rows is not None:
            h = h.reshape(-1, h.shape[-1]).index_select(0, head_rows)  # (n, H)
        return final_logits(model, model.lm_head(inner.norm(h)))  # (B, S, V) or (n, V)


def weighted_losses(model: nn.Module, role: RankRole, x: Tensor | None, inputs: MicroBatchInputs) -> Tensor:
    """A last stage on one micro-batch: ``ℓ_i / N_t(i)`` of each row with a target (``inputs.loss_rows``),
    ``(n,)`` fp64; their sum is the scalar the stage differentiates.

    The norm, the LM head and the cross-entropy run on those rows only. A row without a target (a
    prompt token, padding) takes no loss and gets exactly zero gradient from it, so leaving it out
    changes no gradient, and it saves the head's ``2 H V`` multiply-adds a row, forward and backward,
    and the softmax over the vocabulary (the demo learns 18% of its tokens; a ``V = 49,152`` head is
    a fifth of SmolLM2-135M's multiply-adds a token). ``ℓ_i`` is computed in fp32 at least (bf16
    logits are upcast).
    """
    logits, targets = target_logits(model, role, x, inputs)
    weights = inputs.weights.view(-1).index_select(0, inputs.loss_rows)
    return F.cross_entropy(logits, targets, reduction="none") * weights


def target_logits(
    model: nn.Module, role: RankRole, x: Tensor | None, inputs: MicroBatchInputs
) -> tuple[Tensor, Tensor]:
    """A last stage's logits at the rows with a target, ``(n, V)`` in fp32 at least, and those targets ``(n,)``: what
    training's loss (:func:`weighted_losses`) and an evaluation's (``evaluate``) are computed from."""
    logits = stage_forward(model, role, x, inputs, head_rows=inputs.loss_rows)  # (n, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits, inputs.targets.view(-1).index_select(0, inputs.loss_rows)


@dataclass(frozen=True)
class WindowStep:
    """One step of a window as one rank runs it."""

    step: int
    microbatches: tuple[MicroBatch, ...]
    """This rank's replica's micro-batches of the step, in plan order."""
    examples: Mapping[int, Example]
    """Global-batch position -> example, for every sequence of ``microbatches``."""
    inv_tokens: Sequence[float]
    """``1 / N_t`` per task (0 for a task absent from the step's batch)."""


def window_stream(steps: Sequence[WindowStep]) -> tuple[list[tuple[int, MicroBatch]], list[StreamMicroBatch]]:
    """The window's micro-batches in stream order as ``(position of its step in the window, micro-batch)``,
    and the same as the schedule sees them."""
    mbs = [(j, mb) for j, step in enumerate(steps) for mb in step.microbatches]
    return mbs, [StreamMicroBatch(j, frozenset(mb.task_ids)) for j, mb in mbs]


class WindowForward:
    """``forward(i, x)`` of the window's i-th micro-batch on this rank's stage (``pipeline.run_stream``'s
    callback), accumulating each step's ``Σ_{i on this rank} ℓ_i / N_t`` per task."""

    def __init__(self, model: nn.Module, role: RankRole, device: torch.device, steps: Sequence[WindowStep]) -> None:
        self.model, self.role, self.device, self.steps = model, role, device, steps
        self.mbs, self.stream = window_stream(steps)
        n_tasks = len(steps[0].inv_tokens) if steps else 0
        self.task_loss = torch.zeros((len(steps), n_tasks), dtype=torch.float64, device=device)
        """(W, tasks) fp64; zeros off the last stage and off TP rank 0 (TP ranks compute the same loss)."""
        self._report = role.is_last_stage and role.tp_rank == 0

    def __call__(self, i: int, x: Tensor | None) -> Tensor:
        j, mb = self.mbs[i]
        step = self.steps[j]
        inputs = build_inputs(mb, [step.examples[q] for q in mb.seq_ids], step.inv_tokens, self.device)
        if not self.role.is_last_stage:
            return stage_forward(self.model, self.role, x, inputs)
        weighted = weighted_losses(self.model, self.role, x, inputs)  # (n,) fp64: ℓ_i / N_t(i)
        if self._report:
            tasks = inputs.token_task.view(-1).index_select(0, inputs.loss_rows)
            self.task_loss[j].index_add_(0, tasks, weighted.detach())
        return weighted.sum()


@dataclass(frozen=True)
class RankStepResult:
    """What one rank measured in a step."""

    task_loss: Tensor
    """Per task, ``Σ_{i on this rank} ℓ_i / N_t`` (fp64, zeros off the last stage and off TP rank 0)."""
    busy_s: float
    """Wall time of this rank's forwards and backwards."""


def run_rank_step(
    model: nn.Module,
    role: RankRole,
    neighbours: Neighbours,
    microbatches: tuple[MicroBatch, ...],
    examples: Mapping[int, Example],
    inv_tokens: Sequence[float],
) -> RankStepResult:
    """Forward and backward of one step's micro-batches on this rank, 1F1B; gradients accumulate,
    nothing is updated (the profiler's unit of a step; the executor runs windows, ``window``)."""
    start = time.perf_counter()
    forward = WindowForward(model, role, neighbours.device, [WindowStep(0, microbatches, examples, inv_tokens)])
    order = stream_order(role.replica.pp, role.stage, forward.stream)
    run_stream(microbatches, order, role, neighbours, forward)
    return RankStepResult(forward.task_loss[0], time.perf_counter() - start)
