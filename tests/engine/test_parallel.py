"""A target over two processes (gloo, CPU) decodes what one process decodes (a worker that dies or hangs:
tests/engine/test_parallel_failures.py).

Each parallel LLM starts one worker process; the tests of a model share one LLM per layout (module fixtures), and
the single-process reference runs the same requests. Float32: an all-reduce sums the ranks' partial products in
another order than one matmul does, a difference of a few float32 ulps in the logits, far below the demo models'
gaps between the best and second-best token (the greedy test reports the smallest gap it met).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import jsonschema
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.workers import ParallelConfig
from tandem.llm import resolve_model
from tandem.models.deepseek_v3 import DeepseekV3
from tandem.models.drafts.mtp import MultiTokenPredictor
from tandem.models.parallel import parameter_bytes

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two CPU cores")

PROMPTS = ["Plan a weekend trip to Lisbon.", "List three prime numbers."]
TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "sights": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "days", "sights"],
    "additionalProperties": False,
}
LAYOUTS = {
    "demo-llama": ("eagle3", {"tensor_parallel_size": 2}),
    "demo-deepseek": ("mtp", {"data_parallel_size": 2, "enable_expert_parallel": True}),
}


def build(model: str, graph_mode: str = "eager", draft: str | None = "default", **settings) -> LLM:
    """The demo model and its draft (by default the one of `LAYOUTS`), float32, at a fixed k (adaptive speculation
    off: its choices follow measured times, and seeded sampling draws from the drafts a row verified)."""
    draft = LAYOUTS[model][0] if draft == "default" else draft
    llm = LLM(model, draft, dtype=torch.float32, max_num_seqs=4, max_model_len=512, graph_mode=graph_mode, **settings)
    llm.engine.config.adaptive = False
    return llm


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def pair(request):
    """(single-process LLM, two-process LLM) of one demo model and its draft."""
    model = request.param
    single = build(model)
    parallel = build(model, **LAYOUTS[model][1])
    yield single, parallel
    parallel.close()


def torchrun(ranks: int, *command: str, **run) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node ranks`` of ``command`` (a program and its arguments, or ``-m module ...``) on a free
    port, its output captured as text; ``run``: more of ``subprocess.run``'s arguments (a ``timeout``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port)]
    return subprocess.run([*launch, *command], capture_output=True, text=True, **run)


def _runs(llm: LLM) -> dict[str, list]:
    greedy = SamplingParams(max_tokens=32)
    schema = SamplingParams(max_tokens=64, json_schema=TRIP)
    sampled = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5)
    return {
        name: llm.generate([llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS], params)
        for name, params in (("greedy", greedy), ("schema", schema), ("sampled", sampled))
    }


def test_two_ranks_decode_what_one_does(pair):
    single, parallel = pair
    expected, got = _runs(single), _runs(parallel)
    for name in expected:
        for want, out in zip(expected[name], got[name]):
            assert out.token_ids == want.token_ids, f"{name}: {out.text!r} != {want.text!r}"
            assert (out.stats.drafted, out.stats.accepted) == (want.stats.drafted, want.stats.accepted)
    for out in got["schema"]:
        jsonschema.validate(json.loads(out.text), TRIP)
    assert any(out.stats.accepted for out in got["greedy"])  # the draft ran and was verified


def test_graph_mode_on_two_ranks_decodes_what_eager_does_on_one(monkeypatch):
    """Each rank runs its own graphs (torch.compile's eager backend: the whole-graph trace, collectives inside,
    without inductor's compile time; the spawned rank inherits the setting). Plain decoding keeps it to one decode
    graph per rank; tests/models/test_tensor_parallel.py runs verify-shaped graphs on two ranks."""
    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")
    prompts, params = PROMPTS[:1], SamplingParams(max_tokens=24)
    expected = build("demo-llama", draft=None).generate(prompts, params)
    parallel = build("demo-llama", "compiled", draft=None, tensor_parallel_size=2, capture_sizes=[1])
    try:
        got = parallel.generate(prompts, params)
        assert parallel.engine.runner.replays > 0
    finally:
        parallel.close()
    assert [out.token_ids for out in got] == [out.token_ids for out in expected]


def test_each_rank_holds_part_of_the_weights(pair):
    single, parallel = pair
    whole = sum(p.nbytes for p in single.target.parameters())
    mine = sum(p.nbytes for p in parallel.target.parameters())
    assert mine < 0.8 * whole  # rank 0 keeps the replicated parts (norms; its full vocabulary for the draft)


def test_each_rank_holds_its_part_of_the_kv_cache(pair):
    """For the same rows (max_num_seqs full rows): a Llama rank caches its KV heads, a DeepSeek-V3 rank the blocks
    of its own rows (its domain's pool, engine/kv_blocks.py), about half the single process's pool either way."""
    whole, mine = (sum(layer.nbytes for layer in llm.engine.target_cache.layers) for llm in pair)
    assert mine < 0.51 * whole


@pytest.mark.parametrize("pair", ["demo-deepseek"], indirect=True)
def test_each_rank_holds_its_part_of_the_mtp_layer(pair):
    """The MTP draft follows the target's layout: each rank holds half of its layer's MoE (the routed experts and
    the shared experts' columns) and the rest whole. Rank 0's is the draft it loaded; rank 1's is built as the
    worker builds it, on the meta device (construction runs no collective)."""
    single, parallel = pair
    assert isinstance(parallel.draft, MultiTokenPredictor) and parallel.workers.has_draft
    config, shard = single.target.config, parallel.workers.ranks.parallel.shard(1, "deepseek_v3")
    rank1 = MultiTokenPredictor(config, DeepseekV3(config, device="meta", shard=shard), device="meta", shard=shard)
    whole = MultiTokenPredictor(config, DeepseekV3(config, device="meta"), device="meta")
    for mine, full in ((parallel.draft, single.draft), (rank1, whole)):
        moe = full.layer.mlp
        sharded = parameter_bytes(moe.experts) + parameter_bytes(moe.shared_experts)
        assert abs((parameter_bytes(mine) - (parameter_bytes(full) - sharded)) / sharded - 1 / 2) < 0.01


@pytest.mark.parametrize("pair", ["demo-deepseek"], indirect=True)
def test_chunked_prefill_on_two_ranks_decodes_what_one_does(pair, monkeypatch):
    """Prompts fed 8 tokens a step: the MTP draft's first pass fills each rank's draft cache over every chunk."""
    prompts = ["Describe the water cycle in three short sentences.", "Name two rivers and the seas they reach."]
    params, got = SamplingParams(max_tokens=24), []
    for llm in pair:
        monkeypatch.setattr(llm.engine.scheduler, "budget", 8)
        fills, fill = [], llm.engine._fill_draft
        monkeypatch.setattr(llm.engine, "_fill_draft", lambda *args, fill=fill, fills=fills: fills.append(fill(*args)))
        got.append(llm.generate([llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts], params))
        assert len(fills) >= 2  # chunks before each prompt's last
    single, parallel = got
    assert [out.token_ids for out in parallel] == [out.token_ids for out in single]
    assert [out.stats.accepted for out in parallel] == [out.stats.accepted for out in single]


def test_a_bad_layout_is_refused_before_loading():
    config = json.loads((resolve_model("demo-llama") / "config.json").read_text())  # 6 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_attention_heads: 6 does not divide over 4 ranks"):
        ParallelConfig(tensor_parallel_size=4).check(config, torch.device("cpu"))
    with pytest.raises(ValueError, match="data-parallel"):
        ParallelConfig(tensor_parallel_size=2).check({"model_type": "deepseek_v3"}, torch.device("cpu"))
    with pytest.raises(ValueError, match="2 ranks on this machine .* but it has 0 GPUs"):
        ParallelConfig(tensor_parallel_size=2).check(config, torch.device("cuda"))


def test_torchrun_launches_the_ranks_and_rank_zero_answers(capsys):
    """`torchrun -m tandem.cli generate --tensor-parallel-size 2`: torchrun starts both ranks, rank 0 runs the
    command and prints, rank 1 follows its forwards; the answer is the single process's."""
    from tandem.cli import main

    command = ["generate", "List three prime numbers.", "--model", "demo-llama", "--draft", "eagle3"]
    command += ["--json", "--max-tokens", "24", "--graph-mode", "eager"]
    done = torchrun(2, "-m", "tandem.cli", *command, "--tensor-parallel-size", "2", timeout=240)
    assert done.returncode == 0, done.stderr[:4000] + "\n[...]\n" + done.stderr[-3000:]  # the first rank to fail, too
    assert main(command) == 0
    single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    answers = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 1  # rank 0's; the other rank prints nothing
    parallel = json.loads(answers[0])
    assert (parallel["reasoning"], parallel["text"]) == (single["reasoning"], single["text"])


def test_torchrun_refuses_models_whose_data_parallel_ranks_differ(monkeypatch):
    """`tandem bench --models` under torchrun with `--data-parallel-size`: a Llama model's other ranks drive engine
    replicas, a DeepSeek-V3 model's run its engine's forwards; no rank can follow both, so every rank refuses."""
    from tandem.cli import follows_rank_zero

    layout = {"tensor_parallel_size": 1, "data_parallel_size": 2, "enable_expert_parallel": False, "device": "cpu"}
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ValueError, match="run demo-llama and demo-deepseek in separate torchrun jobs"):
            follows_rank_zero(argparse.Namespace(models=["demo-llama", "demo-deepseek"], **layout))
    monkeypatch.setenv("RANK", "0")  # rank 0 runs the command; one kind of model is fine
    assert not follows_rank_zero(argparse.Namespace(models=["demo-llama", "demo-llama"], **layout))


def test_engine_replicas_share_the_requests_and_decode_what_one_engine_does():
    """Llama's data_parallel_size: a second engine in its own process takes half the requests; an abort of one
    of its requests returns the output at once."""
    prompts = [[{"role": "user", "content": p}] for p in (*PROMPTS, "Name two rivers.", "Count to five.")]
    params = SamplingParams(max_tokens=24)
    single = LLM("demo-llama", "eagle3", max_num_seqs=2, max_model_len=512)
    expected = single.generate([single.chat_prompt(m) for m in prompts], params)
    replicated = LLM("demo-llama", "eagle3", max_num_seqs=2, max_model_len=512, data_parallel_size=2)
    try:
        got = replicated.generate([replicated.chat_prompt(m) for m in prompts], params)
        assert replicated.engine.assigned == [2, 2]
        engine, long = replicated.engine, SamplingParams(max_tokens=200)
        first, second = (engine.add_request(replicated.chat_prompt(prompts[0]), long) for _ in range(2))
        assert engine.assigned == [3, 3]  # the second went to the other replica, the less loaded
        engine.step()
        engine.abort(second)
        assert engine.pop_finished(second).finish_reason == "abort"
        engine.abort(first)
        assert engine.pop_finished(first).finish_reason == "abort"
        engine.step()  # hands out the deltas the abort's wait took in
        assert not engine.has_unfinished()
    finally:
        replicated.close()
    assert [out.token_ids for out in got] == [out.token_ids for out in expected]
