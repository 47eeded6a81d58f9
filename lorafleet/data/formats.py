"""Rows of every supported format -> one of three things to render: a chat, a prompt and its response, a text.

A file's format is chosen once, from its first row (``auto``: :func:`detect_format`), after the task's
``columns`` map renamed the file's columns to the format's fields; every row must then be of that format. A row
that is not is an InputError naming the file, the row and the field, and, where the row's fields fit another
format, which (the near-misses: alpaca rows under ``format: messages``, ShareGPT turns in ``messages``).

Conversions (docs/workload.md, ``data``):

- ``alpaca``: the prompt is ``instruction``, then ``input`` after a newline when it is not empty (LLaMA-Factory's
  rule); the response ``output``; ``system`` a system turn.
- ``sharegpt``: each ``{from, value}`` turn becomes a ``messages`` turn by ``specs.data.SHAREGPT_ROLES``; a
  ``function_call`` turn's value (JSON ``{name, arguments}`` or a list of them) becomes an assistant turn's
  ``tool_calls``; the row's ``system`` a first system turn.
- ``prompt_completion`` (TRL): two strings are a prompt and its response; two chats are one chat whose
  completion turns alone are learnt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorafleet.data.readers import Row
from lorafleet.errors import InputError
from lorafleet.specs.data import FORMAT_FIELDS, SHAREGPT_ROLES, DataFormat

ROLES = ("system", "user", "assistant", "tool")
"""The roles a ``messages`` turn may have."""

Where = tuple[str, str]
"""(file, ``row N``) for messages."""


@dataclass(frozen=True)
class Chat:
    """A chat to render with the tokenizer's chat template."""

    messages: tuple[dict[str, Any], ...]
    learn: tuple[bool, ...]
    """Per turn: whether the task learns to produce it (assistant turns; a TRL completion's only)."""


@dataclass(frozen=True)
class PromptPair:
    """A prompt and the response to learn (``prompt_response``, ``alpaca``, TRL string prompt/completion)."""

    prompt: str
    response: str
    system: str | None = None


@dataclass(frozen=True)
class Text:
    """A document learnt whole."""

    text: str


Unit = Chat | PromptPair | Text

_DETECTION = (
    (DataFormat.MESSAGES, ("messages",)),
    (DataFormat.SHAREGPT, ("conversations",)),
    (DataFormat.PROMPT_COMPLETION, ("prompt", "completion")),
    (DataFormat.PROMPT_RESPONSE, ("prompt", "response")),
    (DataFormat.ALPACA, ("instruction", "output")),
    (DataFormat.TEXT, ("text",)),
)
"""``auto``'s order: the first format whose fields a row has."""

ACCEPTED = (
    "messages (chat), conversations (sharegpt), prompt+completion, prompt+response, instruction+output (alpaca), text"
)


def detect_format(row: Row) -> DataFormat | None:
    """The format a row's fields fit (the module doc's order), None for none. ``messages`` of ShareGPT turns
    (``from``/``value``) are sharegpt."""
    for fmt, fields in _DETECTION:
        if all(f in row for f in fields):
            if fmt is DataFormat.MESSAGES and _sharegpt_turns(row["messages"]):
                return DataFormat.SHAREGPT
            return fmt
    return None


def _sharegpt_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "from" in value[0]


def map_columns(row: Row, columns: Mapping[str, str], where: Where) -> Row:
    """``row`` with each mapped column renamed to its format field (``columns``: field -> column)."""
    if not columns:
        return row
    renamed = {k: v for k, v in row.items() if k not in columns.values()}
    for field, column in columns.items():
        if column not in row:
            raise InputError(
                where[0],
                f"{where[1]}",
                f"has no column {column!r} (data.columns.{field}); its columns are {_names(row)}",
            )
        renamed[field] = row[column]
    return renamed


def _names(row: Row) -> str:
    return ", ".join(sorted(row)) or "none"


