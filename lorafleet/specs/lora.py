"""LoRA adapter and optimizer settings of one task (PEFT ``LoraConfig`` vocabulary)."""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import Field, field_validator, model_validator

from lorafleet.specs._base import Bool, Float, Int, Spec

#: Projection names of Llama-family decoder layers that an adapter may target.
LLAMA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: Projections that one linear computes in some families (Phi-3), by name, with the projections they fuse, in the
#: order of their output rows (``specs.architecture``).
FUSED_TARGET_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

#: Every name a target list may hold: the Llama family's projections and the fused ones.
TARGET_MODULES = (*LLAMA_TARGET_MODULES, *FUSED_TARGET_MODULES)


class LoraSpec(Spec):
    """One task's adapter: ``W x + scaling * B(A(dropout(x)))`` on each target module."""

    rank: Int = Field(16, gt=0, le=4096)
    """LoRA rank r (rows of A, columns of B)."""
    alpha: Float = Field(16.0, gt=0)
    """LoRA alpha; scaling = alpha / r, or alpha / sqrt(r) with ``use_rslora``."""
    dropout: Float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability on the adapter's input (the base path sees no dropout)."""
    target_modules: tuple[str, ...] = LLAMA_TARGET_MODULES
    """Module names (suffix match) that get an adapter; on a model with fused projections they map onto them
    (``specs.architecture.model_targets``)."""
    use_rslora: Bool = False
    """Rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski, 2023)."""
    use_dora: Bool = False
    """DoRA (Liu et al., 2024): ``m ⊙ (W + s B A) x / ||W + s B A||_c`` with a trained magnitude ``m`` per output
    (PEFT's ``use_dora``, its ``lora_magnitude_vector``); the norm is detached, as the paper's §4.3 and PEFT do."""
    use_vera: Bool = False
    """VeRA (Kopiczko et al., 2024): ``W x + λ_b ⊙ B (λ_d ⊙ A dropout(x))`` with frozen random ``A (r, max in)`` and
    ``B (max out, r)`` shared by every targeted layer (each slices its ``in`` columns and ``out`` rows) and trained
    vectors ``λ_d (r)``, ``λ_b (out)`` per layer (PEFT's ``VeraConfig``: no alpha scaling, so ``alpha`` and
    ``use_rslora`` do not apply; ``executor/torch/vera.py``)."""
    vera_prng_key: Int = Field(0, ge=0)
    """VeRA's ``projection_prng_key``: the seed ``A`` and ``B`` are drawn from (PEFT's Kaiming-uniform draw)."""
    vera_d_initial: Float = 0.1
    """VeRA's ``d_initial``: every ``λ_d`` starts at it, every ``λ_b`` at zero (so the adapter starts as the
    identity update)."""
    lr_ratio: Float | None = Field(None, gt=0)
    """LoRA+ (Hayou et al., 2024): ``B`` (and a DoRA magnitude) learn at ``lr * lr_ratio``, ``A`` at ``lr``, as
    ``peft.optimizers.create_loraplus_optimizer``'s ``loraplus_lr_ratio``; None: one rate for all."""

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("must name at least one module")
        unknown = [m for m in value if m not in TARGET_MODULES]
        if unknown:
            raise ValueError(f"unknown module {unknown[0]!r}; choose from {', '.join(TARGET_MODULES)}")
        if len(set(value)) != len(value):
            raise ValueError("names a module twice")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> LoraSpec:
        if self.use_vera:
            for other in ("use_dora", "use_rslora", "lr_ratio"):
                if getattr(self, other):
                    raise ValueError(f"use_vera cannot be combined with {other} (VeRA trains no A, B or alpha scaling)")
        return self

    @property
    def kind(self) -> str:
        """The adapter's kind, as a checkpoint's resume check names it: ``LoRA``, ``DoRA`` or ``VeRA``."""
        return "VeRA" if self.use_vera else "DoRA" if self.use_dora else "LoRA"

    @property
    def scaling(self) -> float:
        """The factor on B·A: alpha / r, or alpha / sqrt(r) for rsLoRA; 1 for VeRA (its ``λ_b`` is the scale)."""
        if self.use_vera:
            return 1.0
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class Quantization(StrEnum):
    """How the shared frozen base's projection weights are stored (QLoRA, Dettmers et al., 2023): dequantized in the
    forward, the adapters fp32 masters as over a bf16 base (``executor/torch/quant.py``: bitsandbytes' formats)."""

    NF4 = "nf4"
    """NormalFloat-4 in blocks of 64 with an fp32 scale: 0.5625 bytes a weight."""
    INT8 = "int8"
    """Row-wise int8 with an fp32 scale a row (LLM.int8's storage): 1 byte a weight."""


class OptimizerName(StrEnum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


class LrSchedule(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class OptimizerSpec(Spec):
    """One task's optimizer; every task steps its own optimizer on its own adapter."""

    name: OptimizerName = OptimizerName.ADAMW
    """Optimizer algorithm."""
    lr: Float = Field(1e-4, gt=0, le=10)
    """Peak learning rate."""
    weight_decay: Float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW) or L2 (Adam, SGD)."""
    betas: tuple[Float, Float] = (0.9, 0.999)
    """Adam betas."""
    warmup_steps: Int = Field(0, ge=0)
    """Linear warm-up steps from 0 to ``lr``."""
    schedule: LrSchedule = LrSchedule.COSINE
    """Decay after warm-up, down to ``min_lr_ratio * lr`` at the last step."""
    min_lr_ratio: Float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of ``lr``."""
    grad_clip: Float = Field(1.0, ge=0)
    """Max global L2 norm of this task's adapter gradient; 0 disables clipping."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value
