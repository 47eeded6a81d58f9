"""Base-model dimensions: the numbers the cost model and the executor need.

A ``ModelSpec`` comes from a named preset or from a Hugging Face ``config.json`` on disk
(never from a hub): its ``model_type`` must be one the executor trains (``specs.architecture``), so
``validate`` and ``plan`` refuse another before any work, as ``train`` would.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, model_validator

from lorafleet.errors import InputError
from lorafleet.specs._base import Bool, Int, Spec
from lorafleet.specs.architecture import (
    FULL,
    SLIDING,
    attention_layout,
    layer_window,
    model_targets,
    unsupported_model_type,
)
from lorafleet.specs.io import read_json_object
from lorafleet.specs.lora import FUSED_TARGET_MODULES


class ModelSpec(Spec):
    """Dimensions of a decoder-only transformer of a supported family (``specs.architecture``)."""

    name: str
    """Preset name or the path it was read from."""
    model_type: str = "llama"
    """The family, as transformers' ``model_type`` names it (``specs.architecture.SUPPORTED_MODEL_TYPES``)."""
    n_layers: Int = Field(gt=0)
    """Transformer blocks L."""
    hidden: Int = Field(gt=0)
    """Model width h."""
    ffn: Int = Field(gt=0)
    """Intermediate size of the SwiGLU MLP."""
    n_heads: Int = Field(gt=0)
    """Attention (query) heads."""
    n_kv_heads: Int = Field(gt=0)
    """Key/value heads (GQA when smaller than ``n_heads``)."""
    vocab: Int = Field(gt=0)
    """Vocabulary size."""
    tied_embeddings: Bool = False
    """Whether the LM head shares the embedding matrix."""
    head_dim: Int = Field(0, ge=0)
    """Per-head width; 0 means hidden // n_heads."""
    sliding_window: Int = Field(0, ge=0)
    """Keys a query of a windowed layer meets (itself included); 0: no layer has a window."""
    layer_types: tuple[str, ...] = ()
    """Each layer's ``sliding_attention`` or ``full_attention``, as transformers' ``layer_types``; empty: the window
    (if any) is on every layer (Mistral, Phi-3)."""

    @model_validator(mode="after")
    def _heads_consistent(self) -> ModelSpec:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim == 0 and self.hidden % self.n_heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of n_heads ({self.n_heads})")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.n_layers}")
        if set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"layer_types holds {sorted(set(self.layer_types) - {SLIDING, FULL})}: {SLIDING} or {FULL}"
            )
        return self

    @property
    def windowed_layers(self) -> tuple[bool, ...]:
        """Whether each layer attends within ``sliding_window`` (``architecture.layer_window``, the executor's rule)."""
        window = self.sliding_window or None
        return tuple(layer_window(window, self.layer_types, i) is not None for i in range(self.n_layers))

    @property
    def d_head(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden // self.n_heads

    @property
    def norm_params(self) -> int:
        """Norm weights of one block: two of width h (Gemma: four, before and after attention and the MLP), and
        Qwen3's and Gemma 3's query and key norms (d each, shared by the heads)."""
        norms = (4 if self.model_type in ("gemma2", "gemma3_text") else 2) * self.hidden
        return norms + (2 * self.d_head if self.model_type in ("qwen3", "gemma3_text") else 0)

    @property
    def layer_params(self) -> int:
        """Parameters of one block: q, o (h x h'), k, v (h x kv*d), gate/up/down (h x ffn), the norms."""
        q_width = self.n_heads * self.d_head
        kv_width = self.n_kv_heads * self.d_head
        attn = 2 * self.hidden * q_width + 2 * self.hidden * kv_width
        return attn + 3 * self.hidden * self.ffn + self.norm_params

    @property
    def embedding_params(self) -> int:
        """Embedding plus LM head (one matrix when tied) plus the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def n_params(self) -> int:
        """Total parameter count."""
        return self.n_layers * self.layer_params + self.embedding_params

    def target_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection in one block."""
        q_width = self.n_heads * self.d_head
        kv_width = self.n_kv_heads * self.d_head
        h, f = self.hidden, self.ffn
        return {
            "q_proj": (h, q_width),
            "k_proj": (h, kv_width),
            "v_proj": (h, kv_width),
            "o_proj": (q_width, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    def adapter_shapes(self, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every projection of one block that a LoRA target list puts an adapter on
        in this family (``architecture.model_targets``): a fused projection's outputs are its parts' together."""
        shapes = self.target_shapes()
        for fused, parts in FUSED_TARGET_MODULES.items():
            shapes[fused] = (shapes[parts[0]][0], sum(shapes[p][1] for p in parts))
        return {m: shapes[m] for m in model_targets(targets, self.model_type)}


def _preset(
    name: str,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv: int,
    vocab: int,
    tied: bool = False,
    *,
    model_type: str = "llama",
    head_dim: int = 0,
    window: int = 0,
    global_every: int = 0,
) -> ModelSpec:
    """A preset; ``window`` on every layer, or with ``global_every`` = k on all but every k-th (transformers'
    ``sliding_window_pattern``: layer i is global where (i + 1) % k == 0)."""
    types = tuple(FULL if (i + 1) % global_every == 0 else SLIDING for i in range(layers)) if global_every else ()
    return ModelSpec(
        name=name,
        model_type=model_type,
        n_layers=layers,
        hidden=hidden,
        ffn=ffn,
        n_heads=heads,
        n_kv_heads=kv,
        vocab=vocab,
        tied_embeddings=tied,
        head_dim=head_dim,
        sliding_window=window,
        layer_types=types,
    )


_GEMMA2 = {"tied": True, "model_type": "gemma2", "head_dim": 256, "window": 4096, "global_every": 2}
_GEMMA3 = {"tied": True, "model_type": "gemma3_text", "head_dim": 256, "window": 512, "global_every": 6}

#: Named base models. Figures from each model's published config.json (its Hub id below); ``lobra-60l`` is the
#: 60-layer model of the LobRA evaluation (hidden 6656, FFN 17920, 64 heads). Sliding windows, as the configs
#: give them: Mistral-7B-v0.1 4,096 on every layer; Gemma 2 4,096 on every other layer (layer 0 first);
#: Gemma 3 1B 512 with ``sliding_window_pattern`` 6 (5 local : 1 global); Phi-3-mini-4k 2,047 on every layer;
#: Qwen2.5 and Qwen3 (``use_sliding_window: false``), Llama 2 and Phi-4 none.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _preset("llama2-7b", 32, 4096, 11008, 32, 32, 32000),
        _preset("llama2-13b", 40, 5120, 13824, 40, 40, 32000),
        _preset("llama2-70b", 80, 8192, 28672, 64, 8, 32000),
        _preset("lobra-60l", 60, 6656, 17920, 64, 64, 32000),
        _preset("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, model_type="qwen2"),
        _preset("qwen2.5-32b", 64, 5120, 27648, 40, 8, 152064, model_type="qwen2"),
        _preset("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, model_type="qwen2"),
        _preset("qwen3-0.6b", 28, 1024, 3072, 16, 8, 151936, tied=True, model_type="qwen3", head_dim=128),
        _preset("qwen3-8b", 36, 4096, 12288, 32, 8, 151936, model_type="qwen3", head_dim=128),
        _preset("mistral-7b", 32, 4096, 14336, 32, 8, 32000, model_type="mistral", window=4096),
        _preset("gemma2-2b", 26, 2304, 9216, 8, 4, 256000, **_GEMMA2),
        _preset("gemma2-9b", 42, 3584, 14336, 16, 8, 256000, **_GEMMA2),
        _preset("gemma3-1b", 26, 1152, 6912, 4, 1, 262144, **_GEMMA3),
        _preset("phi3-mini", 32, 3072, 8192, 32, 32, 32064, model_type="phi3", window=2047),
        _preset("phi4", 40, 5120, 17920, 40, 10, 100352, model_type="phi3"),
        _preset("smollm2-135m", 30, 576, 1536, 9, 3, 49152, tied=True),
        # A few layers and a small width: CPU runs and tests (TP2 and PP2 both divide it).
        _preset("tiny-llama", 4, 64, 176, 4, 2, 1024),
    )
}

#: The Hugging Face Hub id of each preset's weights (the ones its figures are of): what an adapter trained
#: over the preset names as its ``base_model_name_or_path`` (:func:`adapter_base_model`). ``lobra-60l`` and
#: ``tiny-llama`` are dimensions only, with no weights anywhere: no id.
PRESET_HUB_IDS: dict[str, str] = {
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-32b": "Qwen/Qwen2.5-32B",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "gemma2-2b": "google/gemma-2-2b",
    "gemma2-9b": "google/gemma-2-9b",
    "gemma3-1b": "google/gemma-3-1b-pt",
    "phi3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "phi4": "microsoft/phi-4",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

_HF_KEYS = {
    "n_layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "ffn": "intermediate_size",
    "n_heads": "num_attention_heads",
    "vocab": "vocab_size",
}


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (or a directory holding one) into a ModelSpec; an InputError naming
    ``model_type`` when the executor cannot train the family."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    raw = read_json_object(file)
    if "model_type" not in raw:
        raise InputError(str(file), "model_type", "missing")
    why = unsupported_model_type(raw["model_type"])
    if why is not None:
        raise InputError(str(file), "model_type", why)
    values: dict[str, object] = {"model_type": raw["model_type"]}
    for ours, theirs in _HF_KEYS.items():
        if theirs not in raw:
            raise InputError(str(file), theirs, "missing")
        values[ours] = raw[theirs]
    values["n_kv_heads"] = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    values["tied_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    values["head_dim"] = raw.get("head_dim") or 0
    window, values["layer_types"] = attention_layout(raw)
    values["sliding_window"] = window or 0
    try:
        return ModelSpec(name=str(path), **values)
    except ValueError as err:
        raise InputError(str(file), "", str(err).splitlines()[-1]) from None


def resolve_model(name_or_path: str, source: str = "<args>", field: str = "model") -> ModelSpec:
    """A preset by name, else a local HF config path; an InputError naming ``source: field`` otherwise."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.exists():
        return model_from_hf_config(path)
    if looks_like_hub_id(name_or_path):
        raise InputError(source, field, hub_id_message(name_or_path))
    raise InputError(
        source, field, f"unknown model {name_or_path!r}: not a preset ({', '.join(MODEL_PRESETS)}) nor an existing path"
    )


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` has a Hugging Face Hub id's form, ``owner/name`` (one slash, no path prefix such as ``./``)."""
    return _HUB_ID.fullmatch(name) is not None and not name.endswith((".gguf", ".json"))


def hub_id_message(name: str) -> str:
    """What to do when a workload names a Hub id that is not on disk: lorafleet never downloads, so the command that
    does (``hf``, huggingface_hub's CLI) and what to name then."""
    local = name.rpartition("/")[2]
    return (
        f"{name!r} is not on disk (lorafleet never downloads); as a Hugging Face Hub id, download it first with "
        f"`hf download {name} --local-dir {local}`, then set model: to that directory"
    )


def adapter_base_model(model: str, base_model_id: str | None = None) -> str:
    """What an adapter trained over a workload's ``model:`` names as its ``base_model_name_or_path``: the
    workload's ``base_model_id`` when set, else the preset's Hub id (a preset without one: its name), else the
    local model's absolute path, so that PEFT's ``AutoPeftModelForCausalLM`` finds it from any directory (a
    workload's relative ``model:`` is relative to where the run started)."""
    if base_model_id is not None:
        return base_model_id
    if model in MODEL_PRESETS:
        return PRESET_HUB_IDS.get(model, model)
    return str(Path(model).absolute())
