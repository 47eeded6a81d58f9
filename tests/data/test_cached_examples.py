"""A dataset read from the token cache (``data.workload_tokens``, ``data.length_cache``) is its tokenization, example
for example, in every format and container the project reads; a second read loads no tokenizer and tokenizes
nothing; a rank whose data the launcher tokenized (another process) imports no transformers for it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from lorafleet.data.length_cache import CACHE_ENV
from lorafleet.data.tokenize import tokenize_data
from lorafleet.data.workload_tokens import WorkloadTokens
from lorafleet.specs.data import DataSpec
from lorafleet.work import counting
from tests.helpers.containers import write_rows
from tests.helpers.repo import DEMO, REPO

TOOL_CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
ROWS = {
    "messages": [
        {"messages": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]},
        {
            "messages": [
                {"role": "system", "content": "Use tools."},
                {"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
                {"role": "tool", "content": "5"},
                {"role": "assistant", "content": "It is 5."},
            ]
        },
    ],  # fmt: skip
    "sharegpt": [{"conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello!"}]}] * 2,
    "alpaca": [
        {"instruction": "Translate.", "input": "chat", "output": "cat", "system": "Be brief."},
        {"instruction": "Name the colour of grass.", "input": "", "output": "Green."},
    ],
    "prompt_completion": [{"prompt": "Two and two", "completion": " make four."}] * 3,
    "prompt_response": [{"prompt": "Say hi.", "response": "hi"}, {"prompt": "Count to 3.", "response": "1 2 3"}],
    "text": [{"text": "A document of its own."}, {"text": "Another, longer document, with more words in it."}],
}
"""A few rows of each format, tool turns and system prompts among them."""
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


CASES = [(fmt, "jsonl", {}) for fmt in ROWS] + [
    ("alpaca", "json", {}),
    ("prompt_response", "parquet", {}),
    ("messages", "parquet", {}),
    ("prompt_response", "csv", {}),
    ("text", "txt", {}),
    ("sharegpt", "saved", {}),
    ("prompt_response", "jsonl", {"chat_template": "never", "train_on_inputs": True}),
    ("messages", "jsonl", {"system_prompt": "Be kind."}),
]


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer_with_template):
    """The project's tiny tokenizer under a template that renders tool calls."""
    return tokenizer_with_template(TOOL_TEMPLATE)


@pytest.mark.parametrize("fmt,container,settings", CASES)
def test_cached_examples_are_the_tokenization_and_a_second_read_loads_no_tokenizer(
    tmp_path, monkeypatch, tool_tokenizer, fmt, container, settings
):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    tokenizer = AutoTokenizer.from_pretrained(str(tool_tokenizer))
    spec = DataSpec(path=str(write_rows(tmp_path, ROWS[fmt], container)), **settings)
    fresh = tokenize_data(tokenizer, spec)
    loads = []

    def load():
        loads.append(1)
        return tokenizer

    with counting() as work:
        first = WorkloadTokens(load, "tiny-llama", str(tool_tokenizer)).examples(spec)
        second = WorkloadTokens(load, "tiny-llama", str(tool_tokenizer)).examples(spec)
    assert first == second == fresh and len(fresh) == len(ROWS[fmt])
    assert work["tokenizations"] == 1 and loads == [1]  # the second: no tokenizer, no tokenization


RANK = """
import json, sys
from lorafleet.runtime.data_stream import training_streams
from lorafleet.work import counting
from lorafleet.workload import load_workload
spec = load_workload(sys.argv[1]).spec
with counting() as work:
    streams = training_streams(spec, 4)
print(json.dumps({"tokenizations": work["tokenizations"], "transformers": "transformers" in sys.modules,
                  "fingerprints": [s.data.fingerprint for s in streams.streams]}))
"""


def test_a_rank_reads_the_launchers_tokenization_and_loads_no_tokenizer(tmp_path, monkeypatch, tiny_tokenizer_dir):
    """The launcher (this process) measures the tasks' lengths, cold; a rank's data streams (a fresh process, as
    ``lorafleet.train.rank`` is) then tokenize nothing and import no transformers, and hold the examples a
    tokenization gives (their fingerprints, every token and label, equal)."""
    from lorafleet.runtime.data_stream import training_streams
    from lorafleet.workload import load_workload

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = tmp_path / "w.yaml"
    path.write_text(
        f"model: tiny-llama\ntokenizer: {tiny_tokenizer_dir}\ntasks:\n"
        f"  - {{name: chat, data: {{path: {DEMO / 'chat.jsonl'}}}, batch_size: 3, context_length: 128}}\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 2, context_length: 256,"
        " eval: {split: 0.1, every_steps: 2}}\n"
    )
    with counting() as launcher:
        spec = load_workload(path).spec
    assert launcher["tokenizations"] == 2
    done = subprocess.run([sys.executable, "-c", RANK, str(path)], capture_output=True, text=True, check=True, cwd=REPO)
    rank = json.loads(done.stdout.splitlines()[-1])
    assert rank["tokenizations"] == 0 and not rank["transformers"]
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "fresh"))
    fresh = training_streams(spec, 4)
    assert rank["fingerprints"] == [s.data.fingerprint for s in fresh.streams]
