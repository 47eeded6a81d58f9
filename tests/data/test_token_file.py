"""One tokenized dataset in one file (``data.token_file``): read back equal to what was written, in every
encoding; a file that is not whole (cut anywhere, any byte changed) never reads as an entry; writers racing on
one entry never show a reader half a file."""

from __future__ import annotations

import contextlib
import multiprocessing
import random

import pytest

from lorafleet.data.token_file import CorruptEntry, read_examples, read_lengths, write_examples
from lorafleet.data.tokenize import IGNORE_INDEX, Example

MASKED = [Example((1, 2, 3), (IGNORE_INDEX, 2, 3)), Example((4,), (4,)), Example((65_535, 0), (IGNORE_INDEX,) * 2)]
"""uint16 ids, each label its id or ignored: the mask encoding."""
WIDE = [Example((70_000, 5), (70_000, 5)), Example((1, 2), (IGNORE_INDEX, 2))]
"""An id above 2**16: int32 ids."""
OWN_LABELS = [Example((1, 2, 3), (IGNORE_INDEX, 7, 3))]
"""A label that is neither its id nor ignored (a template whose renderings do not extend each other): kept whole."""
HUGE = [Example((2**40,), (2**40,)), Example((3,), (-(2**35),))]
"""Beyond int32: int64 ids and labels."""


@pytest.mark.parametrize("examples", [MASKED, WIDE, OWN_LABELS, HUGE], ids=["mask", "int32", "labels", "int64"])
def test_an_entry_reads_back_as_written(tmp_path, examples):
    path = tmp_path / "entry.tokens"
    size = write_examples(path, examples)
    assert size == path.stat().st_size and size % 8 == 0
    assert read_examples(path) == examples
    assert read_lengths(path).tolist() == [len(e) for e in examples]
    assert [p.name for p in tmp_path.iterdir()] == ["entry.tokens"]  # no temporary file left


def test_the_mask_encoding_takes_two_bytes_and_a_bit_a_token(tmp_path):
    examples = [
        Example(tuple(range(i, i + 100)), (IGNORE_INDEX,) * 50 + tuple(range(i + 50, i + 100))) for i in range(50)
    ]
    size = write_examples(tmp_path / "e", examples)
    assert size - 50 * 100 * (2 + 1 / 8) < 8 * 51 + 400  # the rest: the offsets, the header (~250 bytes), padding


def test_no_cut_and_no_changed_byte_reads_as_an_entry(tmp_path):
    """Every prefix, and every single byte flipped: CorruptEntry from the examples' reader; from the lengths'
    reader too, or (a flip in what it does not read: the tokens, the payload's hash) the lengths as written."""
    path = tmp_path / "entry.tokens"
    write_examples(path, MASKED)
    whole = path.read_bytes()
    for cut in range(len(whole)):
        path.write_bytes(whole[:cut])
        for read in (read_examples, read_lengths):
            with pytest.raises(CorruptEntry):
                read(path)
    lengths_kept = 0
    for at in range(len(whole)):
        flipped = bytearray(whole)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(CorruptEntry):
            read_examples(path)
        with contextlib.suppress(CorruptEntry):
            assert read_lengths(path).tolist() == [3, 1, 2]
            lengths_kept += 1
    assert 0 < lengths_kept < len(whole) / 2


def _dataset(seed: int) -> list[Example]:
    rng = random.Random(seed)
    return [Example(tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 400))), ()) for _ in range(200)]


def test_writers_racing_on_one_entry_never_show_half_a_file(tmp_path):
    """Two processes rewrite one entry (as every rank of a run may) while this one reads it: each read is a
    missing file or one writer's whole dataset."""
    path = tmp_path / "entry.tokens"
    datasets = [[Example(e.input_ids, e.input_ids) for e in _dataset(seed)] for seed in (1, 2)]
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_often_labelled, args=(str(path), seed)) for seed in (1, 2)]
    for writer in writers:
        writer.start()
    reads = 0
    while any(w.is_alive() for w in writers) or reads == 0:
        try:
            found = read_examples(path)
        except FileNotFoundError:
            continue
        assert found in datasets
        reads += 1
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    assert reads > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["entry.tokens"]


def _write_often_labelled(path: str, seed: int) -> None:
    from pathlib import Path

    examples = [Example(e.input_ids, e.input_ids) for e in _dataset(seed)]
    for _ in range(15):
        write_examples(Path(path), examples)
