"""Graph mode (engine/graphs.py) in the engine: speculative greedy output equals plain greedy output,
both compiled, token for token, for every trained demo pair, with and without a JSON schema; a batch
that changes bucket mid-run stays correct; seeded sampling gives eager's tokens; bad settings are
refused. The GPU tests (``-m gpu``) capture CUDA graphs.

CPU graphs compile with dynamo's ``eager`` backend: dynamo traces each shape whole
(``fullgraph=True``, so a graph break still fails) and the graph runs eager's kernels, at about
half of ``aot_eager``'s compile time; tests/models/test_compile.py runs the bodies through AOT
tracing (functionalization, the custom op's fake kernel).

The models are loaded once per target and shared by the engines, so an engine built after another
finds the same shapes' graphs in dynamo's cache and compiles nothing new.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from tandem.decoding.params import RelaxedAcceptance, SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine import engine as engine_module
from tandem.engine.engine import Engine, EngineConfig
from tandem.engine.graphs import GraphRunner
from tandem.llm import chat_prompt_ids

PAIRS = [("demo-llama", "eagle3"), ("demo-llama", "eagle"), ("demo-deepseek", "mtp")]
EXAMPLES = generate_examples(2, seed=11, split="heldout")
MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def _dynamo_only(monkeypatch):
    monkeypatch.setenv("TANDEM_COMPILE_BACKEND", "eager")


def _engine(models, name: str, draft: str | None, **config) -> Engine:
    target, draft_model, tokenizer = models(name, draft)
    settings = dict(max_num_seqs=2, max_model_len=384, graph_mode="compiled", capture_sizes=(2,))
    return Engine(target, draft_model, tokenizer, EngineConfig(**{**settings, **config}))


def _outcomes(engine: Engine, params: list[SamplingParams]) -> list[tuple[list[int], int, int]]:
    """Each demo example's token ids, steps and accepted drafts, one request per params entry, all in one batch."""
    ids = [
        engine.add_request(chat_prompt_ids(engine.tokenizer, example.messages, example.tools), p)
        for example, p in zip(EXAMPLES, params)
    ]
    while engine.has_unfinished():
        engine.step()
    return [(o.token_ids, o.stats.steps, o.stats.accepted) for o in map(engine.pop_finished, ids)]


def _generate(engine: Engine, params: list[SamplingParams]) -> list[list[int]]:
    """Token ids of the demo examples, one request per params entry, all in one batch."""
    return [tokens for tokens, _, _ in _outcomes(engine, params)]


@pytest.mark.parametrize("schema", [False, True], ids=["free", "schema"])
@pytest.mark.parametrize("name, draft", PAIRS)
def test_speculative_greedy_equals_plain_greedy_compiled(models, name, draft, schema):
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, json_schema=TASK_FAMILIES[e.family].schema if schema else None)
        for e in EXAMPLES
    ]
    # Fixed k: adaptive speculation, choosing by timings, may keep the draft idle through so short a run.
    speculative = _engine(models, name, draft, adaptive=False)
    plain = _engine(models, name, None)
    assert _generate(speculative, params) == _generate(plain, params)
    for engine in (speculative, plain):  # the steps after each prefill ran as graphs
        assert engine.runner.replays > 0 and engine.runner.fallbacks >= 1
    # A proposal runs as one graph, a grammar row's too (the walk follows its tokens after).
    assert any(key[0] == "chain" for key in speculative.runner._graphs)


def _recorded(function, record: list):
    """``function``, appending each call's result to ``record``."""

    def run(*args, **kwargs):
        record.append(function(*args, **kwargs))
        return record[-1]

    return run


