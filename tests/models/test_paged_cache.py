"""Attention through block tables (models/attention.py, ``BlockAddressing``): a target run over scattered,
out-of-order blocks of a few positions gives the logits of the contiguous layout (one block per slot), for GQA
K/V (Llama) and MLA latents (DeepSeek-V3), prefill then verify-shaped steps; positions of a read-only (shared)
prefix are run again without writing their blocks."""

from __future__ import annotations

import pytest
import torch

from tandem.models.base import BlockTable, ForwardBatch
from tandem.models.loading import load_target
from tests.models.test_deepseek_v3 import save_reference, tiny_config

BLOCK, MAX_LEN = 4, 32


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def target(request, llama_dir, tmp_path_factory):
    if request.param == "llama":
        return load_target(llama_dir)
    path = tmp_path_factory.mktemp("deepseek")
    save_reference(path, tiny_config())
    return load_target(path)


def _scattered_table(blocks: list[list[int]]) -> BlockTable:
    table = BlockTable(len(blocks), MAX_LEN, BLOCK, 1 + max(max(row) for row in blocks))
    for slot, row in enumerate(blocks):
        table.set_blocks(slot, row)
    return table


def test_scattered_blocks_give_the_contiguous_logits(target):
    # Slot 0's blocks run backwards, slot 1's interleave with them: no gather is a view of the pool.
    table = _scattered_table([[8, 6, 4, 2, 1], [3, 5, 7, 9, 10]])
    paged, contiguous = target.new_cache(2, MAX_LEN, table=table), target.new_cache(2, MAX_LEN)
    steps = [
        ([[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8]], [0, 0]),  # prefill, ragged
        ([[3, 5, 8], [2, 8, 1]], [9, 4]),  # verify-shaped, 3 per row
        ([[9], [8]], [12, 7]),  # decode, rows at different lengths
    ]
    for rows, starts in steps:
        batch = ForwardBatch.from_rows(rows, starts, [0, 1])
        expected = target.forward(batch, contiguous).logits
        torch.testing.assert_close(target.forward(batch, paged).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_read_only_prefix_is_run_again_without_writing_its_blocks(target):
    """Slot 1 shares slot 0's first block read-only: running its last position again (to recompute its hidden
    state) writes the scratch block, and slot 1's logits after it equal slot 0's."""
    tokens = [3, 1, 4, 1, 5, 9]
    table = _scattered_table([[2, 3], [4]])
    cache = target.new_cache(2, MAX_LEN, table=table)
    first = target.forward(ForwardBatch.from_rows([tokens], [0], [0]), cache).logits
    table.set_blocks(1, [2, 4], read_only=BLOCK)  # slot 0's first block, shared
    cache.truncate([1], [BLOCK - 1])
    shared = [layer[2].clone() for layer in cache.layers]
    second = target.forward(ForwardBatch.from_rows([tokens[BLOCK - 1 :]], [BLOCK - 1], [1]), cache).logits
    assert all(torch.equal(layer[2], before) for layer, before in zip(cache.layers, shared))
    scratch = table.scratch_block  # zero until now: the rerun position's entries went there
    assert all(layer[scratch, BLOCK - 1].abs().sum() > 0 for layer in cache.layers)
    torch.testing.assert_close(second, first[BLOCK - 1 :], rtol=1e-5, atol=1e-5)
