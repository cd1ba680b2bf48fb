"""The paged KV cache in graph mode: block tables are persistent inputs of the compiled steps, padding writes go
to the scratch block, and the outputs equal eager steps over one block per row (the contiguous layout), token
for token, for the model drafts (CPU: dynamo's ``eager`` backend, as in test_graphs.py)."""

from __future__ import annotations

import pytest

from tests.engine.test_paged_kv import (
    MAX_LEN,
    _assert_pool_whole,
    _dynamo_only,
    _engine,
    _generate,
    _params,
    _prompts,
)

__all__ = ["_dynamo_only"]  # the fixture this module uses


@pytest.mark.parametrize("name, draft", [("demo-llama", "eagle3"), ("demo-deepseek", "mtp")])
def test_paged_graph_mode_gives_the_eager_contiguous_outputs(models, name, draft):
    """Graph mode over block tables (persistent inputs, padding writes to the scratch block) against eager
    steps over one block per row."""
    compiled = _engine(models, name, draft, graph_mode="compiled", capture_sizes=(1, 2), max_num_seqs=2)
    eager = _engine(models, name, draft, block_size=MAX_LEN, max_num_seqs=2)
    prompts, params = _prompts(compiled), _params()
    assert _generate(compiled, prompts, params) == _generate(eager, prompts, params)
    assert compiled.runner.replays > 0
    _assert_pool_whole(compiled)