@pytest.mark.parametrize("draft", ["eagle3", None])
def test_a_free_greedy_step_takes_its_graphs_argmaxes(models, monkeypatch, draft):
    """The target's graph chooses its greedy tokens with the forward (`TargetOutput.greedy`): a step of greedy rows
    without masks or penalties that ran a graph calls neither `sample` nor `accept` (prefills, which run eagerly, do),
    and gives eager's tokens. Rows with penalties adjust the logits first, so each of their steps calls one."""
    decided = []  # the results of every `sample` and `accept` the engine calls
    for name in ("sample", "accept"):
        monkeypatch.setattr(engine_module, name, _recorded(getattr(engine_module, name), decided))
    for penalty in (0.0, 0.5):
        params = [SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=penalty) for _ in EXAMPLES]
        engine = _engine(models, "demo-llama", draft, adaptive=False)
        forwards = []  # the target's outputs
        monkeypatch.setattr(engine.runner, "forward", _recorded(engine.runner.forward, forwards))
        decided.clear()
        tokens = _generate(engine, params)
        chose = sum(out.greedy is not None for out in forwards)  # the forwards that ran a graph
        assert chose > 0 and len(decided) == (len(forwards) - chose if penalty == 0 else len(forwards))
        assert tokens == _generate(_engine(models, "demo-llama", draft, graph_mode="eager", adaptive=False), params)


def test_a_batch_changing_bucket_stays_correct(models):
    """Two rows (bucket 2) until the shorter one finishes, then one (bucket 1): the eager tokens, and both
    buckets' graphs ran."""
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=MAX_TOKENS)]
    compiled = _engine(models, "demo-llama", "eagle3", capture_sizes=(1, 2))
    eager = _engine(models, "demo-llama", "eagle3", graph_mode="eager")
    assert eager.runner is None
    assert _generate(compiled, params) == _generate(eager, params)
    assert {key[1] for key in compiled.runner._graphs} == {1, 2}


@pytest.mark.parametrize("name, draft", [("demo-llama", "eagle3"), ("demo-deepseek", "mtp")])
def test_drafts_in_graphs_are_accepted_as_eager_ones(models, name, draft):
    """The draft's graphs (a proposal's chain of steps as one) propose what its eager steps do: at a fixed k
    (adaptive speculation off, its choices follow timings) every request takes the same steps and accepts the same
    drafts. Greedy equality alone would not see a draft that reads the wrong hidden states or cache entries: it
    only costs acceptance."""
    params = [SamplingParams(max_tokens=MAX_TOKENS) for _ in EXAMPLES]
    stats = {}
    for mode in ("compiled", "eager"):
        engine = _engine(models, name, draft, graph_mode=mode, adaptive=False)
        stats[mode] = _outcomes(engine, params)
        if mode == "compiled":  # (a prefill's proposal, its first step eager, chains the rest step by step)
            assert any(key[0] == "chain" for key in engine.runner._graphs)
    assert stats["compiled"] == stats["eager"]
    assert sum(accepted for _, _, accepted in stats["eager"]) > 0


def test_adaptive_speculation_times_no_graph_build(models, monkeypatch):
    """A step or proposal that builds a graph is a capture, not a step: its time enters none of the policy's cost
    points (each new draft shape would otherwise make its pass count look slow, and the policy shun it)."""
    build = GraphRunner._build

    def slow_build(runner, body, args):
        time.sleep(0.3)
        return build(runner, body, args)

    monkeypatch.setattr(GraphRunner, "_build", slow_build)
    engine = _engine(models, "demo-llama", "eagle3", capture_sizes=(1, 2))
    assert _generate(engine, [SamplingParams(max_tokens=16), SamplingParams(max_tokens=48)])
    policy = engine.policy
    assert len(engine.runner._graphs) > 2 and policy.draft_cost.tokens
    assert max(policy.cost.seconds + policy.draft_cost.seconds) < 0.3


