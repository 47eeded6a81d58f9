"""The profiler's replica is the executor's: its timed parts compose to the executor's stage, its
synthetic micro-batches are laid out as the executor's, and its memory accounting sees what a step keeps.

(TP exactness of the executor's TP path over gloo is tests/executor/torch/test_joint_training.py.)
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.parallel_config import ParallelConfig
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.executor.torch.multi_lora import MultiLoraLinear
from lorafleet.executor.torch.step import build_inputs, stage_forward
from lorafleet.profiling.measure import CPU, median_ms
from lorafleet.profiling.replica import ProfiledReplica, inverse_counts, microbatches, random_examples
from lorafleet.profiling.stages import only_layers, part_role
from lorafleet.specs.model import MODEL_PRESETS

TINY = MODEL_PRESETS["tiny-llama"]


@pytest.fixture(scope="module")
def replica() -> ProfiledReplica:
    """A lone TP1 replica in a world of one process (no process group needed)."""
    return ProfiledReplica(TINY, AdapterLoad.uniform(2, 4), tp=1, rank=0, busy=1, world=1)


def test_synthetic_microbatches_are_the_executors():
    shapes = [MicroBatchShape.padded(2, 8), MicroBatchShape.packed([3, 5])]
    mbs = microbatches(shapes, [1, 0])
    assert [mb.seq_ids for mb in mbs] == [(0, 1), (2, 3)]
    assert [mb.task_ids for mb in mbs] == [(1, 1), (0, 0)]
    assert [mb.shape for mb in mbs] == shapes
    examples = random_examples(mbs, TINY.vocab, random.Random(0))
    assert [len(examples[q]) for q in range(4)] == [8, 8, 3, 5]
    assert all(e.labels == e.input_ids for e in examples.values())  # every token is learned
    # N_t: the loss tokens (a sequence of n predicts n - 1) of each task
    assert inverse_counts(mbs, examples, 3) == [1 / (2 + 4), 1 / (7 + 7), 0.0]


def test_blocks_and_head_compose_to_the_executors_whole_stage(replica):
    """The parts the profiler times (all blocks as a middle stage, the head as a last stage over no
    layer) are exactly the executor's stage split in two."""
    torch.manual_seed(0)
    with torch.no_grad():  # B != 0, so the adapters change the output
        for module in replica.model.modules():
            if isinstance(module, MultiLoraLinear):
                for b in module.lora_B.values():
                    b.normal_(0, 0.5)
    mbs = microbatches([MicroBatchShape.packed([5, 9, 3])], [1])
    examples = random_examples(mbs, TINY.vocab, random.Random(1))
    inputs = build_inputs(
        mbs[0], [examples[q] for q in mbs[0].seq_ids], inverse_counts(mbs, examples, 2), torch.device("cpu")
    )
    model = replica.model
    with torch.no_grad():
        whole = stage_forward(model, part_role(1, 0, embeds=True, heads=True), None, inputs)
        hidden = stage_forward(
            model, part_role(1, 0, embeds=False, heads=False), model.model.embed_tokens(inputs.input_ids), inputs
        )
        with only_layers(model, ()):
            head = stage_forward(model, part_role(1, 0, embeds=False, heads=True), hidden, inputs)
    assert hidden.shape == (1, 17, TINY.hidden) and len(model.model.layers) == TINY.n_layers  # restored
    torch.testing.assert_close(head, whole)


def test_static_bytes_count_weights_adapters_and_optimizer_states():
    r = ProfiledReplica(TINY, AdapterLoad.uniform(2, 4), tp=1, rank=0, busy=1, world=1)
    everything = range(TINY.n_layers)
    before = r.static_bytes(everything, True, True)
    assert before == sum(p.numel() * 4 for p in r.model.parameters())  # weights and adapters, no gradient yet
    adapters = sum(p.numel() * 4 for p in r.replica.params.values())
    r.prime()  # each task's optimizer steps and frees the gradients
    assert all(p.grad is None for p in r.replica.params.values())
    # AdamW's two moments (and a scalar step count per tensor)
    assert r.static_bytes(everything, True, True) == pytest.approx(before + 2 * adapters, rel=0.01)
    assert r.static_bytes(range(2), True, False) < r.static_bytes(everything, True, True)


def test_stage_runs_grow_with_tokens_and_halve_under_pp(replica):
    replica.prime()
    whole = replica.stage_runs(ParallelConfig(1, 1))
    halves = replica.stage_runs(ParallelConfig(1, 2))
    assert set(whole) == {"replica"} and set(halves) == {"first", "last"}

    def peak(run, tokens):
        replica.clear_grads()
        return CPU.peak_bytes(lambda: run(tokens))

    step = whole["replica"][1]
    peaks = [peak(step, n) for n in (128, 256, 512)]
    assert peaks[0] < peaks[1] < peaks[2]
    assert halves["first"][0] < whole["replica"][0] and halves["last"][0] < whole["replica"][0]
    assert peak(halves["last"][1], 256) < peaks[1]  # half the blocks, one micro-batch


@pytest.mark.parametrize("pp", [1, 2])
def test_recomputing_stages_peak_lower(replica, pp):
    replica.prime()
    plain = replica.stage_runs(ParallelConfig(1, pp))
    rc = replica.stage_runs(ParallelConfig(1, pp, recompute=True))
    for name, (static, run) in plain.items():
        replica.clear_grads()
        plain_peak = CPU.peak_bytes(functools.partial(run, 512))
        replica.clear_grads()
        rc_peak = CPU.peak_bytes(functools.partial(rc[name][1], 512))
        assert rc[name][0] == static and rc_peak < plain_peak


def test_timed_runs_run(replica):
    for run in (
        replica.blocks_run(MicroBatchShape.packed([7, 4]), task=1),
        replica.head_run(16),
        replica.step_run([MicroBatchShape.padded(2, 8), MicroBatchShape.packed([5, 3])], None),
    ):
        assert median_ms(run, warmup=0, repeats=1) > 0
