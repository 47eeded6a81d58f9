"""The token cache (``data.length_cache``): a key is every input of a dataset's tokenization and nothing else, a
hit skips the tokenization, an entry that is not whole is said, computed again and rewritten, and what cannot be
keyed or stored is computed as before."""

from __future__ import annotations

import shutil
import struct

import pytest
import yaml

from lorafleet.data.length_cache import CACHE_ENV, cache_dir, cached_examples, cached_lengths, data_key
from lorafleet.data.tokenize import Example
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
    key = data_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer))
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(data, moved)
    assert data_key(DataSpec(path=str(moved)), "tiny-llama", str(tokenizer)) == key
    assert data_key(DataSpec(path=str(data), system_prompt="be brief"), "tiny-llama", str(tokenizer)) != key
    assert data_key(DataSpec(path=str(data), chat_template="never"), "tiny-llama", str(tokenizer)) != key
    assert data_key(DataSpec(path=str(data)), "tiny-llama", None) != key  # the preset's own tiny BPE
    (tokenizer / "model.safetensors").write_bytes(b"other weights")  # not the tokenizer's
    assert data_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer)) == key
    (tokenizer / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    changed_tokenizer = data_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer))
    data.write_text('{"prompt": "a", "response": "bc"}\n')
    changed_data = data_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer))
    assert len({key, changed_tokenizer, changed_data}) == 3


def test_a_saved_dataset_directory_is_keyed_by_its_files(inputs, tmp_path):
    _, tokenizer = inputs
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    (saved / "train" / "data-00000-of-00001.arrow").write_bytes(b"rows")
    key = data_key(DataSpec(path=str(saved)), "tiny-llama", str(tokenizer))
    (saved / "train" / "data-00000-of-00001.arrow").write_bytes(b"other rows")
    assert data_key(DataSpec(path=str(saved)), "tiny-llama", str(tokenizer)) != key


def _gguf(pairs: list[tuple[str, str | list[str]]], tensors: bytes = b"") -> bytes:
    """A GGUF v3 file of string and string-array key-value pairs (types 8 and 9), then ``tensors``' bytes."""

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    body = b"".join(
        string(key)
        + (
            struct.pack("<I", 8) + string(value)
            if isinstance(value, str)
            else struct.pack("<IIQ", 9, 8, len(value)) + b"".join(map(string, value))
        )
        for key, value in pairs
    )
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs)) + body + tensors


def test_a_gguf_is_keyed_by_its_metadata_and_what_cannot_be_keyed_cheaply_is_not(inputs, tmp_path):
    """A GGUF's tokenizer by its key-value pairs (not the weights after them); a file whose header does not read
    and a chat template that puts today's date in its text are never keyed."""
    data, tokenizer = inputs
    vocab = [("tokenizer.ggml.tokens", ["a", "b", "<|im_end|>"]), ("tokenizer.chat_template", "{{ messages }}")]
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(_gguf(vocab, tensors=b"weights"))
    key = data_key(DataSpec(path=str(data)), str(gguf), None)
    assert key is not None
    gguf.write_bytes(_gguf(vocab, tensors=b"other weights"))
    assert data_key(DataSpec(path=str(data)), str(gguf), None) == key
    gguf.write_bytes(_gguf([vocab[0], ("tokenizer.chat_template", "{{ messages[0] }}")]))
    assert data_key(DataSpec(path=str(data)), str(gguf), None) not in (None, key)
    unknown_type = b"GGUF" + struct.pack("<IQQQI", 3, 0, 1, 0, 99)
    for unreadable in (b"GGUF", _gguf(vocab)[:-3], unknown_type, b"GGUF" + struct.pack("<IQQ", 1, 0, 0)):
        gguf.write_bytes(unreadable)
        assert data_key(DataSpec(path=str(data)), str(gguf), None) is None
    gguf.write_bytes(_gguf([("tokenizer.chat_template", "{{ strftime_now('%d %b %Y') }}")]))
    assert data_key(DataSpec(path=str(data)), str(gguf), None) is None
    (tokenizer / "chat_template.jinja").write_text("{{ strftime_now('%d %b %Y') }}")
    assert data_key(DataSpec(path=str(data)), "tiny-llama", str(tokenizer)) is None


EXAMPLES = [Example((5, 6, 7), (-100, 6, 7)), Example((9,) * 12, (9,) * 12)]


def test_a_hit_skips_the_tokenization_and_a_bad_entry_is_said_and_computed_again(inputs):
    data, tokenizer = inputs
    spec = DataSpec(path=str(data))
    calls = []

    def tokenize() -> list[Example]:
        calls.append(1)
        return EXAMPLES

    assert cached_lengths(spec, "tiny-llama", str(tokenizer), tokenize).tolist() == [3, 12]
    assert cached_examples(spec, "tiny-llama", str(tokenizer), tokenize) == EXAMPLES
    assert cached_lengths(spec, "tiny-llama", str(tokenizer), tokenize).tolist() == [3, 12]
    assert len(calls) == 1  # the lengths' tokenization stored the examples
    (entry,) = (cache_dir() / "tokens").iterdir()
    whole = entry.read_bytes()
    flipped = bytearray(whole)
    flipped[-20] ^= 1
    for bad in (whole[:-1], bytes(flipped), whole[:40], b""):  # cut short, a bit flipped, cut in the header, empty
        entry.write_bytes(bad)
        with pytest.warns(UserWarning, match="not whole"):
            assert cached_examples(spec, "tiny-llama", str(tokenizer), tokenize) == EXAMPLES
        assert entry.read_bytes() == whole
    assert len(calls) == 5


def test_an_unwritable_cache_is_one_warning_and_the_lengths_as_computed(inputs, tmp_path, monkeypatch):
    data, tokenizer = inputs
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked))  # its tokens/ cannot be made under a file
    with pytest.warns(UserWarning, match="token cache"):
        lengths = cached_lengths(DataSpec(path=str(data)), "tiny-llama", str(tokenizer), lambda: EXAMPLES)
    assert lengths.tolist() == [3, 12]


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
