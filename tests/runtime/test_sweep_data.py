"""A sweep's members share one dataset (``runtime.data_stream.shared_data``): the data is read and tokenized once
per sweep, however many members, when the run starts and when a sweep joins a running fleet; every member has the
same held-out rows, none of them in training, and draws the same batches at the same steps."""

from __future__ import annotations

from lorafleet.data.length_cache import CACHE_ENV
from lorafleet.runtime import data_stream
from lorafleet.work import counting
from lorafleet.workload import load_workload
from tests.helpers.repo import DEMO


def _workload(tmp_path, tokenizer):
    path = tmp_path / "w.yaml"
    path.write_text(
        "model: tiny-llama\n"
        f"tokenizer: {tokenizer}\n"
        "tasks:\n"
        f"  - {{name: docsum, data: {{path: {DEMO / 'docsum.jsonl'}}}, batch_size: 2, context_length: 256}}\n"
        f"  - name: chat\n    data: {{path: {DEMO / 'chat.jsonl'}}}\n    batch_size: 4\n    context_length: 128\n"
        "    eval: {split: 0.1, every_steps: 2}\n"
        "    sweep: {grid: {optimizer.lr: [1.0e-3, 1.0e-2, 1.0e-1], lora.rank: [2, 4]}}\n"
    )
    return load_workload(path).spec


def test_a_sweep_is_tokenized_once_and_its_members_see_the_same_rows_and_batches(
    tmp_path, tiny_tokenizer_dir, monkeypatch
):
    spec = _workload(tmp_path, tiny_tokenizer_dir)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # not the lengths' tokenizations: the streams' own
    with counting() as work:
        streams = data_stream.training_streams(spec, 10)
    assert len(spec.tasks) == 7 and work["tokenizations"] == 2  # one per dataset (the held-out rows split off it)
    members = [s for s in streams.streams if s.data.name.startswith("chat.")]
    assert len(members) == 6 and len({s.data.name for s in members}) == 6
    first = members[0].data
    assert all(s.data.examples is first.examples and s.data.eval_examples is first.eval_examples for s in members)
    trained = {tuple(e.input_ids) for e in first.examples}
    assert first.eval_examples and not trained & {tuple(e.input_ids) for e in first.eval_examples}
    for step in (0, 3, 9):
        batch = streams.global_batch(step)
        ids = {name: [s for t, s in zip(batch.task_ids.tolist(), batch.sample_ids.tolist(), strict=True)
                   if streams.streams[t].data.name == name]
               for name in (m.data.name for m in members)}  # fmt: skip
        assert len({tuple(v) for v in ids.values()}) == 1  # every member: the same sample ids at the same step
    # a sweep that joins a running fleet: its members' data prepared once too, the running tasks' kept
    first_only = type(streams)([streams.streams[0].data], [2], spec.seed)
    tokenizer = data_stream.task_tokenizer(spec)
    with counting() as work:
        joined = first_only.changed(spec.tasks, lambda t: data_stream.prepare_task_data(t, tokenizer, "q"), {}, (), {})
    assert work["tokenizations"] == 1 and len(joined.streams) == 7
