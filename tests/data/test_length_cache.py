"""The token-length cache (``data.length_cache``): a key is every input of a dataset's lengths and nothing else, a
hit skips the tokenization, and what cannot be keyed or stored is computed as before."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from lorafleet.data.length_cache import CACHE_ENV, cache_dir, cached_lengths, lengths_key
from lorafleet.specs.data import DataSpec
from lorafleet.work import counting
from lorafleet.workload import load_workload
from tests.helpers.repo import DEMO


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A data file and a tokenizer directory (files to hash; nothing here loads them), the cache under tmp."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"model": {}}')
    (tokenizer / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (tokenizer / "model.safetensors").write_bytes(b"weights")
    return data, tokenizer


def test_a_key_changes_with_every_input_of_the_lengths_and_not_with_the_data_path(inputs, tmp_path):
    data, tokenizer = inputs
    key = lengths_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer))
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(data, moved)
    assert lengths_key(DataSpec(path=str(moved)), "tiny-llama", str(tokenizer)) == key
    assert lengths_key(DataSpec(path=str(data), system_prompt="be brief"), "tiny-llama", str(tokenizer)) != key
    assert lengths_key(DataSpec(path=str(data), chat_template="never"), "tiny-llama", str(tokenizer)) != key
    assert lengths_key(DataSpec(path=str(data)), "tiny-llama", None) != key  # the preset's own tiny BPE
    (tokenizer / "model.safetensors").write_bytes(b"other weights")  # not the tokenizer's
    assert lengths_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer)) == key
    (tokenizer / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    changed_tokenizer = lengths_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer))
    data.write_text('{"prompt": "a", "response": "bc"}\n')
    changed_data = lengths_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer))
    assert len({key, changed_tokenizer, changed_data}) == 3


def test_a_saved_dataset_directory_is_keyed_by_its_files(inputs, tmp_path):
    _, tokenizer = inputs
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    (saved / "train" / "data-00000-of-00001.arrow").write_bytes(b"rows")
    key = lengths_key(DataSpec(path=str(saved)), "tiny-llama", str(tokenizer))
    (saved / "train" / "data-00000-of-00001.arrow").write_bytes(b"other rows")
    assert lengths_key(DataSpec(path=str(saved)), "tiny-llama", str(tokenizer)) != key


def test_what_cannot_be_keyed_cheaply_is_not(inputs, tmp_path):
    """A GGUF's tokenizer (inside the model file) and a chat template that puts today's date in its text."""
    data, tokenizer = inputs
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert lengths_key(DataSpec(path=str(data)), str(gguf), None) is None
    (tokenizer / "chat_template.jinja").write_text("{{ strftime_now('%d %b %Y') }}")
    assert lengths_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer)) is None


def test_a_hit_skips_the_tokenization_and_a_bad_entry_is_computed_again(inputs):
    data, tokenizer = inputs
    spec = DataSpec(path=str(data))
    calls = []

    def tokenize() -> dict[int, int]:
        calls.append(1)
        return {7: 2, 12: 1}

    assert cached_lengths(spec, "tiny-llama", str(tokenizer), tokenize) == {7: 2, 12: 1}
    assert cached_lengths(spec, "tiny-llama", str(tokenizer), tokenize) == {7: 2, 12: 1}
    assert len(calls) == 1
    (entry,) = (cache_dir() / "lengths").iterdir()
    entry.write_text('{"histogram": [[7, "two"]]}')
    assert cached_lengths(spec, "tiny-llama", str(tokenizer), tokenize) == {7: 2, 12: 1}
    assert len(calls) == 2 and json.loads(entry.read_text()) == {"histogram": [[7, 2], [12, 1]]}


def test_an_unwritable_cache_is_one_warning_and_the_lengths_as_computed(inputs, tmp_path, monkeypatch):
    data, tokenizer = inputs
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked))  # its lengths/ cannot be made under a file
    with pytest.warns(UserWarning, match="token-length cache"):
        assert cached_lengths(DataSpec(path=str(data)), "tiny-llama", str(tokenizer), lambda: {3: 1}) == {3: 1}


def test_a_sweeps_members_lengths_are_one_tokenization(tmp_path, monkeypatch, tiny_tokenizer_dir):
    """The members of a sweep share their data (``specs.sweep``): resolving the workload measures it once, the other
    members' lengths are the cache's (before it, once a member: 9 tokenizations of one file)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    sweep = {"grid": {"optimizer.lr": [1e-4, 3e-4, 1e-3], "lora.rank": [4, 8, 16]}}
    task = {"name": "chat", "data": {"path": str(DEMO / "chat.jsonl")}, "batch_size": 3, "context_length": 128,
            "sweep": sweep}  # fmt: skip
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny-llama", "tokenizer": str(tiny_tokenizer_dir), "tasks": [task]}))
    with counting() as work:
        workload = load_workload(path)
    assert len(workload.tasks) == 9 and work["tokenizations"] == 1
    assert len({tuple(sorted(t.histogram.items())) for t in workload.tasks}) == 1
