"""The KV block pool: which blocks each row holds, their reference counts, and automatic prefix caching.

One pool of block ids serves the target's cache and the draft's (they share one
:class:`~tandem.models.base.BlockTable`: block ``i`` holds the same positions of the same row in
both), so a row's blocks hold every entry of its positions, target and draft alike.

A row grows block by block (:meth:`BlockPool.grow`, before each forward: the positions its verify
and its next proposal write), gives back the blocks past its committed positions after each step
(:meth:`BlockPool.trim`: a rejected speculation's blocks) and all of them when it finishes or is
preempted (:meth:`BlockPool.release`).

Prefix caching (vLLM's scheme): a full block is keyed by ``sha256(parent key, its token ids)``, the
parent being the key of the block before it, so a key names the whole prefix up to its block's end.
A block is registered (:meth:`BlockPool.register`) once every entry it holds is committed in both
caches; a new row takes the longest chain of registered blocks that its tokens begin with
(:meth:`BlockPool.assign`), shared, reference-counted and never written again. Blocks nobody
references are free: uncached ones are taken first, lowest id first (a row growing alone gets
consecutive blocks, whose keys attention reads as a view of the pool), then cached ones in the order
they were freed (least recently used first): a cached block is evicted only when no uncached block
is left, and its key is dropped then.

Domains (data-parallel attention over N ranks): slot ``s`` is domain ``s % N``'s (``Shard.owns_slot``), whose
rank alone holds its entries, so each domain has a pool of its own: ``table.num_blocks`` blocks (its scratch
block among them), on its rank only, and the table holds each slot's ids in its domain's pool (the same id in two
domains names two blocks). Every rank's caches are then sized to its rows (a rank's ``kv_cache_memory`` holds N
times the tokens of one shared pool) and indexed by the table the driver sends, untranslated. Free lists, reference
counts and evictions are per domain: a row grows, and is preempted for, within its domain only. Keys start from
the slot's domain, so a row reuses only blocks written from slots of its own.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tandem.models.base import BlockTable


@dataclass
class KVStats:
    """The pool's counters (``Engine.kv_stats``)."""

    blocks_total: int  # blocks rows can hold, every domain's (the scratch blocks excluded)
    blocks_in_use: int  # blocks some row references
    blocks_cached: int  # registered blocks (in use or evictable)
    prefix_queried_tokens: int  # prompt tokens of admitted requests looked up in the prefix cache
    prefix_hit_tokens: int  # of those, tokens served from cached blocks
    preemptions: int  # rows preempted (their blocks freed, recomputed later)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


