"""Admission, KV blocks and preemption: the waiting and running requests, and the outputs of finished ones.

A request waits until its grammar has compiled, a row (a slot of the block table) is free and the
block pool can hold its tokens and the step's writes. Admission goes in arrival order (a preempted
request first), but a request still compiling does not hold back the ones behind it; a request that
does not fit the pool does (it would never fit if later ones kept taking blocks). Admission gives
the request a slot, the cached blocks of its longest registered prefix (``kv_blocks``) and a row of
the masker (its matcher, and a thinking tracker over its prompt). A grammar that failed to compile
finishes its request with "error" before it runs.

Under data-parallel attention each slot's blocks come from its domain's pool (``kv_blocks``): a request is
admitted into a free slot of the domain with the most free blocks left once it holds the request (its cached
prefix counted), so the ranks fill evenly and a shared prefix draws a request to the rank that holds it; it
waits while no domain can hold it.

Before each step every running row grows to the positions the step writes (:meth:`Scheduler.schedule`);
when its domain's pool cannot supply a row, that domain's most recently admitted row is preempted: its
blocks are freed and it waits at the front of the queue, to be prefilled again over its prompt and the tokens it
generated (so greedy output is unchanged) and go on where it stopped; its masker row stays.
Finishing (a stop rule, an abort) frees the slot, the blocks and the masker row; the output waits
for `pop_finished`.

Chunked prefill (``budget``: the tokens one step may feed, None: unbounded): rows that decode or verify
always run; the rows still prefilling share what the budget leaves (at least a block's worth, so a
prefill always progresses), in admission order. A row whose rest does not fit is fed a chunk this step
(:attr:`Scheduler.chunk_ends`) and one that gets nothing sits the step out; its blocks hold its whole prompt
from admission on, as an unchunked row's do, so a prefill under way is never short of blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.kv_blocks import BlockPool
from tandem.engine.output import RequestOutput, finish_output
from tandem.engine.request import Request, thinking_tracker
from tandem.grammars.errors import GrammarError
from tandem.grammars.masks import SpeculativeMasker
from tandem.models.base import KVCache
from tandem.thinking import ThinkingMarkers


class Scheduler:
    """Which requests wait, which run, and in which slot. `running` is in admission order: the
    order of the step's rows.

    `reserve(request)` is the number of positions the request's next step writes (its verify and its
    next proposal); `cache` is the target's, whose lengths say where each row's next forward starts.
    `chunk_ends` maps each of the step's rows that prefills only part of its tokens to the position its
    chunk ends at (exclusive; the row's other tokens follow in later steps).
    """

    def __init__(
        self,
        num_slots: int,
        masker: SpeculativeMasker,
        cache: KVCache,
        markers: ThinkingMarkers | None,
        pool: BlockPool,
        reserve: Callable[[Request], int],
        budget: int | None = None,
    ) -> None:
        self.masker, self.cache, self.markers, self.pool, self.reserve = masker, cache, markers, pool, reserve
        self.budget = budget
        self.chunk_ends: dict[str, int] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._free_slots = list(range(num_slots))
        self._finished: dict[str, RequestOutput] = {}
        self._preempted: set[str] = set()  # waiting requests that ran before (their masker rows kept)
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def may_admit(self) -> bool:
        """Whether the next :meth:`schedule` may admit a request: one waits and a slot is free."""
        return bool(self.waiting and self._free_slots)

    def schedule(self) -> list[Request]:
        """Grow every running row to its step's writes, preempting the latest admitted rows of its domain when the
        domain's pool runs out, admit what fits, then hand the rows still prefilling their chunks of the budget;
        returns the step's rows (in admission order)."""
        for request in list(self.running):
            while request.slot >= 0 and not self.pool.grow(request.slot, self.reserve(request)):
                domain = self.pool.domain(request.slot)
                self._preempt(next(r for r in reversed(self.running) if self.pool.domain(r.slot) == domain))
        self.admit()
        prefilling = [r for r in self.running if self.cache.lengths[r.slot] < len(r.tokens) - 1]
        if self.budget is None or not prefilling:
            self.chunk_ends = {}
            return list(self.running)
        decode = sum(1 + len(r.drafts) for r in self.running if self.cache.lengths[r.slot] == len(r.tokens) - 1)
        left = max(self.budget - decode, self.pool.block_size)
        self.chunk_ends, idle = {}, set()
        for request in prefilling:
            held = self.cache.lengths[request.slot]
            if left == 0:
                idle.add(request.request_id)
            elif len(request.tokens) - held > left:
                self.chunk_ends[request.request_id] = held + left
            left -= min(left, len(request.tokens) - held)
        return [r for r in self.running if r.request_id not in idle]

    def admit(self) -> None:
        """Move waiting requests whose grammar is ready into free slots (:meth:`slot_for`), in arrival order, while
        their blocks fit."""
        for request in list(self.waiting):
            if not self._free_slots:
                return
            job = request.grammar_job
            if job is not None and not job.done():
                continue
            resumed = request.request_id in self._preempted
            slot = self.slot_for(request)
            if slot is None:
                return
            self.waiting.remove(request)
            if not resumed:
                try:
                    grammar = None if job is None else job.result()
                    matcher = None if grammar is None else grammar.new_matcher()
                except GrammarError as error:
                    request.output.error = str(error)
                    request.output.finish_reason = "error"
                    self._finished[request.request_id] = request.output
                    continue
                tracker = thinking_tracker(self.markers, request.prompt)
                self.masker.add_row(request.request_id, matcher, tracker, grammar=grammar)
            self._preempted.discard(request.request_id)
            self._free_slots.remove(slot)
            request.slot = slot
            cached = self.pool.assign(request.slot, request.tokens, count=not resumed)
            self.pool.grow(request.slot, self.reserve(request))
            if not resumed:
                request.output.num_cached_tokens = min(cached, len(request.prompt))
            # A reused prefix is run again from its last position, whose hidden state no cache keeps (the
            # draft's first new entry pairs with it); that position's writes go to scratch (BlockTable.read_only).
            self.cache.truncate([request.slot], [max(cached - 1, 0)])
            self.running.append(request)

    def slot_for(self, request: Request) -> int | None:
        """The free slot `request` is admitted into, each domain offering the one free the longest: of the domains
        with a free slot, the one with the most free blocks left once the slot holds the request, then the one
        with the longest cached prefix of it (its free cached blocks count as free ones), then the lower slot;
        None when no domain can hold it."""
        firsts: dict[int, int] = {}  # per domain, its slot free the longest
        for slot in self._free_slots:
            firsts.setdefault(self.pool.domain(slot), slot)
        tokens, reserve = request.tokens, self.reserve(request)
        scores = {s: (self.pool.room(s, tokens, reserve), len(self.pool.match(tokens, s))) for s in firsts.values()}
        slot = max(sorted(scores), key=scores.__getitem__, default=None)
        return None if slot is None or scores[slot][0] < 0 else slot

    def finish(self, request: Request, reason: str) -> None:
        """End a running request with `reason`."""
        self._close(request, reason)
        self.running.remove(request)

    def abort(self, request_id: str) -> None:
        """Drop a request, waiting or running (unknown or finished ids are ignored)."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    self._close(request, "abort")
                    queue.remove(request)
                    return

    def pop_finished(self, request_id: str) -> RequestOutput | None:
        """The output of a finished request, handed over once (None while it runs)."""
        return self._finished.pop(request_id, None)

    def _preempt(self, request: Request) -> None:
        """Free `request`'s slot and blocks and queue it first, to be recomputed (its masker row stays)."""
        self.pool.release(request.slot)
        self._free_slots.append(request.slot)
        request.slot = -1
        request.clear_drafts()
        request.undrafted = None  # its prefill feeds the draft again from the start
        self.running.remove(request)
        self.waiting.insert(0, request)
        self._preempted.add(request.request_id)
        self.preemptions += 1

    def _close(self, request: Request, reason: str) -> None:
        finish_output(request.output, request.text, reason)
        self._finished[request.request_id] = request.output
        if request.slot >= 0 or request.request_id in self._preempted:
            self.masker.remove_row(request.request_id)
            self._preempted.discard(request.request_id)
        if request.slot >= 0:
            self.pool.release(request.slot)
            self._free_slots.append(request.slot)
            request.slot = -1
