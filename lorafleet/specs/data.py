"""Where a task's rows come from: a file or a saved dataset on local disk, and how its rows become text."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from lorafleet.specs._base import Spec


class DataFormat(StrEnum):
    """How rows of a task's dataset are turned into text."""

    AUTO = "auto"
    """``messages`` if present, else ``prompt``/``response``, else ``text``."""
    PROMPT_RESPONSE = "prompt_response"
    """Fields ``prompt`` and ``response``; loss on the response only."""
    MESSAGES = "messages"
    """A chat (``[{role, content}, ...]``) rendered with the tokenizer's chat template; loss on assistant turns."""
    TEXT = "text"
    """One ``text`` field; loss on every token."""


class DataSpec(Spec):
    """A task's training data on local disk."""

    path: str = Field(min_length=1)
    """A JSONL file or a directory saved by ``datasets.Dataset.save_to_disk``."""
    format: DataFormat = DataFormat.AUTO
    """How rows become text (see DataFormat)."""
