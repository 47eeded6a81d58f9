"""``validate`` and ``plan`` check the model before any work: its ``config.json``'s family, a Hub id that is not on
disk, and a chat template for chat data; each is one line on stderr naming the file and field, exit 2, nothing on
stdout."""

from __future__ import annotations

import json

import pytest
import yaml

from lorafleet.cli import main

CHATS = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]} for w in "abcd"]
GIVEN = {"mean": 20, "skewness": 1.0, "kurtosis": 4.0}


def _workload(tmp_path, model: str, task: dict, **extra) -> str:
    path = tmp_path / "w.yaml"
    raw = {"model": model, **extra, "tasks": [{"name": "t", "batch_size": 2, "context_length": 64, **task}]}
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    return err


@pytest.fixture(scope="module")
def no_template_tokenizer(tokenizer_with_template):
    return tokenizer_with_template(None)


@pytest.mark.parametrize(
    "command", [["validate"], ["plan", "--gpus", "1", "--gpu", "cpu"], ["train", "--steps", "1", "--out", "run"]]
)
def test_an_unsupported_model_type_is_refused_before_any_work(tmp_path, capsys, monkeypatch, command):
    """validate, plan, and train before it claims a run directory or starts a worker (#42's Phi-2 case)."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "phi2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "phi", "hidden_size": 64}))
    path = _workload(tmp_path, str(model), {"lengths": GIVEN})
    assert main([command[0], path, *command[1:]]) == 2
    err = _one_line_error(capsys)
    assert f"{model / 'config.json'}: model_type: model type 'phi' is not supported" in err and "phi3" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [["validate"], ["plan", "--gpus", "1", "--gpu", "cpu"]])
def test_a_hub_id_not_on_disk_says_how_to_download_it(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    path = _workload(tmp_path, "google/gemma-2-9b", {"lengths": GIVEN})
    assert main([command[0], path, *command[1:]]) == 2
    assert "hf download google/gemma-2-9b --local-dir gemma-2-9b" in _one_line_error(capsys)


def test_a_phi3_target_naming_part_of_a_fused_projection_is_refused(tmp_path, capsys):
    model = tmp_path / "phi3"
    model.mkdir()
    shape = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    (model / "config.json").write_text(json.dumps({"model_type": "phi3", "vocab_size": 1024, **shape}))
    task = {"lengths": GIVEN, "lora": {"target_modules": ["q_proj", "v_proj"]}}
    assert main(["plan", _workload(tmp_path, str(model), task), "--gpus", "1", "--gpu", "cpu"]) == 2
    err = _one_line_error(capsys)
    assert "tasks[0].lora.target_modules: phi3 fuses q_proj, k_proj, v_proj into qkv_proj" in err


@pytest.mark.parametrize("command", [["validate"], ["plan", "--gpus", "1", "--gpu", "cpu"]])
def test_chat_data_needs_a_chat_template(tmp_path, no_template_tokenizer, capsys, command):
    """A tokenizer with no chat template and chat rows: one line naming the task's data, also where the lengths are
    given (``plan`` tokenizes none of its rows)."""
    (tmp_path / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in CHATS))
    task = {"lengths": GIVEN, "data": {"path": "chats.jsonl"}}
    path = _workload(tmp_path, "tiny-llama", task, tokenizer=str(no_template_tokenizer))
    assert main([command[0], path, *command[1:]]) == 2
    err = _one_line_error(capsys)
    assert "w.yaml: tasks[0].data: " in err and "holds chats (format messages), and the tokenizer has no chat" in err
