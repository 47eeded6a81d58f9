""" "Did you mean" for an unknown key: the names users bring from PEFT, TRL, transformers' Trainer, axolotl and
LLaMA-Factory (``r``, ``lora_alpha``, ``learning_rate``, ``max_seq_length``...), and near-typos of lorafleet's own.

:func:`did_you_mean` takes an unknown key's location in a workload file and returns the hint that
``specs.workload.describe_validation_error`` appends to pydantic's "Extra inputs are not permitted".
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

FOREIGN_NAMES: dict[str, tuple[str, str, str]] = {
    "r": ("lora", "rank", "PEFT"),
    "lora_r": ("lora", "rank", "axolotl"),
    "lora_rank": ("lora", "rank", "LLaMA-Factory"),
    "lora_alpha": ("lora", "alpha", "PEFT"),
    "lora_dropout": ("lora", "dropout", "PEFT"),
    "lora_target_modules": ("lora", "target_modules", "axolotl"),
    "lora_target": ("lora", "target_modules", "LLaMA-Factory"),
    "learning_rate": ("optimizer", "lr", "Trainer"),
    "lr_scheduler_type": ("optimizer", "schedule", "Trainer"),
    "lr_scheduler": ("optimizer", "schedule", "axolotl"),
    "optim": ("optimizer", "name", "Trainer"),
    "max_seq_length": ("", "context_length", "TRL"),
    "max_length": ("", "context_length", "TRL"),
    "sequence_len": ("", "context_length", "axolotl"),
    "cutoff_len": ("", "context_length", "LLaMA-Factory"),
    "per_device_train_batch_size": ("", "batch_size", "Trainer"),
    "micro_batch_size": ("", "batch_size", "axolotl"),
    "num_train_epochs": ("", "epochs", "Trainer"),
    "num_epochs": ("", "epochs", "axolotl"),
    "max_steps": ("", "steps", "Trainer"),
    "dataset": ("", "data", "LLaMA-Factory"),
    "datasets": ("", "data", "axolotl"),
    "train_file": ("", "data", "Trainer's examples"),
    "dataset_text_field": ("data", "columns", "TRL"),
    "model_name_or_path": ("top", "model", "Trainer"),
    "base_model": ("top", "model", "axolotl"),
}
"""Another tool's key -> (where lorafleet keeps it: ``lora``, ``optimizer`` or ``data`` under a task, ``""`` a task's
own key, ``top`` the file's; lorafleet's key; whose name it is)."""

MOVED = {
    "lr": "optimizer",
    "warmup_steps": "optimizer",
    "weight_decay": "optimizer",
    "schedule": "optimizer",
    "rank": "lora",
    "alpha": "lora",
    "dropout": "lora",
    "target_modules": "lora",
    "use_rslora": "lora",
    "train_on_inputs": "data",
    "chat_template": "data",
    "system_prompt": "data",
    "columns": "data",
    "format": "data",
    "split": "data",
}
"""A lorafleet key written one level too high (a task's ``lr``) -> the mapping it belongs in."""


def _known_keys() -> list[str]:
    """Every field name of every spec (``specs._base.Spec``'s subclasses, those imported so far)."""
    from lorafleet.specs._base import Spec

    names: set[str] = set()
    todo = list(Spec.__subclasses__())
    while todo:
        cls = todo.pop()
        names |= set(cls.model_fields)
        todo += cls.__subclasses__()
    return sorted(names)


def did_you_mean(loc: Sequence[int | str]) -> str | None:
    """The hint for the unknown key at ``loc`` (``("tasks", 0, "lora", "r")``), None when there is none."""
    if not loc or not isinstance(loc[-1], str):
        return None
    key, parent = loc[-1], loc[-2] if len(loc) > 1 else None
    in_task = isinstance(parent, int) and len(loc) >= 3 and loc[-3] == "tasks"
    if key in FOREIGN_NAMES:
        section, ours, whose = FOREIGN_NAMES[key]
        if section == parent or (section == "" and in_task) or (section == "top" and len(loc) == 1):
            return f"did you mean {ours}? ({whose}'s {key})"
        if section in ("", "top"):
            where = "a task's own key" if section == "" else "at the file's top level"
            return f"did you mean {ours}, {where}? ({whose}'s {key})"
        if in_task:
            return f"did you mean {section}: {{{ours}: ...}}? ({whose}'s {key})"
        return f"did you mean {ours}, under a task's {section}? ({whose}'s {key})"
    if key in MOVED and in_task:
        return f"did you mean {MOVED[key]}: {{{key}: ...}}? ({key} belongs in a task's {MOVED[key]})"
    close = difflib.get_close_matches(key, _known_keys(), n=1, cutoff=0.8)
    return f"did you mean {close[0]}?" if close else None
