"""A saved DatasetDict's named splits in training: the task trains on its ``data`` split and evaluates on the split
its ``eval.data`` names (``runtime.data_stream.prepare_task_data``)."""

from __future__ import annotations

import datasets
from transformers import AutoTokenizer

from lorafleet.data.tokenize import tokenize_data
from lorafleet.runtime.data_stream import prepare_task_data
from lorafleet.specs.data import DataSpec
from lorafleet.specs.workload import TaskSpec

CHATS = [
    {"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
    for w in ("one", "two", "three", "four", "five")
]


def test_a_test_split_is_the_tasks_held_out_rows(tmp_path, tiny_tokenizer_dir):
    path = str(tmp_path / "dict")
    splits = {"train": datasets.Dataset.from_list(CHATS[:3]), "test": datasets.Dataset.from_list(CHATS[3:])}
    datasets.DatasetDict(splits).save_to_disk(path)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    task = TaskSpec.model_validate(
        {
            "name": "say",
            "data": {"path": path},
            "eval": {"data": {"path": path, "split": "test"}},
            "batch_size": 1,
            "context_length": 64,
        }
    )
    prepared = prepare_task_data(task, tokenizer, "test")
    train = tokenize_data(tokenizer, DataSpec(path=path, split="train"))
    held = tokenize_data(tokenizer, DataSpec(path=path, split="test"))
    assert list(prepared.examples) == train and list(prepared.eval_examples) == held
    assert len(train) == 3 and len(held) == 2 and not set(train) & set(held)
