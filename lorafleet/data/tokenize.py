"""A task's rows -> token ids and labels, with the loss on what the task learns to produce.

``labels[i] = -100`` (PyTorch's ignore index) on every token the task does not learn: the prompt, the user and
system turns, the **tool turns** (a tool's output is the world's, not the model's: masked, as TRL and axolotl
do), the chat template's scaffolding before each reply. An assistant turn is learnt whole: its text, its
``tool_calls`` as the template renders them, and its end token. ``train_on_inputs: true`` learns every token.

What is wrapped in the tokenizer's chat template (``data.chat_template``): chats always; prompt rows (a prompt and
its response) under ``auto`` when the tokenizer has a template, under ``always``, never under ``never`` (the
prompt's tokens, then the response's and the end-of-sequence token). ``data.system_prompt`` gives chats without a
system turn one, so a template's default system prompt (:func:`default_system_prompt`) is not what is trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorafleet.data.formats import Chat, PromptPair, Text, Unit
from lorafleet.data.readers import Container, Row
from lorafleet.data.records import TaskRows, read_task_rows, task_rows
from lorafleet.errors import InputError
from lorafleet.specs.data import ChatTemplateUse, DataFormat, DataSpec
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


Where = tuple[str, str]


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, where: Where) -> list[int]:
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja's TemplateError, or a template's own raise_exception: the row is named
        raise InputError(where[0], where[1], f"the tokenizer's chat template cannot render it ({err})") from None
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _chat_example(tokenizer: Any, chat: Chat, spec: DataSpec, where: Where) -> Example:
    """Render a chat; learn each turn marked to learn (the span its message adds to the rendering)."""
    if not tokenizer.chat_template:
        raise InputError(where[0], where[1], "is a chat, and the tokenizer has no chat template to render it")
    messages, learn = list(chat.messages), list(chat.learn)
    if spec.system_prompt is not None and messages[0]["role"] != "system":
        messages, learn = [{"role": "system", "content": spec.system_prompt}, *messages], [False, *learn]
    if any(m.get("tool_calls") for m in messages) and "tool_calls" not in tokenizer.chat_template:
        raise InputError(where[0], where[1], "has tool calls, and the tokenizer's chat template does not render them")
    ids: list[int] = []
    labels: list[int] = []
    for i, learnt in enumerate(learn):
        upto = _chat_ids(tokenizer, messages[: i + 1], False, where)
        if learnt:
            prefix = _chat_ids(tokenizer, messages[:i], True, where)
            # The reply's own tokens start after the generation prompt of the turns before it.
            labels += [IGNORE_INDEX] * (len(prefix) - len(ids)) + upto[len(prefix) :]
        else:
            labels += [IGNORE_INDEX] * (len(upto) - len(ids))
        ids = upto
    return Example(tuple(ids), tuple(ids) if spec.train_on_inputs else tuple(labels))


def wraps_prompts(tokenizer: Any, spec: DataSpec) -> bool:
    """Whether prompt rows are wrapped in the chat template (module doc); InputError for ``always`` without one."""
    if spec.chat_template is ChatTemplateUse.NEVER:
        return False
    if spec.chat_template is ChatTemplateUse.ALWAYS and not tokenizer.chat_template:
        raise InputError(spec.path, "chat_template", "is always, and the tokenizer has no chat template")
    return bool(tokenizer.chat_template)


def render(tokenizer: Any, unit: Unit, spec: DataSpec, where: Where) -> Example:
    """One row (converted: ``data.formats``) as an Example; ``where`` = (file, ``row N``) for error messages."""
    if isinstance(unit, Chat):
        return _chat_example(tokenizer, unit, spec, where)
    eos = [tokenizer.eos_token_id]
    if isinstance(unit, Text):
        ids = tokenizer(unit.text, add_special_tokens=False)["input_ids"] + eos
        return Example(tuple(ids), tuple(ids))
    assert isinstance(unit, PromptPair)
    if wraps_prompts(tokenizer, spec):
        turns = [{"role": "user", "content": unit.prompt}, {"role": "assistant", "content": unit.response}]
        if unit.system is not None:  # else data.system_prompt's, as for any chat
            turns.insert(0, {"role": "system", "content": unit.system})
        return _chat_example(tokenizer, Chat(tuple(turns), tuple(t["role"] == "assistant" for t in turns)), spec, where)
    # Not wrapped: a row's own system text goes before the prompt; data.system_prompt is a chat's turn only.
    prompt = unit.prompt if unit.system is None else f"{unit.system}\n\n{unit.prompt}"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(unit.response, add_special_tokens=False)["input_ids"] + eos
    ids = prompt_ids + response_ids
    labels = ids if spec.train_on_inputs else [IGNORE_INDEX] * len(prompt_ids) + response_ids
    return Example(tuple(ids), tuple(labels))


def tokenize_task_rows(tokenizer: Any, rows: TaskRows, spec: DataSpec) -> list[Example]:
    """Every row rendered; row numbers in errors count from 1. Counted (``work``: ``tokenizations``): a run
    tokenizes each task's data once a process, and an added task's once."""
    count_work("tokenizations")
    return [render(tokenizer, unit, spec, (rows.source, f"row {i}")) for i, unit in enumerate(rows.units, start=1)]


def tokenize_data(tokenizer: Any, spec: DataSpec) -> list[Example]:
    """The rows of ``spec`` (read: ``data.records.read_task_rows``), tokenized."""
    return tokenize_task_rows(tokenizer, read_task_rows(spec), spec)


def tokenize_rows(tokenizer: Any, rows: list[Row], data: DataSpec | DataFormat, path: str) -> list[Example]:
    """Rows already read, tokenized under ``data`` (a format alone: the other ``data`` keys' defaults);
    ``path`` names the file in errors."""
    spec = data if isinstance(data, DataSpec) else DataSpec(path=path, format=data)
    return tokenize_task_rows(tokenizer, task_rows(Container(rows, "rows"), spec, path), spec)


def default_system_prompt(tokenizer: Any) -> str | None:
    """The system prompt the tokenizer's chat template adds to a chat that has none (SmolLM2's "You are a helpful
    AI assistant named SmolLM..."), None when it adds none or cannot say. Found by rendering one chat with no
    system turn and with an empty one: what the first has in place of the second's empty content is the
    template's own."""
    if not tokenizer.chat_template:
        return None
    chat = [{"role": "user", "content": "\x01u"}, {"role": "assistant", "content": "\x01a"}]
    try:
        bare = tokenizer.apply_chat_template(chat, tokenize=False)
        empty = tokenizer.apply_chat_template([{"role": "system", "content": ""}, *chat], tokenize=False)
    except Exception:  # a template that refuses system turns adds none either
        return None
    if len(bare) <= len(empty):
        return None
    head = next((i for i, (a, b) in enumerate(zip(bare, empty)) if a != b), len(empty))
    tail = next((i for i, (a, b) in enumerate(zip(reversed(bare), reversed(empty))) if a != b), len(empty))
    tail = min(tail, len(empty) - head)
    added = bare[head : len(bare) - tail].strip()
    return added or None


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
