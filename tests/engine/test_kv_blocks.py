"""The block pool's accounting (engine/kv_blocks.py) as a state machine: rows are admitted (reusing cached
prefixes), grow, roll back, register their blocks, finish, are aborted or preempted, and cached blocks are
evicted for new ones; reference counts never go negative, no block is held by two rows unless it is cached,
and once every row is gone the pool is whole again. The pool has two domains (data-parallel attention: slots 0, 2
and 1, 3 are two ranks' rows, each rank a pool of its own), and a row's blocks come from its domain's pool only."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.engine.kv_blocks import BlockPool, block_keys
from tandem.models.base import BlockTable

BLOCK, SLOTS, BLOCKS, MAX_LEN, DOMAINS = 4, 4, 9, 32, 2  # BLOCKS: per domain, its scratch block included
# A small alphabet, so prompts share prefixes and cached blocks are reused.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.table = BlockTable(SLOTS, MAX_LEN, BLOCK, BLOCKS)
        self.pool = BlockPool(self.table, domains=DOMAINS)
        self.rows: dict[int, list[int]] = {}  # slot -> its tokens (the committed ones)

    @rule(tokens=TOKENS, data=st.data())
    def admit(self, tokens, data):
        free = [s for s in range(SLOTS) if s not in self.rows]
        if not free:
            return
        slot = data.draw(st.sampled_from(free))
        reserve = min(len(tokens) + 4, MAX_LEN)
        if self.pool.room(slot, tokens, reserve) < 0:
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
        tokens, domain = self.rows[slot], self.pool.domain(slot)
        needed = self.pool.blocks_for(min(len(tokens) + drafts, MAX_LEN)) - len(self.table.rows[slot])
        free = [self.pool.free_in(d) for d in range(DOMAINS)]
        if not self.pool.grow(slot, min(len(tokens) + drafts, MAX_LEN)):
            assert needed > free[domain]  # a full domain refuses, whatever the other has free
            return
        others = [self.pool.free_in(d) for d in range(DOMAINS) if d != domain]
        assert others == [n for d, n in enumerate(free) if d != domain]  # growth takes from its own domain only
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

    @rule(positions=st.integers(1, MAX_LEN), data=st.data())
    def evict_by_growing(self, positions, data):
        """A fresh row that takes every block it can, evicting cached blocks of its domain, then leaves."""
        free = [s for s in range(SLOTS) if s not in self.rows]
        if not free:
            return
        slot = data.draw(st.sampled_from(free))
        if self.pool.grow(slot, positions):
            held = {self.pool.index(s, b) for s in self.rows for b in self.table.rows[s]}
            assert not {self.pool.index(slot, b) for b in self.table.rows[slot]} & held
            self.pool.release(slot)

    @invariant()
    def accounting_holds(self):
        holders: dict[int, int] = {}  # by pool index: (domain, block)
        for slot in range(SLOTS):
            for block in self.table.rows[slot]:
                assert 0 <= block < BLOCKS and block != self.table.scratch_block
                holders[self.pool.index(slot, block)] = holders.get(self.pool.index(slot, block), 0) + 1
        for index, ref in enumerate(self.pool.ref):
            domain, block = divmod(index, BLOCKS)
            uncached, evictable = block in self.pool.uncached[domain], block in self.pool.evictable[domain]
            assert ref >= 0 and ref == holders.get(index, 0)
            assert not (uncached and evictable)
            assert (ref == 0) == (uncached or evictable) or block == self.table.scratch_block
            assert not evictable or self.pool.key[index] is not None
            if ref > 1:
                assert self.pool.key[index] is not None  # only cached blocks are shared
        for domain in range(DOMAINS):
            assert self.table.scratch_block not in self.pool.uncached[domain]
            assert self.pool.ref[domain * BLOCKS + self.table.scratch_block] == 0
        keyed = {key: index for index, key in enumerate(self.pool.key) if key is not None}
        assert len(keyed) == len(self.pool.cached)
        for key, block in self.pool.cached.items():
            assert keyed[key] % BLOCKS == block
        for slot, tokens in self.rows.items():  # a row's registered blocks hold its tokens' keys
            keys = block_keys(tokens, BLOCK, self.pool.root(slot))
            for i, block in enumerate(self.table.rows[slot][: len(self.pool.keys[slot])]):
                key = self.pool.key[self.pool.index(slot, block)]
                if key is not None:
                    assert key == keys[i]

    def teardown(self):
        for slot in list(self.rows):
            self.pool.release(slot)
        assert self.pool.num_free == self.pool.num_total == DOMAINS * (BLOCKS - 1)
        for domain in range(DOMAINS):
            assert len(set(self.pool.uncached[domain]) | set(self.pool.evictable[domain])) == BLOCKS - 1
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
    table = BlockTable(4, 16, 2, 9)
    pool = BlockPool(table, domains=2)
    pool.assign(0, [1, 2, 3, 4, 5])
    pool.grow(0, 6)
    pool.register(0, [1, 2, 3, 4, 5], 4)
    assert pool.match([1, 2, 3, 4], 1) == [] and pool.match([1, 2, 3, 4], 3) == []
    assert pool.match([1, 2, 3, 4], 2) == table.rows[0][:2]


def test_each_domain_has_a_pool_of_its_own():
    """Data-parallel attention: block ids name blocks of the slot's domain's pool, each with its scratch block; a
    full domain refuses a row that the other domain's free blocks could hold, and `fits` counts rows slot by slot."""
    table = BlockTable(4, 16, 2, 5)  # per domain: 4 blocks and the scratch block
    pool = BlockPool(table, domains=2)
    assert pool.num_total == 8 and pool.fits(2) == 4 and pool.fits(3) == 2
    assert pool.grow(0, 8) and pool.grow(1, 2)
    assert table.rows[0] == [1, 2, 3, 4] and table.rows[1] == [1]  # the same ids, two pools
    assert pool.free_in(0) == 0 and pool.free_in(1) == 3
    assert not pool.grow(2, 1) and table.rows[2] == []  # domain 0 is full, domain 1 is not
    assert pool.room(2, [7], 1) == -1 and pool.room(3, [7], 1) == 2
    assert pool.grow(3, 6) and pool.fits(1) == 0
    pool.release(1)
    assert pool.fits(1) == 0 and pool.free_in(1) == 1  # slot 0's domain has nothing left: no row fits from slot 0


def test_can_grow_says_whether_every_growth_fits_together():
    """Async scheduling's check before it launches a step ahead: every row's growth at once, per domain's pool."""
    table = BlockTable(4, 16, 2, 5)  # per domain: 4 blocks and the scratch block
    pool = BlockPool(table, domains=2)
    assert pool.grow(0, 4)  # two of domain 0's four blocks
    assert pool.can_grow({0: 8}) and pool.can_grow({0: 4, 2: 4}) and pool.can_grow({1: 8, 3: 0})
    assert not pool.can_grow({0: 6, 2: 4})  # one more for slot 0 and two for slot 2: three of the two left
    assert not pool.can_grow({1: 8, 3: 2})  # domain 1: five of four
    assert table.rows[0] == [1, 2] and not table.rows[2]  # a check changes nothing