def resolve_format(first: Row, requested: DataFormat, where: Where) -> DataFormat:
    """The file's format: ``requested``, or (``auto``) the first row's (InputError naming its fields when it fits
    none)."""
    if requested is not DataFormat.AUTO:
        return requested
    found = detect_format(first)
    if found is None:
        if "chosen" in first and "rejected" in first:
            raise InputError(
                where[0],
                where[1],
                "is a preference pair (chosen/rejected, for DPO), which lorafleet does not "
                "train: give the chosen reply as a response (columns: {response: chosen})",
            )
        raise InputError(
            where[0],
            where[1],
            f"its fields {_names(first)} fit no format (accepted: {ACCEPTED}); name yours with data.columns, "
            f"e.g. {_suggested_columns(first)}",
        )
    return found


_PROMPT_NAMES = ("question", "query", "instruction", "input", "problem", "context")
_RESPONSE_NAMES = ("answer", "response", "output", "reply", "solution", "target")


def _suggested_columns(row: Row) -> str:
    """A ``columns`` map for a row whose fields have common names of a prompt and a response (``question`` and
    ``answer``...), else the same map for the example's names."""
    prompt = next((name for name in _PROMPT_NAMES if name in row), "question")
    response = next((name for name in _RESPONSE_NAMES if name in row and name != prompt), "answer")
    return f"columns: {{prompt: {prompt}, response: {response}}}"


def to_unit(row: Row, fmt: DataFormat, where: Where) -> Unit:
    """One row of format ``fmt`` as what it renders to; InputError naming the field that is wrong."""
    missing = [f for f in _required(fmt, row) if f not in row]
    if missing:
        raise InputError(where[0], where[1], _near_miss(row, fmt, missing))
    if fmt is DataFormat.TEXT:
        return Text(_string(row, "text", where))
    if fmt is DataFormat.PROMPT_RESPONSE:
        return PromptPair(_string(row, "prompt", where), _string(row, "response", where), _system(row, where))
    if fmt is DataFormat.ALPACA:
        instruction, extra = _string(row, "instruction", where), row.get("input")
        if extra is not None and not isinstance(extra, str):
            raise InputError(where[0], f"{where[1]}.input", "must be a string")
        prompt = f"{instruction}\n{extra}" if extra else instruction
        return PromptPair(prompt, _string(row, "output", where), _system(row, where))
    if fmt is DataFormat.PROMPT_COMPLETION:
        return _prompt_completion(row, where)
    if fmt is DataFormat.SHAREGPT:
        return _sharegpt(row, where)
    assert fmt is DataFormat.MESSAGES
    messages = check_messages(row["messages"], f"{where[1]}.messages", where[0])
    return Chat(tuple(_present(m) for m in messages), tuple(m["role"] == "assistant" for m in messages))


def _present(message: dict[str, Any]) -> dict[str, Any]:
    """A turn without its null keys but ``content``: parquet and ``datasets`` give every turn of a chat every
    key any turn has (``tool_calls: null`` on a user turn), which a template testing ``is defined`` would take
    for a value."""
    return {k: v for k, v in message.items() if v is not None or k == "content"}


def _required(fmt: DataFormat, row: Row) -> tuple[str, ...]:
    if fmt is DataFormat.SHAREGPT:
        return () if "conversations" in row or "messages" in row else ("conversations",)
    return tuple(f for f in FORMAT_FIELDS[fmt] if f not in ("system", "input"))


def _near_miss(row: Row, fmt: DataFormat, missing: list[str]) -> str:
    """What a row lacks for ``fmt``, and the format its fields do fit, if one does."""
    said = f"has no field {' or '.join(missing)} (format {fmt.value} reads {', '.join(FORMAT_FIELDS[fmt])})"
    fits = detect_format(row)
    if fits is not None:
        return f"{said}; its fields {_names(row)} are format {fits.value}: set format: {fits.value} or auto"
    return f"{said}; its fields are {_names(row)}: map them with data.columns"


