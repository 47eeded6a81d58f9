"""What ``lorafleet validate`` says of each task's data: where its rows come from, their format, the splits left
unused, and what the chat template does to them, one line each.

Every row of every task's ``data`` (and ``eval.data``) is read and checked (``data.records``: no tokenizer
needed), so a bad row is found before a run. The chat-template lines need the workload's tokenizer; when it
cannot be had (a preset with no weights here), one line says the template was not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lorafleet.data.formats import Chat, PromptPair
from lorafleet.data.readers import chosen_split, saved_splits
from lorafleet.data.records import TaskRows, read_task_rows
from lorafleet.data.tokenize import default_system_prompt, render, wraps_prompts
from lorafleet.errors import InputError
from lorafleet.specs.data import ChatTemplateUse, DataFormat, DataSpec
from lorafleet.specs.workload import TaskSpec


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _read(task: TaskSpec) -> list[tuple[str, DataSpec, TaskRows]]:
    """(``data`` or ``eval.data``, its spec, its rows) of a task."""
    specs = [("data", task.data)] if task.data is not None else []
    if task.eval is not None and task.eval.data is not None:
        specs.append(("eval.data", task.eval.data))
    return [(key, spec, read_task_rows(spec)) for key, spec in specs]


def check_task_data(tasks: Sequence[TaskSpec]) -> list[str]:
    """Every row of every task's ``data`` and ``eval.data`` read and checked (an InputError naming the file, row
    and field), and :func:`unused_split_lines`: what ``train``'s launcher does before it writes anything, so bad
    data is refused there and not on the ranks after the run directory is claimed (no tokenizer: its lengths may
    be given, and the ranks tokenize)."""
    for task in tasks:
        _read(task)
    return unused_split_lines(tasks)


def unused_split_lines(tasks: Sequence[TaskSpec]) -> list[str]:
    """A line for each task whose ``data`` is a saved DatasetDict with splits that neither its ``data`` nor its
    ``eval.data`` reads: what ``validate`` and ``train`` say, so no split is left out without a word. Reads only
    the DatasetDicts' split names."""
    lines = []
    for task in tasks:
        if task.data is None:
            continue
        names = saved_splits(task.data.path)
        used = {chosen_split(names, task.data.split)}
        held = task.eval.data if task.eval is not None else None
        if held is not None and Path(held.path).resolve() == Path(task.data.path).resolve():
            used.add(chosen_split(names, held.split))
        unused = [s for s in names if s not in used]
        if unused:
            hint = f"eval: {{data: {{path: {task.data.path}, split: {unused[0]}}}}}"
            lines.append(
                f"{task.name}: {task.data.path}: split {', '.join(unused)} not used (one can be the task's held-out "
                f"rows: {hint})"
            )
    return lines


def _template_lines(task: TaskSpec, spec: DataSpec, rows: TaskRows, tokenizer: Any) -> Iterator[str]:
    """How the chat template renders this data: prompt rows wrapped or not, a default system prompt added."""
    pairs = sum(isinstance(u, PromptPair) for u in rows.units)
    if pairs:
        if wraps_prompts(tokenizer, spec):
            yield (
                f"{task.name}: prompt rows wrapped in the tokenizer's chat template as a user turn and an assistant "
                f"turn (data.chat_template: {spec.chat_template.value}; never: the prompt's text, then the response)"
            )
        else:
            why = "never" if spec.chat_template is ChatTemplateUse.NEVER else "the tokenizer has none"
            yield f"{task.name}: prompt rows not wrapped in a chat template ({why}): prompt text, then the response"
    wrapped = sum(isinstance(u, Chat) for u in rows.units) + (pairs if wraps_prompts(tokenizer, spec) else 0)
    system = default_system_prompt(tokenizer) if spec.system_prompt is None else None
    without = sum(
        (isinstance(u, Chat) and u.messages[0]["role"] != "system") or (isinstance(u, PromptPair) and u.system is None)
        for u in rows.units
    )
    if wrapped and system is not None and without:
        yield (
            f"{task.name}: the chat template adds the system prompt {system!r} to its {_rows(without)} without one "
            '(data.system_prompt sets your own, "" an empty one)'
        )
    if rows.units:
        render(tokenizer, rows.units[0], spec, (rows.source, "row 1"))  # the template renders this data


