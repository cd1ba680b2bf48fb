"""Per-rank KV pools under data-parallel attention (DeepSeek-V3 over two processes, gloo, CPU): each rank's pool holds
its own rows' blocks, so the same `kv_cache_memory` per rank holds twice the rows one process holds, and the greedy
tokens are one process's, token for token, through waits and preemptions."""

from __future__ import annotations

import os

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine import Engine, EngineConfig

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two CPU cores")

BLOCK, MAX_LEN = 8, 80
# Chat prompts of 26, 30, 25 and 22 tokens: 4, 4, 4 and 3 blocks at admission (4, 5, 4 and 4 with MTP's k = 4 ahead).
PROMPTS = ["Plan a weekend trip to Lisbon.", "List three prime numbers.", "Name two rivers.", "Count to five."]


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[int, list[list[int]]]:
    """The rows the first step runs (all requests queued at once), and each request's tokens."""
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=12)) for prompt in prompts]
    engine.step()
    admitted = len(engine.scheduler.running)
    while engine.has_unfinished():
        engine.step()
    return admitted, [engine.pop_finished(request_id).token_ids for request_id in ids]


@pytest.mark.parametrize("draft", [None, "mtp"])
def test_two_ranks_hold_twice_the_rows_of_one_in_the_same_kv_memory(draft):
    """A kv_cache_memory of one full row's blocks (target and draft entries): one process runs two of the four
    requests at first (and preempts), each of two ranks holds as many blocks in the same bytes, twice the rows in
    all."""
    settings = dict(max_num_seqs=4, max_model_len=MAX_LEN, block_size=BLOCK, graph_mode="eager")
    single = LLM("demo-deepseek", draft, dtype=torch.float32, **settings)
    caches = [c for c in (single.engine.target_cache, single.engine.draft_cache) if c is not None]
    memory = sum(c.bytes_per_position for c in caches) * MAX_LEN
    one = Engine(single.target, single.draft, single.tokenizer, EngineConfig(**settings, kv_cache_memory=memory))
    layout = dict(data_parallel_size=2, enable_expert_parallel=True)
    two = LLM("demo-deepseek", draft, dtype=torch.float32, kv_cache_memory=memory, **layout, **settings)
    try:
        prompts = [single.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
        assert [len(p) for p in prompts] == [26, 30, 25, 22]
        rows_one, expected = _run(one, prompts)
        rows_two, got = _run(two.engine, prompts)
        pools = [sum(layer.nbytes for layer in engine.target_cache.layers) for engine in (one, two.engine)]
        stats_one, stats_two = one.kv_stats(), two.engine.kv_stats()
    finally:
        two.close()
    assert got == expected
    assert pools[0] == pools[1]  # rank 0's pool (every rank's is its size): the same bytes,
    assert (stats_one.blocks_total, stats_two.blocks_total) == (MAX_LEN // BLOCK, 2 * MAX_LEN // BLOCK)  # twice
    assert (rows_one, rows_two) == (2, 4)  # the blocks and the rows
    assert stats_one.preemptions > 0 and stats_two.blocks_in_use == 0
