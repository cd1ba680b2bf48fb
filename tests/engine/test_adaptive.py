"""Adaptive speculation (engine/adaptive.py): the policy's choice, exactness, and the fall to plain steps."""

import itertools
import time

import pytest
import torch

from tandem.decoding.params import SamplingParams
from tandem.demo.corpus import TASK_FAMILIES, generate_examples
from tandem.engine import Engine, EngineConfig
from tandem.engine import engine as engine_module
from tandem.engine.adaptive import (
    STALE,
    AdaptivePolicy,
    CostModel,
    choose_drafts,
    expected_tokens,
    forced_extension,
)
from tandem.llm import LLM, chat_prompt_ids
from tandem.models.base import Draft, DraftProposal

# ------------------------------------------------------------------ the policy


def objective(counts, rates, cost, draft_cost, overhead=0.0):
    """Expected tokens per second of a step where row b verifies counts[b] drafts; the draft runs as many passes
    as the most any row drafts (with none, `draft_cost(0)`); `overhead`: the step's other seconds."""
    tokens = sum(expected_tokens(a, j) for a, j in zip(rates, counts))
    return tokens / (cost(sum(j + 1 for j in counts)) + draft_cost(max(counts)) + overhead)


def per_pass(first: float, each: float, cache: float = 0.0):
    """A draft's seconds by the most drafts a row verifies: the first pass, then each one after it; with none,
    `cache` (0 for a draft skipped when no row drafts; more for one that runs its first pass anyway)."""
    return lambda passes: first + each * (passes - 1) if passes else cache


@pytest.mark.parametrize("runs_anyway", [False, True], ids=["skipped", "runs-anyway"])
@pytest.mark.parametrize(
    "rates",
    [[0.0, 0.0], [0.9, 0.1], [0.5, 0.5, 0.7], [0.99, 0.3, 0.0], [0.6]],
)
@pytest.mark.parametrize(
    "cost",
    [
        CostModel([1, 5, 20], [1.0, 1.2, 3.0]),  # verify almost free
        CostModel([1, 5, 20], [1.0, 4.0, 16.0]),  # cost grows with every token
        CostModel([1, 4, 8], [1.0, 1.5, 5.0]),
    ],
)
@pytest.mark.parametrize("overhead", [0.0, 0.7])
def test_choice_maximises_expected_tokens_per_second(rates, cost, runs_anyway, overhead):
    k_max = 3
    for first, each in ((0.0, 0.0), (0.3, 0.0), (0.2, 0.15), (0.05, 0.6)):
        draft_cost = per_pass(first, each, first if runs_anyway else 0.0)  # with no row drafting
        chosen = choose_drafts(rates, k_max, cost, draft_cost, overhead=overhead)
        value = objective(chosen, rates, cost, draft_cost, overhead)
        options = itertools.product(range(k_max + 1), repeat=len(rates))
        assert value == pytest.approx(max(objective(c, rates, cost, draft_cost, overhead) for c in options))
        assert value >= objective([0] * len(rates), rates, cost, draft_cost, overhead) - 1e-12


def test_a_steps_host_overhead_makes_drafting_pay():
    """Every step pays the host's per-step work alike: where it is a large share of a step (a GPU in graph mode),
    a draft that does not pay against the forward alone pays against the whole step."""
    flat = CostModel([1, 5], [1.0, 1.0])
    draft = per_pass(0.5, 0.5)
    assert choose_drafts([0.5], 4, flat, draft) == [0]  # 1 / 1.0 against 1.5 / 1.5
    assert choose_drafts([0.5], 4, flat, draft, overhead=1.0) == [1]  # 1 / 2.0 against 1.5 / 2.5
    probs, runs = [[0.5]], [2]  # a forced run of 2 after one draft: reached with probability 0.5
    dear = CostModel([2, 4], [1.0, 2.0])
    assert forced_extension(probs, runs, dear, 0.0, [False]) == [False]  # 1.5 / 1.0 against 2.5 / 2.0
    assert forced_extension(probs, runs, dear, 0.0, [False], overhead=2.0) == [True]  # 1.5 / 3.0 against 2.5 / 4.0


