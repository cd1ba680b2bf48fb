"""The block pool's accounting (engine/kv_blocks.py) as a state machine: rows are admitted (reusing cached
prefixes), grow, roll back, register their blocks, finish, are aborted or preempted, and cached blocks are
evicted for new ones; reference counts never go negative, no block is held by two rows unless it is cached,
and once every row is gone the pool is whole again."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.kv_blocks import BlockPool, block_keys
from tandem.models.base import BlockTable

BLOCK, SLOTS, BLOCKS, MAX_LEN = 4, 4, 17, 40
# A small alphabet, so prompts share prefixes and cached blocks are reused.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.table = BlockTable(SLOTS, MAX_LEN, BLOCK, BLOCKS)
        self.pool = BlockPool(self.table, domains=2)  # slots 0, 2 and 1, 3 reuse only each other's blocks
        self.rows: dict[int, list[int]] = {}  # slot -> its tokens (the committed ones)

    @rule(tokens=TOKENS, data=st.data())
    def admit(self, tokens, data):
        free = [s for s in range(SLOTS) if s not in self.rows]
        if not free:
            return
        slot = data.draw(st.sampled_from(free))
        reserve = min(len(tokens) + 4, MAX_LEN)
        if not self.pool.can_assign(slot, tokens, reserve):
            return
        expected = self.pool.match(tokens, slot)
        cached = self.pool.assign(slot, tokens)
        assert cached == len(expected) * BLOCK and self.table.rows[slot] == expected
        assert self.table.read_only[slot] == cached
        assert self.pool.grow(slot, reserve)
        self.rows[slot] = list(tokens)

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), new=TOKENS, drafts=st.integers(0, 6))
    def step(self, data, new, drafts):
        """Grow for a verify of `drafts` positions, commit some of them, register, trim to the committed ones."""
        slot = data.draw(st.sampled_from(sorted(self.rows)))
        tokens = self.rows[slot]
        if not self.pool.grow(slot, min(len(tokens) + drafts, MAX_LEN)):
            return
        committed = (tokens + new)[: min(len(tokens) + data.draw(st.integers(0, drafts + 1)), MAX_LEN)]
        self.rows[slot] = committed
        self.pool.register(slot, committed, len(committed) - 1)
        self.pool.trim(slot, len(committed))
        assert len(self.table.rows[slot]) >= self.pool.blocks_for(len(committed) - 1)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def leave(self, data):
        """Finish, abort and preemption all give every block of the row back."""
        slot = data.draw(st.sampled_from(sorted(self.rows)))
        self.pool.release(slot)
        del self.rows[slot]

    @rule(positions=st.integers(1, MAX_LEN))
    def evict_by_growing(self, positions):
        """A fresh row that takes every block it can, evicting cached blocks, then leaves."""
        free = [s for s in range(SLOTS) if s not in self.rows]
        if free and self.pool.grow(free[0], positions):
            assert not set(self.table.rows[free[0]]) & {b for s in self.rows for b in self.table.rows[s]}
            self.pool.release(free[0])

    @invariant()
    def accounting_holds(self):
        holders: dict[int, int] = {}
        for slot in range(SLOTS):
            for block in self.table.rows[slot]:
                holders[block] = holders.get(block, 0) + 1
        for block, ref in enumerate(self.pool.ref):
            assert ref >= 0
            assert ref == holders.get(block, 0)
            free = block in self.pool.uncached or block in self.pool.evictable
            assert (ref == 0) == free or block == self.table.scratch_block
            assert block not in self.pool.evictable or self.pool.key[block] is not None
            if ref > 1:
                assert self.pool.key[block] is not None  # only cached blocks are shared
        assert self.table.scratch_block not in self.pool.uncached and self.pool.ref[self.table.scratch_block] == 0
        for key, block in self.pool.cached.items():
            assert self.pool.key[block] == key
        for slot, tokens in self.rows.items():  # a row's registered blocks hold its tokens' keys
            keys = block_keys(tokens, BLOCK, self.pool.root(slot))
            for index, block in enumerate(self.table.rows[slot][: len(self.pool.keys[slot])]):
                if self.pool.key[block] is not None:
                    assert self.pool.key[block] == keys[index]

    def teardown(self):
        for slot in list(self.rows):
            self.pool.release(slot)
        assert (
            self.pool.num_free == BLOCKS - 1 and len(set(self.pool.uncached) | set(self.pool.evictable)) == BLOCKS - 1
        )
        assert all(ref == 0 for ref in self.pool.ref)
        assert all(not row for row in self.table.rows)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_pool_accounting = PoolMachine.TestCase


def test_a_cached_prefix_is_matched_by_its_whole_chain():
    """Keys name the whole prefix: the same block of tokens after a different one is a different key."""
    assert block_keys([1, 2, 3, 4], 2)[1] != block_keys([5, 6, 3, 4], 2)[1]
    table = BlockTable(2, 16, 2, 9)
    pool = BlockPool(table)
    pool.assign(0, [1, 2, 3, 4, 5])
    pool.grow(0, 6)
    pool.register(0, [1, 2, 3, 4, 5], 4)
    pool.release(0)
    assert len(pool.match([1, 2, 3, 4, 9], 1)) == 2
    assert pool.match([5, 6, 3, 4], 1) == []
    assert pool.assign(1, [1, 2, 3, 9]) == 2 and table.read_only[1] == 2


def test_a_domain_reuses_only_the_blocks_its_own_slots_wrote():
    """Data-parallel attention: slot s's entries exist only on rank s % domains."""
    table = BlockTable(4, 16, 2, 17)
    pool = BlockPool(table, domains=2)
    pool.assign(0, [1, 2, 3, 4, 5])
    pool.grow(0, 6)
    pool.register(0, [1, 2, 3, 4, 5], 4)
    assert pool.match([1, 2, 3, 4], 1) == [] and pool.match([1, 2, 3, 4], 3) == []
    assert pool.match([1, 2, 3, 4], 2) == table.rows[0][:2]