def test_a_draft_that_skipped_steps_catches_up_through_a_graph(models, monkeypatch):
    """Steps where no row drafts leave the draft behind (batching.defer_draft); the next proposal's first pass takes
    the missed tokens too, wider than a verify's, through the chain graph of the widest static width."""
    engine = _engine(models, "demo-llama", "eagle3")
    choices = itertools.cycle([[2, 1], *[[0, 0]] * 5])  # then a proposal over the 6 tokens since the last
    monkeypatch.setattr(engine.policy, "choose", lambda ids, pinned=None: next(choices)[: len(ids)])
    params = [SamplingParams(max_tokens=24) for _ in EXAMPLES]
    assert _generate(engine, params) == _generate(_engine(models, "demo-llama", None), params)
    assert any(key[:3] == ("chain", 2, engine.max_drafts + 1) for key in engine.runner._graphs)


def test_a_chain_longer_than_its_proposal_proposes_the_eager_tokens(models, monkeypatch):
    """On CUDA every chain runs the longest proposal's steps (one graph per bucket and width), whatever a step asks:
    a shorter proposal is the chain's first tokens, and the steps past it write cache entries the next proposal
    rewrites. Here on the CPU, with the policy's choices cycling through 1..4 drafts, the same steps and accepted
    drafts as eager proposals of each length."""
    params = [SamplingParams(max_tokens=MAX_TOKENS) for _ in EXAMPLES]
    stats = {}
    for mode in ("compiled", "eager"):
        engine = _engine(models, "demo-llama", "eagle3", graph_mode=mode)
        if engine.runner is not None:
            engine.runner.longest_chains = True
        choices = itertools.cycle([1, 3, 2, 4])
        monkeypatch.setattr(engine.policy, "choose", lambda ids, pinned=None, c=choices: [next(c)] * len(ids))
        stats[mode] = _outcomes(engine, params)
        if mode == "compiled":
            assert {key[3] for key in engine.runner._graphs if key[0] == "chain"} == {engine.k}
    assert stats["compiled"] == stats["eager"]


def test_a_chain_never_proposes_past_the_vocabulary_limit(models):
    """A model whose embedding rows run past its tokenizer's never drafts those ids (`Engine.vocab_limit`), through
    the chain graph too. Here the limit is set at an id the unlimited run emits: compiled and eager take the same
    steps and accept the same drafts, and no proposal reaches the limit."""
    params = [SamplingParams(max_tokens=MAX_TOKENS) for _ in EXAMPLES]
    unlimited = _generate(_engine(models, "demo-llama", "eagle3", graph_mode="eager", adaptive=False), params)
    limit = max(token for tokens in unlimited for token in tokens)
    stats, proposed = {}, []
    for mode in ("compiled", "eager"):
        engine = _engine(models, "demo-llama", "eagle3", graph_mode=mode, adaptive=False)
        engine.vocab_limit = limit
        if engine.runner is not None:  # its target graphs choose greedy tokens below the limit (none is built yet)
            engine.runner.vocab_limit = limit
        run_draft = engine._run_draft

        def recorded(inp, num_tokens, run_draft=run_draft):
            proposal = run_draft(inp, num_tokens)
            proposed.extend(proposal.tokens.flatten().tolist())
            return proposal

        engine._run_draft = recorded
        stats[mode] = _outcomes(engine, params)
        if mode == "compiled":
            assert any(key[0] == "chain" and key[4] == limit for key in engine.runner._graphs)
    assert stats["compiled"] == stats["eager"]
    assert proposed and max(proposed) < limit
    assert all(token < limit for tokens, _, _ in stats["eager"] for token in tokens)


