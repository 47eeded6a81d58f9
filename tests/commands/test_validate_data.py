"""``lorafleet validate`` reads every task's data: a line each for its container, rows and format, a split left
unused, the chat template's wrapping and default system prompt; bad data is one line on stderr naming the file, row
and field, exit 2, and nothing on stdout."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from lorafleet.cli import main
from tests.data.test_rendering import SMOLLM2_TEMPLATE

ALPACA = [{"instruction": f"Count to {n}.", "input": "", "output": " ".join(map(str, range(1, n + 1)))} for n in (2, 3)]
SHAREGPT = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}] * 2
CHATS = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]} for w in "abc"]


@pytest.fixture(scope="module")
def smol_template_tokenizer(tokenizer_with_template):
    """The project's tiny tokenizer carrying SmolLM2's chat template (which adds a default system prompt)."""
    return tokenizer_with_template(SMOLLM2_TEMPLATE)


@pytest.fixture
def data(tmp_path):
    """An alpaca JSON array, ShareGPT parquet and a saved DatasetDict of chats with train and test splits."""
    (tmp_path / "alpaca.json").write_text(json.dumps(ALPACA, indent=1))
    pq.write_table(pa.Table.from_pylist(SHAREGPT), tmp_path / "chats.parquet")
    splits = {"train": datasets.Dataset.from_list(CHATS[:2]), "test": datasets.Dataset.from_list(CHATS[2:])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    return tmp_path


def _workload(tmp_path, tokenizer, tasks):
    path = tmp_path / "w.yaml"
    base = {"batch_size": 2, "context_length": 128}
    raw = {"model": "tiny-llama", "tokenizer": str(tokenizer), "tasks": [{**base, **t} for t in tasks]}
    path.write_text(yaml.safe_dump(raw))
    return path


def test_validate_says_what_each_tasks_data_is(data, smol_template_tokenizer, capsys):
    path = _workload(
        data,
        smol_template_tokenizer,
        [
            {"name": "count", "data": {"path": "alpaca.json"}},
            {"name": "greet", "data": {"path": "chats.parquet", "system_prompt": ""}},
            {"name": "say", "data": {"path": "dict"}},
            {"name": "said", "data": {"path": "dict"}, "eval": {"data": {"path": "dict", "split": "test"}}},
        ],
    )
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    smol = "'You are a helpful AI assistant named SmolLM, trained by Hugging Face'"
    d = str(data)
    assert lines == [
        f"count: data {d}/alpaca.json: JSON array, 2 rows, format alpaca (auto)",
        "count: prompt rows wrapped in the tokenizer's chat template as a user turn and an assistant turn "
        "(data.chat_template: auto; never: the prompt's text, then the response)",
        f"count: the chat template adds the system prompt {smol} to its 2 rows without one (data.system_prompt sets "
        'your own, "" an empty one)',
        f"greet: data {d}/chats.parquet: parquet file, 2 rows, format sharegpt (auto)",
        f"say: data {d}/dict (split train): saved DatasetDict, 2 rows, format messages (auto)",
        f"say: {d}/dict: split test not used (one can be the task's held-out rows: eval: {{data: {{path: {d}/dict, "
        "split: test}})",
        f"say: the chat template adds the system prompt {smol} to its 2 rows without one (data.system_prompt sets "
        'your own, "" an empty one)',
        f"said: data {d}/dict (split train): saved DatasetDict, 2 rows, format messages (auto)",
        f"said: eval.data {d}/dict (split test): saved DatasetDict, 1 row, format messages (auto)",
        f"said: the chat template adds the system prompt {smol} to its 2 rows without one (data.system_prompt sets "
        'your own, "" an empty one)',
    ]


def _corrupt_parquet(directory):
    (directory / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 40)
    return "bad.parquet", {}


def _alpaca_array_bad_row(directory):
    (directory / "bad.json").write_text(json.dumps([ALPACA[0], {"instruction": "x", "output": 5}]))
    return "bad.json", {}


def _missing_column(directory):
    (directory / "qa.jsonl").write_text(json.dumps({"question": "q", "reply": "a"}) + "\n")
    return "qa.jsonl", {"columns": {"prompt": "question", "response": "answer"}}


def _missing_split(directory):
    return "dict", {"split": "validation"}


def _unknown_column_key(directory):
    return "alpaca.json", {"format": "alpaca", "columns": {"response": "output"}}


def _alpaca_as_messages(directory):
    (directory / "a.jsonl").write_text(json.dumps(ALPACA[0]) + "\n")
    return "a.jsonl", {"format": "messages"}


@pytest.mark.parametrize(
    "make,where,message",
    [
        (_corrupt_parquet, "bad.parquet", "not a readable parquet file ("),
        (_alpaca_array_bad_row, "bad.json: row 2.output", "must be a string, got a number"),
        (_missing_column, "qa.jsonl: row 1", "has no column 'answer' (data.columns.response); its columns are"),
        (_missing_split, "dict: split", "no split 'validation' (the saved DatasetDict has train, test)"),
        (_unknown_column_key, "w.yaml: tasks[0].data.columns.response", "format alpaca has no field 'response'"),
        (_alpaca_as_messages, "a.jsonl: row 1", "has no field messages (format messages reads messages); its fields"),
    ],
    ids=["corrupt-parquet", "bad-row", "missing-column", "missing-split", "unknown-column-key", "alpaca-as-messages"],
)
@pytest.mark.parametrize("lengths", [False, True], ids=["measured", "given"])
def test_bad_data_is_one_line_exit_2_and_nothing_written(
    data, smol_template_tokenizer, capsys, make, where, message, lengths
):
    """With the lengths measured from the data (read at load) and given (read by validate's own check) alike."""
    name, extra = make(data)
    task = {"name": "t", "data": {"path": name, **extra}}
    if lengths:
        task["lengths"] = {"histogram": {10: 1}}
    path = _workload(data, smol_template_tokenizer, [task])
    before = sorted(p.name for p in data.rglob("*"))
    assert main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith(f"lorafleet: error: {data}/{where}: {message}"), err
    assert sorted(p.name for p in data.rglob("*")) == before


def test_trains_launcher_names_an_unused_split_too(data, tiny_tokenizer_dir, capsys):
    """``train`` reads its data on the ranks; its launcher says which split it leaves unused, before they start."""
    from lorafleet.cli import build_parser
    from lorafleet.commands.train import options_of
    from lorafleet.train.preflight import prepare

    path = _workload(data, tiny_tokenizer_dir, [{"name": "say", "data": {"path": "dict"}}])
    plan = data / "plan.json"
    assert main(["plan", str(path), "--gpus", "1", "--gpu", "cpu", "--samples", "0", "--json", str(plan)]) == 0
    capsys.readouterr()
    argv = ["train", str(path), "--plan", str(plan), "--gpus", "1", "--gpu", "cpu", "--out", str(data / "run")]
    prepare(options_of(build_parser().parse_args(argv)))
    assert capsys.readouterr().out == (
        f"lorafleet train: say: {data}/dict: split test not used (one can be the task's held-out rows: eval: "
        f"{{data: {{path: {data}/dict, split: test}}}})\n"
    )


def test_train_refuses_a_bad_row_before_it_writes_anything(data, tiny_tokenizer_dir, capsys):
    """With the lengths given, no tokenization at load reads the rows: the launcher reads them before the claim."""
    (data / "bad.jsonl").write_text(json.dumps(ALPACA[0]) + "\n" + json.dumps({"instruction": "x"}) + "\n")
    task = {"name": "count", "data": {"path": "bad.jsonl"}, "lengths": {"histogram": {10: 1}}}
    path = _workload(data, tiny_tokenizer_dir, [task])
    plan = data / "plan.json"
    assert main(["plan", str(path), "--gpus", "1", "--gpu", "cpu", "--samples", "0", "--json", str(plan)]) == 0
    capsys.readouterr()
    argv = ["train", str(path), "--plan", str(plan), "--gpus", "1", "--gpu", "cpu", "--out", str(data / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"lorafleet: error: {data}/bad.jsonl: row 2: has no field output (format alpaca"), err
    assert not (data / "run").exists()
