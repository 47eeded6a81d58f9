"""Rows -> token ids and labels, with the loss on response tokens only.

``labels[i] = -100`` (PyTorch's ignore index) on every token the task does not learn to
produce: the prompt, the user turns, the chat template's scaffolding before each reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorafleet.data.records import Row, detect_format
from lorafleet.errors import InputError
from lorafleet.specs.data import DataFormat
from lorafleet.work import count as count_work

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    """One tokenized sequence."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    """Same length as ``input_ids``; ``IGNORE_INDEX`` where no loss is taken."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def truncated(self, length: int) -> Example:
        return Example(self.input_ids[:length], self.labels[:length])


def _text_field(row: Row, key: str, where: tuple[str, str]) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise InputError(where[0], f"{where[1]}.{key}", "missing" if value is None else "must be a string")
    return value


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _messages_example(tokenizer: Any, messages: list[dict[str, str]]) -> Example:
    """Render a chat; learn every assistant turn (the span its message adds to the rendering)."""
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        upto = _chat_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if message["role"] == "assistant":
            prefix = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True)
            # The reply's own tokens start after the generation prompt of the turns before it.
            labels += [IGNORE_INDEX] * (len(prefix) - len(ids)) + upto[len(prefix) :]
        else:
            labels += [IGNORE_INDEX] * (len(upto) - len(ids))
        ids = upto
    return Example(tuple(ids), tuple(labels))


def _check_messages(value: Any, where: tuple[str, str]) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InputError(where[0], f"{where[1]}.messages", "must be a non-empty list")
    for j, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise InputError(where[0], f"{where[1]}.messages[{j}]", "needs string fields role and content")
        if message["role"] not in ("system", "user", "assistant"):
            raise InputError(where[0], f"{where[1]}.messages[{j}].role", f"unknown role {message['role']!r}")
    if not any(m["role"] == "assistant" for m in value):
        raise InputError(where[0], f"{where[1]}.messages", "has no assistant turn to learn")
    return value


def tokenize_row(tokenizer: Any, row: Row, fmt: DataFormat, where: tuple[str, str]) -> Example:
    """One row as an Example; ``where`` = (file, ``row N``) for error messages."""
    kind = detect_format(row, fmt)
    if kind is DataFormat.MESSAGES:
        return _messages_example(tokenizer, _check_messages(row.get("messages"), where))
    if kind is DataFormat.PROMPT_RESPONSE:
        prompt, response = _text_field(row, "prompt", where), _text_field(row, "response", where)
        if tokenizer.chat_template:
            return _messages_example(
                tokenizer, [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return Example(tuple(prompt_ids + response_ids), tuple([IGNORE_INDEX] * len(prompt_ids) + response_ids))
    if kind is DataFormat.TEXT:
        ids = tokenizer(_text_field(row, "text", where), add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        return Example(tuple(ids), tuple(ids))
    raise InputError(where[0], where[1], "has none of the fields messages, prompt+response, text")


def tokenize_rows(tokenizer: Any, rows: list[Row], fmt: DataFormat, path: str) -> list[Example]:
    """Every row tokenized; row numbers in errors count from 1. Counted (``work``: ``tokenizations``): a run
    tokenizes each task's data once a process, and an added task's once."""
    count_work("tokenizations")
    return [tokenize_row(tokenizer, row, fmt, (path, f"row {i}")) for i, row in enumerate(rows, start=1)]


def load_tokenizer(path: str, source: str, field: str) -> Any:
    """A tokenizer from a local directory (never a hub); InputError naming ``source: field`` otherwise."""
    from pathlib import Path

    if not Path(path).is_dir():
        raise InputError(source, field, f"tokenizer directory {path!r} does not exist")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise InputError(source, field, f"cannot load a tokenizer from {path!r} ({str(err).splitlines()[0]})") from None
