"""Admission and preemption over a block pool of two domains (data-parallel attention: slots 0, 2 are one rank's
rows, slots 1, 3 the other's, each rank a pool of its own): a request goes to the domain with the most room left,
where a cached prefix breaks ties; a row that cannot grow preempts only rows of its domain."""

from __future__ import annotations

import torch

from tandem.decoding.params import SamplingParams
from tandem.engine.kv_blocks import BlockPool
from tandem.engine.output import RequestOutput, TextAssembler
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.grammars.masks import SpeculativeMasker
from tandem.models.base import BlockTable, KVCache

BLOCK, SLOTS, BLOCKS = 4, 4, 5  # BLOCKS: per domain, its scratch block included (4 blocks, 16 positions a domain)


def _scheduler() -> Scheduler:
    table = BlockTable(SLOTS, 32, BLOCK, BLOCKS)
    cache = KVCache.allocate(1, SLOTS, 32, (1,), dtype=torch.float32, device="cpu", table=table)
    pool = BlockPool(table, domains=2)
    return Scheduler(SLOTS, SpeculativeMasker(16), cache, None, pool, reserve=lambda r: len(r.tokens))


def _request(name: str, tokens: list[int]) -> Request:
    output = RequestOutput(request_id=name, prompt_token_ids=list(tokens))
    text = TextAssembler(None, eos_token_ids=set(), tracker=None, stop=[])
    return Request(name, list(tokens), SamplingParams(), seed=0, text=text, tokens=list(tokens), output=output)


def _admit(scheduler: Scheduler, *requests: Request) -> dict[str, int]:
    for request in requests:
        scheduler.add(request)
    scheduler.admit()
    return {r.request_id: r.slot for r in scheduler.running}


def test_a_request_goes_to_the_domain_with_the_most_room():
    """A long row fills domain 0; the short ones after it go to domain 1 (by `slot % 2` alone the second would
    wait for domain 0), and one that fits neither domain's free slots waits."""
    scheduler = _scheduler()
    slots = _admit(scheduler, _request("long", list(range(13))), *(_request(n, [1, 2, 3]) for n in "abc"))
    assert slots == {"long": 0, "a": 1, "b": 3}
    assert [r.request_id for r in scheduler.waiting] == ["c"]  # slot 2 is free, but domain 0 has no block left
    assert [scheduler.pool.free_in(d) for d in range(2)] == [0, 2]


def test_a_cached_prefix_draws_its_request_to_its_domain():
    """Both domains would have one block left; the one that holds the request's prefix takes it (not the lowest free
    slot, slot 1, of the other)."""
    scheduler = _scheduler()
    first = _request("first", list(range(9)))
    assert _admit(scheduler, first) == {"first": 0}
    scheduler.pool.register(0, first.tokens, 8)  # two full blocks, cached in domain 0
    scheduler.finish(first, "stop")  # its blocks stay cached, free
    assert _admit(scheduler, _request("again", [*range(8), 7])) == {"again": 2}
    assert scheduler.pool.table.read_only[2] == 8  # the cached prefix, reused


def test_a_row_that_cannot_grow_preempts_in_its_domain_only():
    """Domain 0 is full and its first row grows: the latest row of domain 0 is preempted, not the latest row of
    all (domain 1's, whose freed blocks domain 0 could not use)."""
    scheduler = _scheduler()
    requests = [_request(n, list(range(length))) for n, length in (("a", 8), ("b", 8), ("c", 8), ("d", 4))]
    assert _admit(scheduler, *requests) == {"a": 0, "b": 1, "c": 2, "d": 3}
    requests[0].tokens.append(8)  # a needs a third block
    rows = scheduler.schedule()
    assert [r.request_id for r in rows] == ["a", "b", "d"]
    assert [r.request_id for r in scheduler.waiting] == ["c"] and scheduler.preemptions == 1
    assert len(scheduler.pool.table.rows[0]) == 3 and scheduler.pool.free_in(1) == 1
