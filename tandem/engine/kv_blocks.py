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

Domains: under data-parallel attention each rank writes the entries of the slots it owns only (``slot %
domains``), so a block filled from one rank's slot holds nothing on the others. Keys start from the slot's
domain, and a row reuses only blocks written from slots of its own.
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

    blocks_total: int  # blocks rows can hold (the scratch block excluded)
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
    """The block ids of ``table``'s pools (the scratch block excluded), handed to its slots.

    Every method that changes a slot's blocks updates ``table``'s rows. ``ref[b]`` counts the slots
    holding block ``b``; only registered (cached) blocks are ever held by more than one.
    """

    def __init__(self, table: BlockTable, *, enable_prefix_caching: bool = True, domains: int = 1):
        self.table, self.block_size = table, table.block_size
        self.enable_prefix_caching, self.domains = enable_prefix_caching, domains
        num_blocks = table.num_blocks
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block
        self.uncached = [b for b in range(num_blocks) if b != table.scratch_block]  # a heap of free blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free cached blocks, least recently used first
        self.keys: list[list[bytes]] = [[] for _ in range(table.num_slots)]  # per slot: its full blocks' keys
        self.queried_tokens = self.hit_tokens = 0

    @property
    def num_total(self) -> int:
        return self.table.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks no slot holds (evictable cached ones included)."""
        return len(self.uncached) + len(self.evictable)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def root(self, slot: int) -> bytes:
        """The parent key of a slot's first block: its domain's."""
        return b"" if self.domains == 1 else (slot % self.domains).to_bytes(4, "little")

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

    def can_assign(self, slot: int, tokens: list[int], num_positions: int) -> bool:
        """Whether :meth:`assign` of ``tokens`` to ``slot`` and a :meth:`grow` to ``num_positions`` would both
        succeed."""
        cached = self.match(tokens, slot)
        taken_from_free = sum(self.ref[b] == 0 for b in cached)
        return self.blocks_for(num_positions) - len(cached) <= self.num_free - taken_from_free

    def assign(self, slot: int, tokens: list[int], *, count: bool = True) -> int:
        """Give the empty ``slot`` the cached blocks of ``tokens``' longest registered prefix, read-only; returns
        the number of positions they hold. ``count``: the lookup counts in the stats (a request's first
        admission; a preempted row's recompute does not)."""
        if self.table.rows[slot]:
            raise ValueError(f"slot {slot} still holds blocks {self.table.rows[slot]}")
        blocks = self.match(tokens, slot)
        for block in blocks:
            self._take(block)
        positions = len(blocks) * self.block_size
        self.keys[slot] = block_keys(tokens[:positions], self.block_size, self.root(slot))
        self.table.set_blocks(slot, blocks, read_only=positions)
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += positions
        return positions

    def grow(self, slot: int, num_positions: int) -> bool:
        """Give ``slot`` blocks until they hold ``num_positions`` positions, evicting the least recently used
        cached blocks if needed; False (and nothing changed) when too few blocks are free."""
        row = self.table.rows[slot]
        needed = self.blocks_for(num_positions) - len(row)
        if needed <= 0:
            return True
        if needed > self.num_free:
            return False
        new = [self._allocate() for _ in range(needed)]
        self.table.set_blocks(slot, row + new, read_only=self.table.read_only[slot])
        return True

    def trim(self, slot: int, num_positions: int) -> None:
        """Give back ``slot``'s blocks past its first ``num_positions`` positions (never a registered one)."""
        row = self.table.rows[slot]
        keep = max(self.blocks_for(num_positions), len(self.keys[slot]))
        if keep < len(row):
            self._give_back(row[keep:])
            self.table.set_blocks(slot, row[:keep], read_only=self.table.read_only[slot])

    def release(self, slot: int) -> None:
        """Give back every block of ``slot`` (a finished, aborted or preempted row)."""
        self._give_back(self.table.rows[slot])
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
                self.key[block] = key

    def stats(self, preemptions: int) -> KVStats:
        return KVStats(
            blocks_total=self.num_total,
            blocks_in_use=self.num_total - self.num_free,
            blocks_cached=len(self.cached),
            prefix_queried_tokens=self.queried_tokens,
            prefix_hit_tokens=self.hit_tokens,
            preemptions=preemptions,
        )

    def _allocate(self) -> int:
        """A free block for new entries: the lowest uncached one, else the least recently used cached one,
        evicted (its key dropped)."""
        if self.uncached:
            block = heapq.heappop(self.uncached)
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.key[block]]
            self.key[block] = None
        self.ref[block] = 1
        return block

    def _take(self, block: int) -> None:
        """One more reference to the cached ``block`` (a free one stops being evictable, its entries kept)."""
        if self.ref[block] == 0:
            del self.evictable[block]
        self.ref[block] += 1

    def _give_back(self, blocks: list[int]) -> None:
        """One reference less to each of ``blocks``, last first: a row's tail is evicted before its head."""
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            if self.ref[block] == 0:
                if self.key[block] is None:
                    heapq.heappush(self.uncached, block)
                else:
                    self.evictable[block] = None  # the most recently used: evicted last