def block_keys(tokens: list[int], block_size: int, parent: bytes = b"", start: int = 0) -> list[bytes]:
    """The prefix-cache keys of ``tokens``' full blocks from block ``start`` (``parent``: the key before it)."""
    keys = []
    for first in range(start * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", tokens[first : first + block_size]).tobytes()).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """The block ids of ``table``'s pools (the scratch block excluded), handed to its slots: one pool per domain.

    Every method that changes a slot's blocks updates ``table``'s rows. ``ref[d * table.num_blocks + b]`` counts
    the slots holding block ``b`` of domain ``d`` (:meth:`index`); only registered (cached) blocks are ever held by
    more than one.
    """

    def __init__(self, table: BlockTable, *, enable_prefix_caching: bool = True, domains: int = 1):
        self.table, self.block_size = table, table.block_size
        self.enable_prefix_caching, self.domains = enable_prefix_caching, domains
        size = table.num_blocks
        self.ref = [0] * (domains * size)
        self.key: list[bytes | None] = [None] * (domains * size)  # by index
        self.cached: dict[bytes, int] = {}  # key -> block, of the domain the key starts from
        # Per domain: a heap of its free uncached blocks, and its free cached ones, least recently used first.
        self.uncached = [[b for b in range(size) if b != table.scratch_block] for _ in range(domains)]
        self.evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(domains)]
        self.keys: list[list[bytes]] = [[] for _ in range(table.num_slots)]  # per slot: its full blocks' keys
        self.queried_tokens = self.hit_tokens = 0

    @property
    def num_total(self) -> int:
        """Blocks rows can hold, every domain's."""
        return self.domains * (self.table.num_blocks - 1)

    @property
    def num_free(self) -> int:
        """Blocks no slot holds (evictable cached ones included), every domain's."""
        return sum(self.free_in(d) for d in range(self.domains))

    def free_in(self, domain: int) -> int:
        """``domain``'s blocks no slot holds."""
        return len(self.uncached[domain]) + len(self.evictable[domain])

    def domain(self, slot: int) -> int:
        """The domain whose pool holds ``slot``'s blocks."""
        return slot % self.domains

    def index(self, slot: int, block: int) -> int:
        """Where block ``block`` of ``slot``'s domain sits in :attr:`ref` and :attr:`key`."""
        return self.domain(slot) * self.table.num_blocks + block

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def fits(self, num_blocks: int) -> int:
        """How many rows of ``num_blocks`` blocks the free blocks hold in slots 0, 1, 2, ... (each in its slot's
        domain): domain ``d`` holds ``c`` of them, in slots ``d, d + N, ..``, so the rows stop at slot ``d + c N``."""
        return min(d + self.free_in(d) // num_blocks * self.domains for d in range(self.domains))

    def root(self, slot: int) -> bytes:
        """The parent key of a slot's first block: its domain's."""
        return b"" if self.domains == 1 else self.domain(slot).to_bytes(4, "little")

    def match(self, tokens: list[int], slot: int) -> list[int]:
        """The cached blocks of the longest registered prefix of ``tokens`` that ``slot`` may reuse (full blocks
        only). Changes nothing."""
        blocks = []
        if self.enable_prefix_caching:
            for key in block_keys(tokens, self.block_size, self.root(slot)):
                block = self.cached.get(key)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def room(self, slot: int, tokens: list[int], num_positions: int) -> int:
        """The free blocks ``slot``'s domain would have left after :meth:`assign` of ``tokens`` to ``slot`` and a
        :meth:`grow` to ``num_positions`` (negative: they would not both succeed). Changes nothing."""
        cached = self.match(tokens, slot)
        taken_from_free = sum(self.ref[self.index(slot, b)] == 0 for b in cached)
        return self.free_in(self.domain(slot)) - taken_from_free - (self.blocks_for(num_positions) - len(cached))

    def assign(self, slot: int, tokens: list[int], *, count: bool = True) -> int:
        """Give the empty ``slot`` the cached blocks of ``tokens``' longest registered prefix, read-only; returns
        the number of positions they hold. ``count``: the lookup counts in the stats (a request's first
        admission; a preempted row's recompute does not)."""
        if self.table.rows[slot]:
            raise ValueError(f"slot {slot} still holds blocks {self.table.rows[slot]}")
        blocks = self.match(tokens, slot)
        for block in blocks:
            self._take(slot, block)
        positions = len(blocks) * self.block_size
        self.keys[slot] = block_keys(tokens[:positions], self.block_size, self.root(slot))
        self.table.set_blocks(slot, blocks, read_only=positions)
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += positions
        return positions

    def grow(self, slot: int, num_positions: int) -> bool:
        """Give ``slot`` blocks of its domain until they hold ``num_positions`` positions, evicting the domain's
        least recently used cached blocks if needed; False (and nothing changed) when too few are free."""
        row, domain = self.table.rows[slot], self.domain(slot)
        needed = self._missing(slot, num_positions)
        if needed == 0:
            return True
        if needed > self.free_in(domain):
            return False
        new = [self._allocate(domain) for _ in range(needed)]
        self.table.set_blocks(slot, row + new, read_only=self.table.read_only[slot])
        return True

    def can_grow(self, wants: dict[int, int]) -> bool:
        """Whether :meth:`grow` would succeed for every ``slot: num_positions`` of ``wants`` together."""
        needed = [0] * self.domains
        for slot, num_positions in wants.items():
            needed[self.domain(slot)] += self._missing(slot, num_positions)
        return all(n <= self.free_in(domain) for domain, n in enumerate(needed))

    def _missing(self, slot: int, num_positions: int) -> int:
        """The blocks ``slot`` lacks to hold ``num_positions`` positions (:meth:`grow` takes them)."""
        return max(self.blocks_for(num_positions) - len(self.table.rows[slot]), 0)

    def trim(self, slot: int, num_positions: int) -> None:
        """Give back ``slot``'s blocks past its first ``num_positions`` positions (never a registered one)."""
        row = self.table.rows[slot]
        keep = max(self.blocks_for(num_positions), len(self.keys[slot]))
        if keep < len(row):
            self._give_back(slot, row[keep:])
            self.table.set_blocks(slot, row[:keep], read_only=self.table.read_only[slot])

    def release(self, slot: int) -> None:
        """Give back every block of ``slot`` (a finished, aborted or preempted row)."""
        self._give_back(slot, self.table.rows[slot])
        self.keys[slot] = []
        self.table.set_blocks(slot, [])

    def register(self, slot: int, tokens: list[int], num_positions: int) -> None:
        """Register ``slot``'s full blocks within its first ``num_positions`` positions, whose entries are all
        committed in every cache (``tokens``: the row's tokens). A block whose key is cached already (another row
        computed the same prefix) stays the row's own and is freed uncached."""
        if not self.enable_prefix_caching:
            return
        keys, row = self.keys[slot], self.table.rows[slot]
        full = min(num_positions, len(tokens)) // self.block_size
        if full <= len(keys):
            return
        start = len(keys)
        parent = keys[-1] if keys else self.root(slot)
        keys += block_keys(tokens[: full * self.block_size], self.block_size, parent, start)
        for key, block in zip(keys[start:], row[start:full]):
            if key not in self.cached:
                self.cached[key] = block
                self.key[self.index(slot, block)] = key

    def stats(self, preemptions: int) -> KVStats:
        return KVStats(
            blocks_total=self.num_total,
            blocks_in_use=self.num_total - self.num_free,
            blocks_cached=len(self.cached),
            prefix_queried_tokens=self.queried_tokens,
            prefix_hit_tokens=self.hit_tokens,
            preemptions=preemptions,
        )

    def _allocate(self, domain: int) -> int:
        """A free block of ``domain`` for new entries: its lowest uncached one, else its least recently used cached
        one, evicted (its key dropped)."""
        if self.uncached[domain]:
            block = heapq.heappop(self.uncached[domain])
        else:
            block, _ = self.evictable[domain].popitem(last=False)
        index = domain * self.table.num_blocks + block
        if self.key[index] is not None:  # an evicted cached block
            del self.cached[self.key[index]]
            self.key[index] = None
        self.ref[index] = 1
        return block

    def _take(self, slot: int, block: int) -> None:
        """One more reference to the cached ``block`` of ``slot``'s domain (a free one stops being evictable, its
        entries kept)."""
        index = self.index(slot, block)
        if self.ref[index] == 0:
            del self.evictable[self.domain(slot)][block]
        self.ref[index] += 1

    def _give_back(self, slot: int, blocks: list[int]) -> None:
        """One reference less to each of ``blocks`` of ``slot``'s domain, last first: a row's tail is evicted before
        its head."""
        domain = self.domain(slot)
        for block in reversed(blocks):
            index = self.index(slot, block)
            self.ref[index] -= 1
            if self.ref[index] < 0:
                raise RuntimeError(f"block {block} of domain {domain} released more often than taken")
            if self.ref[index] == 0:
                if self.key[index] is None:
                    heapq.heappush(self.uncached[domain], block)
                else:
                    self.evictable[domain][block] = None  # the most recently used: evicted last
