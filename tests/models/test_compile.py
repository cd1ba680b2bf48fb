"""Every provider's tensor body compiles whole (``torch.compile(fullgraph=True)``: no graph break, so
nothing in it syncs with the host) at decode, verify and draft shapes, does not recompile over 100
steps of varying lengths once warm, and matches the eager forward; the C linear is a custom op.

Compiled with the ``aot_eager`` backend (aten kernels, quick to compile), through
:class:`tandem.engine.graphs.GraphRunner` on a bucket of two rows. Tolerance on float32 logits and
hidden states: 1e-3 absolute plus 1e-4 relative. The graph attends over a key window masked by
position where eager slices it, and AOT tracing decomposes attention into its math form, so sums
round differently through 16 layers (seen: 1.4e-4 on an aux hidden state of 2); a layout bug (a
wrong key seen, an entry in the wrong slot) moves them by orders of magnitude more.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from tandem.engine.graphs import GraphRunner
from tandem.kernels import cpu_linear
from tandem.llm import resolve_model
from tandem.models.attention import RaggedLayout
from tandem.models.base import ForwardBatch
from tandem.models.linear import narrow_exact_weights
from tandem.models.loading import load_draft, load_target

K, ROWS, MAX_LEN, STEPS = 4, 2, 64, 100
ATOL, RTOL = 1e-3, 1e-4
TARGETS = {"demo-llama": ("eagle", "eagle3"), "demo-deepseek": ("mtp",)}  # each target with its drafts


def _load(name: str):
    """The target and its drafts in float32 with narrowed weights: the C kernel's case, so the graphs
    call it as the custom op."""
    path = resolve_model(name)
    target = load_target(path, dtype=torch.float32)
    drafts = [
        load_draft(kind if kind == "mtp" else path.parent / f"{name}-{kind}", target, dtype=torch.float32)
        for kind in TARGETS[name]
    ]
    for model in (target, *drafts):
        narrow_exact_weights(model)
    return target, drafts


def _caches(model):
    """An eager cache of ROWS slots and the graph's, with the runner's scratch slot past them."""
    return model.new_cache(ROWS, MAX_LEN), model.new_cache(ROWS + GraphRunner.SCRATCH_SLOTS, MAX_LEN)


def _close(graph: torch.Tensor, eager: torch.Tensor) -> None:
    assert graph.shape == eager.shape
    torch.testing.assert_close(graph, eager, atol=ATOL, rtol=RTOL)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the engine runs small steps, and a fresh count of compiled graphs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.utils.counters.clear()
    yield
    torch.set_num_threads(threads)


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", sorted(TARGETS))
@torch.inference_mode()
def test_steps_compile_whole_match_eager_and_never_recompile(name):
    """Target decode/verify steps and each draft's steps (first pass up to k + 1 wide, then a chained step)
    over 100 random steps: rows of 1..k+1 tokens, rolled back by random rejections, one row or two."""
    target, drafts = _load(name)
    eager_cache, graph_cache = _caches(target)
    draft_caches = [_caches(draft) for draft in drafts]
    runners = [
        GraphRunner(target, graph_cache, draft, graph, widths=(1, K + 1), capture_sizes=(ROWS,), backend="aot_eager")
        for draft, (_, graph) in zip(drafts, draft_caches)
    ]
    rng = random.Random(0)
    lengths = [1, 1]  # committed tokens per row (the cache holds one fewer)
    for step in range(STEPS):
        rows = rng.choice([1, 2]) if step >= 2 else 2  # the first two steps build the two-row graphs
        widths = [K + 1] * rows if step == 1 else [rng.randint(1, K + 1) if step % 2 else 1 for _ in range(rows)]
        if max(lengths[:rows]) + K + 2 >= MAX_LEN:
            lengths = [1, 1]
        ids = [[rng.randrange(target.vocab_size) for _ in range(w)] for w in widths]
        starts = [n - 1 for n in lengths[:rows]]
        batch = ForwardBatch.from_rows(ids, starts, list(range(rows)))
        for cache in (eager_cache, graph_cache):
            cache.truncate(list(range(rows)), starts)
        eager = target.forward(batch, eager_cache, return_hidden=True, return_aux=True)
        graph = runners[0].forward(batch, graph_cache, return_hidden=True, return_aux=True)
        for got, want in zip(
            (graph.logits, graph.hidden, graph.aux_hidden), (eager.logits, eager.hidden, eager.aux_hidden)
        ):
            _close(got, want)
        # Each draft's first pass over the accepted tokens (paired with the hidden state before each),
        # then one chained step.
        accepted = widths if step == 1 else [rng.randint(1, w) for w in widths]
        offsets = [sum(widths[:b]) for b in range(rows)]
        pick = torch.tensor([offsets[b] + i for b in range(rows) for i in range(accepted[b])])
        draft_starts = [s + 1 for s in starts]
        first = ForwardBatch.from_rows([row[:n] for row, n in zip(ids, accepted)], draft_starts, list(range(rows)))
        chained = first.following(first.input_ids[first.last_token_indices()])
        for draft, runner, (eager_draft, graph_draft) in zip(drafts, runners, draft_caches):
            features = eager.hidden[pick] if draft.hidden_kind == "last" else draft.fc(eager.aux_hidden[pick])
            for cache in (eager_draft, graph_draft):
                cache.truncate(list(range(rows)), draft_starts)
            eager_h = draft.step(first, features, eager_draft)
            _close(runner.draft_step(first, features, graph_draft), eager_h)
            last = eager_h[first.last_token_indices()]
            _close(runner.draft_step(chained, last, graph_draft), draft.step(chained, last, eager_draft))
        lengths[:rows] = [s + 1 + n for s, n in zip(starts, accepted)]
        if step == 1:  # every shape built: the target's (2, 1) and (2, k + 1), each draft's (2, k + 1) and (2, 1)
            assert len(runners[0]._graphs) == 4 and all(len(r._graphs) == 2 for r in runners[1:])
            compiled = _graphs_compiled()
    assert _graphs_compiled() == compiled, "recompiled after warm-up"
    assert runners[0].replays == 3 * STEPS - 4  # one build per shape, then replays
    assert all(r.fallbacks == 0 for r in runners)


@pytest.mark.skipif(not cpu_linear.available(), reason="the C kernel is not built or this CPU lacks AVX2")
def test_cpu_linear_op_passes_opcheck():
    weight = torch.randn(48, 32).to(torch.bfloat16).T.contiguous().T  # stored transposed, as narrowed weights are
    for x, bias in ((torch.randn(3, 32), None), (torch.randn(1, 32), torch.randn(48))):
        torch.library.opcheck(torch.ops.tandem.cpu_linear.default, (x, weight, bias))
        expected = torch.nn.functional.linear(x, weight.float(), bias)
        torch.testing.assert_close(torch.ops.tandem.cpu_linear(x, weight, bias), expected, atol=1e-5, rtol=1e-5)


def test_a_graph_that_writes_a_pool_twice_updates_it_in_place():
    """A chained draft's graph writes its one pool at every step, reading it between. Inductor must scatter into
    the pool itself: a write through a flattened view of it made the generated code copy the whole pool into a
    fresh buffer and back at every call (the pool is max_num_seqs x max_model_len entries)."""
    pool = torch.zeros(64, 4, 2, 2, 8)  # [num_blocks, block_size, 2, nkv, d]
    tables = torch.tensor([[5, 9], [7, 3]])

    def two_steps(pool, positions, writes, tables, entries):
        out = []
        for step in range(2):
            layout = RaggedLayout.static(positions + step, writes + step, tables, 0, pool.shape[1])
            layout.addressing.write(pool, entries + step)
            out.append(layout.addressing.gather(pool).sum())
        return torch.stack(out)

    args = (torch.tensor([[2], [5]]), torch.tensor([5 * 4 + 2, 3 * 4 + 1]), tables, torch.ones(2, 2, 2, 8))
    expected = two_steps(pool.clone(), *args)
    got, (code,) = run_and_get_code(torch.compile(two_steps, fullgraph=True, backend="inductor"), pool, *args)
    torch.testing.assert_close(got, expected)
    assert pool[5, 2].eq(1).all() and pool[5, 3].eq(2).all() and pool[3, 1].eq(1).all() and pool[3, 2].eq(2).all()
    shapes = re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)
    sizes = [math.prod(int(n) for n in shape.split(",") if n.strip()) for shape in shapes]
    assert max(sizes) < pool.numel() // 8, f"a buffer of {max(sizes)} elements beside a pool of {pool.numel()}"
