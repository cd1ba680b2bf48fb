"""Grammar-forced drafting: forced tokens are drafted where the grammar allows nothing else (beyond k too),
accepted whenever reached, and change no output: greedy speculative equals plain greedy token for token, and
sampled tokens keep the target's distribution."""

import numpy as np
import pytest
import torch

from tandem.core.bitmask import pack_bitmask, unpack_bitmask
from tandem.decoding import SamplingTensors, accept
from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine.adaptive import CostModel, forced_extension
from tandem.engine.batching import forced_draft_probs
from tandem.engine.mask_pipeline import MaskPipeline
from tandem.grammars.backends import BACKENDS
from tandem.grammars.masks import MaskWalk, SpeculativeMasker, single_token
from tandem.grammars.spec import GrammarSpec
from tandem.grammars.tokenizer import GrammarTokenizer
from tandem.llm import LLM
from tests.decoding.reference import assert_distributed_as, reference_probs

EXAMPLES = generate_examples(3, seed=11, split="heldout")
PAIRS = [("demo-llama", "eagle3"), ("demo-deepseek", "mtp"), ("demo-llama", "ngram")]
K = 4


@pytest.fixture(scope="module")
def llms():
    cache: dict[tuple[str, str | None], LLM] = {}

    def get(model: str, draft: str | None) -> LLM:
        if (model, draft) not in cache:
            cache[model, draft] = LLM(model, draft, num_speculative_tokens=K, dtype=torch.float32, max_num_seqs=4)
        return cache[model, draft]

    return get


def set_forced(monkeypatch, llm: LLM, on: bool) -> None:
    monkeypatch.setattr(llm.engine, "forced_drafts", on and llm.engine.draft is not None)
    monkeypatch.setattr(llm.engine.step_masks, "detect_forced", on)


def generate(llm: LLM, max_tokens: int = 48) -> list:
    """Greedy schema answers for EXAMPLES, one batch."""
    engine = llm.engine
    ids = [
        engine.add_request(
            llm.chat_prompt(e.messages, e.tools),
            SamplingParams(max_tokens=max_tokens, json_schema=TASK_FAMILIES[e.family].schema),
        )
        for e in EXAMPLES
    ]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def forced_walk(masker: SpeculativeMasker, capacity: int) -> MaskWalk:
    """A forced-detecting walk of the masker's one row "r" over up to ``capacity`` drafts."""
    return MaskWalk(
        masker,
        ["r"],
        capacity,
        torch.zeros(1, capacity + 1, masker.width, dtype=torch.int32),
        torch.zeros(1, capacity + 1, dtype=torch.bool),
        detect_forced=True,
    )


