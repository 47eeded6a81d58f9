"""Token-length histograms of datasets kept on disk, keyed by what they are a function of, so that a process that
needs only a dataset's lengths (``lorafleet train``'s launcher, ``plan``) loads no tokenizer for data tokenized
before: loading one imports transformers and with it torch, about 3 CPU-s, more than the launcher's other work.

An entry's key is SHA-256 over everything a row's token length depends on:

- the dataset's bytes (a file's; a ``save_to_disk`` directory's every file, by relative path);
- its ``DataSpec`` but its path (format, columns, split, chat template use, system prompt, ...);
- the tokenizer's files: every regular file in its directory but weights (a workload's ``tokenizer:``
  directory, an HF model directory), or a random preset's vocabulary and the Python its tiny BPE is trained
  under (``data.tiny_tokenizer``: the standard library's docstrings);
- the versions of the libraries that render and tokenize (transformers, tokenizers, jinja2) and the source of
  ``lorafleet.data`` (reading, rendering and tokenizing the rows).

So a hit is the histogram a tokenization would give, bit for bit. No key (never cached): a GGUF's tokenizer,
which is inside the model file (gigabytes to hash), and a chat template that calls ``strftime_now`` (its text,
so its lengths, change with the date). An entry is written only after a tokenization succeeded: a dataset
that fails to tokenize is tokenized, and refused, every time.

Where: ``$LORAFLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/lorafleet``, else ``~/.cache/lorafleet``; under
``lengths/``, one JSON file an entry (``{"histogram": [[length, rows], ...]}``: kilobytes). An entry that
does not parse as one is computed again and rewritten; a cache directory that cannot be written is said in
one warning, and the run goes on without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from lorafleet.errors import InputError
from lorafleet.specs.data import DataSpec

CACHE_ENV = "LORAFLEET_CACHE_DIR"
"""The cache's directory, when set (the default is the user's cache directory: module doc)."""
LIBRARIES = ("transformers", "tokenizers", "jinja2", "sentencepiece")
"""The libraries whose versions a key holds (one not installed is keyed as absent)."""
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx"})
"""Files of a model directory that hold weights, not the tokenizer: not hashed."""
DATED = b"strftime_now"
"""What a chat template calls to put today's date in its text: such a tokenizer is never keyed."""


def cache_dir() -> Path:
    """The directory entries go under (module doc)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lorafleet"


def cached_lengths(
    data: DataSpec, model: str, tokenizer: str | None, compute: Callable[[], dict[int, int]]
) -> dict[int, int]:
    """``data``'s token-length histogram ({length: rows}): the cache's when it holds the key's entry, else
    ``compute()`` (a tokenization), stored under the key. ``model``/``tokenizer``: the workload's fields naming the
    tokenizer (``data.model_source.data_tokenizer``'s rule)."""
    key = lengths_key(data, model, tokenizer)
    if key is None:
        return compute()
    path = cache_dir() / "lengths" / f"{key}.json"
    found = _read(path)
    if found is not None:
        return found
    histogram = compute()
    _write(path, histogram)
    return histogram


def lengths_key(data: DataSpec, model: str, tokenizer: str | None) -> str | None:
    """The key of ``data``'s lengths under the workload's tokenizer (module doc); None: not cached."""
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
    does (a GGUF's, a dated template's) or the model does not resolve (loading then says why)."""
    from lorafleet.data.model_source import SourceKind, resolve_model_source

    if tokenizer is not None:
        directory = Path(tokenizer)
    else:
        try:
            source = resolve_model_source(model)
        except InputError:
            return None
        if source.kind is SourceKind.GGUF:
            return None
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


def _read(path: Path) -> dict[int, int] | None:
    """The histogram an entry holds; None when there is no entry or it is not one (it is then rewritten), or the
    cache cannot be read (writing it then fails, said in :func:`_write`'s warning)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        pairs = json.loads(text)["histogram"]
        histogram = {int(length): int(rows) for length, rows in pairs}
    except (ValueError, KeyError, TypeError):
        return None
    if not histogram or min(histogram) < 0 or min(histogram.values()) < 1:
        return None
    return histogram


def _write(path: Path, histogram: dict[int, int]) -> None:
    """Write an entry atomically (a reader sees the whole entry or none); a directory that cannot be written is
    one warning (the run goes on without the cache)."""
    text = json.dumps({"histogram": sorted(histogram.items())})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        if tmp.is_file():
            tmp.unlink()
        warnings.warn(f"token-length cache {path.parent} not written ({err}); set {CACHE_ENV}", stacklevel=3)
