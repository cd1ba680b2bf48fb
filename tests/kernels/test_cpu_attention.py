"""The CPU's C paged attention (`tandem.kernels.cpu_attention`) equals the torch path (gather + sdpa) it replaces:
decode and verify steps, ragged rows, GQA, blocks out of order, the eager and the graph layouts, MLA's latent cache,
a whole target's logits; and a query's output depends on its own keys alone. Tolerance: float32 1e-5 (both paths
accumulate in float32, in different orders). Every test runs each C build this CPU runs (AVX-512, AVX2)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.kernels import cpu_attention
from tandem.models import attention
from tandem.models.attention import FOLD_MAX_QUERY, RaggedLayout
from tandem.models.base import BlockTable, ForwardBatch, KVCache

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="the CPU attention is not built")
CLOSE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True, params=cpu_attention.BUILDS)
def build(request, monkeypatch):
    """Each C build in turn (skipped where this CPU does not run it)."""
    if request.param not in cpu_attention.RUNNABLE:
        pytest.skip(f"this CPU does not run the {request.param} build")
    monkeypatch.setattr(cpu_attention, "_BUILD", cpu_attention.BUILDS.index(request.param))
    return request.param


def scattered_cache(ends: list[int], block_size: int, entry: tuple, *, seed: int = 0, first_position: int = 0):
    """A one-layer cache whose rows hold ``ends[b]`` positions in shuffled blocks, every entry random (positions
    past a row's end too: the kernel must not read them)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-end // block_size) for end in ends]
    order = (torch.randperm(sum(blocks) + 1, generator=generator) + 1).tolist()  # block 0: the scratch block
    table = BlockTable(len(ends), max(ends) + block_size, block_size, sum(blocks) + 2, "cpu")
    for slot, n in enumerate(blocks):
        table.set_blocks(slot, [order.pop() for _ in range(n)])
    pool = torch.randn(table.num_blocks, block_size, *entry, generator=generator)
    return KVCache([pool], table, first_position=first_position), generator


def batch(ends: list[int], new: list[int]) -> ForwardBatch:
    return ForwardBatch.from_rows([[0] * n for n in new], [e - n for e, n in zip(ends, new)], list(range(len(ends))))


def attend(layout: RaggedLayout, q: torch.Tensor, pool: torch.Tensor, backend: str, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(attention, "attention_backend", backend)
    return layout.attend(q, pool, q.shape[-1] ** -0.5)


@pytest.mark.parametrize(
    "ends, new",
    [([37, 9, 20], [1, 1, 1]), ([37, 9, 20], [4, 4, 4]), ([37, 9, 20], [1, 4, 3]), ([50, 9, 20], [16, 1, 3])],
    ids=["decode", "verify", "ragged", "chunk"],
)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_the_kernel_equals_gather_and_sdpa(ends, new, heads, monkeypatch):
    num_heads, num_kv_heads = heads
    cache, generator = scattered_cache(ends, 4, (2, num_kv_heads, 32))
    layout = RaggedLayout.build(batch(ends, new), cache)
    q = torch.randn(sum(new), num_heads, 32, generator=generator)
    monkeypatch.setattr(attention, "attention_backend", "auto")
    assert layout.reads_pools(q)  # at most FOLD_MAX_QUERY queries a row, on the CPU
    got = attend(layout, q, cache.layers[0], "auto", monkeypatch)
    torch.testing.assert_close(got, attend(layout, q, cache.layers[0], "torch", monkeypatch), **CLOSE)


@pytest.mark.parametrize("dim", [8, 16, 24, 48, 64, 100, 128, 136, 200])
def test_every_head_size_gives_the_torch_paths_attention(dim, monkeypatch):
    """Heads of one to eight vectors of 16 entries (each scored by its own unrolled loop, the last vector whole or
    part-filled) and wider ones (scored eight vectors at a time); values of as many vectors, summed four at a time."""
    ends, new = [37, 20], [5, 2]
    cache, generator = scattered_cache(ends, 4, (2, 2, dim))
    layout = RaggedLayout.build(batch(ends, new), cache)
    q = torch.randn(sum(new), 6, dim, generator=generator)
    expected = attend(layout, q, cache.layers[0], "torch", monkeypatch)
    torch.testing.assert_close(attend(layout, q, cache.layers[0], "auto", monkeypatch), expected, **CLOSE)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))  # `build` is set once
@given(
    rows=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 6)), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 3, 16]),
    group=st.sampled_from([1, 3, 20]),
    first_position=st.integers(0, 1),
)
def test_any_rows_blocks_and_groups_give_the_torch_paths_attention(rows, block_size, group, first_position):
    """Rows of any length and number of new tokens, blocks of any size, GQA groups past the kernel's tile of heads,
    keys from position 0 or 1 (a draft's cache)."""
    ends = [max(end, new + first_position) for end, new in rows]
    new = [n for _, n in rows]
    cache, generator = scattered_cache(ends, block_size, (2, 2, 16), first_position=first_position)
    layout = RaggedLayout.build(batch(ends, new), cache)
    q = torch.randn(sum(new), 2 * group, 16, generator=generator)
    with pytest.MonkeyPatch.context() as monkeypatch:
        expected = attend(layout, q, cache.layers[0], "torch", monkeypatch)
        got = attend(layout, q, cache.layers[0], "auto", monkeypatch)
    torch.testing.assert_close(got, expected, **CLOSE)


