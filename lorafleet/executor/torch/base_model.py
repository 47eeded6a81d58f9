"""The frozen base model a workload names, loaded: a :class:`~lorafleet.data.model_source.ModelSource`
(where the weights are: ``lorafleet.data.model_source.resolve_model_source``, torch-free so that planning
and training find the same weights and the same tokenizer) -> a causal LM.

**Whole or per stage.** :func:`load_base` chooses by the source's kind how ``build_replica``
gets the model. An HF directory with safetensors weights (``model.safetensors``, or shards
listed in ``model.safetensors.index.json``) is loaded *per stage*: every rank builds the model
on the ``meta`` device (no memory), checks the checkpoint's tensor names and shapes against it
(:class:`SafetensorsWeights`), and ``build_replica`` later reads only what its stage and TP
shard keep, slice by slice. RANDOM and GGUF sources (and an HF directory without safetensors)
are built whole on the host by :func:`load_causal_lm`: random weights are drawn over the
whole model, and transformers dequantises a GGUF as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lorafleet.data.model_source import ModelSource, SourceKind
from lorafleet.data.weights_index import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    checkpoint_files,
    has_safetensors,
    tensor_shapes,
)
from lorafleet.errors import InputError
from lorafleet.executor.torch.families import base_attention
from lorafleet.specs.architecture import unsupported_model_type
from lorafleet.specs.model import ModelSpec


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

    The model is loaded with ``attn_implementation="sdpa"`` (no ``(B, H, S, S)`` weights kept; eager where
    transformers refuses SDPA: ``families.base_attention``); the executor then attends per document
    (``attention.document_attention``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    if source.kind is SourceKind.RANDOM:
        assert source.spec is not None
        # Weights are drawn from the global generator: fork it so building a model does not
        # move the caller's random stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(source.seed)
            model = LlamaForCausalLM(llama_config(source.spec)).to(dtype)
    else:
        kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "attn_implementation": "sdpa"}
        try:
            if source.kind is SourceKind.GGUF:  # a GGUF's family is one transformers reads as Llama's
                kwargs["gguf_file"] = source.gguf_file
            else:
                model_type = AutoConfig.from_pretrained(source.path, local_files_only=True).model_type
                _check_supported(model_type, source)
                kwargs["attn_implementation"] = base_attention(model_type)
            model = AutoModelForCausalLM.from_pretrained(source.path, **kwargs)
        except (OSError, ValueError) as err:
            raise InputError(source.name, "model", f"cannot load ({str(err).splitlines()[0]})") from None
    _check_supported(model.config.model_type, source)
    return model.eval().requires_grad_(False)


def _check_supported(model_type: str, source: ModelSource) -> None:
    why = unsupported_model_type(model_type)
    if why is not None:
        raise InputError(source.name, "model", why)


def load_base(source: ModelSource, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, SafetensorsWeights | None]:
    """The base model as ``build_replica`` takes it, per stage or whole by the source's kind (module doc).

    Returns:
        ``(skeleton, weights)``: the causal LM on the ``meta`` device, frozen, in eval mode, and
        its checked checkpoint (HF directory with safetensors); or ``(model, None)``: the whole
        model from :func:`load_causal_lm` (every other source).

    Raises:
        InputError: the directory cannot be loaded, or its checkpoint lacks a tensor of the model
            or holds one of another shape (naming the file and tensor), before anything is built.
    """
    if source.kind is not SourceKind.HF_DIR or not has_safetensors(Path(source.path)):
        return load_causal_lm(source, dtype), None
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise InputError(source.name, "model", f"cannot load ({str(err).splitlines()[0]})") from None
    _check_supported(config.model_type, source)
    # The same model from_pretrained builds (dtype, attention), with no storage: parameters and
    # buffers are meta tensors until build_replica knows which of them this rank keeps.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=base_attention(config.model_type)
        )
    weights = SafetensorsWeights.of(Path(source.path), model)
    return model.eval().requires_grad_(False), weights


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of the model lives in the checkpoint."""

    file: str
    """The safetensors file, relative to the directory."""
    key: str
    """Its name in the file: the model's own name, or a tied alias's (``lm_head.weight`` is read
    from ``model.embed_tokens.weight`` when the checkpoint stores the tied pair once)."""
    shape: tuple[int, ...]
    """Its whole shape, checked against the model's."""


class SafetensorsWeights:
    """Every persistent tensor of a model, found in a local safetensors checkpoint and read by slices.

    Built by :meth:`of`, which checks names and shapes against the model (on the meta device)
    before anything is read. :meth:`read` then reads one tensor's slice with
    ``safe_open(...).get_slice(key)[index]``: only the slice's bytes come off the disk. Every
    read is recorded in :attr:`reads`, so a test can tell what a stage loaded.
    """

    def __init__(self, directory: Path, entries: dict[str, TensorEntry]) -> None:
        self.directory = directory
        self.entries = entries
        """The model's tensor name (before injection: ``model.layers.0.self_attn.q_proj.weight``) -> entry."""
        self.reads: list[tuple[str, tuple[int, ...], int]] = []
        """``(key, shape read, bytes read)`` of every read, in order."""

    @classmethod
    def of(cls, directory: Path, model: nn.Module) -> SafetensorsWeights:
        """The checkpoint of ``directory`` bound to ``model``'s persistent tensors (``state_dict`` names).

        Raises:
            InputError: the index names a missing file, or a tensor of the model is missing from
                the checkpoint (path: the index or file; field: the tensor), or has another shape
                (path: the file holding it).
        """
        files = checkpoint_files(directory)
        shapes = tensor_shapes(directory, set(files.values()))
        where = str(directory / (SAFETENSORS_INDEX if (directory / SAFETENSORS_INDEX).is_file() else SAFETENSORS_FILE))
        aliases = _aliases(model)
        entries = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            key = next((n for n in aliases[id(tensor)] if n in files), None)
            if key is None:
                raise InputError(
                    where,
                    name,
                    f"tensor missing from the checkpoint (the model's config makes it {tuple(tensor.shape)})",
                )
            shape = shapes[key]
            if shape != tuple(tensor.shape):
                raise InputError(
                    str(directory / files[key]),
                    key,
                    f"shape {shape} in the checkpoint, but the model's config makes it {tuple(tensor.shape)}",
                )
            entries[name] = TensorEntry(files[key], key, shape)
        return cls(directory, entries)

    def read(self, name: str, index: tuple[slice, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """``tensor[index]`` of the model's tensor ``name``, in ``dtype`` on ``device`` (a new, contiguous tensor)."""
        from safetensors import safe_open

        entry = self.entries[name]
        with safe_open(str(self.directory / entry.file), framework="pt", device=str(device)) as f:
            part = f.get_slice(entry.key)[index]
        self.reads.append((entry.key, tuple(part.shape), part.numel() * part.element_size()))
        return part.to(device=device, dtype=dtype).contiguous()


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter and buffer of ``model``, by tensor identity, in model order
    (a tied pair has two names)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return names
