"""Where lorafleet's caches live on disk, and what every entry's key holds of the environment: the caches of
tokenized data (``data.length_cache``) and of tokenizers (``data.tokenizer_cache``) share both.

Where: ``$LORAFLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/lorafleet``, else ``~/.cache/lorafleet``. The
environment's part of a key: the versions of the libraries that build tokenizers, render and tokenize
(transformers, tokenizers, jinja2, sentencepiece, gguf) and the source of ``lorafleet.data`` (reading, rendering
and tokenizing the rows, and the rule for the tokenizer a workload loads).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
from pathlib import Path

CACHE_ENV = "LORAFLEET_CACHE_DIR"
"""The cache's directory, when set (the default is the user's cache directory: module doc)."""
LIBRARIES = ("transformers", "tokenizers", "jinja2", "sentencepiece", "gguf")
"""The libraries whose versions a key holds (one not installed is keyed as absent)."""


def cache_dir() -> Path:
    """The directory the caches' entries go under (module doc)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lorafleet"


@functools.cache
def environment_digest() -> str:
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
