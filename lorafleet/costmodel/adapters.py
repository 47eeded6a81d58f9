"""The adapter load a replica carries: how many tasks, their ranks and targets, and the optimizer.

Every replica holds every task's adapter (joint training is data-parallel over the fleet),
so the adapters' parameters, gradients and optimizer states sit on every device, and their
gradient all-reduce and optimizer step run once per step whatever the batch. Those costs
grow with the number of tasks and their ranks, which is why the cost model takes this as
an input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lorafleet.specs.lora import FUSED_TARGET_MODULES, LLAMA_TARGET_MODULES, LoraSpec, OptimizerName
from lorafleet.specs.model import ModelSpec

FP32_BYTES = 4

#: Optimizer states kept per adapter parameter, in fp32 (Adam: first and second moment).
OPTIMIZER_STATES = {OptimizerName.ADAMW: 2, OptimizerName.ADAM: 2, OptimizerName.SGD: 1}


def llama_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """A target list in the Llama family's projections, a fused name (Phi-3's ``qkv_proj``) as the ones it fuses: the
    vocabulary the cost model prices in."""
    return tuple(dict.fromkeys(p for t in targets for p in FUSED_TARGET_MODULES.get(t, (t,))))


@dataclass(frozen=True)
class TaskAdapter:
    """One task's LoRA adapter shape."""

    rank: int
    """LoRA rank r."""
    targets: tuple[str, ...] = LLAMA_TARGET_MODULES
    """Projections of every block that carry an A (r x in) and a B (out x r)."""
    dora: bool = False
    """A DoRA adapter (``LoraSpec.use_dora``): its tokens cost the rescale, its micro-batches the norm
    (``costmodel.dora_cost``)."""
    dora_dropout: bool = False
    """DoRA with adapter dropout: its tokens also cost one more base-width GEMM (``costmodel.dora_cost``)."""
    vera: bool = False
    """A VeRA adapter (``LoraSpec.use_vera``): it trains ``λ_d (r)`` and ``λ_b (out)`` per projection, not ``A`` and
    ``B``; its tokens meet LoRA's rank-``r`` GEMMs (``diag(λ_b) B diag(λ_d) A``) but for the gradient of its frozen
    ``A`` (:meth:`skipped_gemm_params_per_layer`)."""
    dropout: bool = False
    """Adapter dropout (``LoraSpec.dropout > 0``): each call of a projection it targets draws a keep-mask, one byte an
    input element, which the executor keeps for the backward when memory allows (``memory_model``, "Keep-masks")."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        unknown = set(self.targets) - set(LLAMA_TARGET_MODULES)
        if unknown or not self.targets:
            raise ValueError(f"targets must be a non-empty subset of {LLAMA_TARGET_MODULES}, got {self.targets}")

    def params_per_layer(self, model: ModelSpec) -> int:
        """Trained adapter parameters in one block: Σ r * (in + out) over the projections the targets put an adapter
        on in the model's family (one on a fused projection: ``ModelSpec.adapter_shapes``); VeRA's Σ (r + out). (A
        VeRA task's frozen shared projections, ``r (max in + max out)`` once per replica, are left out: less than
        one block's LoRA matrices.)"""
        shapes = model.adapter_shapes(self.targets).values()
        if self.vera:
            return sum(self.rank + o for _, o in shapes)
        return self.gemm_params_per_layer(model)

    def gemm_params_per_layer(self, model: ModelSpec) -> int:
        """The adapter weights a token multiplies in one block: Σ r * (in + out), LoRA's and VeRA's alike."""
        return sum(self.rank * (i + o) for i, o in model.adapter_shapes(self.targets).values())

    def skipped_gemm_params_per_layer(self, model: ModelSpec) -> int:
        """Of LoRA's 6 FLOPs a token and weight (forward 2: ``A x``, ``B h``; backward 4: ``dh = Bᵀ dy``,
        ``dx = Aᵀ dh``, ``dB``, ``dA``), the weights whose 2 a VeRA token skips: its ``A`` is frozen, so no ``dA``
        (``Σ r * in``); ``dB``'s GEMM stays (``dyᵀ S1``, whose rows against ``B`` sum to ``dλ_b``:
        ``executor.torch.vera``, 3 low-rank GEMMs in the backward to LoRA's 4). 0 for LoRA and DoRA."""
        return sum(self.rank * i for i, _ in model.adapter_shapes(self.targets).values()) if self.vera else 0


@dataclass(frozen=True)
class AdapterLoad:
    """All tasks' adapters on one replica and the optimizer that steps them."""

    tasks: tuple[TaskAdapter, ...]
    """One adapter per task."""
    optimizer: OptimizerName = OptimizerName.ADAMW
    """Optimizer of every task (sets the states kept per parameter)."""
    _per_layer: dict[ModelSpec, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    """:meth:`params_per_layer` by model, summed once: a plan asks ~150 times, each a sum over every task."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("an adapter load needs at least one task")

    @classmethod
    def uniform(
        cls,
        n_tasks: int,
        rank: int = 16,
        targets: Sequence[str] = LLAMA_TARGET_MODULES,
        optimizer: OptimizerName | str = OptimizerName.ADAMW,
    ) -> AdapterLoad:
        """``n_tasks`` identical adapters (LobRA's setting: 6 tasks, rank 16, every projection)."""
        return cls(tuple(TaskAdapter(rank, tuple(targets)) for _ in range(n_tasks)), OptimizerName(optimizer))

    @classmethod
    def from_specs(cls, specs: Sequence[LoraSpec], optimizer: OptimizerName | str = OptimizerName.ADAMW) -> AdapterLoad:
        """The load of a workload's tasks, from their ``LoraSpec``s."""
        return cls(
            tuple(
                TaskAdapter(
                    s.rank,
                    llama_targets(s.target_modules),
                    s.use_dora,
                    s.use_dora and s.dropout > 0,
                    vera=s.use_vera,
                    dropout=s.dropout > 0,
                )
                for s in specs
            ),
            OptimizerName(optimizer),
        )

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    def params_per_layer(self, model: ModelSpec) -> int:
        """All tasks' adapter parameters in one block."""
        if model not in self._per_layer:
            self._per_layer[model] = sum(t.params_per_layer(model) for t in self.tasks)
        return self._per_layer[model]

    def total_params(self, model: ModelSpec) -> int:
        """All tasks' adapter parameters in the whole model (L blocks)."""
        return model.n_layers * self.params_per_layer(model)

    def mean_params_per_layer(self, model: ModelSpec) -> float:
        """Adapter weights one token multiplies in a block, averaged over tasks (each token uses its task's adapter:
        :meth:`TaskAdapter.gemm_params_per_layer`)."""
        return sum(t.gemm_params_per_layer(model) for t in self.tasks) / self.n_tasks

    def mean_skipped_gemm_params_per_layer(self, model: ModelSpec) -> float:
        """:meth:`TaskAdapter.skipped_gemm_params_per_layer` averaged over tasks, as :meth:`mean_params_per_layer`."""
        return sum(t.skipped_gemm_params_per_layer(model) for t in self.tasks) / self.n_tasks

    def dora_share(self, with_dropout: bool = False) -> float:
        """The fraction of tasks whose adapter is DoRA (with ``with_dropout``: DoRA with adapter dropout); a token
        meets one in this proportion, as in :meth:`mean_params_per_layer`."""
        return sum(t.dora and (t.dora_dropout or not with_dropout) for t in self.tasks) / self.n_tasks

    def state_bytes_per_param(self, dtype_bytes: int) -> int:
        """Bytes per adapter parameter: weight and gradient in the compute dtype, an fp32 master copy when
        that dtype is narrower than fp32, and the optimizer's fp32 states."""
        master = FP32_BYTES if dtype_bytes < FP32_BYTES else 0
        return 2 * dtype_bytes + master + FP32_BYTES * OPTIMIZER_STATES[self.optimizer]