def _string(row: Row, key: str, where: Where) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise InputError(
            where[0], f"{where[1]}.{key}", "missing" if value is None else f"must be a string, got {_kind(value)}"
        )
    return value


def _kind(value: Any) -> str:
    return {list: "a list", dict: "a mapping", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__
    )


def _system(row: Row, where: Where) -> str | None:
    return None if row.get("system") is None else _string(row, "system", where)


def check_messages(value: Any, field: str, path: str, *, needs_reply: bool = True) -> list[dict[str, Any]]:
    """``value`` as a valid chat: a non-empty list of ``{role, content}`` turns with known roles (an assistant
    turn may have ``tool_calls`` and no content), with an assistant turn to learn when ``needs_reply``."""
    if not isinstance(value, list) or not value:
        what = (
            "text (as a CSV cell is: put chats in JSONL, JSON or parquet)" if isinstance(value, str) else _kind(value)
        )
        raise InputError(path, field, f"must be a non-empty list of turns, got {what}")
    for j, message in enumerate(value):
        at = f"{field}[{j}]"
        if isinstance(message, dict) and "from" in message and "role" not in message:
            raise InputError(path, at, "is a ShareGPT turn (from/value): set format: sharegpt or auto")
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InputError(path, at, "needs string fields role and content")
        role = message["role"]
        if role not in ROLES:
            raise InputError(path, f"{at}.role", f"unknown role {role!r} (accepted: {', '.join(ROLES)})")
        calls = message.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list) or not calls):
            raise InputError(path, f"{at}.tool_calls", "must be a non-empty list, on an assistant turn")
        content = message.get("content")
        if not isinstance(content, str) and not (calls and content is None):
            raise InputError(path, f"{at}.content", "must be a string (or null on a turn with tool_calls)")
    if needs_reply and not any(m["role"] == "assistant" for m in value):
        raise InputError(path, field, "has no assistant turn to learn")
    return value


def _prompt_completion(row: Row, where: Where) -> Unit:
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return PromptPair(prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        asked = check_messages(prompt, f"{where[1]}.prompt", where[0], needs_reply=False)
        said = check_messages(completion, f"{where[1]}.completion", where[0])
        learn = [False] * len(asked) + [m["role"] == "assistant" for m in said]
        return Chat(tuple(_present(m) for m in asked + said), tuple(learn))
    raise InputError(
        where[0],
        where[1],
        f"prompt and completion must both be strings or both chats, got {_kind(prompt)} and {_kind(completion)}",
    )


def _sharegpt(row: Row, where: Where) -> Chat:
    key = "conversations" if "conversations" in row else "messages"
    turns, field = row[key], f"{where[1]}.{key}"
    if not isinstance(turns, list) or not turns:
        raise InputError(where[0], field, f"must be a non-empty list of turns, got {_kind(turns)}")
    messages: list[dict[str, Any]] = []
    system = _system(row, where)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for j, turn in enumerate(turns):
        at = f"{field}[{j}]"
        speaker = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        value = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if not isinstance(speaker, str) or not isinstance(value, str):
            raise InputError(where[0], at, "needs string fields from and value")
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            raise InputError(
                where[0], f"{at}.from", f"unknown speaker {speaker!r} (accepted: {', '.join(SHAREGPT_ROLES)})"
            )
        if speaker == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": _tool_calls(value, where[0], at)})
        else:
            messages.append({"role": role, "content": value})
    checked = check_messages(messages, field, where[0])
    return Chat(tuple(checked), tuple(m["role"] == "assistant" for m in checked))


def _tool_calls(value: str, path: str, at: str) -> list[dict[str, Any]]:
    """A ``function_call`` turn's value as ``tool_calls`` (``{type: function, function: {name, arguments}}``)."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as err:
        raise InputError(path, f"{at}.value", f"a function_call's value must be JSON ({err.msg})") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise InputError(path, f"{at}.value", "a function_call's value must be {name, arguments} or a list of them")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]
