"""Where a task's rows come from (a file or a saved dataset on local disk), and how its rows become text.

Example (a task's ``data``, or its ``eval``'s)::

    data:
      path: data/qa.parquet            # .jsonl .json .parquet .csv .txt, or a save_to_disk directory
      format: auto                     # or alpaca, sharegpt, messages, prompt_completion, prompt_response, text
      columns: {prompt: question, response: answer}   # the format's field -> the file's column
      split: train                     # a saved DatasetDict's split (default: train, or its only split)
      train_on_inputs: false           # true: the loss on the prompt's tokens too
      chat_template: auto              # wrap prompt rows in the tokenizer's chat template: auto | always | never
      system_prompt: null              # a system turn for chats that have none ("" for an empty one)

``lorafleet.data`` reads and renders rows by these fields (docs/workload.md, ``data``).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from lorafleet.specs._base import Bool, FieldError, Spec


class DataFormat(StrEnum):
    """How rows of a task's dataset are turned into text (the fields each reads: :data:`FORMAT_FIELDS`)."""

    AUTO = "auto"
    """Chosen by the first row's fields (after ``columns``): ``messages``, ``conversations`` (sharegpt),
    ``prompt``+``completion``, ``prompt``+``response``, ``instruction``+``output`` (alpaca), ``text``."""
    PROMPT_RESPONSE = "prompt_response"
    """Fields ``prompt`` and ``response`` (optional ``system``); loss on the response only."""
    PROMPT_COMPLETION = "prompt_completion"
    """TRL's ``prompt`` and ``completion``: two strings (as ``prompt_response``) or two chats (loss on the
    completion's turns)."""
    ALPACA = "alpaca"
    """``instruction``, optional ``input`` (appended to the instruction after a newline), ``output`` (the
    response), optional ``system``."""
    MESSAGES = "messages"
    """A chat (``[{role, content}, ...]``, roles system, user, assistant, tool; an assistant turn may carry
    ``tool_calls``) rendered with the tokenizer's chat template; loss on assistant turns."""
    SHAREGPT = "sharegpt"
    """``conversations`` (or ``messages``) of ``{from, value}`` turns, optional ``system``; the roles mapped to
    ``messages``' (:data:`SHAREGPT_ROLES`)."""
    TEXT = "text"
    """One ``text`` field; loss on every token."""


FORMAT_FIELDS: dict[DataFormat, tuple[str, ...]] = {
    DataFormat.PROMPT_RESPONSE: ("prompt", "response", "system"),
    DataFormat.PROMPT_COMPLETION: ("prompt", "completion"),
    DataFormat.ALPACA: ("instruction", "input", "output", "system"),
    DataFormat.MESSAGES: ("messages",),
    DataFormat.SHAREGPT: ("conversations", "system"),
    DataFormat.TEXT: ("text",),
}
"""The row fields each format reads: what ``columns`` may map."""

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""A ShareGPT turn's ``from`` -> its ``messages`` role. ``function_call`` is an assistant turn calling a tool
(its ``value`` a JSON ``{name, arguments}``, or a list of them); ``observation`` is the tool's output."""


class ChatTemplateUse(StrEnum):
    """Whether prompt rows (``prompt_response``, ``prompt_completion`` strings, ``alpaca``) are wrapped in the
    tokenizer's chat template as a user turn and an assistant turn."""

    AUTO = "auto"
    """Wrapped when the tokenizer has a chat template (``lorafleet validate`` says which)."""
    ALWAYS = "always"
    """Wrapped; a tokenizer without a chat template is an error."""
    NEVER = "never"
    """Never wrapped: the prompt's tokens, then the response's and the end-of-sequence token."""


class DataSpec(Spec):
    """A task's training (or held-out) data on local disk, and how its rows become tokens."""

    path: str = Field(min_length=1)
    """A ``.jsonl`` file (an object a line), a ``.json`` file (an array of objects), ``.parquet``, ``.csv`` (a
    header row), ``.txt`` (a document a line), or a directory saved by ``datasets`` ``save_to_disk`` (a
    ``Dataset`` or a ``DatasetDict``)."""
    format: DataFormat = DataFormat.AUTO
    """How rows become text (see DataFormat)."""
    columns: dict[str, str] = Field(default_factory=dict)
    """The format's field -> the file's column holding it (``{prompt: question, response: answer}``)."""
    split: str | None = None
    """The split of a saved ``DatasetDict`` to read; default ``train``, or its only split. Other splits are
    reported by ``lorafleet validate``; one can be a task's ``eval: {data: {path, split}}``."""
    train_on_inputs: Bool = False
    """Take the loss on every token (prompts, user and tool turns, the template's scaffolding), not only on
    what the task learns to produce."""
    chat_template: ChatTemplateUse = ChatTemplateUse.AUTO
    """Whether prompt rows are wrapped in the tokenizer's chat template (see ChatTemplateUse)."""
    system_prompt: str | None = None
    """A system turn given to every chat that has none; ``""`` gives an empty one. None: the chat template's own
    choice (some add a default system prompt: SmolLM2's and Qwen2.5's do; ``lorafleet validate`` says so)."""

    @model_validator(mode="after")
    def _known_columns(self) -> DataSpec:
        accepted = (
            sorted({f for fields in FORMAT_FIELDS.values() for f in fields})
            if self.format is DataFormat.AUTO
            else list(FORMAT_FIELDS[self.format])
        )
        for key, column in self.columns.items():
            if key not in accepted:
                raise FieldError(
                    ("columns", key),
                    f"format {self.format.value} has no field {key!r} to map (it reads {', '.join(accepted)})",
                )
            if not column:
                raise FieldError(("columns", key), "must name a column")
        return self
