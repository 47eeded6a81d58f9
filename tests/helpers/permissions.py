"""Read-only places a test can rely on, as root too.

Root writes into a folder of mode 0555: ``CAP_DAC_OVERRIDE`` lets it pass any permission check. Where the
suite runs as root, :func:`unprivileged` runs the code under test with that capability out of the calling
thread's effective set (``capset``; the permitted set keeps it, so it comes back afterwards). Root is then
held to the owner's bits like anyone else: it still reads and writes its own files and ``tmp_path``, and a
folder of mode 0555 is read-only to it. Capabilities are per thread, so threads the code under test starts
inherit the dropped set.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

_CAPABILITY_VERSION_3 = 0x20080522
CAP_DAC_OVERRIDE = 1


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def read_only(path: Path) -> Path:
    """``path`` made a folder no one may write into (mode 0555; root too, under :func:`unprivileged`)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    return path


def _capabilities(call: str, data: ctypes.Array) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    header = _Header(_CAPABILITY_VERSION_3, 0)
    if getattr(libc, call)(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), f"{call} failed")


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """The block runs held to file permissions: as root, without ``CAP_DAC_OVERRIDE`` in this thread's
    effective set; otherwise as it is."""
    if os.geteuid() != 0:
        yield
        return
    data = (_Data * 2)()
    _capabilities("capget", data)
    saved = data[0].effective
    data[0].effective &= ~(1 << CAP_DAC_OVERRIDE)
    _capabilities("capset", data)
    try:
        yield
    finally:
        data[0].effective = saved
        _capabilities("capset", data)
