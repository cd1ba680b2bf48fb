"""An eager forward's addressing planned ahead in a phase's copy (`RaggedLayout.stage`) is the one
`RaggedLayout.build` plans on its own, and costs the forward no copy of its own.

A cache's rows hold shuffled blocks (block 0 is the scratch block), so a ragged batch of them needs both a write
index and key-window tables: the arrays that an eager multi-row step used to copy once per layout."""

from __future__ import annotations

import pytest
import torch

from tandem.core import transfer
from tandem.models.attention import BlockAddressing, RaggedLayout
from tandem.models.base import BlockTable, ForwardBatch, KVCache, RowSpans

BLOCK = 4
SPANS = RowSpans(starts=[9, 2, 13], lengths=[3, 1, 2], slots=[2, 0, 1])  # ragged: a verify, a decode, a short one


def _cache(first_position: int) -> KVCache:
    """Three slots of up to 24 positions in shuffled blocks of 4 (a fixed permutation of blocks 1..18), each
    holding what `SPANS` and two chained steps past it write; slot 0's end before the others' key window does."""
    order = torch.randperm(18, generator=torch.Generator().manual_seed(7)).add(1).tolist()
    table = BlockTable(3, 24, BLOCK, 19)
    for slot, n in enumerate([2, 5, 4]):
        table.set_blocks(slot, [order.pop() for _ in range(n)])
    return KVCache([torch.zeros(19, BLOCK, 2)], table, first_position=first_position)


def _batch(spans: RowSpans) -> ForwardBatch:
    return ForwardBatch.from_rows([[0] * n for n in spans.lengths], spans.starts, spans.slots)


def _copies(monkeypatch) -> list[int]:
    """The copies each Staging sends (`Staging.send`), one entry per send."""
    sent, send = [], transfer.Staging.send

    def counted(staging):
        sent.append(staging.num_copies)
        return send(staging)

    monkeypatch.setattr(transfer.Staging, "send", counted)
    return sent


def _same(a: BlockAddressing, b: BlockAddressing) -> None:
    for name in ("write_start", "first_block", "num_rows", "block_size", "key_offset", "key_start", "key_end"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.write_at is None) == (b.write_at is None)
    assert a.write_at is None or all(torch.equal(x, y) for x, y in zip(a.write_at, b.write_at))
    assert (a.tables is None) == (b.tables is None)
    assert a.tables is None or torch.equal(a.tables, b.tables)


@pytest.mark.parametrize("first_position", [0, 1], ids=["target", "draft"])
def test_a_staged_chain_is_what_build_plans_and_copies_nothing_more(monkeypatch, first_position):
    """A draft's chain of three steps: the first over the committed tokens, the next a token per row past them."""
    cache = _cache(first_position)
    staging = transfer.Staging("cpu")
    RaggedLayout.stage(SPANS, cache, staging, num_steps=3)
    staging.send()
    chain = [SPANS, SPANS.following(), SPANS.following().following()]
    batches = [_batch(spans) for spans in chain]
    sent = _copies(monkeypatch)
    staged = [RaggedLayout.build(batch, cache).addressing for batch in batches]
    assert sent == []  # each build took its plan: nothing staged, nothing sent
    assert not cache.planned
    for batch, addressing in zip(batches, staged):
        own = RaggedLayout.build(batch, cache).addressing  # planned now (its plan was taken)
        _same(addressing, own)
        assert own.write_at is not None and own.tables is not None
    assert sent == [1, 1, 1]  # on its own, a layout's write index and tables share one copy


def test_the_staged_tables_are_the_block_tables_rows_over_the_key_window():
    """What the persistent block table holds (`BlockTable.sync`: rows padded with the scratch block), as the eager
    layout once read it, for the rows' key window."""
    cache = _cache(first_position=1)
    layout = RaggedLayout.build(_batch(SPANS), cache)
    a = layout.addressing
    first = a.key_offset // BLOCK
    window = cache.table.sync().index_select(0, torch.tensor(SPANS.slots))[:, first : first + a.tables.shape[1]]
    assert torch.equal(a.tables, window)
    assert a.tables.shape == (3, -(-max(SPANS.ends()) // BLOCK) - first)
    assert a.tables[1, -1] == cache.table.scratch_block  # slot 0's blocks end before the window does
    ends = SPANS.ends()
    expected = [cache.table.flat_index(s, p) for s, b, e in zip(SPANS.slots, SPANS.starts, ends) for p in range(b, e)]
    assert [b * BLOCK + e for b, e in zip(*(t.tolist() for t in a.write_at))] == expected


def test_a_plan_made_before_the_block_table_changed_is_not_used(monkeypatch):
    cache = _cache(first_position=0)
    staging = transfer.Staging("cpu")
    RaggedLayout.stage(SPANS, cache, staging)
    staging.send()
    moved = [b for b in range(1, 19) if b not in cache.table.rows[2]][:5]
    cache.table.set_blocks(2, moved)  # slot 2 moves to other blocks after the plan
    batch = _batch(SPANS)
    sent = _copies(monkeypatch)
    addressing = RaggedLayout.build(batch, cache).addressing
    assert sent == [1]
    blocks, entries = (t[:3].tolist() for t in addressing.write_at)  # positions 9..11
    assert blocks == [moved[2]] * 3 and entries == [1, 2, 3]


def test_a_new_stage_replaces_the_plans_before_it():
    cache = _cache(first_position=0)
    for spans in (SPANS, SPANS.following()):
        staging = transfer.Staging("cpu")
        RaggedLayout.stage(spans, cache, staging)
        staging.send()
    assert len(cache.planned) == 1


def test_rows_past_their_blocks_are_left_to_the_forwards_cache_check():
    """Staging plans before any check: rows that do not fit plan nothing (`KVCache.begin_forward` then raises,
    naming the row), and neither does a chain from the step that stops fitting."""
    cache = _cache(first_position=0)
    staging = transfer.Staging("cpu")
    RaggedLayout.stage(RowSpans([6], [3], [0]), cache, staging)  # slot 0 holds 8 positions
    assert not cache.planned
    RaggedLayout.stage(RowSpans([5], [2], [0]), cache, staging, num_steps=3)  # positions 5..6, 7, then 8
    assert len(cache.planned) == 2
    cache.lengths[0] = 6
    with pytest.raises(ValueError, match=r"row 0 \(slot 0\) writes up to position 8 but its blocks hold 8"):
        cache.begin_forward(RowSpans([6], [3], [0]))
