"""A workload's tokenizer kept on disk in its saved form, so that one built at a cost is built once on a machine.

transformers builds a GGUF's tokenizer from the file's vocabulary and merges every time it loads it (the demo's
SmolLM2: ~5-6 CPU-s); the saved form (``save_pretrained``: ``tokenizer.json``, its config, its chat template)
loads in ~0.1. So :func:`cached_tokenizer` loads the tokenizer the usual way once, saves it under the cache, and
later loads read the saved files. Saved and read back, the tokenizer is the one built (the demo's GGUF: the same
ids on every demo row, the same special tokens, padding side and chat template, and its ``save_pretrained`` gives
the same bytes, so the files exported beside adapters do not change: ``benchmarks/bench_data_load.py`` and the
tests check it).

An entry's key is SHA-256 over what the tokenizer is a function of, as the token cache's (``data.length_cache``):
the tokenizer's files (``data.model_source.tokenizer_digest``: a GGUF's key-value metadata, a directory's every
file but weights, a random preset's vocabulary and Python), the tokenizing libraries' versions and
``lorafleet.data``'s source (``data.cache_key``). No key (a dated chat template, a model file whose header does
not read): loaded the usual way every time, never saved.

An entry is a directory ``tokenizers/<key>/`` under ``data.cache_key.cache_dir``: the saved files and
:data:`MANIFEST`, each file's SHA-256. It is written whole in a directory of its own name
(``<key>.<pid>-<random>.tmp``) and renamed into place, so every rank and launch may build and write one at once (the
first rename wins; the rest find it there and drop theirs). On reading, the directory must hold exactly the
manifest's files with its digests; an entry that does not (a file cut short, changed, missing or added) is said in
one warning, moved aside and removed, and the tokenizer built and saved again: never used. A cache that cannot be
written is one warning, and the built tokenizer is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet.data.cache_key import CACHE_ENV, cache_dir, environment_digest
from lorafleet.data.tokenize import load_tokenizer
from lorafleet.specs.io import file_sha256

MANIFEST = "lorafleet-manifest.json"
"""An entry's list of its files and their SHA-256 (``{"files": {name: hex}}``), written last."""


def cached_tokenizer(digest: str | None, build: Callable[[], Any]) -> Any:
    """The tokenizer ``build()`` gives, ``digest`` identifying it (``data.model_source.tokenizer_digest``; None:
    not cached, built): read from the cache's entry when it holds a whole one, else built, then saved there
    (module doc). ``build()`` returning None (no tokenizer for the model) is returned as it is."""
    if digest is None:
        return build()
    key = hashlib.sha256(f"{environment_digest()}\0{digest}".encode()).hexdigest()
    entry = cache_dir() / "tokenizers" / key
    if entry.is_dir():
        problem = entry_problem(entry)
        if problem is None:
            return load_tokenizer(str(entry), str(entry), "tokenizer")
        warnings.warn(f"tokenizer cache entry {entry} is not whole ({problem}): built again", stacklevel=2)
        _remove(entry)
    built = build()
    if built is not None:
        _save(built, entry)
    return built


def entry_problem(entry: Path) -> str | None:
    """Why ``entry`` is not a whole entry (None when it is): its manifest does not read, or its files are not the
    manifest's (one missing, one more) or one's SHA-256 is not its recorded one."""
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
        names = {p.name for p in entry.iterdir()} - {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable manifest ({type(err).__name__})"
    if not isinstance(files, dict) or names != set(files):
        return f"files {sorted(names)}, its manifest names {sorted(files) if isinstance(files, dict) else files!r}"
    for name, recorded in files.items():
        if file_sha256(entry / name) != recorded:
            return f"{name} does not match its checksum"
    return None


def _save(tokenizer: Any, entry: Path) -> None:
    """``tokenizer.save_pretrained`` into a directory of its own, its manifest written last, renamed to ``entry``;
    an entry another process renamed there first is kept (theirs is the same tokenizer) and this one removed."""
    staging = entry.with_name(f"{entry.name}.{os.getpid()}-{uuid.uuid4().hex}.tmp")
    try:
        staging.mkdir(parents=True)
        tokenizer.save_pretrained(str(staging))
        files = {p.name: file_sha256(p) for p in sorted(staging.iterdir())}
        (staging / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
        staging.rename(entry)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        if not entry.is_dir():  # else another process's rename won: its entry is this tokenizer's
            warnings.warn(f"tokenizer cache {entry.parent} not written ({err}); set {CACHE_ENV}", stacklevel=3)


def _remove(entry: Path) -> None:
    """Move a corrupt entry aside (one rename: a reader sees it whole or not at all), then delete it; another
    process that moved it first leaves nothing to do."""
    aside = entry.with_name(f"{entry.name}.{os.getpid()}-{uuid.uuid4().hex}.corrupt")
    try:
        entry.rename(aside)
    except OSError:  # moved by another process already, or a cache that cannot be written (``_save`` says so)
        return
    shutil.rmtree(aside)