def check_chat_templates(tasks: Sequence[TaskSpec], tokenizer: Callable[[], Any], source: str) -> None:
    """A task whose training rows are chats needs a tokenizer with a chat template to render them: checked for the
    tasks whose lengths are not their rows' (given, or another dataset's: ``plan`` tokenizes no row of theirs; a
    task's lengths measured from its rows rendered them already, and a chat without a template was refused, naming
    the row). ``tokenizer()`` loads the workload's, once, and only for such a task; where it gives None, or there is
    no tokenizer here (a preset without weights: a what-if), nothing is checked.

    Raises:
        InputError: naming ``source``'s task and its data file, when the tokenizer has no chat template.
    """
    loaded: list[Any] = []
    for i, task in enumerate(tasks):
        if task.data is None or task.lengths is None:  # its lengths are its rows', rendered already
            continue
        try:
            rows = read_task_rows(task.data)
        except InputError:  # a bad row: validate's and train's to name (plan reads rows for this check only)
            continue
        if not any(isinstance(u, Chat) for u in rows.units):
            continue
        if not loaded:
            try:
                loaded.append(tokenizer())
            except InputError:
                return
        if loaded[0] is None:
            return
        if not loaded[0].chat_template:
            raise InputError(
                source,
                f"tasks[{i}].data",
                f"{rows.source} holds chats (format {rows.format.value}), and the tokenizer has no chat template to "
                "render them: set tokenizer: to a tokenizer directory that has one, or give prompt/response rows",
            )


def data_lines(tasks: list[TaskSpec] | tuple[TaskSpec, ...], tokenizer: Callable[[], Any]) -> list[str]:
    """The lines of the module doc for ``tasks``; ``tokenizer()`` loads the workload's tokenizer, once, when a
    task's rows render through a chat template (an InputError from it is a line, not an error)."""
    lines: list[str] = []
    once = _Once(tokenizer)
    for task in tasks:
        read = _read(task)
        for key, spec, rows in read:
            how = f"format {rows.format.value}" + (" (auto)" if spec.format is DataFormat.AUTO else "")
            tools = sum(isinstance(u, Chat) and any(m["role"] == "tool" for m in u.messages) for u in rows.units)
            extra = f", {tools} with tool turns (their output masked)" if tools else ""
            extra += ", loss on every token (train_on_inputs)" if spec.train_on_inputs else ""
            lines.append(
                f"{task.name}: {key} {rows.source}: {rows.container.kind}, {_rows(len(rows.units))}, {how}{extra}"
            )
        lines += unused_split_lines([task])
        lines += _task_templates(task, read, once)
    return lines


def template_lines(tasks: Sequence[TaskSpec], tokenizer: Callable[[], Any]) -> list[str]:
    """Only the chat-template lines of :func:`data_lines` (prompt rows wrapped or not, a default system prompt
    added): what ``lorafleet train`` says as it starts, with the tokenizer it trains with."""
    once = _Once(tokenizer)
    return [line for task in tasks for line in _task_templates(task, _read(task), once)]


class _Once:
    """The workload's tokenizer, loaded at the first call only (None, and a line, when it cannot be had)."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load, self._loaded, self.failed = load, False, ""
        self._tokenizer: Any = None

    def __call__(self) -> Any:
        if not self._loaded:
            self._loaded = True
            try:
                self._tokenizer = self._load()
            except InputError as err:
                self.failed = f"chat templates not checked: no tokenizer ({err.msg})"
        return self._tokenizer

    def failure_once(self) -> list[str]:
        """The line saying the templates were not checked, the first time it is asked for (then none)."""
        line, self.failed = self.failed, ""
        return [line] if line else []


def _task_templates(task: TaskSpec, read: list[tuple[str, DataSpec, TaskRows]], once: _Once) -> list[str]:
    """A task's chat-template lines, for its training rows that render through a template."""
    lines: list[str] = []
    for key, spec, rows in read:
        if key != "data" or not any(isinstance(u, Chat | PromptPair) for u in rows.units):
            continue
        tokenizer = once()
        if tokenizer is None:
            lines += once.failure_once()
            continue
        lines += _template_lines(task, spec, rows, tokenizer)
    return lines
