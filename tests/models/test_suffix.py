"""Suffix draft: repeated spans, longest match, most frequent continuation, confidence cutoff,
slot reuse, incremental = from-scratch, the global store, and exactness on the demo model."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from tandem.decoding.params import SamplingParams
from tandem.models import DraftInput, ForwardBatch
from tandem.models.drafts.suffix import Node, SuffixDraft, SuffixTrie


def t(values):
    return torch.tensor(values, dtype=torch.int64)


def proposal(draft: SuffixDraft, history, k: int, slot: int = 0) -> list[int]:
    tokens, _ = draft.propose_row(slot, t(history), k)
    return tokens + [-1] * (k - len(tokens))


def test_a_repeated_span_proposes_its_continuation_cycling_past_the_history_end():
    draft = SuffixDraft()
    assert proposal(draft, [1, 2, 3, 4, 5, 1, 2], 3) == [3, 4, 5]
    # the walk reaches the sequence end after [3, 4, 5, 1, 2]: it re-anchors and goes round again
    assert proposal(SuffixDraft(), [1, 2, 3, 4, 5, 1, 2], 8) == [3, 4, 5, 1, 2, 3, 4, 5]
    assert proposal(SuffixDraft(), [1, 2, 3, 4], 3) == [-1, -1, -1]  # nothing repeats: nothing proposed


def test_the_longest_match_wins_over_shorter_ones():
    # [2, 3] is followed by 9 twice, but the longer suffix [1, 2, 3] was followed by 4
    history = [1, 2, 3, 4, 7, 2, 3, 9, 8, 2, 3, 9, 6, 1, 2, 3]
    assert proposal(SuffixDraft(), history, 1) == [4]
    assert proposal(SuffixDraft(max_depth=2), history, 1) == [9]  # depth 2 only sees [2, 3]


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_most_recent():
    history = [5, 1, 5, 2, 5, 1, 5, 3, 5]  # 5 -> 1 twice, 2 once, 3 once
    assert proposal(SuffixDraft(max_depth=1), history, 1) == [1]
    history = [5, 1, 5, 2, 5]  # 5 -> 1 once, 2 once: the most recent
    assert proposal(SuffixDraft(max_depth=1), history, 1) == [2]


def test_low_confidence_stops_the_proposal_and_pads_with_minus_one():
    # the longest match [0, 7, 8] is followed by 9 three times; [0, 7, 8, 9] by 2, 3, 4 once each
    history = [7, 8, 9, 1, 0, 7, 8, 9, 2, 0, 7, 8, 9, 3, 0, 7, 8, 9, 4, 0, 7, 8]
    tokens, confidence = SuffixDraft(min_token_prob=0.4).propose_row(0, t(history), 4)
    assert tokens == [9] and confidence == 1.0
    tokens, confidence = SuffixDraft(min_token_prob=0.3).propose_row(0, t(history), 4)
    assert tokens == [9, 4, 0, 7] and confidence == pytest.approx(1 / 3)  # ties: the most recent
    # the running product can stop it too
    tokens, _ = SuffixDraft(min_token_prob=0.3, min_confidence=0.5).propose_row(0, t(history), 4)
    assert tokens == [9]


def test_propose_pads_rows_and_keeps_slots_apart():
    draft = SuffixDraft()
    assert draft.new_cache(2, 64) is None and draft.hidden_kind is None and not draft.follows_constraint
    histories = [t([3, 4, 5, 3, 4]), t([7, 8, 9])]
    batch = ForwardBatch.from_rows([[4], [9]], [4, 2], [0, 1])
    out = draft.propose(DraftInput(batch=batch, hidden=None, history=histories), None, 3)
    assert out.probs is None and out.tokens.tolist() == [[5, 3, 4], [-1, -1, -1]]
    assert len(draft.last_confidence) == 2
    with pytest.raises(ValueError, match="history"):
        draft.propose(DraftInput(batch=batch, hidden=None, history=None), None, 3)


def test_slot_reuse_resets_the_slot():
    draft = SuffixDraft()
    assert proposal(draft, [1, 2, 3, 1, 2], 2) == [3, 1]
    # a new request in slot 0: its history does not extend the old one, so [1, 2] -> 3 is forgotten
    assert proposal(draft, [1, 2], 2) == [-1, -1]
    assert proposal(draft, [1, 2, 4, 1], 2) == [2, 4]
    # a row starting at position 0 resets as well, even if its tokens extend the old ones
    state = draft.update(0, t([1, 2, 4, 1, 2]), start=0)
    assert state.trie.root.total == 5 and len(draft.slots) == 1


def counts(node: Node) -> dict:
    return {token: (child.count, child.total, counts(child)) for token, child in node.children.items()}


def test_incremental_updates_equal_a_from_scratch_build():
    rng = random.Random(0)
    history = [rng.randrange(6) for _ in range(300)]
    incremental = SuffixDraft(max_depth=8)
    length = 1
    while length < len(history):
        got = proposal(incremental, history[:length], 4)
        scratch = SuffixDraft(max_depth=8)
        assert got == proposal(scratch, history[:length], 4)
        assert counts(incremental.slots[0].trie.root) == counts(scratch.slots[0].trie.root)
        length += rng.randrange(1, 6)  # commits of 1 .. k + 1 tokens


def test_the_trie_takes_counts_back_exactly():
    trie = SuffixTrie(4)
    trie.extend([trie.root], [1, 2, 3, 1, 2])
    before = counts(trie.root)
    trie.extend([trie.root], [2, 2, 5, 1])
    trie.remove([trie.root], [2, 2, 5, 1])
    assert counts(trie.root) == before


def test_the_global_store_serves_other_requests_and_stays_bounded():
    draft = SuffixDraft(global_tokens=12)
    prompt = [100, 101]
    draft.propose_row(0, t([*prompt, 50]), 2)  # first proposal: prompt + first output token
    draft.propose_row(0, t([*prompt, 50, 51, 52, 53, 54]), 2)
    assert proposal(draft, [400, 50, 51], 3, slot=3) == [-1, -1, -1]  # the store is still empty
    # a new request in the slot retires the old output [50 .. 54] into the global store
    assert proposal(draft, [200, 50, 51], 3) == [52, 53, 54]
    assert draft.global_size == 5
    assert proposal(draft, [400, 50, 51], 3, slot=3) == [52, 53, 54]  # a running row sees the new output
    # another slot sees it too
    assert proposal(draft, [300, 52], 2, slot=1) == [53, 54]
    # more outputs push the oldest out (FIFO) once the store holds more than 12 tokens
    for slot, first in ((2, 60), (2, 70), (2, 80)):
        draft.propose_row(slot, t([first]), 1)
        draft.propose_row(slot, t([first, *range(first + 1, first + 5)]), 1)
    draft.propose_row(2, t([999]), 1)  # retires the last one
    assert draft.global_size <= 12 and len(draft.global_outputs) >= 1
    assert 50 not in draft.global_trie.root.children  # the first output left the store


@pytest.fixture(scope="module")
def demo_llms():
    from tandem.llm import LLM

    kwargs = dict(num_speculative_tokens=4, dtype=torch.float32, max_num_seqs=4)
    return LLM("demo-llama", None, **kwargs), LLM("demo-llama", "suffix", **kwargs)


def generate(llm, examples, schema: bool):
    from tandem.demo.corpus import TASK_FAMILIES

    engine = llm.engine
    ids = [
        engine.add_request(
            llm.chat_prompt(ex.messages, ex.tools),
            SamplingParams(max_tokens=40, json_schema=TASK_FAMILIES[ex.family].schema if schema else None),
        )
        for ex in examples
    ]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


@pytest.mark.parametrize("schema", [False, True], ids=["free", "schema"])
def test_speculative_greedy_with_the_suffix_draft_equals_plain_greedy(demo_llms, schema):
    from tandem.demo.corpus import TASK_FAMILIES, generate_examples
    from tandem.models.drafts.suffix import SuffixDraft as Loaded

    examples = generate_examples(3, seed=11, split="heldout")
    plain_llm, suffix_llm = demo_llms
    assert isinstance(suffix_llm.engine.draft, Loaded)
    plain = generate(plain_llm, examples, schema)
    speculative = generate(suffix_llm, examples, schema)
    assert [o.token_ids for o in speculative] == [o.token_ids for o in plain]
    assert sum(o.stats.drafted for o in speculative) > 0
    if schema:
        for example, output in zip(examples, speculative):
            if output.finish_reason == "stop":
                jsonschema.validate(json.loads(output.text), TASK_FAMILIES[example.family].schema)