def test_the_static_layout_reads_whole_tables_masked_by_position(monkeypatch):
    """Graph mode's layout: every row reads its whole table (blocks past its end: the scratch block), a padding
    row reads the scratch slot at the first position."""
    ends, width = [13, 30], 3
    cache, generator = scattered_cache(ends, 4, (2, 2, 16))
    tables = torch.cat([cache.table.sync(), torch.zeros_like(cache.table.sync()[:1])])  # the padding row's
    positions = torch.tensor([[e - width + j for j in range(width)] for e in ends] + [[0] * width])
    layout = RaggedLayout.static(positions, torch.zeros(9, dtype=torch.int64), tables, 0, 4)
    q = torch.randn(9, 4, 16, generator=generator)
    expected = attend(layout, q, cache.layers[0], "torch", monkeypatch)
    torch.testing.assert_close(attend(layout, q, cache.layers[0], "auto", monkeypatch), expected, **CLOSE)


@pytest.mark.parametrize("dim, value_dim", [(80, 64), (144, 128)], ids=["demo", "wide"])
def test_mla_latent_cache_one_head_whose_values_are_the_keys_first_entries(dim, value_dim, monkeypatch):
    from tandem.models.deepseek_v3 import attend_latent

    ends = [23, 11]
    cache, generator = scattered_cache(ends, 4, (dim,))
    layout = RaggedLayout.build(batch(ends, [3, 3]), cache)
    q = torch.randn(6, 8, dim, generator=generator)
    monkeypatch.setattr(attention, "attention_backend", "torch")
    expected = attend_latent(layout, q, cache.layers[0], value_dim, 0.1)
    monkeypatch.setattr(attention, "attention_backend", "auto")
    torch.testing.assert_close(attend_latent(layout, q, cache.layers[0], value_dim, 0.1), expected, **CLOSE)


def test_a_querys_output_depends_on_its_own_keys_alone(monkeypatch):
    """The same query at the same position gives the same bits whether its row decodes or verifies, alone or
    beside other rows: what lets a verify step reproduce a decode step's attention exactly."""
    monkeypatch.setattr(attention, "attention_backend", "auto")
    ends = [40, 25]
    cache, generator = scattered_cache(ends, 4, (2, 2, 16))
    pool = cache.layers[0]
    queries = torch.randn(5, 6, 16, generator=generator)  # row 0's last five tokens
    verify = RaggedLayout.build(batch(ends, [5, 3]), cache)
    together = verify.attend(torch.cat([queries, torch.randn(3, 6, 16, generator=generator)]), pool, 0.25)[:5]
    for i in range(5):
        alone = RaggedLayout.build(batch([ends[0] - 4 + i], [1]), cache)
        assert torch.equal(alone.attend(queries[i : i + 1], pool, 0.25)[0], together[i])


def test_prefills_torch_and_compiled_steps_keep_the_torch_path(monkeypatch):
    cache, generator = scattered_cache([40], 4, (2, 2, 16))
    q = torch.randn(FOLD_MAX_QUERY + 1, 4, 16, generator=generator)
    monkeypatch.setattr(attention, "attention_backend", "auto")
    assert not RaggedLayout.build(batch([40], [FOLD_MAX_QUERY + 1]), cache).reads_pools(q)  # a prefill: sdpa
    decode = RaggedLayout.build(batch([40], [1]), cache)
    assert decode.reads_pools(q[:1]) and not decode.reads_pools(q[:1].double())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not decode.reads_pools(q[:1])
    monkeypatch.undo()
    monkeypatch.setattr(attention, "attention_backend", "torch")
    assert not decode.reads_pools(q[:1])


def test_pools_and_tables_that_do_not_fit_are_refused_with_their_shapes():
    q = torch.zeros(1, 1, 4, 16)
    pool = torch.zeros(3, 4, 2, 2, 16)
    tables, positions = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64)
    window = {"scale": 0.25, "key_start": 0, "key_end": 8, "key_offset": 0}
    assert cpu_attention.paged_attention(q, pool[:, :, 0], pool[:, :, 1], tables, positions, **window).shape == (
        1, 1, 4, 16
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"tables \(1, 2\).*window 0\.\.12"):
        cpu_attention.paged_attention(q, pool[:, :, 0], pool[:, :, 1], tables, positions, **window | {"key_end": 12})
    with pytest.raises(ValueError, match="CPU float32 tensors"):
        cpu_attention.paged_attention(q.double(), pool[:, :, 0], pool[:, :, 1], tables, positions, **window)


def test_a_target_over_scattered_blocks_gives_the_torch_paths_logits(tmp_path, monkeypatch):
    """A tiny GQA Llama's prefill, verify and decode steps, one cache per path: logits as the torch path's."""
    from tandem.models.loading import load_target
    from tests.models.conftest import save_tiny_llama

    save_tiny_llama(tmp_path, num_hidden_layers=2)
    target = load_target(tmp_path)
    caches = []
    for _ in range(2):
        table = BlockTable(2, 32, 4, 12, "cpu")
        for slot, blocks in enumerate([[8, 6, 4, 2, 1], [3, 5, 7, 9, 10]]):
            table.set_blocks(slot, blocks)
        caches.append(target.new_cache(2, 32, table=table))
    steps = [
        ([[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8]], [0, 0]),  # prefill (sdpa), then verify and decode (the kernel)
        ([[3, 5, 8], [2, 8, 1]], [9, 4]),
        ([[9], [8]], [12, 7]),
    ]
    for rows, starts in steps:
        forward = ForwardBatch.from_rows(rows, starts, [0, 1])
        logits = []
        for backend, cache in zip(["torch", "auto"], caches):
            monkeypatch.setattr(attention, "attention_backend", backend)
            logits.append(target.forward(forward, cache).logits)
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
