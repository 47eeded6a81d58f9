"""Where an HF model directory's safetensors weights are, read from the files' headers only (torch-free).

A directory holds one ``model.safetensors`` or shards named by ``model.safetensors.index.json``. Every
tensor's file and shape comes from the index and the headers (a header is a length and a JSON table of
names, dtypes, shapes and byte ranges; no tensor data is read), so the launcher can refuse a truncated or
corrupt file in one line before any worker starts, and each worker binds the same table to its model
(``executor.torch.base_model.SafetensorsWeights``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from lorafleet.errors import InputError

#: The safetensors weights of an HF model directory: one file, or shards named by an index.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def has_safetensors(directory: Path) -> bool:
    """Whether ``directory`` holds safetensors weights (one file or an index)."""
    return (directory / SAFETENSORS_INDEX).is_file() or (directory / SAFETENSORS_FILE).is_file()


def checkpoint_files(directory: Path) -> dict[str, str]:
    """Tensor key -> file (relative to ``directory``), from the shard index or the one file's header.

    Raises:
        InputError: the index is not one, names a file that is not there, or the one file's header cannot
            be read (naming the file).
    """
    index = directory / SAFETENSORS_INDEX
    if not index.is_file():
        return dict.fromkeys(_header(directory / SAFETENSORS_FILE), SAFETENSORS_FILE)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise InputError(str(index), "weight_map", f"not a safetensors index ({err})") from None
    for file in sorted(set(weight_map.values())):
        if not (directory / file).is_file():
            raise InputError(str(index), "weight_map", f"names {file!r}, which is not in {directory}")
    return dict(weight_map)


def tensor_shapes(directory: Path, files: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in ``files`` (relative to ``directory``), from their headers.

    Raises:
        InputError: a file's header cannot be read: truncated, not safetensors, or unreadable (naming it).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update(_header(directory / file))
    return shapes


def check_weights(directory: Path) -> None:
    """Every safetensors file of ``directory`` has a whole, readable header covering the file (what a worker
    reads before it loads a slice): one line naming the file otherwise. Nothing is checked for a directory
    without safetensors weights (transformers loads those whole, and says what it cannot)."""
    if has_safetensors(directory):
        tensor_shapes(directory, set(checkpoint_files(directory).values()))


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors of one safetensors file and their shapes (``safe_open`` checks the header: its length,
    its JSON, and that the byte ranges it names cover the file exactly)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError) as err:
        raise InputError(str(path), "", f"not a readable safetensors file ({str(err).splitlines()[0]})") from None
