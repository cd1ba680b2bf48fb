"""Graph mode under DeepSeek-V3's data-parallel attention (engine/graphs.py, models/deepseek_v3.py): each rank runs
its own graphs over the whole padded batch, the rows it does not own planned as padding rows, whose attention
outputs it zeroes before the all-reduce.

Two ranks (gloo, CPU) with the MTP draft in graph mode decode what one process decodes eagerly, token for token,
with and without a JSON schema; and a rank's plan sends the rows it does not own to the scratch slot and block, so
they never read or write its pool (their block-table rows hold another domain's ids).
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch

from tandem import SamplingParams
from tandem.engine.graphs import GraphRunner
from tandem.llm import resolve_model
from tandem.models.base import BlockTable, KVCache, RowSpans
from tandem.models.config import DeepseekV3Config
from tandem.models.deepseek_v3 import DeepseekV3
from tandem.models.parallel import Shard
from tests.engine.test_parallel import PROMPTS, TRIP, build

PARALLEL = {"data_parallel_size": 2, "enable_expert_parallel": True}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two CPU cores")
def test_graph_mode_with_data_parallel_attention_decodes_what_eager_does_on_one(monkeypatch):
    """Three rows over two ranks (rank 0 owns slots 0 and 2, rank 1 slot 1; a rank owns none once its rows end), in
    one bucket of 4 (torch.compile's eager backend: the whole-graph trace, collectives inside; the spawned rank
    inherits the setting). The target's and the MTP draft's steps run as graphs on both ranks: a rank running a
    step eagerly would all-reduce other shapes than the other's graph and fail. Then prompts fed 8 tokens a step:
    the draft fills each chunk eagerly on every rank, between the graphs' steps."""
    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")
    messages = [*PROMPTS, "Name two rivers of Europe."]
    runs = {
        "greedy": SamplingParams(max_tokens=16),
        "schema": SamplingParams(max_tokens=32, json_schema=TRIP),
        "chunked": SamplingParams(max_tokens=16),
    }
    fills = []

    def generate(llm) -> dict[str, list]:
        out = {}
        for name, params in runs.items():
            if name == "chunked":
                monkeypatch.setattr(llm.engine.scheduler, "budget", 8)
                fill = llm.engine._fill_draft
                monkeypatch.setattr(llm.engine, "_fill_draft", lambda *args, fill=fill: fills.append(fill(*args)))
            out[name] = llm.generate(prompts, params)
        return out

    single = build("demo-deepseek")
    prompts = [single.chat_prompt([{"role": "user", "content": m}]) for m in messages]
    expected = generate(single)
    parallel = build("demo-deepseek", "compiled", capture_sizes=[4], **PARALLEL)
    try:
        fills.clear()
        got = generate(parallel)
        runner = parallel.engine.runner
        assert runner.replays > 0 and {key[0] for key in runner._graphs} == {"target", "draft"}
    finally:
        parallel.close()
    for name in runs:
        for want, out in zip(expected[name], got[name]):
            assert out.token_ids == want.token_ids, f"{name}: {out.text!r} != {want.text!r}"
    for out in got["schema"]:
        jsonschema.validate(json.loads(out.text), TRIP)
    assert any(out.stats.accepted for out in got["greedy"])  # the draft's graphs proposed and were verified
    assert len(fills) >= 2  # chunks before a prompt's last (past the prefix the earlier runs cached)


def demo_config() -> DeepseekV3Config:
    return DeepseekV3Config.from_dict(json.loads((resolve_model("demo-deepseek") / "config.json").read_text()))


def test_rows_a_rank_does_not_own_are_planned_as_padding():
    """Rank 1 of 2: slot 0's row (rank 0's; its block ids are of rank 0's pool) reads the scratch slot and writes
    the scratch block only; slot 1's row writes its own blocks; the slots buffer marks which rows are its own."""
    config = demo_config()
    shard = Shard(1, 2, data_parallel_attention=True, expert_parallel=True)
    target = DeepseekV3(config, device="meta", shard=shard)  # the plan reads no weight
    table = BlockTable(3, 64, 16, 5, scratch_block=4)
    cache = KVCache.allocate(
        config.num_hidden_layers, 3, 64, (config.latent_dim,), dtype=torch.float32, device="cpu", table=table
    )
    runner = GraphRunner(target, cache, widths=(1, 3), capture_sizes=(2,))
    table.set_blocks(0, [0, 1])  # rank 0's blocks: on rank 1 they are other rows' (or none)
    table.set_blocks(1, [2])
    plan = runner._plan(RowSpans([17, 5], [2, 3], [0, 1]), (2, 3), cache.first_position)
    positions, writes, slots = plan[:6], plan[6:12], plan[12:14]
    scratch = range(4 * 16, 5 * 16)
    assert slots == [runner.scratch, 1]
    assert all(w in scratch for w in writes[:3]) and writes[3:] == [2 * 16 + p for p in (5, 6, 7)]
    assert positions == [cache.first_position] * 3 + [5, 6, 7]
    assert plan[14:] == [0, 1, 3, 4, 5]  # every row's tokens in the grid: the MLP runs them all
    owned = runner._owned(torch.tensor(slots), 3)["owned"]
    assert owned.tolist() == [False] * 3 + [True] * 3


def test_a_body_without_its_rows_is_refused_under_data_parallel_attention():
    """Every rank would attend every row, into a cache holding its own rows' entries only."""
    model = DeepseekV3(demo_config(), device="meta", shard=Shard(0, 2, data_parallel_attention=True))
    ids = torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="pass the rows this rank attends"):
        model.forward_layout(None, ids, ids, [])