def test_no_acceptance_gives_no_drafts_and_near_certain_acceptance_gives_k_max():
    cheap = CostModel([1, 5, 40], [1.0, 1.05, 1.4])
    assert choose_drafts([0.0, 0.0, 0.0], 4, cheap, per_pass(0.1, 0.0)) == [0, 0, 0]
    assert choose_drafts([0.0, 0.0], 4, cheap, per_pass(0.1, 0.0, cache=0.1)) == [0, 0]
    assert choose_drafts([0.98, 0.99], 4, cheap, per_pass(0.05, 0.0)) == [4, 4]


def test_costly_draft_passes_shorten_every_row_together():
    """When each chained pass costs much, a row drafting further makes every row's proposal longer: the choice
    caps the most any row drafts instead of spreading drafts to each row's own best."""
    cheap = CostModel([1, 40], [1.0, 1.4])
    assert choose_drafts([0.9, 0.9], 4, cheap, per_pass(0.1, 0.01)) == [4, 4]
    assert choose_drafts([0.9, 0.9], 4, cheap, per_pass(0.1, 0.5)) == [1, 1]
    assert choose_drafts([0.9, 0.9], 4, cheap, per_pass(0.1, 0.5), pinned=[True, False]) == [4, 4]


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx((1 - 0.5**4) / (1 - 0.5))


def test_policy_learns_from_commits_and_probes():
    policy = AdaptivePolicy(4, CostModel([1, 5], [1.0, 2.0]), draft_always=False, probe_every=4)
    assert policy.choose(["r"])[0] > 0  # a new row drafts on the prior when verify is cheap
    for _ in range(30):
        policy.observe("r", 4, 0)  # the first draft is always rejected
    assert policy.rate("r") < 0.1
    choices = []
    for _ in range(8):
        (j,) = policy.choose(["r"])
        choices.append(j)
        policy.observe("r", j, 0)
    assert choices.count(0) >= 5 and 1 in choices  # mostly plain, probing now and then
    policy.forget("r")
    assert policy.rate("r") == policy.prior_rate() < 0.1  # a new row starts from the overall rate


def test_a_draft_without_a_proposal_where_one_was_asked_counts_as_rejected():
    """An n-gram draft's proposals may be good when it has one (3 of 4 accepted here), but asked each step it
    mostly has none: the rate is what asking yields, so it falls below what its proposals alone would give,
    and where a verified token costs half a step the row stops asking (but to probe)."""
    cost = CostModel([1, 5], [1.0, 3.0])
    asking, proposals = (AdaptivePolicy(4, cost, draft_always=False, prior=0.9) for _ in range(2))
    for step in range(40):
        hit = step % 5 == 0
        asking.observe("r", 4 if hit else 0, 3 if hit else 0, 4)
        proposals.observe("r", 4 if hit else 0, 3 if hit else 0)  # the misses unseen: idle steps
    assert asking.rate("r") < 0.45 < 0.65 < proposals.rate("r")
    assert asking.choose(["r"]) == [0] and proposals.choose(["r"])[0] > 0
    assert asking.rows["r"].idle == 0 and proposals.rows["r"].idle == 4


# ------------------------------------------------------------------ the engine


class WrongDraft(Draft):
    """A draft that always proposes a token the target never emits here."""

    hidden_kind = None
    follows_constraint = False

    def __init__(self, token: int) -> None:
        self.token = token

    def new_cache(self, num_slots, max_len):
        return None

    def propose(self, inp, cache, num_tokens):
        rows = len(inp.batch.spans.slots)
        return DraftProposal(torch.full((rows, num_tokens), self.token, dtype=torch.int64), None)


def generate(engine: Engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i).token_ids for i in ids]


