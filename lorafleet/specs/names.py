"""What a task may be called: the one rule the workload, the queue's request files and its HTTP front-end check."""

from __future__ import annotations

import re

TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=\-]{0,63}")
"""What a task may be called (it names its adapter's directory, its request files and its metrics): letters,
digits, ``_ . - =``, a letter or digit first, at most 64 characters (``=`` for a sweep's members,
``support-bot.lr=3e-4.rank=16``). The one rule: the workload, the queue's request
files and its HTTP front-end all check a name by :func:`task_name_error`."""


def task_name_error(name: str) -> str | None:
    """Why ``name`` is not a task name (:data:`TASK_NAME`), or None."""
    if TASK_NAME.fullmatch(name):
        return None
    return f"{name!r} is not a valid task name (letters, digits, _ . - =, a letter or digit first; at most 64)"
