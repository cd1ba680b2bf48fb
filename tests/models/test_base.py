"""The provider contract's helpers: host-to-tensor copies, ragged batches and their host spans, cache checks."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.models.base import ForwardBatch, KVCache, RowSpans

rows_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 100), min_size=1, max_size=6), st.integers(0, 50)), min_size=1, max_size=5
)


@given(rows_strategy)
def test_a_batch_keeps_its_device_tensors_and_host_spans_in_step(rows):
    tokens, starts = [r for r, _ in rows], [s for _, s in rows]
    slots = list(range(len(rows)))[::-1]
    batch = ForwardBatch.from_rows(tokens, starts, slots)
    assert batch.spans == RowSpans(starts, [len(r) for r in tokens], slots)
    assert batch.input_ids.tolist() == [t for r in tokens for t in r]
    assert batch.positions.tolist() == [s + i for r, s in zip(tokens, starts) for i in range(len(r))]
    assert batch.row_offsets.tolist() == batch.spans.offsets() == [0, *itertools.accumulate(len(r) for r in tokens)]
    assert batch.row_offsets.diff().tolist() == batch.spans.lengths and batch.slots.tolist() == slots
    assert batch.token_rows().tolist() == [b for b, r in enumerate(tokens) for _ in r]

    following = batch.following(torch.arange(len(rows)))
    ends = batch.spans.ends()
    assert following.spans == RowSpans(ends, [1] * len(rows), slots)
    assert following.positions.tolist() == ends and following.input_ids.tolist() == list(range(len(rows)))
    chained = following.following(following.input_ids)
    assert chained.positions.tolist() == [e + 1 for e in ends]
    assert following.row_offsets.tolist() == chained.row_offsets.tolist() == list(range(len(rows) + 1))


def test_a_batch_rejects_spans_that_do_not_fit_its_tokens():
    with pytest.raises(ValueError, match="3 input ids for rows of lengths"):
        ForwardBatch.build(torch.arange(3), RowSpans([0, 0], [1, 1], [0, 1]))
    with pytest.raises(ValueError, match="differ in length"):
        ForwardBatch.build(torch.arange(2), RowSpans([0], [1, 1], [0, 1]))


def test_begin_forward_names_the_row_that_does_not_fit():
    cache = KVCache.allocate(1, 2, 8, (1,), dtype=torch.float32, device="cpu")
    cache.begin_forward(ForwardBatch.from_rows([[1, 2, 3], [4]], [0, 0], [0, 1]).spans)
    assert cache.lengths == [3, 1]
    for rows, starts, slots, message in [
        ([[1], []], [3, 1], [0, 1], "row 1 has no tokens"),
        ([[1], [2]], [3, 1], [0, 2], "row 1 names slot 2"),
        ([[1], [2]], [4, 1], [0, 1], r"row 0 \(slot 0\) writes positions 4..4 but the slot holds 3"),
        ([[1], [2] * 8], [3, 1], [0, 1], r"row 1 \(slot 1\) writes positions 1..8 .* max_len is 8"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.begin_forward(ForwardBatch.from_rows(rows, starts, slots).spans)
    assert cache.lengths == [3, 1]  # a rejected batch changes nothing
    cache.truncate([1, 0], [0, 2])
    assert cache.lengths == [2, 0]
    with pytest.raises(ValueError, match="outside"):
        cache.truncate([0], [9])
