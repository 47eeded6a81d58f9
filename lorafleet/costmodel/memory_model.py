"""Max tokens M of a parallel config: how large a micro-batch one replica can hold.

Memory on a device is a line in the tokens of one micro-batch (FlashAttention keeps no
s^2 activations, so a micro-batch of b sequences of length s fits iff b*s <= M)::

    static + bytes_per_token * tokens <= budget      =>      M = floor((budget - static) / bytes_per_token)

``static`` is the frozen weights of the stage (L/pp blocks / tp, plus the embedding on the
first stage and the LM head on the last), every task's adapter with its gradient, master copy
and optimizer states, and a runtime reserve (CUDA context, NCCL buffers, GEMM workspaces).
``bytes_per_token`` is the activation bytes a token leaves per block, times the blocks of the
stage, times the micro-batches in flight: 1F1B keeps pp micro-batches on the first stage and
one on the last, which instead holds the logits. The busiest stage sets M. (LobRA measures M
on the real model and rounds it down to a power of two; this keeps the line, and the
profiler measures it to 1/16 of its value with ``search_max_tokens``.)

A quantized shared base (``quantize``, QLoRA) stores the projections of every block at :func:`weight_bytes` a weight
(NF4 0.5625, int8 1 + a 4-byte scale a row) instead of ``dtype``; the norms, the embedding and the LM head stay in
``dtype`` (bitsandbytes quantizes linear layers only, and QLoRA keeps the head), and one projection at a time is
dequantized into ``dtype`` for its GEMMs, a transient as large as the largest projection of a stage's device. Only
``static`` changes, so a quantized base raises M by ``(bytes saved) / bytes_per_token``.

**Split LoRA inputs.** lorafleet's executor keeps, at TP > 1, only its 1/tp of the rows of a column-parallel
group's LoRA input for the backward (``executor/torch``: each TP rank computes its rows' share of the LoRA A weight
gradient, with the partial dS summed over the TP group), so that input costs h/tp elements a token, not h
(``split_lora_inputs``, True). LobRA's executor (Hetu) keeps it whole: its column-parallel LoRA A is sharded on the
rank dimension over the all-gathered input (``../shared/reference/lobra-notes.md``, section 8), so the checks against
LobRA's measured max tokens model it with ``split_lora_inputs=False``, the only callers that do.

**Keep-masks.** With adapter dropout every call of an adapted projection draws a bool keep-mask over its input,
one byte an element (``executor/torch/dropout.py``). The executor keeps it for the backward only in a micro-batch of
at most :meth:`StageMemory.mask_tokens` tokens, the most whose masks fit beside everything above
(``mask_bytes_per_token``: ``static + (bytes_per_token + mask_bytes_per_token) * tokens <= budget``), and above that
draws it again in the backward from the generator state it was drawn from. So ``M`` counts no mask (at ``M`` none is
kept, unless the masks fit there too), and every micro-batch of at most ``M`` tokens fits, its masks kept or not: the
line is right for whichever path runs. A plan's ``M`` may be below the memory's (a knee, ``microbatch_size``): on
this repository's CPU preset ``M`` is about a seventh of the memory's, and every mask is kept there.

With full activation recomputation (``ParallelConfig.recompute``) a block keeps only its
input hidden state (h elements a token, split over tp with sequence parallelism) for the
backward, and re-runs its forward there, one block and one micro-batch at a time; so::

    bytes_per_token = in_flight * (blocks + 1) * hidden_state + per_block

instead of ``in_flight * (blocks * per_block + hidden_state)``: about 20x less for Llama2-70B (10x for 7B),
which is what lets its 16K-token sequences fit (the analytic M without it is at most ~14K on
A800-80GB with 12 tasks, at ⟨8,16⟩, since 1F1B keeps pp micro-batches of L/pp blocks on stage one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from lorafleet.costmodel.adapters import FP32_BYTES, AdapterLoad
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.specs.gpus import GIB
from lorafleet.specs.lora import Quantization
from lorafleet.specs.model import ModelSpec

#: The column-parallel projections (split by output rows under tensor parallelism; o and down, by input columns),
#: grouped by the input they share: the attention norm's output feeds q, k and v, the MLP norm's gate and up.
COLUMN_PARALLEL_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class StageMemory:
    """Bytes on the busiest device of a replica: ``static + bytes_per_token * tokens`` against a budget."""

    budget_bytes: float
    """Device memory the replica may use."""
    static_bytes: float
    """Bytes that do not depend on the micro-batch (weights, adapter states, runtime reserve)."""
    bytes_per_token: float
    """Bytes per token of one micro-batch, all in-flight copies included."""
    mask_bytes_per_token: float = 0.0
    """Bytes per token the dropout keep-masks add when they are kept for the backward, in-flight copies included
    (module doc, "Keep-masks"); 0 without adapter dropout."""

    def max_tokens(self) -> int:
        """M = floor((budget - static) / bytes_per_token), 0 when the static part alone does not fit."""
        return self._tokens(self.bytes_per_token)

    def mask_tokens(self) -> int:
        """The most tokens of a micro-batch that keeps its dropout keep-masks for the backward:
        floor((budget - static) / (bytes_per_token + mask_bytes_per_token)), at most :meth:`max_tokens`."""
        return self._tokens(self.bytes_per_token + self.mask_bytes_per_token)

    def _tokens(self, per_token: float) -> int:
        """floor((budget - static) / per_token), 0 when the static part alone does not fit."""
        free = self.budget_bytes - self.static_bytes
        return max(0, int(free // per_token)) if per_token > 0 else 0

    def with_static_delta(self, delta_bytes: float) -> StageMemory:
        """The same stage holding ``delta_bytes`` more static state (e.g. another task's adapter)."""
        return replace(self, static_bytes=self.static_bytes + delta_bytes)


@dataclass(frozen=True)
class MemoryFactors:
    """The two global factors of the analytic memory model (not per config)."""

    reserve_gib: float = 2.5
    """Runtime memory outside the tensors: CUDA context, NCCL and GEMM workspaces, GiB."""
    activation_overhead: float = 1.36
    """Allocator fragmentation and transient buffers, as a factor on activation bytes."""


def activation_elements_per_token(
    model: ModelSpec, tp: int, adapters: AdapterLoad, sequence_parallel: bool = True, split_lora_inputs: bool = True
) -> float:
    """Elements one token leaves saved for backward in one block, on one of ``tp`` devices.

    What lives at head or FFN width is split over the TP ranks; what lives at model width h is
    split too with sequence parallelism (Megatron-LM's, which LobRA's max-token runs use: their
    table lists sp=1), and replicated on every rank without it. What a LoRA A GEMM of a
    column-parallel projection saves for its weight gradient is its input after the sequence
    all-gather, once per group of projections sharing that input (q, k, v share one; gate and up
    another): h a token per group, kept whole on every rank by LobRA's executor
    (``split_lora_inputs=False``), its 1/tp of the rows on each rank by lorafleet's (module doc)::

        split with SP:   2 RMSNorm inputs + 2 outputs (4h)
        split:           q, k, v after RoPE (hq + 2 hkv), attention output (hq), SwiGLU gate, up,
                         SiLU(gate), product (4 ffn), LoRA row copies of o_proj (hq) and down_proj (ffn) inputs
        split or whole:  h per column-parallel group a LoRA or DoRA adapter targets (VeRA's frozen A needs no
                         input: a group only VeRA adapters target saves none)
        replicated:      LoRA A outputs (r per target)

    With whole inputs a token's bytes are A / tp + B with B ≥ h per group, as LobRA's measured table
    needs: it cannot be bracketed by a pure 1 / tp (the per-target copies split over TP this model
    once charged, 5h a block, put ⟨1,8⟩, ⟨2,8⟩ and ⟨1,16⟩ below LobRA's measured M). Split, only the
    LoRA A outputs stay replicated. TP 1 is the same either way.
    """
    h, f = model.hidden, model.ffn
    hq = model.n_heads * model.d_head
    hkv = model.n_kv_heads * model.d_head
    targets = {t for task in adapters.tasks for t in task.targets}
    mean_rank = sum(t.rank for t in adapters.tasks) / adapters.n_tasks
    model_width = 4 * h
    split = hq + 2 * hkv + hq + 4 * f + hq * ("o_proj" in targets) + f * ("down_proj" in targets)
    trained_a = {t for task in adapters.tasks if not task.vera for t in task.targets}  # VeRA's A is frozen
    lora_inputs = h * sum(bool(trained_a & set(group)) for group in COLUMN_PARALLEL_GROUPS)
    replicated = mean_rank * len(targets)
    return (
        (model_width if not sequence_parallel else model_width / tp)
        + split / tp
        + (lora_inputs / tp if split_lora_inputs else lora_inputs)
        + replicated
    )


def mask_bytes_per_token(model: ModelSpec, tp: int, adapters: AdapterLoad) -> float:
    """Bytes of dropout keep-masks one token leaves in one block's projection calls, on one of ``tp`` devices, when
    the executor keeps them (module doc): one byte an input element of every projection that a task with adapter
    dropout targets (a call draws one ``(T, K)`` mask over all its rows when any of them drops; the executor's
    ``draw_keep_mask``). A column-parallel projection's input is whole on every TP rank (after the sequence
    all-gather), so its mask is too: ``h`` bytes; a row-parallel one (o, down) holds its ``1 / tp`` of the input
    columns. A fused projection (``qkv_proj``) is one call and one mask, counted here as its parts: an over-count."""
    dropping = {t for task in adapters.tasks if task.dropout for t in task.targets}
    column = {name for group in COLUMN_PARALLEL_GROUPS for name in group}
    return sum(k if name in column else k / tp for name, (k, _) in model.target_shapes().items() if name in dropping)


def weight_bytes(model: ModelSpec, quantize: Quantization | None, dtype_bytes: int) -> float:
    """Bytes of one block's weights on one device of TP 1: the projections at the quantization's bytes a weight
    (NF4: 0.5 and an fp32 scale a block of 64; int8: 1 and an fp32 scale an output row) or ``dtype``, the two
    norms in ``dtype`` (module doc)."""
    shapes = model.target_shapes().values()
    projections = sum(i * o for i, o in shapes)
    norms = (model.layer_params - projections) * dtype_bytes
    if quantize is None:
        return projections * dtype_bytes + norms
    if quantize is Quantization.NF4:
        return projections * (0.5 + 4 / 64) + norms
    return projections + 4 * sum(o for _, o in shapes) + norms


def busiest(lines: tuple[StageMemory, ...]) -> StageMemory:
    """The memory line of the busiest stage among :func:`stage_lines`' (first or last, whichever has the smaller M)."""
    return min(lines, key=lambda m: m.max_tokens())


def stage_lines(
    model: ModelSpec,
    config: ParallelConfig,
    adapters: AdapterLoad,
    budget_bytes: float,
    dtype_bytes: int = 2,
    factors: MemoryFactors = MemoryFactors(),
    sequence_parallel: bool = True,
    quantize: Quantization | None = None,
    split_lora_inputs: bool = True,
) -> tuple[StageMemory, ...]:
    """The memory lines of ``config``'s first and last stages (one line at pp 1; :func:`busiest` picks the one that
    bounds M): the first holds ``pp`` micro-batches in flight and the embedding, the last one micro-batch, the LM head
    and the logits. A middle stage holds fewer micro-batches than the first and no embedding: within both. With
    ``quantize``, over a base whose projections are stored so; ``split_lora_inputs=False`` models LobRA's executor,
    which keeps the column-parallel LoRA inputs whole on every TP rank (module doc)."""
    tp, pp = config.tp, config.pp
    blocks = model.n_layers / pp
    vocab_matrix = model.vocab * model.hidden * dtype_bytes / tp  # vocab-parallel embedding or LM head
    adapter_state = adapters.params_per_layer(model) * blocks / tp * adapters.state_bytes_per_param(dtype_bytes)
    weights = blocks * weight_bytes(model, quantize, dtype_bytes) / tp
    if quantize is not None:  # the one projection dequantized at a time
        weights += max(i * o for i, o in model.target_shapes().values()) * dtype_bytes / tp
    common = weights + adapter_state + factors.reserve_gib * GIB
    per_block = (
        activation_elements_per_token(model, tp, adapters, sequence_parallel, split_lora_inputs)
        * dtype_bytes
        * factors.activation_overhead
    )
    masks = mask_bytes_per_token(model, tp, adapters) * factors.activation_overhead
    logits = model.vocab / tp * (dtype_bytes + 2 * FP32_BYTES)  # logits, fp32 copy for the loss, its gradient
    # One hidden state: the embedding output, the activations a stage receives, or a block input kept for recompute.
    hidden_state = model.hidden * dtype_bytes / (tp if sequence_parallel else 1)

    def kept(in_flight: int, block: float) -> float:
        """Bytes a token's blocks keep for the backward on a stage holding ``in_flight`` micro-batches, ``block`` a
        block: every block's, or with recompute each block's input plus one block's (the one re-run)."""
        if config.recompute:
            return in_flight * blocks * hidden_state * factors.activation_overhead + block
        return in_flight * blocks * block

    def kept_masks(in_flight: int) -> float:
        """The keep-masks a token's blocks keep on such a stage (module doc, "Keep-masks")."""
        return kept(in_flight, masks) - kept(in_flight, 0.0)

    first = StageMemory(budget_bytes, common + vocab_matrix, kept(pp, per_block) + pp * hidden_state, kept_masks(pp))
    head = 0 if (pp == 1 and model.tied_embeddings) else vocab_matrix
    last_static = (first.static_bytes if pp == 1 else common) + head
    last_per_token = (first.bytes_per_token if pp == 1 else kept(1, per_block)) + logits
    last_masks = first.mask_bytes_per_token if pp == 1 else kept_masks(1)
    last = StageMemory(budget_bytes, last_static, last_per_token, last_masks)
    return (first, last) if pp > 1 else (last,)


def search_max_tokens(
    fits: Callable[[int], bool], start: int = 256, resolution: float = 1 / 16, limit: int = 1 << 24
) -> int:
    """The largest token count n with ``fits(n)``, to within ``resolution`` of its value.

    ``fits`` must be monotone (true up to M, false above). Doubling (or halving) from
    ``start`` brackets M in [lo, 2 lo); bisection then narrows the bracket until
    hi - lo <= lo * resolution. Returns lo, which never overstates M; 0 if not even one token
    fits; ``limit`` caps the doubling.
    """
    if start < 1 or not 0 < resolution < 1:
        raise ValueError("start must be >= 1 and resolution in (0, 1)")
    if fits(start):
        lo, hi = start, 2 * start
        while hi <= limit and fits(hi):
            lo, hi = hi, 2 * hi
        if hi > limit:
            return lo
    else:
        lo, hi = start // 2, start
        while lo >= 1 and not fits(lo):
            lo, hi = lo // 2, lo
        if lo == 0:
            return 0
    while hi - lo > max(1.0, lo * resolution):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
