"""What a committed checkpoint is on disk, and which one a resume may trust; torch-free, so the launcher
verifies checkpoints before it starts a process (``checkpoint.py`` reads and writes their tensors).

A step directory ``step-NNNNNN/`` is committed once it has been renamed into place; its
``manifest.json`` records the SHA-256 of every other file in it. :func:`resumable_checkpoint`
takes the newest directory whose manifest reads and whose files all match (``latest.json`` is
a pointer for people and tools, not trusted), naming every newer one it passed over.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError

FORMAT_VERSION = 2
"""2 adds ``files``: the SHA-256 of every file of the step directory, verified on resume."""
MANIFEST = "manifest.json"
LATEST = "latest.json"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_problem(step_dir: Path) -> str | None:
    """Why ``step_dir`` is not an intact committed checkpoint (None when it is): its manifest does
    not read, is of another format, or a file is missing or differs from its recorded SHA-256."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION:
            return f"format {manifest.get('format')!r}, expected {FORMAT_VERSION}"
        int(manifest["step"])
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable manifest ({type(err).__name__})"
    for name, digest in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if file_sha256(path) != digest:
            return f"{name} does not match its checksum"
    return None


@dataclass(frozen=True)
class Resumable:
    """The checkpoint a run resumes from, and the newer ones that were passed over."""

    step_dir: Path
    step: int
    broken: tuple[str, ...] = ()
    """One line per newer checkpoint that is not intact (``step-000006: adapter_model... checksum``)."""


def resumable_checkpoint(directory: str | Path) -> Resumable | None:
    """The newest intact checkpoint of ``directory`` (module docstring); None when there is no checkpoint.

    Raises:
        InputError: there are checkpoints but none is intact.
    """
    root = Path(directory)
    broken = []
    for step_dir in sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: p.name, reverse=True):
        problem = checkpoint_problem(step_dir)
        if problem is None:
            step = int(json.loads((step_dir / MANIFEST).read_text())["step"])
            return Resumable(step_dir=step_dir, step=step, broken=tuple(broken))
        broken.append(f"{step_dir.name}: {problem}")
    if broken:
        raise InputError(str(root), "", f"no intact checkpoint to resume from ({'; '.join(broken)})")
    return None


def read_manifest(step_dir: str | Path) -> dict[str, Any]:
    """The manifest of a (verified) step directory."""
    return json.loads((Path(step_dir) / MANIFEST).read_text())
