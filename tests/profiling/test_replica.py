"""The profiling replica: packed attention stays inside sequences, rows go through their own task's adapter,
and the memory accounting sees what a step allocates."""

from __future__ import annotations

import pytest
import torch

from lorafleet.costmodel.adapters import AdapterLoad
from lorafleet.costmodel.time_model import MicroBatchShape
from lorafleet.profiling.measure import median_ms, peak_bytes
from lorafleet.profiling.replica import Replica
from lorafleet.specs.model import MODEL_PRESETS

TINY = MODEL_PRESETS["tiny-llama"]


@pytest.fixture(scope="module")
def replica() -> Replica:
    torch.manual_seed(0)
    r = Replica(TINY, AdapterLoad.uniform(2, 4))
    with torch.no_grad():  # B != 0, so every adapter changes its rows (PEFT initialises B to zero)
        for layer in r.lora_layers:
            for name in r.tasks:
                layer.lora_B[name].weight.normal_(0, 0.5)
    return r


def _blocks(replica: Replica, ids: torch.Tensor, pos: torch.Tensor, names: tuple[str, ...], cu=None) -> torch.Tensor:
    from lorafleet.profiling.replica import Batch

    batch = Batch(ids, pos, names, cu)
    with torch.no_grad():
        hidden, rotary = replica.embed(batch)
        return replica.run_blocks(hidden, rotary, batch, range(TINY.n_layers))


def test_rows_go_through_their_own_adapter(replica):
    ids = torch.randint(0, TINY.vocab, (1, 12)).repeat(2, 1)
    pos = torch.arange(12).expand(2, 12)
    mixed = _blocks(replica, ids, pos, ("task0", "task1"))
    assert not torch.allclose(mixed[0], mixed[1])  # sanity: the two adapters differ
    alone = [_blocks(replica, ids[i : i + 1], pos[i : i + 1], (name,)) for i, name in enumerate(("task0", "task1"))]
    torch.testing.assert_close(mixed, torch.cat(alone))


def test_packed_attention_stays_inside_each_sequence(replica):
    lens = [5, 9, 3]
    batch = replica.batch(MicroBatchShape.packed(lens), torch.Generator().manual_seed(1))
    packed = _blocks(replica, batch.input_ids, batch.position_ids, batch.adapter_names, batch.cu_seq_lens)
    start = 0
    for n in lens:
        ids = batch.input_ids[:, start : start + n]
        alone = _blocks(replica, ids, torch.arange(n).unsqueeze(0), batch.adapter_names)
        torch.testing.assert_close(packed[:, start : start + n], alone)
        start += n


def test_a_micro_batch_belongs_to_one_task():
    r = Replica(TINY, AdapterLoad.uniform(3, 4))
    gen = torch.Generator().manual_seed(0)
    assert r.batch(MicroBatchShape.padded(4, 8), gen, task=4).adapter_names == ("task1",) * 4
    packed = r.batch(MicroBatchShape.packed([3, 4]), gen, task=2)
    assert packed.adapter_names == ("task2",)
    assert packed.input_ids.shape == (1, 7) and packed.cu_seq_lens.tolist() == [0, 3, 7]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]


def test_static_bytes_count_weights_adapters_and_optimizer_states():
    r = Replica(TINY, AdapterLoad.uniform(2, 4))
    everything = range(TINY.n_layers)
    before = r.static_bytes(everything, True, True)
    weights = sum(p.numel() * 4 for p in r.peft.parameters())
    adapters = sum(p.numel() * 4 for p in r.adapter_params)
    assert before == weights + adapters  # weights (adapters included) plus adapter gradients
    r.prime(torch.Generator())
    # AdamW's two moments (and a scalar step count per tensor)
    assert r.static_bytes(everything, True, True) == pytest.approx(before + 2 * adapters, rel=0.01)
    assert r.static_bytes(range(2), True, False) < r.static_bytes(everything, True, True)


def test_peak_bytes_grow_linearly_with_tokens(replica):
    gen = torch.Generator().manual_seed(0)
    peaks = [peak_bytes(lambda: replica.forward_backward(replica.batch(MicroBatchShape.padded(1, n), gen))) for n in (128, 256, 512)]
    assert peaks[0] < peaks[1] < peaks[2]
    assert (peaks[2] - peaks[1]) == pytest.approx(2 * (peaks[1] - peaks[0]), rel=0.25)


def test_median_ms_counts_cpu_time():
    x = torch.randn(256, 256)
    assert median_ms(lambda: x @ x, warmup=1, repeats=3) > 0
