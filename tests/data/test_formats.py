"""Rows of every format (``data.formats``) render as the same chat: alpaca, ShareGPT, TRL's prompt/completion,
prompt/response and messages; ``auto`` tells them apart; a column map names the file's own columns; and a row
that is nearly right is one line naming the file, row and field, and what it is."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from lorafleet.data.records import read_task_rows
from lorafleet.data.tokenize import IGNORE_INDEX, tokenize_data
from lorafleet.errors import InputError
from lorafleet.specs.data import DataFormat, DataSpec

PROMPT, ANSWER = "Name the colour of grass.", "Green."
CHAT = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": ANSWER}]

ONE_ROW = {
    DataFormat.MESSAGES: {"messages": CHAT},
    DataFormat.SHAREGPT: {"conversations": [{"from": "human", "value": PROMPT}, {"from": "gpt", "value": ANSWER}]},
    DataFormat.ALPACA: {"instruction": PROMPT, "input": "", "output": ANSWER},
    DataFormat.PROMPT_COMPLETION: {"prompt": PROMPT, "completion": ANSWER},
    DataFormat.PROMPT_RESPONSE: {"prompt": PROMPT, "response": ANSWER},
}
"""One exchange in each format that renders it as a chat."""


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


def _jsonl(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("fmt", list(ONE_ROW))
def test_every_format_renders_the_same_chat_and_auto_finds_it(tmp_path, tokenizer, fmt):
    path = _jsonl(tmp_path, [ONE_ROW[fmt]])
    reference = tokenize_data(tokenizer, DataSpec(path=_jsonl(tmp_path, [ONE_ROW[DataFormat.MESSAGES]], "m.jsonl")))
    assert read_task_rows(DataSpec(path=path)).format is fmt
    for spec in (DataSpec(path=path), DataSpec(path=path, format=fmt)):
        (example,) = tokenize_data(tokenizer, spec)
        assert example == reference[0]
    learnt = tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])
    assert learnt == f"{ANSWER}<|im_end|>\n"  # the reply and its end, not the prompt


def test_sharegpt_turns_under_messages_and_alpaca_input_and_system(tmp_path, tokenizer):
    """ShareGPT turns under a ``messages`` key are sharegpt to ``auto``; alpaca's input follows its instruction
    after a newline and its system is a system turn."""
    turns = ONE_ROW[DataFormat.SHAREGPT]["conversations"]
    assert read_task_rows(DataSpec(path=_jsonl(tmp_path, [{"messages": turns}]))).format is DataFormat.SHAREGPT
    alpaca = {"instruction": "Translate.", "input": "chat", "output": "cat", "system": "Be brief."}
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Translate.\nchat"},
        {"role": "assistant", "content": "cat"},
    ]
    assert tokenize_data(tokenizer, DataSpec(path=_jsonl(tmp_path, [alpaca]))) == tokenize_data(
        tokenizer, DataSpec(path=_jsonl(tmp_path, [{"messages": chat}], "m.jsonl"))
    )


def test_trl_conversational_prompt_completion_learns_the_completion_only(tmp_path, tokenizer):
    prompt = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
    ]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "6"}]}
    (example,) = tokenize_data(tokenizer, DataSpec(path=_jsonl(tmp_path, [row])))
    learnt = tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])
    assert learnt == "6<|im_end|>\n"  # not the prompt's own assistant turn "4"


def test_a_column_map_names_the_files_columns(tmp_path, tokenizer):
    path = _jsonl(tmp_path, [{"question": PROMPT, "answer": ANSWER, "id": 7}])
    spec = DataSpec(path=path, columns={"prompt": "question", "response": "answer"})
    assert read_task_rows(spec).format is DataFormat.PROMPT_RESPONSE
    reference = _jsonl(tmp_path, [ONE_ROW[DataFormat.PROMPT_RESPONSE]], "r.jsonl")
    assert tokenize_data(tokenizer, spec) == tokenize_data(tokenizer, DataSpec(path=reference))


def test_the_hint_for_a_preference_pair_reads_it(tmp_path):
    path = _jsonl(tmp_path, [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    rows = read_task_rows(DataSpec(path=path, columns={"response": "chosen"}))
    assert rows.format is DataFormat.PROMPT_RESPONSE and rows.units[0].response == "c"


def test_a_column_map_naming_a_missing_column_is_one_line(tmp_path):
    path = _jsonl(tmp_path, [{"question": "q", "answer": "a"}, {"question": "q", "reply": "a"}])
    with pytest.raises(InputError) as err:
        read_task_rows(DataSpec(path=path, columns={"prompt": "question", "response": "answer"}))
    assert (
        str(err.value)
        == f"{path}: row 2: has no column 'answer' (data.columns.response); its columns are question, reply"
    )


@pytest.mark.parametrize(
    "row,fmt,field,message",
    [
        (
            ONE_ROW[DataFormat.ALPACA],
            DataFormat.MESSAGES,
            "row 1",
            "has no field messages (format messages reads messages); its fields input, instruction, output are format "
            "alpaca: set format: alpaca or auto",
        ),
        (
            {"messages": ONE_ROW[DataFormat.SHAREGPT]["conversations"]},
            DataFormat.MESSAGES,
            "row 1.messages[0]",
            "is a ShareGPT turn (from/value): set format: sharegpt or auto",
        ),
        (
            {"question": "q", "answer": "a"},
            DataFormat.AUTO,
            "row 1",
            "its fields answer, question fit no format (accepted: messages (chat), conversations (sharegpt), "
            "prompt+completion, prompt+response, instruction+output (alpaca), text); name yours with data.columns, "
            "e.g. columns: {prompt: question, response: answer}",
        ),
        (
            {"query": "q", "reply": "a", "id": 3},
            DataFormat.AUTO,
            "row 1",
            "its fields id, query, reply fit no format (accepted: messages (chat), conversations (sharegpt), "
            "prompt+completion, prompt+response, instruction+output (alpaca), text); name yours with data.columns, "
            "e.g. columns: {prompt: query, response: reply}",
        ),
        (
            {"prompt": "p", "chosen": "c", "rejected": "r"},
            DataFormat.AUTO,
            "row 1",
            "is a preference pair (chosen/rejected, for DPO), which lorafleet does not train: give the chosen reply "
            "as a response (columns: {response: chosen})",
        ),
        (
            {"question": "q", "answer": "a"},
            DataFormat.ALPACA,
            "row 1",
            "has no field instruction or output (format alpaca reads instruction, input, output, system); its fields "
            "are answer, question: map them with data.columns",
        ),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            DataFormat.AUTO,
            "row 1.messages[0].role",
            "unknown role 'bot' (accepted: system, user, assistant, tool)",
        ),
        (
            {"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]},
            DataFormat.AUTO,
            "row 1.conversations[1].from",
            "unknown speaker 'robot' (accepted: system, human, user, gpt, assistant, model, function_call, tool, "
            "observation, function_response)",
        ),
        (
            {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "get()"}]},
            DataFormat.AUTO,
            "row 1.conversations[1].value",
            "a function_call's value must be JSON (Expecting value)",
        ),
        ({"messages": []}, DataFormat.AUTO, "row 1.messages", "must be a non-empty list of turns, got a list"),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            DataFormat.AUTO,
            "row 1.messages",
            "has no assistant turn to learn",
        ),
        ({"prompt": "p", "completion": ["c"]}, DataFormat.AUTO, "row 1", "prompt and completion must both be strings"),
        ({"text": 3}, DataFormat.AUTO, "row 1.text", "must be a string, got a number"),
    ],
    ids=[
        "alpaca-as-messages",
        "sharegpt-as-messages",
        "no-format",
        "no-format-own-names",
        "preference-pair",
        "not-alpaca",
        "unknown-role",
        "unknown-speaker",
        "bad-function-call",
        "empty-chat",
        "no-reply",
        "mixed-completion",
        "text-not-string",
    ],
)
def test_a_near_miss_names_what_was_found_and_what_is_accepted(tmp_path, row, fmt, field, message):
    path = _jsonl(tmp_path, [row])
    with pytest.raises(InputError) as err:
        read_task_rows(DataSpec(path=path, format=fmt))
    assert (err.value.path, err.value.field) == (path, field)
    assert err.value.msg.startswith(message), err.value.msg


def test_the_first_row_chooses_the_files_format(tmp_path):
    """``auto`` decides once: a later row of another format is an error naming it, not a second format."""
    path = _jsonl(tmp_path, [ONE_ROW[DataFormat.PROMPT_RESPONSE], {"text": "a document"}])
    with pytest.raises(InputError) as err:
        read_task_rows(DataSpec(path=path))
    assert (
        err.value.field == "row 2" and "format prompt_response" in err.value.msg and "are format text" in err.value.msg
    )


def test_a_csv_cell_is_not_a_chat(tmp_path):
    path = tmp_path / "chat.csv"
    path.write_text('messages\n"[{""role"": ""user""}]"\n')
    with pytest.raises(
        InputError, match=r"row 1.messages: must be a non-empty list of turns, got text \(as a CSV cell is"
    ):
        read_task_rows(DataSpec(path=str(path), format=DataFormat.MESSAGES))


def test_a_column_map_key_the_format_does_not_read_is_refused():
    with pytest.raises(ValueError, match="format alpaca has no field 'response' to map"):
        DataSpec(path="x.jsonl", format=DataFormat.ALPACA, columns={"response": "answer"})
