"""Suffix draft: repeated spans, longest match, most frequent continuation, confidence cutoff,
slot reuse, incremental = from-scratch, and exactness on the demo model (the store: test_suffix_store.py)."""

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


def counts(trie: SuffixTrie, node: Node | None = None) -> dict:
    """Every string's (count, total, continuations) as nested dicts, lazy nodes' implied ones included."""
    node = trie.root if node is None else node
    return {token: (child.count, trie.total(child), counts(trie, child)) for token, child in trie.children(node)}


def substring_counts(sequences: list[list[int]], max_depth: int) -> dict:
    """The reference: how often each string of 1 .. max_depth + 1 tokens occurs in the sequences."""
    found: dict[tuple, int] = {}
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, min(max_depth + 1, len(seq) - i) + 1):
                found[tuple(seq[i : i + n])] = found.get(tuple(seq[i : i + n]), 0) + 1
    return found


def flat(tree: dict, prefix: tuple = ()) -> dict:
    """`counts` as {string: count}, checking on the way that each total is its children's sum."""
    found = {}
    for token, (count, total, children) in tree.items():
        assert total == sum(c for c, _, _ in children.values()), (prefix + (token,), total, children)
        found[prefix + (token,)] = count
        found |= flat(children, prefix + (token,))
    return found


def test_the_trie_holds_every_strings_count_lazy_nodes_included():
    rng = random.Random(1)
    for vocab, depth in ((3, 4), (6, 8), (50, 32)):
        sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 120))] for _ in range(3)]
        trie = SuffixTrie(depth)
        for seq in sequences:
            trie.extend([trie.root], seq, 0)
        assert flat(counts(trie)) == substring_counts(sequences, depth)
        assert trie.root.total == sum(map(len, sequences))


def test_incremental_updates_equal_a_from_scratch_build():
    rng = random.Random(0)
    history = [rng.randrange(6) for _ in range(300)]
    incremental = SuffixDraft(max_depth=8)
    length = 1
    while length < len(history):
        got = proposal(incremental, history[:length], 4)
        scratch = SuffixDraft(max_depth=8)
        assert got == proposal(scratch, history[:length], 4)
        assert counts(incremental.slots[0].trie) == counts(scratch.slots[0].trie)
        assert flat(counts(scratch.slots[0].trie)) == substring_counts([history[:length]], 8)
        length += rng.randrange(1, 6)  # commits of 1 .. k + 1 tokens


def test_the_trie_takes_counts_back_exactly():
    rng = random.Random(2)
    for vocab in (3, 8):
        trie = SuffixTrie(4)
        kept, removed = [rng.randrange(vocab) for _ in range(60)], [rng.randrange(vocab) for _ in range(40)]
        trie.extend([trie.root], kept, 0)
        before = counts(trie)
        trie.extend([trie.root], removed, 0)
        trie.remove(removed)
        assert counts(trie) == before
        trie.extend([trie.root], removed, 0)
        trie.remove(kept)  # the older first (a store's order): nodes split by the newer one stay right
        assert flat(counts(trie)) == substring_counts([removed], 4)
        trie.remove(removed)
        assert trie.root.children == {} and trie.root.total == 0


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