@pytest.mark.parametrize("schema", [False, True], ids=["free", "schema"])
@pytest.mark.parametrize("name, draft", PAIRS)
def test_a_lookahead_proposes_what_a_proposal_after_the_commit_does(models, name, draft, schema):
    """A lookahead proposal (`Engine._lookahead`: the draft's first pass over every verified position, fed the tokens
    emitted there, launched before the host reads the verify; its chain from each row's accepted drafts) proposes what
    a proposal after the commit does: at a fixed k every request takes the same steps, accepts the same drafts and
    emits the same tokens, with a JSON schema too (acceptance under masks decides on the device), and the steps
    after the prefills ran as lookaheads."""
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, json_schema=TASK_FAMILIES[e.family].schema if schema else None)
        for e in EXAMPLES
    ]
    stats = {}
    for lookahead in (True, False):
        engine = _engine(models, name, draft, adaptive=False, lookahead=lookahead)
        stats[lookahead] = _outcomes(engine, params)
        assert (engine.lookahead_steps > 0) == lookahead
    assert stats[True] == stats[False]
    assert sum(accepted for _, _, accepted in stats[True]) > 0


def test_a_lookahead_under_relaxed_acceptance_proposes_what_a_proposal_after_the_commit_does(models):
    """Inside `<think>` relaxed acceptance takes drafts the greedy rule would not (the acceptance decides on the
    device, its emitted tokens feed the lookahead): the same steps, accepted drafts and tokens as after the commit."""
    params = [SamplingParams(max_tokens=MAX_TOKENS) for _ in EXAMPLES]
    relaxed = RelaxedAcceptance(top_k=10, delta=0.6)
    stats = {}
    for lookahead in (True, False):
        engine = _engine(models, "demo-llama", "eagle3", adaptive=False, relaxed=relaxed, lookahead=lookahead)
        stats[lookahead] = _outcomes(engine, params)
        assert (engine.lookahead_steps > 0) == lookahead
    assert stats[True] == stats[False]


def test_a_lookahead_over_rows_of_unequal_drafts_gives_plain_greedy_tokens(models, monkeypatch):
    """Rows that verify different numbers of drafts (adaptive speculation's choices, here cycled: 0 to 4, one row
    none while the other drafts four) feed the lookahead's first pass their own verified positions only: plain
    greedy's tokens. A row with a penalty makes the step propose after the commit (the chain graph proposes
    without penalties), and seeded sampled rows draw the tokens they draw without lookaheads."""
    engine = _engine(models, "demo-llama", "eagle3", lookahead=True)
    choices = itertools.cycle([[4, 0], [1, 3], [2, 2], [0, 4], [3, 1]])
    monkeypatch.setattr(engine.policy, "choose", lambda ids, pinned=None: next(choices)[: len(ids)])
    params = [SamplingParams(max_tokens=24) for _ in EXAMPLES]
    assert _generate(engine, params) == _generate(_engine(models, "demo-llama", None), params)
    assert engine.lookahead_steps > 0
    mixed = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.5)]
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7 + i) for i in range(2)]
    for params in (mixed, sampled):
        ahead = _engine(models, "demo-llama", "eagle3", lookahead=True, adaptive=False)
        tokens = _generate(ahead, params)
        assert tokens == _generate(_engine(models, "demo-llama", "eagle3", lookahead=False, adaptive=False), params)
        assert (ahead.lookahead_steps > 0) == (params is sampled)


def test_lookahead_needs_a_chain_graph(models):
    with pytest.raises(ValueError, match="lookahead proposals"):
        _engine(models, "demo-llama", "eagle3", graph_mode="eager", lookahead=True)
    assert not _engine(models, "demo-llama", "eagle3").lookahead  # None: on CUDA only


