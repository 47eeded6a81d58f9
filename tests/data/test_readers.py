"""The containers a task's rows come in (``data.readers``): the same rows from every container, named splits of a
saved DatasetDict, and a one-line InputError naming what a file that does not fit is."""

from __future__ import annotations

import gzip
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lorafleet.data.readers import read_container
from lorafleet.errors import InputError
from tests.helpers.containers import write_rows

ROWS = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
    {"instruction": "Name the colour.", "input": "grass", "output": "green"},
    {"instruction": "Say hi, in French.", "input": "", "output": "bonjour"},
]


def _write(tmp_path, kind: str, rows=ROWS):
    """``rows`` written as ``kind`` (``tests.helpers.containers``); the path."""
    return write_rows(tmp_path, rows, kind)


@pytest.mark.parametrize(
    "kind,said",
    [
        ("jsonl", "JSONL file"),
        ("json", "JSON array"),
        ("parquet", "parquet file"),
        ("csv", "CSV file"),
        ("saved", "saved Dataset"),
    ],
)
def test_every_container_gives_the_same_rows(tmp_path, kind, said):
    found = read_container(_write(tmp_path, kind))
    assert found.rows == ROWS and found.kind == said and found.split is None and found.splits == ()


def test_a_chat_in_parquet_comes_back_as_lists_and_dicts(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    assert read_container(_write(tmp_path, "parquet", rows)).rows == rows


def test_a_text_file_is_a_document_a_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first document\n\n  \nsecond document\n")
    found = read_container(path)
    assert found.rows == [{"text": "first document"}, {"text": "second document"}]
    assert found.kind == "text file (a document a line)"


def test_content_wins_over_the_suffix(tmp_path):
    """A parquet file named .jsonl is read as parquet; a JSON array named .jsonl as an array."""
    parquet = _write(tmp_path, "parquet")
    (tmp_path / "p.jsonl").write_bytes(parquet.read_bytes())
    assert read_container(tmp_path / "p.jsonl").kind == "parquet file"
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS))
    assert read_container(tmp_path / "a.jsonl").rows == ROWS


@pytest.fixture
def train_and_test(tmp_path):
    path = tmp_path / "dict"
    splits = {"train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:])}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def test_a_dataset_dicts_splits_are_named(train_and_test):
    default = read_container(train_and_test)
    assert (default.rows, default.split, default.splits) == (ROWS[:2], "train", ("train", "test"))
    test = read_container(train_and_test, "test")
    assert (test.rows, test.split, test.kind) == (ROWS[2:], "test", "saved DatasetDict")
    with pytest.raises(InputError) as err:
        read_container(train_and_test, "validation")
    assert str(err.value) == f"{train_and_test}: split: no split 'validation' (the saved DatasetDict has train, test)"


def test_a_dataset_dict_without_train_needs_a_split(tmp_path):
    path = tmp_path / "dict"
    splits = {"a": datasets.Dataset.from_list(ROWS[:1]), "b": datasets.Dataset.from_list(ROWS[1:])}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    with pytest.raises(InputError, match=r"split: the saved DatasetDict has splits a, b; name one \(split: ...\)"):
        read_container(path)
    only = tmp_path / "only"
    datasets.DatasetDict({"dev": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(only))
    assert read_container(only).split == "dev"


def test_a_split_of_a_file_or_a_single_dataset_is_refused(tmp_path):
    with pytest.raises(InputError, match="split: a file has no splits"):
        read_container(_write(tmp_path, "jsonl"), "test")
    with pytest.raises(InputError, match=r"split: a saved Dataset \(not a DatasetDict\) has no splits"):
        read_container(_write(tmp_path, "saved"), "test")


def _parquet_truncated(tmp_path):
    path = _write(tmp_path, "parquet")
    path.write_bytes(path.read_bytes()[:-20])
    return path


def _gzip(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "a"}\n'))
    return path


def _latin1(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    return path


def _text(name: str, text: str):
    def write(tmp_path):
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def _parquet_dir(tmp_path):
    for i in range(2):
        pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / f"train-{i}.parquet")
    return tmp_path


@pytest.mark.parametrize(
    "make,field,message",
    [
        (_parquet_truncated, "", "not a readable parquet file ("),
        (_gzip, "", "is a gzip-compressed file (decompress it first), not a .jsonl, .json, .parquet, .csv or .txt"),
        (_latin1, "", "is neither UTF-8 text nor parquet (invalid continuation byte)"),
        (
            _text("w.json", '{\n "data": [],\n "version": 1\n}\n'),
            "",
            "is one JSON object (keys data, version), not rows",
        ),
        (_text("a.json", '[{"text": "a"}, "b"]'), "row 2", "expected a JSON object, got a string"),
        (_text("a.json", '[{"text": "a"},'), "", "a JSON array that is not valid JSON (Expecting value, line 1)"),
        (_text("r.jsonl", '{"text": "a"}\n{"text": \n'), "row 2", "not valid JSON (Expecting value) as a JSONL row"),
        (_text("r.jsonl", '{"text": "a"}\n[1]\n'), "row 2", "expected a JSON object, got an array"),
        (_text("r.jsonl", '[1]\n{"text": "a"}\n'), "row 1", "expected a JSON object, got an array"),
        (_text("r.csv", "prompt,response\na,b\nc,d,e\n"), "row 2", "has more cells than the header's 2"),
        (_text("r.csv", "prompt,response\na\n"), "row 1", "has fewer cells than the header's 2"),
        (_parquet_dir, "", "not a saved dataset (no dataset_dict.json or state.json) (it holds 2 .parquet files"),
    ],
    ids=[
        "truncated-parquet",
        "gzip",
        "latin-1",
        "json-object",
        "array-of-a-string",
        "broken-array",
        "broken-jsonl",
        "jsonl-array-row",
        "jsonl-first-row-an-array",
        "csv-long-row",
        "csv-short-row",
        "parquet-directory",
    ],
)
def test_a_file_that_does_not_fit_says_what_it_is(tmp_path, make, field, message):
    path = make(tmp_path)
    with pytest.raises(InputError) as err:
        read_container(path)
    assert (err.value.path, err.value.field) == (str(path), field)
    assert message in err.value.msg, err.value.msg