def test_single_token_reads_one_bit_anywhere_in_the_row():
    for token in (0, 31, 32, 63, 100):
        row = torch.zeros(4, dtype=torch.int32)
        row[token // 32] = pack_bitmask(torch.arange(32) == token % 32)
        assert single_token(row) == token
        row[(token // 32 + 1) % 4] |= 1
        assert single_token(row) == -1
    assert single_token(torch.zeros(4, dtype=torch.int32)) == -1
    assert single_token(torch.tensor([3, 0], dtype=torch.int32)) == -1


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_walk_flags_exactly_the_positions_with_one_allowed_token(backend, tokenizer):
    grammar_tokenizer = GrammarTokenizer(tokenizer, len(tokenizer))
    schema = TASK_FAMILIES["weather"].schema
    new_matcher = BACKENDS[backend].compile(GrammarSpec.json_schema(schema, whitespace="default"), grammar_tokenizer)
    text = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius", "days": 3}}'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    masker = SpeculativeMasker(len(tokenizer))
    masker.add_row("r", new_matcher())
    capacity = len(tokens)
    walk = forced_walk(masker, capacity)
    for token in tokens:
        walk.advance([token])
    walk.finish()
    counts = unpack_bitmask(walk.bitmask[0], len(tokenizer)).sum(-1).tolist()
    assert walk.forced[0] == [
        int(unpack_bitmask(walk.bitmask[0, i], len(tokenizer)).nonzero()) if n == 1 else -1
        for i, n in enumerate(counts)
    ]
    assert walk.path(0) == tokens
    if backend == "llguidance":  # it forces the canonical tokens of keys and constants
        assert sum(f >= 0 for f in walk.forced[0]) >= len(tokens) // 2


def test_a_walk_goes_on_with_forced_tokens_and_replaces_a_proposal_that_disagrees(tokenizer):
    grammar_tokenizer = GrammarTokenizer(tokenizer, len(tokenizer))
    new_matcher = BACKENDS["llguidance"].compile(GrammarSpec.choice(["alpha beta gamma", "delta"]), grammar_tokenizer)
    expected = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    masker = SpeculativeMasker(len(tokenizer), end_token_ids=[tokenizer.eos_token_id])
    masker.add_row("r", new_matcher())
    capacity = len(expected) + 2
    walk = forced_walk(masker, capacity)
    wrong = tokenizer.encode(" wrong", add_special_tokens=False)[0]
    walk.advance_proposals([[expected[0], wrong, wrong]], [3], [capacity])  # the first token is free: taken
    walk.finish()
    assert walk.path(0) == [*expected, tokenizer.eos_token_id]  # then forced all the way, EOS included
    assert walk.forced[0][0] == -1 and all(f >= 0 for f in walk.forced[0][1 : len(expected) + 1])


def test_the_pipeline_fills_a_step_narrower_than_its_buffers_like_a_direct_fill(tokenizer):
    grammar_tokenizer = GrammarTokenizer(tokenizer, len(tokenizer))
    new_matcher = BACKENDS["llguidance"].compile(GrammarSpec.regex("[a-z]+ [0-9]+"), grammar_tokenizer)
    masker = SpeculativeMasker(len(tokenizer))
    for row in range(2):
        masker.add_row(row, new_matcher())
    pipeline = MaskPipeline(masker, max_batch=4, k=7)
    drafts = torch.tensor([tokenizer.encode("ab 1", add_special_tokens=False)[:2]] * 2)
    bitmask, in_thinking, _ = pipeline.submit([0, 1], drafts).wait()
    expected = torch.zeros(2, 3, masker.width, dtype=torch.int32)
    masker.fill([0, 1], drafts, expected, torch.zeros(2, 3, dtype=torch.bool))
    assert bitmask.shape == (2, 3, masker.width) and torch.equal(bitmask, expected)
    pipeline.close()


def test_a_forced_run_is_verified_when_it_pays_and_always_for_pinned_rows():
    cheap = CostModel([1, 20], [1.0, 1.2])  # a wider verify costs little more
    dear = CostModel([1, 2], [1.0, 2.0])  # every verified token costs a whole step
    probs = [[0.5, 1.0], [0.9]]  # row 0: a model draft then a forced one
    assert forced_extension(probs, [3, 2], cheap, 0.0, [False, False]) == [True, True]
    assert forced_extension([[0.1] * 4, [1.0]], [3, 0], dear, 0.0, [False, False]) == [False, False]
    assert forced_extension([[0.1] * 4, [1.0]], [3, 0], dear, 0.0, [True, False]) == [True, False]


def test_forced_drafts_keep_every_emitted_token_distributed_as_the_target():
    """A forced position (one allowed token) between sampled drafts: it is accepted whenever reached, and the
    tokens around it keep the target's distributions (`accept`'s lossless rule, with the engine's draft probs)."""
    rows, vocab, k, forced = 20_000, 12, 3, 5
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(k + 1, vocab, generator=generator) * 1.5
    allowed = torch.ones(k + 1, vocab, dtype=torch.bool)
    allowed[1] = torch.arange(vocab) == forced
    q = (torch.randn(k, vocab, generator=generator) * 1.5).softmax(-1)
    drafts = torch.multinomial(q, rows, replacement=True, generator=generator).T.contiguous()
    drafts[:, 1] = forced
    draft_probs = forced_draft_probs(q, drafts[0].tolist(), [False, True, False])
    assert torch.equal(draft_probs[1], (torch.arange(vocab) == forced).float())
    result = accept(
        logits.expand(rows, -1, -1),
        drafts,
        draft_probs=draft_probs.expand(rows, -1, -1),
        sampling=SamplingTensors.full(rows, seed=torch.arange(rows) * 7919),
        bitmask=pack_bitmask(allowed).expand(rows, -1, -1).contiguous(),
    )
    reached = result.num_accepted >= 1
    assert reached.sum() > 1000 and bool((result.num_accepted[reached] >= 2).all())
    assert_distributed_as(result.tokens[:, 0], reference_probs(logits[0]), "first token")
    third = result.num_accepted >= 2
    assert_distributed_as(result.tokens[third, 2], reference_probs(logits[2]), "token after the forced one")
    assert np.isclose(float(draft_probs.sum(-1).sum()), k)


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_speculative_greedy_equals_plain_greedy_with_forced_drafts(llms, pair, monkeypatch):
    """Forced drafts inside and beyond k, every one accepted where reached; the output is plain greedy's. Adaptive
    speculation is off: it verifies a forced run only where the measured costs say it pays."""
    model, draft = pair
    llm = llms(model, draft)
    engine = llm.engine
    monkeypatch.setattr(engine.config, "adaptive", False)
    reached, rejected, beyond = 0, 0, 0
    real_accept = engine._accept

    def spy(rows, scores, drafts, bitmask, in_thinking, settings, greedy=None, ahead=None):
        nonlocal reached, rejected, beyond
        result = real_accept(rows, scores, drafts, bitmask, in_thinking, settings, greedy, ahead)
        for b, (r, n) in enumerate(zip(rows, result.num_accepted.tolist())):
            beyond += len(r.drafts) > K
            for j, certain in enumerate(r.draft_forced):
                single = int(unpack_bitmask(bitmask[b, j], scores.shape[-1]).sum()) == 1
                assert certain == single, f"position {j}: forced flag {certain}, one allowed token {single}"
                if certain and n >= j:
                    reached += 1
                    rejected += n == j
        return result

    set_forced(monkeypatch, llm, True)
    monkeypatch.setattr(engine, "_accept", spy)
    speculative = generate(llm)
    plain = generate(llms(model, None))
    assert [o.token_ids for o in speculative] == [o.token_ids for o in plain]
    assert reached > 0 and rejected == 0, f"{rejected} of {reached} reached forced drafts rejected"
    if model == "demo-llama":  # llguidance forces whole keys: runs go past k
        assert beyond > 0


@pytest.mark.parametrize("pair", PAIRS[:2], ids=["+".join(p) for p in PAIRS[:2]])
def test_forced_drafting_raises_the_accepted_tokens_per_step_under_a_schema(llms, pair, monkeypatch):
    """At a fixed k (adaptive speculation verifies a forced run only where the measured costs say it pays)."""
    llm = llms(*pair)
    monkeypatch.setattr(llm.engine.config, "adaptive", False)
    lengths = {}
    for on in (False, True):
        set_forced(monkeypatch, llm, on)
        outputs = generate(llm)
        steps = sum(o.stats.steps for o in outputs)
        lengths[on] = (sum(o.stats.accepted for o in outputs) + steps) / steps
    assert lengths[True] > lengths[False], lengths
