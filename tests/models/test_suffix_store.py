"""The suffix draft's store of finished requests: bounded in tokens and in requests, FIFO eviction that
takes counts back exactly, content matches across requests and slots, the row's own match first; and
on the demo model, a request that repeats an earlier one's output drafts it from the store, greedy
output unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.decoding.params import SamplingParams
from tandem.models.drafts.suffix import SuffixDraft, SuffixStore, SuffixTrie
from tests.models.test_suffix import counts, flat, substring_counts


def t(values):
    return torch.tensor(values, dtype=torch.int64)


def built_from(sequences: list[list[int]], max_depth: int = 32) -> dict:
    trie = SuffixTrie(max_depth)
    for tokens in sequences:
        trie.extend([trie.root], tokens, 0)
    return counts(trie)


def test_the_store_is_bounded_in_tokens_and_evicts_the_oldest_first():
    store = SuffixStore(max_tokens=10)
    store.add([1, 2, 3, 4])
    store.add([5, 6, 7])
    assert store.size == 7 and list(store.sequences) == [[1, 2, 3, 4], [5, 6, 7]]
    store.add([8, 9, 10, 11])  # 11 tokens: the oldest sequence leaves
    assert store.size == 7 and list(store.sequences) == [[5, 6, 7], [8, 9, 10, 11]]
    assert counts(store.trie) == built_from([[5, 6, 7], [8, 9, 10, 11]])  # its counts taken back exactly
    store.add(list(range(100, 125)))  # longer than the store: its last 10 tokens, alone
    assert list(store.sequences) == [list(range(115, 125))] and store.size == 10
    assert counts(store.trie) == built_from([list(range(115, 125))])


def test_after_any_adds_and_evictions_the_store_counts_exactly_what_it_holds():
    rng = random.Random(0)
    store = SuffixStore(max_tokens=50, max_requests=4, max_depth=5)
    for _ in range(40):
        store.add([rng.randrange(4) for _ in range(rng.randrange(1, 30))])  # a small vocabulary: many repeats
        assert store.size == sum(map(len, store.sequences)) <= 50 and len(store.sequences) <= 4
        assert flat(counts(store.trie)) == substring_counts(list(store.sequences), 5)


def test_the_store_is_bounded_in_requests():
    store = SuffixStore(max_tokens=1000, max_requests=2)
    for first in (10, 20, 30):
        store.add([first, first + 1, first + 2])
    assert list(store.sequences) == [[20, 21, 22], [30, 31, 32]] and store.size == 6
    assert counts(store.trie) == built_from([[20, 21, 22], [30, 31, 32]])


def test_overlapping_sequences_count_twice_and_leave_once():
    store = SuffixStore(max_tokens=8, max_depth=4)
    store.add([1, 2, 3, 4])
    store.add([1, 2, 3, 9])
    trie = store.trie
    assert trie.total(trie.match([1, 2, 3])) == 2
    store.add([7])  # 9 tokens: [1, 2, 3, 4] leaves, [1, 2, 3] -> 9 stays
    assert counts(store.trie) == built_from([[1, 2, 3, 9], [7]], max_depth=4)


def test_the_version_changes_with_the_contents():
    store = SuffixStore(max_tokens=4)
    versions = [store.version]
    for tokens in ([1, 2], [3, 4], [5]):
        store.add(tokens)
        versions.append(store.version)
    assert len(set(versions)) == 4
    store.add([])  # nothing to index: nothing changes
    assert store.version == versions[-1]


def test_a_finished_request_serves_other_requests_by_content():
    draft = SuffixDraft(store=SuffixStore(max_tokens=100))
    prompt, output = [100, 101, 102], [50, 51, 52, 53, 54]
    draft.propose_row(0, t([*prompt, 50]), 3)
    running = draft.propose_row(1, t([400, 50, 51]), 3)  # another row, already running
    assert running == ([], 1.0)  # nothing repeats yet
    draft.release(0, [*prompt, *output])  # the engine: the row in slot 0 finished
    assert 0 not in draft.slots and list(draft.store.sequences) == [[*prompt, *output]]
    # the running row and a new row in another slot (another prompt, the same span) draw on it
    assert draft.propose_row(1, t([400, 50, 51]), 3)[0] == [52, 53, 54]
    assert draft.propose_row(2, t([300, 301, 101, 102]), 4)[0] == [50, 51, 52, 53]  # the prompt is stored too
    # without a store the same row finds nothing
    assert SuffixDraft().propose_row(2, t([300, 301, 101, 102]), 4)[0] == []


def test_the_rows_own_match_wins_ties_and_the_store_wins_when_it_scores_higher():
    draft = SuffixDraft(store=SuffixStore(max_tokens=100))
    draft.release(5, [7, 8, 9, 9, 9])
    # the row's own history: 7 8 -> 3 once; the store: 7 8 -> 9 once; equal scores: the row's own
    assert draft.propose_row(0, t([7, 8, 3, 7, 8]), 1)[0] == [3]
    # the row's own: 7 8 -> 3 or 4, half each; the store: 7 8 -> 9 -> 9 -> 9, every step certain
    assert draft.propose_row(1, t([7, 8, 3, 7, 8, 4, 1, 7, 8]), 3)[0] == [9, 9, 9]
    assert SuffixDraft().propose_row(1, t([7, 8, 3, 7, 8, 4, 1, 7, 8]), 3)[0][0] == 4  # its own alone


def test_a_slot_reused_without_release_forgets_its_row_and_stores_nothing():
    draft = SuffixDraft(store=SuffixStore(max_tokens=100))
    draft.propose_row(0, t([1, 2, 3, 1, 2]), 2)
    draft.propose_row(0, t([9, 9]), 2, start=0)  # an aborted row's slot taken by a new request
    assert draft.store.size == 0 and draft.slots[0].trie.root.total == 2


def test_build_makes_a_store_from_the_config():
    from tandem.models.config import SuffixConfig
    from tandem.models.drafts.suffix import build

    assert build(SuffixConfig(), None, dtype=torch.float32, device=torch.device("cpu")).store is None
    draft = build(SuffixConfig(global_tokens=64, max_depth=6), None, dtype=torch.float32, device=torch.device("cpu"))
    assert draft.store.max_tokens == 64 and draft.store.trie.max_depth == 6


@pytest.fixture(scope="module")
def suffix_llm():
    from tandem.llm import LLM

    return LLM("demo-llama", "suffix", num_speculative_tokens=4, dtype=torch.float32, max_num_seqs=2)


def test_a_repeated_request_drafts_from_the_store_with_unchanged_greedy_output(suffix_llm, monkeypatch):
    from tandem.demo.corpus import generate_examples

    monkeypatch.setattr(suffix_llm.engine.config, "adaptive", False)  # every step drafts k: comparable acceptance
    monkeypatch.setattr(suffix_llm.draft, "store", None)
    (example,) = generate_examples(1, seed=5, split="heldout")
    prompt = suffix_llm.chat_prompt(example.messages, example.tools)
    params = SamplingParams(max_tokens=48)

    def accepted_per_step(output) -> float:
        return output.stats.accepted / output.stats.steps

    first, again = (suffix_llm.generate([prompt], params)[0] for _ in range(2))  # no store: the row's own trie
    monkeypatch.setattr(suffix_llm.draft, "store", SuffixStore(max_tokens=4096))
    stored = suffix_llm.generate([prompt], params)[0]  # enters the store as it finishes
    assert list(suffix_llm.draft.store.sequences) == [prompt + stored.token_ids]
    from_store = suffix_llm.generate([prompt], params)[0]
    assert first.token_ids == again.token_ids == stored.token_ids == from_store.token_ids
    assert accepted_per_step(from_store) > accepted_per_step(again), (from_store.stats, again.stats)
    assert from_store.stats.steps < again.stats.steps


def test_the_server_gives_the_suffix_draft_a_store():
    from tandem.serve.server import build_app

    server = build_app("demo-llama", "suffix", max_num_seqs=1, suffix_store_tokens=1000).state.server
    assert (
        server.llm.draft.store.max_tokens == 1000
        and server.llm.draft.store.trie.max_depth == server.llm.draft.max_depth
    )
    assert build_app("demo-llama", "suffix", max_num_seqs=1, suffix_store_tokens=0).state.server.llm.draft.store is None