def test_drafts_that_never_match_fall_to_plain_steps(llama_target, tokenizer, monkeypatch):
    prompts = [tokenizer.encode(p) for p in ("The cat sat on the", "Once upon a time", "1 2 3")]
    params = SamplingParams(max_tokens=40)
    config = EngineConfig(max_num_seqs=4, max_model_len=96)
    plain = generate(Engine(llama_target, None, tokenizer, config), prompts, params)
    wrong = next(t for t in range(len(tokenizer)) if all(t not in out for out in plain))

    step_ks = []
    run_step = engine_module.Engine._run_step
    monkeypatch.setattr(
        engine_module.Engine,
        "_run_step",
        lambda self, rows, batch, k, chunked: step_ks.append(k) or run_step(self, rows, batch, k, chunked),
    )
    engine = Engine(llama_target, WrongDraft(wrong), tokenizer, config)
    assert engine.policy is not None and engine.calibration_s < 5.0
    assert generate(engine, prompts, params) == plain
    plain_steps = step_ks.count(0)
    assert plain_steps >= len(step_ks) // 2, step_ks
    assert 0 in step_ks[len(step_ks) // 2 :] and step_ks[-10:].count(0) >= 5, step_ks
    assert engine.policy.chosen[0] > 0


def test_the_policy_times_the_rest_of_a_step(llama_target, tokenizer, llama_drafts):
    """The caller's time between steps is part of every step's period: it enters the policy's overhead (the step's
    period less its verify's and proposal's timings), so it is at least the pause between steps, and the cost
    points hold only the steps' own times."""
    pause = 0.02
    engine = Engine(llama_target, llama_drafts["ngram"], tokenizer, EngineConfig(max_num_seqs=2))
    engine.add_request(tokenizer.encode("1 2 3 1 2 3 1 2"), SamplingParams(max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        time.sleep(pause)
    assert len(engine.policy.overheads) >= 5
    assert pause <= engine.policy.overhead() < 10 * pause
    assert max(engine.policy.cost.seconds) < pause
    # An engine left idle after its last row finished: the wait before its next request's steps is no step's.
    idle = 0.3
    time.sleep(idle)
    engine.add_request(tokenizer.encode("1 2 3"), SamplingParams(max_tokens=1))
    engine.step()
    assert max(engine.policy.overheads) < idle


def test_adaptive_off_keeps_fixed_k(llama_target, tokenizer, llama_drafts):
    engine = Engine(llama_target, llama_drafts["ngram"], tokenizer, EngineConfig(max_num_seqs=2, adaptive=False))
    assert engine.policy is None and engine._step_k([]) == engine.k


PAIRS = [("demo-llama", "eagle3"), ("demo-deepseek", "mtp")]


@pytest.fixture(scope="module")
def demo_llms():
    return {pair: LLM(*pair, num_speculative_tokens=4, dtype=torch.float32, max_num_seqs=4) for pair in PAIRS}


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_adaptive_greedy_equals_plain_greedy_token_for_token(demo_llms, pair, monkeypatch):
    llm = demo_llms[pair]
    prompts = [llm.chat_prompt(e.messages, e.tools) for e in generate_examples(3, seed=5, split="heldout")]
    params = SamplingParams(max_tokens=32)
    assert llm.engine.policy is not None
    speculative = generate(llm.engine, prompts, params)
    drafted = llm.engine.policy.chosen.copy()
    monkeypatch.setattr(llm.engine, "draft", None)
    monkeypatch.setattr(llm.engine, "k", 0)
    plain = generate(llm.engine, prompts, params)
    assert speculative == plain
    assert sum(n for k, n in drafted.items() if k > 0) > 0  # the trained draft was used


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_the_draft_proposes_only_as_far_as_the_row_that_drafts_most(demo_llms, pair, monkeypatch):
    """Each proposal runs as many chained passes as the most drafts any row chose, with and without a schema; the
    tokens stay plain greedy's. Where no row chose any, the draft does not run: the next proposal's first pass
    takes the tokens it missed, with their hidden states, and proposes what a draft that ran at every step would
    have (the same tokens, proposal by proposal)."""
    llm = demo_llms[pair]
    examples = generate_examples(2, seed=5, split="heldout")
    prompts = [llm.chat_prompt(e.messages, e.tools) for e in examples]
    schemas = [None, *(TASK_FAMILIES[e.family].schema for e in examples)]
    cycle = [[0, 2], [4, 1], [0, 0], [0, 0], [3, 0], [1, 1]]
    propose = llm.engine.draft.propose
    monkeypatch.setattr(llm.engine.blocks, "enable_prefix_caching", False)  # both runs prefill the same way

    def run(deferred: bool) -> tuple[list, list, list]:
        choices, chosen, proposals = itertools.cycle(cycle), [], []
        monkeypatch.setattr(llm.engine, "_draft_skippable", deferred)
        monkeypatch.setattr(llm.engine.policy, "draft_always", not deferred)
        monkeypatch.setattr(
            llm.engine.policy, "choose", lambda ids, pinned=None: chosen.append(next(choices)[: len(ids)]) or chosen[-1]
        )
        # Forced runs verified always: the policy's choice follows measured times, which differ between the runs.
        monkeypatch.setattr(llm.engine.policy, "forced_runs", lambda ids, forced, runs, *_: [n > 0 for n in runs])

        def recorded(inp, cache, n):
            proposal = propose(inp, cache, n)
            proposals.append((chosen[-1], n, proposal.tokens.tolist()))
            return proposal

        monkeypatch.setattr(llm.engine.draft, "propose", recorded)
        outputs = [generate(llm.engine, prompts, SamplingParams(max_tokens=32, json_schema=s)) for s in schemas]
        return outputs, chosen, proposals

    speculative, chosen, proposals = run(deferred=True)
    passes = [n for _, n, _ in proposals]
    assert passes == [max(c) for c in chosen if any(c)] and {1, 2, 3, 4} <= set(passes)
    always, _, proposals_always = run(deferred=False)
    assert always == speculative
    assert [p for c, _, p in proposals_always if any(c)] == [p for _, _, p in proposals]
    monkeypatch.setattr(llm.engine, "draft", None)
    monkeypatch.setattr(llm.engine, "k", 0)
    assert speculative == [generate(llm.engine, prompts, SamplingParams(max_tokens=32, json_schema=s)) for s in schemas]


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_a_proposal_over_a_prompt_is_not_timed_as_a_proposal(demo_llms, pair, monkeypatch):
    """The proposal after a prefill runs the draft's first pass over the whole prompt (eight prompts of the demo:
    25 ms against 5 for a 4-pass proposal of 8 rows): timed, it would make proposals look dear. Only proposals
    whose first pass takes a step's commits are timed."""
    llm = demo_llms[pair]
    timed = []
    observe = llm.engine.policy.observe_draft_time
    monkeypatch.setattr(llm.engine.policy, "observe_draft_time", lambda s, n: timed.append(n) or observe(s, n))
    prompts = [llm.chat_prompt(e.messages, e.tools) for e in generate_examples(2, seed=7, split="heldout")]
    ids = [llm.engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    llm.engine.step()  # the prefill, and its proposal over the prompts
    assert timed == []
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert timed  # the proposals after it
    for i in ids:
        llm.engine.pop_finished(i)


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_a_copying_draft_proposes_for_the_rows_that_draft_alone(models, kind, monkeypatch):
    """n-gram and suffix drafts read only each row's own history: a step proposes for the rows the policy gave
    drafts and for no other (at a large batch most rows may draft nothing), with and without a schema, and the
    tokens stay plain greedy's."""
    target, draft, tokenizer = models("demo-llama", kind)
    examples = generate_examples(3, seed=7, split="heldout")
    prompts = [chat_prompt_ids(tokenizer, e.messages, e.tools) for e in examples]
    schemas = [None, TASK_FAMILIES[examples[0].family].schema]
    config = EngineConfig(max_num_seqs=3, enable_prefix_caching=False)
    engine = Engine(target, draft, tokenizer, config)
    choices, proposals = itertools.cycle([[0, 2, 1], [3, 0, 0], [0, 0, 0], [1, 1, 4], [0, 4, 0]]), []
    chosen = []
    monkeypatch.setattr(
        engine.policy, "choose", lambda ids, pinned=None: chosen.append(next(choices)[: len(ids)]) or chosen[-1]
    )
    propose = draft.propose

    def recorded(inp, cache, n):
        proposals.append((chosen[-1], list(inp.batch.spans.slots)))
        return propose(inp, cache, n)

    monkeypatch.setattr(draft, "propose", recorded)
    speculative = [generate(engine, prompts, SamplingParams(max_tokens=32, json_schema=s)) for s in schemas]
    assert proposals and all(len(slots) <= sum(c > 0 for c in choice) for choice, slots in proposals)
    assert any(len(slots) < len(choice) for choice, slots in proposals)
    plain_engine = Engine(target, None, tokenizer, config)
    assert speculative == [
        generate(plain_engine, prompts, SamplingParams(max_tokens=32, json_schema=s)) for s in schemas
    ]


@pytest.mark.parametrize("pair", PAIRS[:1], ids=["+".join(p) for p in PAIRS[:1]])
def test_seeded_sampling_runs_with_adaptive_speculation(demo_llms, pair):
    """Sampled tokens stay distributed as plain sampling (every k is exact), but a different k moves
    where the draws happen, so the same seed need not give the same tokens with adaptive on and off:
    check that it runs and stays in the vocabulary."""
    llm = demo_llms[pair]
    prompts = [llm.chat_prompt(e.messages, e.tools) for e in generate_examples(2, seed=6, split="heldout")]
    out = generate(llm.engine, prompts, SamplingParams(max_tokens=24, temperature=0.8, seed=3))
    assert all(out) and all(0 <= t < len(llm.tokenizer) for tokens in out for t in tokens)


def test_a_wider_verify_never_costs_less_even_when_measured_so():
    """Noise can measure a wider step as cheaper; the model must not then see drafts as free."""
    cost = CostModel([1, 4, 8], [1.0, 0.5, 2.0])
    assert cost(1) == cost(4) == 0.75 and cost(1) <= cost(2) <= cost(4) <= cost(6) <= cost(8)  # pooled
    for _ in range(2):  # a new point enters with its second timing
        cost.observe(6, 0.1)
    assert 6 in cost.tokens
    assert [cost(t) for t in (4, 6, 8)] == sorted(cost(t) for t in (4, 6, 8)) and cost(6) >= cost(4)
    assert choose_drafts([0.01, 0.01], 4, CostModel([2, 6], [1.0, 0.9]), per_pass(0.05, 0.0)) == [0, 0]


def test_a_size_timed_once_does_not_lift_the_sizes_above_it():
    """One slow timing at a size the policy seldom picks (a stall, another process) must not make every wider
    step look dear: the fit weighs each point by its timings, so the well-timed wider point holds."""
    cost = CostModel([1, 4, 5], [1.0, 3.0, 1.2])
    for _ in range(30):
        cost.observe(1, 1.0)
        cost.observe(5, 1.2)
    assert cost(5) == pytest.approx((3.0 + 31 * 1.2) / 32) and cost(4) == cost(5) < 1.3
    assert choose_drafts([0.8], 4, cost, per_pass(0.1, 0.1)) == [4]


def test_a_point_untimed_for_long_leaves_the_model():
    """The policy times only what it picks: a point that read too dear would never be timed again. Untimed for
    STALE of the model's timings it leaves, and its size is read from the neighbours; its next timing enters at
    once (it is warm)."""
    cost = CostModel([1, 3, 5], [1.0, 9.0, 1.2])
    for _ in range(STALE):
        cost.observe(5, 1.2)
    assert cost.tokens == [1, 3, 5]
    cost.observe(5, 1.2)
    assert cost.tokens == [5] and cost(3) == pytest.approx(1.2 * 3 / 5) and cost(1) < 1.0
    cost.observe(1, 1.0)
    assert cost.tokens == [1, 5] and cost(1) == 1.0


def test_sizes_outside_the_points_follow_the_measured_growth():
    """Below the first point a cost follows the first segment (a proposal of fewer passes than any timed yet: the
    first pass, then each chained one), never under the cost in proportion to the size, the rule with one point;
    past the last it grows at least at the fit's mean slope, so a flat last segment does not make wide steps free."""
    passes = CostModel([3, 4], [1.6, 2.0])
    assert passes(1) == pytest.approx(0.8) and passes(3) == pytest.approx(1.6)
    assert CostModel([3, 4], [0.3, 3.0])(1) == pytest.approx(0.1) and CostModel([3], [3.0])(1) == pytest.approx(1.0)
    cost = CostModel([1, 5, 15], [1.0, 2.0, 2.0])
    assert cost(30) == pytest.approx(2.0 + 15 * (1.0 / 14)) and cost(10) == 2.0


def test_a_warm_up_timing_does_not_make_a_shape_look_slow():
    """The first step at a new shape builds its graph or buffers: kept, it would make the policy shun the shape
    and never time it again. It enters no point; the second timing does, and a later stall does not move it. The
    same goes for the draft's timings by passes, which cost nothing until timed (so the policy tries them)."""
    cost = CostModel([1, 5], [1.0, 1.2])
    cost.observe(3, 50.0)
    assert cost.tokens == [1, 5] and cost(3) == pytest.approx(1.1)
    cost.observe(3, 1.05)
    assert cost.tokens == [1, 3, 5] and cost(3) == 1.05
    cost.observe(3, 100.0)  # a stall: the point is a median of its timings
    assert cost.seconds == [1.0, 1.05, 1.2]
    cost.observe(3, 1.1)
    assert cost.seconds[1] == 1.1
    for draft_always in (True, False):
        policy = AdaptivePolicy(4, CostModel([1, 5], [1.0, 1.2]), draft_always=draft_always)
        assert [policy.draft_seconds(j) for j in range(5)] == [0.0] * 5
        for seconds, passes in ((40.0, 4), (30.0, 1), (0.4, 4), (0.3, 1)):
            policy.observe_draft_time(seconds, passes)
        assert policy.draft_cost.tokens == [1, 4] and policy.draft_seconds(4) == 0.4
        assert policy.draft_seconds(1) == 0.3 and policy.draft_seconds(2) == pytest.approx(1 / 3)
        assert policy.draft_seconds(0) == (0.3 if draft_always else 0.0)  # its first pass runs anyway, or nothing


def test_one_timed_proposal_length_does_not_keep_the_policy_from_longer_ones():
    """Timed only at 2 passes (the first proposal chose 2 drafts), a 4-pass proposal read in proportion would cost
    twice as much (the first pass, the dearest, counted once per pass), and a row accepting 80% would stay at 2
    drafts, never timing 4 (the figures of a demo-deepseek + MTP run). Read at the timed length's cost it drafts 4;
    once 4 passes are timed their own cost holds, and a dear 4-pass proposal brings the choice back down."""
    policy = AdaptivePolicy(4, CostModel([1, 3, 5], [6.67, 7.02, 8.38]), draft_always=False)
    for _ in range(2):  # the first timing at a length is a warm-up
        policy.observe_draft_time(2.88, 2)
    assert policy.draft_cost.tokens == [2] and policy.draft_seconds(4) == policy.draft_seconds(3) == 2.88
    assert policy.draft_seconds(1) == pytest.approx(1.44)  # shorter: in proportion
    assert choose_drafts([0.8], 4, policy.cost, policy.draft_seconds) == [4]
    assert choose_drafts([0.8], 4, policy.cost, lambda j: 2.88 * j / 2) == [2]  # the proportional read
    for _ in range(2):
        policy.observe_draft_time(9.0, 4)
    assert policy.draft_seconds(4) == 9.0 and choose_drafts([0.8], 4, policy.cost, policy.draft_seconds) == [2]