@pytest.mark.parametrize("name, draft", [("demo-llama", "eagle3"), ("demo-deepseek", "mtp")])
def test_graphs_built_at_start_serve_every_step(models, name, draft):
    """`capture_at_start` (CUDA's default) builds before any request the target's forward, the draft's step and its
    chain at every bucket and width: a run of free and schema rows then builds none, and gives eager's tokens. The
    CPU keys graphs by torch threads too, so every step here runs with torch's setting. Free and schema rows propose
    through the chain; rows with penalties step by step (a batch with one chooses every row's tokens on the host)."""
    free = [SamplingParams(max_tokens=MAX_TOKENS) for _ in EXAMPLES]
    schema = [SamplingParams(max_tokens=MAX_TOKENS, json_schema=TASK_FAMILIES[e.family].schema) for e in EXAMPLES]
    penalised = [SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.5) for _ in EXAMPLES]
    settings = dict(adaptive=False, small_step_threads=None)  # fixed k: every chain is the longest
    engine = _engine(models, name, draft, capture_at_start=True, **settings)
    built = set(engine.runner._graphs)
    assert {key[:3] for key in built} == {
        (kind, 2, width) for kind in ("target", "draft", "chain") for width in engine.runner.widths
    }
    eager = _engine(models, name, draft, graph_mode="eager", **settings)
    for params in (free, schema, penalised):
        assert _generate(engine, params) == _generate(eager, params)
    assert set(engine.runner._graphs) == built and engine.runner.replays > 0


