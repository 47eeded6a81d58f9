"""The tokenizer cache (``data.tokenizer_cache``): a workload's tokenizer is built once on a machine (a GGUF's
conversion, a directory's load), later loads read its saved form; that form tokenizes as the built one and saves
the same files; an entry that is not whole is said, built again and rewritten, never used."""

from __future__ import annotations

import json

import pytest
import yaml

from lorafleet.cli import main
from lorafleet.data import model_source
from lorafleet.data.cache_key import CACHE_ENV, cache_dir
from lorafleet.data.model_source import data_tokenizer
from lorafleet.data.tokenize import tokenize_data
from lorafleet.data.tokenizer_cache import MANIFEST, _save, entry_problem
from lorafleet.specs.data import DataSpec
from lorafleet.work import counting
from tests.data.test_cached_examples import ROWS, TOOL_TEMPLATE
from tests.helpers.containers import write_rows


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """A cache directory of the test's own; the list gets one item a tokenizer built (not read from the cache)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    made: list[str] = []
    build = model_source._built_tokenizer

    def counted(model, tokenizer, source):
        made.append(model)
        return build(model, tokenizer, source)

    monkeypatch.setattr(model_source, "_built_tokenizer", counted)
    return made


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer_with_template):
    return tokenizer_with_template(TOOL_TEMPLATE)


def _entry():
    (entry,) = (cache_dir() / "tokenizers").iterdir()
    return entry


def test_a_gguf_tokenizer_is_converted_once_then_read(builds, monkeypatch, tool_tokenizer):
    """The demo's GGUF (keyed by its metadata): the conversion (here a stand-in returning the tiny tokenizer, so
    the test takes no 5 s) runs on the first load only."""
    from transformers import AutoTokenizer

    conversions = []

    def convert(source):
        conversions.append(source.gguf_file)
        return AutoTokenizer.from_pretrained(str(tool_tokenizer))

    monkeypatch.setattr(model_source, "load_source_tokenizer", convert)
    first = data_tokenizer("smollm2-135m", None, source="w.yaml")
    second = data_tokenizer("smollm2-135m", None, source="w.yaml")
    assert conversions == ["SmolLM2-135M-Instruct.Q4_1.gguf"] and builds == ["smollm2-135m"]
    assert second.name_or_path == str(_entry()) and first.get_vocab() == second.get_vocab()


@pytest.mark.parametrize("fmt", ["messages", "alpaca", "prompt_completion", "text"])
def test_the_cached_tokenizer_tokenizes_and_saves_as_the_built_one(builds, tmp_path, tool_tokenizer, fmt):
    built = data_tokenizer("tiny-llama", str(tool_tokenizer), source="w.yaml")
    cached = data_tokenizer("tiny-llama", str(tool_tokenizer), source="w.yaml")
    assert builds == ["tiny-llama"] and cached is not built
    spec = DataSpec(path=str(write_rows(tmp_path, ROWS[fmt], "jsonl")))
    assert tokenize_data(cached, spec) == tokenize_data(built, spec)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "padding_side", "chat_template", "special_tokens_map"):
        assert getattr(cached, name) == getattr(built, name), name
    for side, tokenizer in (("built", built), ("cached", cached)):
        tokenizer.save_pretrained(str(tmp_path / side))
    files = sorted(p.name for p in (tmp_path / "built").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cached").iterdir())
    assert all((tmp_path / "built" / f).read_bytes() == (tmp_path / "cached" / f).read_bytes() for f in files)


def _flip(entry):
    path = entry / "tokenizer.json"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "spoil",
    [
        _flip,
        lambda entry: (entry / "tokenizer_config.json").unlink(),
        lambda entry: (entry / "special_tokens_map.json").write_text("{}"),
        lambda entry: (entry / MANIFEST).write_text('{"files": '),
    ],
    ids=["bit-flip", "missing", "added", "manifest-cut"],
)
def test_a_corrupt_entry_is_said_built_again_and_rewritten(builds, tiny_tokenizer_dir, spoil):
    data_tokenizer("tiny-llama", str(tiny_tokenizer_dir), source="w.yaml")
    whole = {p.name: p.read_bytes() for p in _entry().iterdir()}
    spoil(_entry())
    assert entry_problem(_entry()) is not None
    with pytest.warns(UserWarning, match="tokenizer cache entry .* is not whole"):
        again = data_tokenizer("tiny-llama", str(tiny_tokenizer_dir), source="w.yaml")
    assert builds == ["tiny-llama"] * 2 and again.name_or_path == str(tiny_tokenizer_dir)
    assert entry_problem(_entry()) is None and {p.name: p.read_bytes() for p in _entry().iterdir()} == whole
    assert [p.name for p in _entry().parent.iterdir()] == [_entry().name]  # nothing left aside


def test_a_writer_that_loses_the_rename_keeps_the_entry_there(builds, tiny_tokenizer_dir, recwarn):
    tokenizer = data_tokenizer("tiny-llama", str(tiny_tokenizer_dir), source="w.yaml")
    entry = _entry()
    before = {p.name: p.read_bytes() for p in entry.iterdir()}
    _save(tokenizer, entry)  # another rank's write, after this one's rename
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == before and not recwarn.list
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_validate_a_second_time_builds_no_tokenizer_and_tokenizes_nothing(builds, tmp_path, tool_tokenizer, capsys):
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS["sharegpt"]))
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS["alpaca"]))
    base = {"batch_size": 2, "context_length": 64}
    tasks = [{"name": n, "data": {"path": f"{n}.jsonl"}, **base} for n in ("chats", "alpaca")]
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump({"model": "tiny-llama", "tokenizer": str(tool_tokenizer), "tasks": tasks}))
    said = []
    for _ in range(2):
        with counting() as work:
            assert main(["validate", str(workload)]) == 0
        said.append((capsys.readouterr().out, work["tokenizations"]))
    assert builds == ["tiny-llama"] and said[0][1] == 2 and said[1][1] == 0 and said[0][0] == said[1][0]
