""" "Did you mean" (``specs.hints``): the names users bring from PEFT, TRL, Trainer and axolotl get lorafleet's,
in the one line an unknown key already gets, with exit code 2."""

from __future__ import annotations

import pytest
import yaml

from lorafleet.cli import main
from lorafleet.specs.hints import did_you_mean


@pytest.mark.parametrize(
    "task,field,hint",
    [
        ({"lora": {"r": 8}}, "tasks[0].lora.r", "did you mean rank? (PEFT's r)"),
        ({"lora": {"lora_alpha": 16}}, "tasks[0].lora.lora_alpha", "did you mean alpha? (PEFT's lora_alpha)"),
        ({"optimizer": {"learning_rate": 1e-4}}, "tasks[0].optimizer.learning_rate", "did you mean lr? (Trainer's"),
        ({"learning_rate": 1e-4}, "tasks[0].learning_rate", "did you mean optimizer: {lr: ...}? (Trainer's"),
        ({"max_seq_length": 512}, "tasks[0].max_seq_length", "did you mean context_length? (TRL's max_seq_length)"),
        ({"lr": 1e-4}, "tasks[0].lr", "did you mean optimizer: {lr: ...}? (lr belongs in a task's optimizer)"),
        ({"train_on_inputs": True}, "tasks[0].train_on_inputs", "did you mean data: {train_on_inputs: ...}?"),
        ({"batchsize": 8}, "tasks[0].batchsize", "did you mean batch_size?"),
    ],
)
def test_an_unknown_key_from_another_tool_gets_lorafleets_name(tmp_path, capsys, task, field, hint):
    path = tmp_path / "w.yaml"
    raw = {"model": "llama2-7b", "tasks": [{"name": "a", "preset": "dolly", **task}]}
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"lorafleet: error: {path}: {field}: Extra inputs are not permitted; {hint}"), err


def test_no_hint_where_nothing_is_close():
    assert did_you_mean(("tasks", 0, "qwzkj")) is None
    assert did_you_mean(("model_name_or_path",)) == "did you mean model? (Trainer's model_name_or_path)"
    assert did_you_mean(("tasks", 0, "lora", "max_seq_length")) == (
        "did you mean context_length, a task's own key? (TRL's max_seq_length)"
    )