def test_seeded_sampling_gives_the_eager_tokens(models):
    """Same seeds, same tokens. The graphs run eager's kernels, up to the rounding of sums over the masked
    key window (about 1e-6 relative): a sample could only flip if its uniform fell that close to a
    boundary. Inductor's fused reductions round differently, so under it seeded runs may part ways."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7 + i) for i in range(2)]
    compiled = _generate(_engine(models, "demo-llama", "eagle3"), params)
    assert compiled == _generate(_engine(models, "demo-llama", "eagle3", graph_mode="eager"), params)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"graph_mode": "fast"}, "'fast'"),
        ({"graph_mode": "compiled", "capture_sizes": (0, 2)}, "capture size 0"),
        ({"graph_mode": "compiled", "capture_sizes": (4,)}, "capture size 4"),
    ],
)
def test_bad_graph_settings_are_refused(models, settings, message):
    with pytest.raises(ValueError, match=message):
        _engine(models, "demo-llama", None, **settings)


def test_auto_is_eager_on_the_cpu(models):
    assert _engine(models, "demo-llama", None, graph_mode="auto").runner is None


# ---------------------------------------------------------------- GPU: CUDA graphs
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_PAIRS = [("demo-llama", "eagle3", torch.float32), ("demo-deepseek", "mtp", torch.bfloat16)]


def _cuda_llm(name: str, draft: str | None, dtype: torch.dtype, mode: str, **settings):
    from tandem import LLM

    return LLM(
        name, draft, device="cuda", dtype=dtype, max_num_seqs=2, graph_mode=mode, capture_sizes=(1, 2), **settings
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, draft, dtype", GPU_PAIRS)
def test_cuda_graphs_replay_the_eager_tokens_across_buckets(name, draft, dtype):
    """Captured at start and replayed through a bucket change (two rows, then one), a speculative run gives the plain
    captured run's greedy tokens, and in float32 the eager run's; the run builds no graph (adaptive speculation's
    shorter proposals run the longest chain)."""
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=32)]
    outputs = {}
    for mode, drafted in (("eager", draft), ("compiled", draft), ("compiled", None)):
        engine = _cuda_llm(name, drafted, dtype, mode).engine
        captured = None if engine.runner is None else set(engine.runner._graphs)
        outputs[mode, drafted] = _generate(engine, params)
        if mode == "compiled":
            assert {key[1] for key in captured} == {1, 2} and engine.runner.graph_bytes > 0
            assert set(engine.runner._graphs) == captured
            assert (engine.lookahead_steps > 0) == (drafted is not None)  # CUDA's default: lookahead proposals
    assert outputs["compiled", draft] == outputs["compiled", None]
    if dtype == torch.float32:
        assert outputs["compiled", draft] == outputs["eager", draft]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, draft, dtype", GPU_PAIRS)
def test_a_replayed_step_reads_the_device_once(name, draft, dtype):
    from tests.engine.test_device_reads import _device_reads

    engine = _cuda_llm(name, draft, dtype, "compiled", adaptive=False).engine  # at a fixed k: every step drafts
    for example in EXAMPLES:
        engine.add_request(
            chat_prompt_ids(engine.tokenizer, example.messages, example.tools), SamplingParams(max_tokens=64)
        )
    for _ in range(3):  # prefill, then the first speculative steps
        engine.step()
    for _ in range(3):
        reads = _device_reads(engine)
        assert len(reads) == 1, "\n".join(reads)
    assert engine.runner.replays > 0 and engine.lookahead_steps >= 3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, draft, dtype", GPU_PAIRS)
def test_cuda_lookahead_proposes_what_a_proposal_after_the_commit_does(name, draft, dtype):
    """Through captured graphs, a lookahead proposal (CUDA's default) and a proposal after the commit: the same steps,
    accepted drafts and tokens at a fixed k, for a JSON-schema row (acceptance under masks on the device) beside a
    seeded sampled one."""
    schema = TASK_FAMILIES[EXAMPLES[0].family].schema
    params = [SamplingParams(max_tokens=40, json_schema=schema), SamplingParams(max_tokens=40, temperature=0.8, seed=3)]
    outcomes = {}
    for lookahead in (True, False):
        engine = _cuda_llm(name, draft, dtype, "compiled", adaptive=False, lookahead=lookahead).engine
        outcomes[lookahead] = _outcomes(engine, params)
        assert (engine.lookahead_steps > 0) == lookahead
    assert outcomes[True] == outcomes[False]


@pytest.mark.gpu
@needs_cuda
def test_graphs_over_inductors_kernels_replay_the_eager_tokens(monkeypatch):
    """With ``$TANDEM_CUDA_COMPILE_BACKEND=inductor`` each captured body is compiled first (whole: a graph break
    fails), the paged-attention kernel inside it as its custom op: demo-llama + EAGLE-3 in float32 gives the eager
    run's greedy tokens, and a step still reads the device once."""
    from tandem import LLM
    from tests.engine.test_device_reads import _device_reads

    monkeypatch.setenv("TANDEM_CUDA_COMPILE_BACKEND", "inductor")
    outputs = {}
    for mode in ("eager", "compiled"):
        settings = dict(device="cuda", dtype=torch.float32, max_num_seqs=1, graph_mode=mode, adaptive=False)
        engine = LLM("demo-llama", "eagle3", **settings).engine  # at a fixed k: every step drafts
        outputs[mode] = _generate(engine, [SamplingParams(max_tokens=24)])
    assert engine.runner.backend == "inductor" and engine.runner.replays > 0
    assert outputs["compiled"] == outputs["eager"]
    engine.add_request(chat_prompt_ids(engine.tokenizer, EXAMPLES[0].messages, EXAMPLES[0].tools), SamplingParams())
    for _ in range(3):  # prefill, then the first speculative steps
        engine.step()
    reads = _device_reads(engine)
    assert len(reads) == 1, "\n".join(reads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name, dtype", [("demo-llama", torch.float32), ("demo-deepseek", torch.bfloat16)])
def test_async_scheduling_through_cuda_graphs_gives_the_synchronous_tokens(name, dtype):
    """Plain decoding through captured graphs, each step launched before the last one's tokens are read (its input
    ids copied on the device from the sampled ones; a JSON-schema row sampled under the mask its commit left), across
    a bucket change: the synchronous run's tokens. The default (None) is async for a plain engine in graph mode."""
    schema = TASK_FAMILIES[EXAMPLES[0].family].schema
    params = [SamplingParams(max_tokens=48, json_schema=schema), SamplingParams(max_tokens=40, temperature=0.8, seed=1)]
    outputs, overlapped = {}, 0
    for overlap in (False, None):
        engine = _cuda_llm(name, None, dtype, "compiled", async_scheduling=overlap).engine
        outputs[overlap] = _generate(engine, params)
        overlapped = engine.overlapped_steps
    assert outputs[None] == outputs[False] and overlapped > 20
