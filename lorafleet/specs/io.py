"""Reading the JSON files users hand to lorafleet (plans, profiles, HF configs) with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lorafleet.errors import InputError


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; an InputError naming the file when it is missing, a directory,
    not UTF-8 JSON, or not an object."""
    src = str(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(src, "", "no such file") from None
    except IsADirectoryError:
        raise InputError(src, "", "is a directory, expected a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(src, "", f"not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise InputError(src, "", "expected a JSON object")
    return raw
