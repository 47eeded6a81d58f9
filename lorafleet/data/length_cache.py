"""Tokenized datasets kept on disk, keyed by what they are a function of, so that a dataset is tokenized once
on a machine: the launcher of ``lorafleet train`` that needs only its lengths, ``plan``, every rank that trains on
it and a later run all read the one tokenization. A process that finds its data's entry loads no tokenizer:
loading one imports transformers and with it torch, about 3 CPU-s, more than the launcher's other work, and a
rank skips the tokenization itself (the demo's four tasks: ~2 CPU-s a rank, and the GGUF tokenizer's ~5.5 on
a rank that does not export).

An entry's key is SHA-256 over everything a row's tokens and labels depend on:

- the dataset's bytes (a file's; a ``save_to_disk`` directory's every file, by relative path);
- its ``DataSpec`` but its path (format, columns, split, chat template use, system prompt, ...);
- the tokenizer's files: every regular file in its directory but weights (a workload's ``tokenizer:``
  directory, an HF model directory); a GGUF's metadata (its key-value section, which holds the vocabulary,
  merges, special tokens and chat template a tokenizer is built from: megabytes, not the weights after it);
  or a random preset's vocabulary and the Python its tiny BPE is trained under (``data.tiny_tokenizer``: the
  standard library's docstrings);
- the versions of the libraries that render and tokenize (transformers, tokenizers, jinja2, sentencepiece,
  gguf) and the source of ``lorafleet.data`` (reading, rendering and tokenizing the rows).

So a hit is the examples a tokenization would give, bit for bit, and their lengths the histogram it would
give. No key (never cached): a chat template that calls ``strftime_now`` (its text, so its tokens, change with
the date), and a model file that is not a GGUF this module can read. An entry is written only after a
tokenization succeeded, and never for a dataset with no row: one that fails to tokenize is tokenized, and
refused, every time.

Where: ``$LORAFLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/lorafleet``, else ``~/.cache/lorafleet``; under
``tokens/``, one file an entry (``data.token_file``: each token's id in 2 bytes, 4 above 65,535, and its label
in a bit; the demo's 960 rows, 355,152 tokens, take 0.76 MB). Every rank of a run may read and write an entry
at once: entries are written whole and renamed into place, and an entry that is not whole (truncated,
corrupt) is said in one warning, computed again and rewritten, never used. A cache directory that cannot be
written is said in one warning, and the run goes on without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from lorafleet.data.token_file import CorruptEntry, read_examples, read_lengths, write_examples
from lorafleet.data.tokenize import Example
from lorafleet.errors import InputError
from lorafleet.specs.data import DataSpec

CACHE_ENV = "LORAFLEET_CACHE_DIR"
"""The cache's directory, when set (the default is the user's cache directory: module doc)."""
LIBRARIES = ("transformers", "tokenizers", "jinja2", "sentencepiece", "gguf")
"""The libraries whose versions a key holds (one not installed is keyed as absent)."""
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx"})
"""Files of a model directory that hold weights, not the tokenizer: not hashed."""
DATED = b"strftime_now"
"""What a chat template calls to put today's date in its text: such a tokenizer is never keyed."""
Tokenize = Callable[[], Sequence[Example]]
"""A dataset's tokenization (``data.tokenize.tokenize_data``), run on a miss."""
T = TypeVar("T")


def cache_dir() -> Path:
    """The directory entries go under (module doc)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lorafleet"


def cached_examples(data: DataSpec, model: str, tokenizer: str | None, tokenize: Tokenize) -> list[Example]:
    """``data``'s examples: the cache's when it holds the key's entry, else ``tokenize()``, stored under the key.
    ``model``/``tokenizer``: the workload's fields naming the tokenizer (``data.model_source.data_tokenizer``'s
    rule)."""
    return _through_cache(data, model, tokenizer, tokenize, read_examples, list)


def cached_lengths(data: DataSpec, model: str, tokenizer: str | None, tokenize: Tokenize) -> np.ndarray:
    """Every row's token count (int64, in row order) of ``data``: read from the offsets of the key's entry when
    the cache holds it (its tokens are not read), else of ``tokenize()``, whose examples are then stored (so the
    ranks that train on the data read them: one tokenization a machine)."""
    return _through_cache(
        data, model, tokenizer, tokenize, read_lengths, lambda ex: np.fromiter(map(len, ex), np.int64, len(ex))
    )


def _through_cache(
    data: DataSpec,
    model: str,
    tokenizer: str | None,
    tokenize: Tokenize,
    read: Callable[[Path], T],
    of: Callable[[list[Example]], T],
) -> T:
    """``read`` of the key's entry when there is a whole one; else ``of`` the examples ``tokenize()`` gives,
    which are stored under the key (when ``data`` has one)."""
    key = data_key(data, model, tokenizer)
    path = None if key is None else cache_dir() / "tokens" / f"{key}.tokens"
    found = None if path is None else _read(path, read)
    if found is not None:
        return found
    examples = list(tokenize())
    if path is not None:
        _write(path, examples)
    return of(examples)


def data_key(data: DataSpec, model: str, tokenizer: str | None) -> str | None:
    """The key of ``data``'s tokenization under the workload's tokenizer (module doc); None: not cached."""
    tokenizer_part = _tokenizer_digest(model, tokenizer)
    if tokenizer_part is None:
        return None
    digest = hashlib.sha256()
    digest.update(_environment_digest().encode())
    digest.update(tokenizer_part.encode())
    digest.update(data.model_dump_json(exclude={"path"}).encode())
    _hash_path(digest, Path(data.path))
    return digest.hexdigest()


def _tokenizer_digest(model: str, tokenizer: str | None) -> str | None:
    """What identifies the tokenizer ``data_tokenizer`` would load, without loading it; None where nothing cheap
    does (a dated template, a GGUF file whose header does not read) or the model does not resolve (loading then
    says why)."""
    from lorafleet.data.gguf_metadata import metadata_bytes
    from lorafleet.data.model_source import SourceKind, resolve_model_source

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


@functools.cache
def _environment_digest() -> str:
    """The libraries' versions and ``lorafleet.data``'s source: the same in every call of a process."""
    digest = hashlib.sha256()
    for name in LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{name}={version}\0".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _hash_path(digest: hashlib._Hash, path: Path) -> None:
    """A file's bytes, or a directory's every file (relative path, then bytes), into ``digest``. A path that is
    neither (missing: the reader refuses it) hashes as its name alone: its entry is never written."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else "").encode() + b"\0")
        with file.open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())


def _read(path: Path, read: Callable[[Path], T]) -> T | None:
    """What ``read`` gets from an entry (``data.token_file``); None when there is none, or the cache cannot be read
    (writing it then fails, said in :func:`_write`'s warning), or it is not a whole entry: said, and rewritten."""
    try:
        return read(path)
    except CorruptEntry as err:
        warnings.warn(f"token cache entry {path} is not whole ({err}): tokenized again", stacklevel=3)
        return None
    except OSError:  # no entry (a miss), or a cache that cannot be read: writing it says so
        return None


def _write(path: Path, examples: Sequence[Example]) -> None:
    """Write an entry atomically (``data.token_file``: a reader sees the whole entry or none); none for a dataset
    with no row; a directory that cannot be written is one warning (the run goes on without the cache)."""
    if not examples:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_examples(path, examples)
    except OSError as err:
        warnings.warn(f"token cache {path.parent} not written ({err}); set {CACHE_ENV}", stacklevel=3)
