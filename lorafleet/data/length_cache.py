"""Tokenized datasets kept on disk, keyed by what they are a function of, so that a dataset is tokenized once
on a machine: the launcher of ``lorafleet train`` that needs only its lengths, ``plan``, every rank that trains on
it and a later run all read the one tokenization. A process that finds its data's entry loads no tokenizer:
loading one imports transformers and with it torch, about 3 CPU-s, more than the launcher's other work, and a
rank skips the tokenization itself (the demo's four tasks: ~2 CPU-s a rank; the tokenizer, where a process
loads it, is read in its saved form: ``data.tokenizer_cache``).

An entry's key is SHA-256 over everything a row's tokens and labels depend on:

- the dataset's bytes (a file's; a ``save_to_disk`` directory's every file, by relative path);
- its ``DataSpec`` but its path (format, columns, split, chat template use, system prompt, ...);
- the tokenizer's files (``data.model_source.tokenizer_digest``): every regular file in its directory but
  weights (a workload's ``tokenizer:`` directory, an HF model directory); a GGUF's metadata (its key-value
  section, which holds the vocabulary, merges, special tokens and chat template a tokenizer is built from:
  megabytes, not the weights after it); or a random preset's vocabulary and the Python its tiny BPE is trained
  under (``data.tiny_tokenizer``: the standard library's docstrings);
- the versions of the libraries that render and tokenize (transformers, tokenizers, jinja2, sentencepiece,
  gguf) and the source of ``lorafleet.data`` (reading, rendering and tokenizing the rows): ``data.cache_key``.

So a hit is the examples a tokenization would give, bit for bit, and their lengths the histogram it would
give. No key (never cached): a chat template that calls ``strftime_now`` (its text, so its tokens, change with
the date), and a model file that is not a GGUF this module can read. An entry is written only after a
tokenization succeeded, and never for a dataset with no row: one that fails to tokenize is tokenized, and
refused, every time.

Where: under ``data.cache_key.cache_dir`` (``$LORAFLEET_CACHE_DIR``, else the user's cache directory), in
``tokens/``, one file an entry (``data.token_file``: each token's id in 2 bytes, 4 above 65,535, and its label
in a bit; the demo's 960 rows, 355,152 tokens, take 0.76 MB). Every rank of a run may read and write an entry
at once: entries are written whole and renamed into place, and an entry that is not whole (truncated,
corrupt) is said in one warning, computed again and rewritten, never used. A cache directory that cannot be
written is said in one warning, and the run goes on without it.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from lorafleet.data.cache_key import CACHE_ENV, cache_dir, environment_digest
from lorafleet.data.token_file import CorruptEntry, read_examples, read_lengths, write_examples
from lorafleet.data.tokenize import Example
from lorafleet.specs.data import DataSpec

Tokenize = Callable[[], Sequence[Example]]
"""A dataset's tokenization (``data.tokenize.tokenize_data``), run on a miss."""
T = TypeVar("T")


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
    from lorafleet.data.model_source import tokenizer_digest

    tokenizer_part = tokenizer_digest(model, tokenizer)
    if tokenizer_part is None:
        return None
    digest = hashlib.sha256()
    digest.update(environment_digest().encode())
    digest.update(tokenizer_part.encode())
    digest.update(data.model_dump_json(exclude={"path"}).encode())
    _hash_path(digest, Path(data.path))
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
