"""The paged-attention kernel equals the torch path (gather + sdpa) it replaces: decode and verify steps, ragged
rows, GQA, blocks out of order, the eager and the graph layouts, MLA's latent cache, a whole target's logits.

On the CPU the kernel runs under Triton's interpreter, so shapes stay small. Tolerances: float32 1e-5 (both
paths accumulate in float32); bfloat16 2e-2, under three of its ulps at the outputs' magnitude (about 1; the
kernel rounds the probabilities to bfloat16 before ``p @ v``, as flash attention does; sdpa's CPU path does not).
On a GPU the same tests run the compiled kernel on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels import paged_attention_triton
from tandem.models import attention
from tandem.models.attention import RaggedLayout
from tandem.models.base import BlockTable, ForwardBatch, KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU's kernel: Triton's interpreter
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _attend(layout: RaggedLayout, q: torch.Tensor, pool: torch.Tensor, backend: str, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(attention, "attention_backend", backend)
    return layout.attend(q, pool, q.shape[-1] ** -0.5)


def _scattered_cache(ends: list[int], block_size: int, entry: tuple, dtype, *, seed: int = 0, first_position=0):
    """A one-layer cache whose rows hold ``ends[b]`` positions in shuffled blocks, every entry random (positions
    past a row's end too: the kernel must mask them, not rely on zeros)."""
    generator = torch.Generator().manual_seed(seed)
    max_len = max(ends) + block_size
    blocks = [-(-end // block_size) for end in ends]
    order = (torch.randperm(sum(blocks) + 1, generator=generator) + 1).tolist()  # block 0: the scratch block
    table = BlockTable(len(ends), max_len, block_size, sum(blocks) + 2, DEVICE)
    for slot, n in enumerate(blocks):
        table.set_blocks(slot, [order.pop() for _ in range(n)])
    pool = torch.randn(table.num_blocks, block_size, *entry, generator=generator).to(DEVICE, dtype)
    return KVCache([pool], table, first_position=first_position), generator


def _batch(ends: list[int], new: list[int]) -> ForwardBatch:
    starts = [e - n for e, n in zip(ends, new)]
    return ForwardBatch.from_rows([[0] * n for n in new], starts, list(range(len(ends))), device=DEVICE)


def _randn(*shape: int, generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Standard normal values on the test device (drawn on the CPU: the same values on every device)."""
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ends, new",
    [
        ([37, 9, 20], [1, 1, 1]),  # decode, rows of different lengths
        ([37, 9, 20], [4, 4, 4]),  # verify: k + 1 = 4, causal within each row's new tokens
        ([37, 9, 20], [1, 4, 3]),  # ragged: a padded query grid
        ([50, 9, 20], [40, 1, 3]),  # a prefill chunk beside decode and verify rows: several tiles of queries
    ],
    ids=["decode", "verify", "ragged", "chunk"],
)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_the_kernel_equals_gather_and_sdpa(ends, new, heads, dtype, monkeypatch):
    num_heads, num_kv_heads = heads
    cache, generator = _scattered_cache(ends, 4, (2, num_kv_heads, 32), dtype)
    layout = RaggedLayout.build(_batch(ends, new), cache)
    assert layout.addressing.tables is not None  # shuffled blocks: no view of the pool
    q = _randn(sum(new), num_heads, 32, generator=generator, dtype=dtype)
    expected = _attend(layout, q, cache.layers[0], "torch", monkeypatch)
    got = _attend(layout, q, cache.layers[0], "triton", monkeypatch)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_a_window_of_consecutive_blocks_and_keys_from_position_one(monkeypatch):
    """The contiguous layout (one block per slot, a view of the pool for the torch path) and a draft's cache,
    which holds nothing at position 0."""
    table = BlockTable.contiguous(3, 24, DEVICE)
    generator = torch.Generator().manual_seed(1)
    cache = KVCache([_randn(3, 24, 2, 2, 16, generator=generator)], table, first_position=1)
    layout = RaggedLayout.build(_batch([24, 24, 24], [3, 3, 3]), cache)
    assert layout.addressing.tables is None and layout.addressing.key_start == 1
    q = _randn(9, 4, 16, generator=generator)
    expected = _attend(layout, q, cache.layers[0], "torch", monkeypatch)
    torch.testing.assert_close(
        _attend(layout, q, cache.layers[0], "triton", monkeypatch), expected, **TOLERANCE[torch.float32]
    )


def test_the_static_layout_reads_whole_tables_masked_by_position(monkeypatch):
    """Graph mode's layout: every row reads its whole table (blocks past its end: the scratch block), a padding
    row reads the scratch slot at the first position."""
    ends, width = [13, 30], 3
    cache, generator = _scattered_cache(ends, 4, (2, 2, 16), torch.float32)
    tables = cache.table.sync()
    tables = torch.cat([tables, torch.zeros_like(tables[:1])])  # the padding row: the scratch block only
    positions = torch.tensor([[e - width + j for j in range(width)] for e in ends] + [[0] * width], device=DEVICE)
    layout = RaggedLayout.static(positions, torch.zeros(9, dtype=torch.int64, device=DEVICE), tables, 0, 4)
    q = _randn(9, 4, 16, generator=generator)
    expected = _attend(layout, q, cache.layers[0], "torch", monkeypatch)
    torch.testing.assert_close(
        _attend(layout, q, cache.layers[0], "triton", monkeypatch), expected, **TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_splitting_the_keys_combines_to_one_softmax(splits, monkeypatch):
    """Each row's keys cut into slices, combined by their softmax mass; more slices than the short row has key
    tiles leave some of its slices empty."""
    ends = [300, 40]
    cache, generator = _scattered_cache(ends, 16, (2, 2, 16), torch.float32)
    pool = cache.layers[0]
    layout = RaggedLayout.build(_batch(ends, [2, 2]), cache)
    q = _randn(4, 4, 16, generator=generator)
    got = paged_attention_triton(
        layout.to_grid(q), pool[:, :, 0], pool[:, :, 1], layout.block_tables(), layout.positions,
        scale=0.25, key_start=0, key_end=300, splits=splits,
    )  # fmt: skip
    expected = _attend(layout, q, pool, "torch", monkeypatch)
    torch.testing.assert_close(layout.from_grid(got), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("latent", [False, True], ids=["llama", "mla"])
def test_the_kernel_is_a_custom_op_that_compiles_whole(latent, monkeypatch):
    """Traced by torch.compile, the kernel is ``tandem::paged_attention`` (the eager launch reads the caches'
    addresses, which tracing cannot): its fake kernel passes ``opcheck``, and graph mode's static layout attends
    whole (``fullgraph``) with eager's outputs, over Llama's key and value views and MLA's latent one."""
    monkeypatch.setattr(attention, "attention_backend", "triton")
    ends, width, dim = [13, 30], 3, 24
    cache, generator = _scattered_cache(ends, 4, (dim,) if latent else (2, 2, dim), torch.float32)
    pool = cache.layers[0]
    keys, values = (pool[:, :, None], pool[:, :, None, :16]) if latent else (pool[:, :, 0], pool[:, :, 1])
    tables = cache.table.sync()
    positions = torch.tensor([[e - width + j for j in range(width)] for e in ends], device=DEVICE)
    q = _randn(6, 4, dim, generator=generator)

    def attend(q, keys, values, positions, tables):
        layout = RaggedLayout.static(positions, positions.flatten(), tables, 0, 4)
        return layout.attend_paged(q, keys, values, 0.25)

    window = {"scale": 0.25, "key_start": 0, "key_end": 32}
    torch.library.opcheck(
        torch.ops.tandem.paged_attention.default,
        (q.view(len(ends), width, 4, dim), keys, values, tables, positions),
        window,
    )
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(
        compiled(q, keys, values, positions, tables), attend(q, keys, values, positions, tables), atol=0, rtol=0
    )


@settings(max_examples=12)
@given(
    rows=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 6)), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 3, 16]),
    group=st.sampled_from([1, 3]),
    first_position=st.integers(0, 1),
    splits=st.integers(1, 4),
)
def test_any_rows_blocks_and_splits_give_the_torch_paths_attention(rows, block_size, group, first_position, splits):
    """Rows of any length and number of new tokens (at most its length past the first position), blocks of any
    size, GQA or not, keys from position 0 or 1, and any number of splits."""
    ends = [max(end, new + first_position) for end, new in rows]
    new = [n for _, n in rows]
    cache, generator = _scattered_cache(ends, block_size, (2, 2, 16), torch.float32, first_position=first_position)
    pool = cache.layers[0]
    layout = RaggedLayout.build(_batch(ends, new), cache)
    q = _randn(sum(new), 2 * group, 16, generator=generator)
    a = layout.addressing
    got = paged_attention_triton(
        layout.to_grid(q), pool[:, :, 0], pool[:, :, 1], layout.block_tables(), layout.positions,
        scale=0.25, key_start=a.key_start, key_end=a.key_end, key_offset=a.key_offset, splits=splits,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as monkeypatch:
        expected = _attend(layout, q, pool, "torch", monkeypatch)
    torch.testing.assert_close(layout.from_grid(got), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dim, value_dim", [(80, 64), (144, 128)], ids=["demo", "wide"])
def test_mla_latent_cache_one_head_whose_values_are_the_keys_first_entries(dim, value_dim, monkeypatch):
    """DeepSeek-V3's absorbed MLA: every query head over one latent head (``kv_lora_rank + qk_rope_head_dim``
    wide, not a power of two), through the kernel's latent path (tests/kernels/test_paged_latent.py)."""
    from tandem.models.deepseek_v3 import attend_latent

    monkeypatch.setattr(attention, "attention_backend", "torch")  # the reference: gather + sdpa, whatever is set

    ends = [23, 11]
    cache, generator = _scattered_cache(ends, 4, (dim,), torch.float32)
    latents = cache.layers[0]
    layout = RaggedLayout.build(_batch(ends, [3, 3]), cache)
    q = _randn(6, 8, dim, generator=generator)
    expected = attend_latent(layout, q, latents, value_dim, 0.1)
    got = layout.attend_paged(q, latents[:, :, None], latents[:, :, None, :value_dim], 0.1)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def assert_triton_logits_equal_torch_logits(target, monkeypatch) -> int:
    """Prefill, verify and decode steps of two rows over out-of-order blocks, one cache per backend: the target's
    logits through the kernel ("triton") as the torch path's (float32: both accumulate in float32). Returns the
    steps run."""
    caches = []
    for _ in range(2):
        table = BlockTable(2, 32, 4, 12, DEVICE)
        for slot, blocks in enumerate([[8, 6, 4, 2, 1], [3, 5, 7, 9, 10]]):
            table.set_blocks(slot, blocks)
        caches.append(target.new_cache(2, 32, table=table))
    steps = [
        ([[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8]], [0, 0]),
        ([[3, 5, 8], [2, 8, 1]], [9, 4]),
        ([[9], [8]], [12, 7]),
    ]
    for rows, starts in steps:
        batch = ForwardBatch.from_rows(rows, starts, [0, 1], device=DEVICE)
        logits = []
        for backend, cache in zip(["torch", "triton"], caches):
            monkeypatch.setattr(attention, "attention_backend", backend)
            logits.append(target.forward(batch, cache).logits)
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    return len(steps)


def test_a_target_over_scattered_blocks_gives_the_torch_paths_logits(tmp_path, monkeypatch):
    """A tiny GQA Llama's prefill, verify and decode steps: every layer through the kernel, logits as the torch
    path's."""
    from tandem.models.loading import load_target
    from tests.models.conftest import save_tiny_llama

    save_tiny_llama(tmp_path, num_hidden_layers=2)
    assert_triton_logits_equal_torch_logits(load_target(tmp_path, device=DEVICE), monkeypatch)


def test_an_unknown_backend_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(attention, "attention_backend", "flash")
    with pytest.raises(ValueError, match="TANDEM_ATTENTION must be one of auto, torch, triton; got 'flash'"):
        attention.uses_kernel(torch.zeros(1))


def test_auto_keeps_cpu_tensors_off_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(attention, "attention_backend", "auto")
    assert not attention.uses_kernel(torch.zeros(1))


# Run in a process of its own: where the tests interpret Triton, its whole language module is the interpreter's.
_COMPILE_FOR_SM90 = """
import json, subprocess, sys, tempfile
from pathlib import Path

import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tandem.kernels import paged_attention

kernel, usage = paged_attention._partial_kernel, []
for pairs, dim_k, dim_v, latent in json.loads(sys.argv[1]):
    tiles = paged_attention.tile_config(pairs, dim_k, dim_v, torch.bfloat16, latent)
    num_warps = tiles.pop("num_warps")
    constants = dict(tiles, BLOCK_SIZE=16, GROUP=pairs, DK=dim_k, DV=dim_v, LATENT=latent, SPLIT=True, F32_DOT=False)
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i64", "pos_ptr": "*i64",
                "out_ptr": "*fp32", "lse_ptr": "*fp32"}
    signature = {name: pointers.get(name, "constexpr" if name in constants else "fp32" if name == "scale" else "i32")
                 for name in kernel.arg_names}
    # The JIT's specialisation at real shapes: pointers, and the strides it specialises, divisible by 16.
    strides = {f"stride_{s}" for s in ("qq", "qh", "kb", "ke", "kh", "vb", "ve", "vh", "oq", "oh", "lq")}
    aligned = [i for i, name in enumerate(kernel.arg_names) if name in pointers or name in strides]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.cubin").write_bytes(compiled.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        out = subprocess.run([tool, "--dump-resource-usage", Path(tmp) / "k.cubin"], capture_output=True, text=True)
    usage.append(next(line.strip() for line in out.stdout.splitlines() if "REG:" in line))
print(json.dumps(usage))
"""


def test_the_kernel_compiles_for_sm90_without_spilling_registers():
    """Llama-3-8B's decode and verify (k = 4) tiles and DeepSeek-V3's MLA decode (its latent tiles), in bfloat16,
    compiled ahead of time for an H100 by Triton's own ptxas (no GPU needed) with the tiles and warps a launch takes:
    a spill (stack) would send each key tile's values through local memory, in the loop that reads the whole
    context. MLA's 64-pair tile may spill a little (at most 512 bytes a thread): it reads the latents half as often
    as a 32-pair tile that fits, which measured faster on an H200 (README, paged attention)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("Triton without its NVIDIA tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    cases = [(4, 128, 128, False), (20, 128, 128, False), (128, 576, 512, True)]
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90, json.dumps(cases)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for case, usage in zip(cases, json.loads(run.stdout), strict=True):
        stack = int(usage.split("STACK:")[1].split()[0])
        assert stack <= (512 if case[3] else 0), (case, usage)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Over thousands of keys random values average out to small outputs, where an absolute tolerance says little: the
# GPU tests bound the error's norm relative to the output's (bfloat16: about two of its ulps; float32: loose for
# float32 kernels, and far below what a wrong key or mask gives).
RELATIVE_ERROR = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def _assert_close_relative(got: torch.Tensor, expected: torch.Tensor) -> None:
    error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert got.dtype == expected.dtype and error < RELATIVE_ERROR[expected.dtype], error


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "context, dtype", [(1024, torch.bfloat16), (4096, torch.bfloat16), (16384, torch.bfloat16), (4096, torch.float32)]
)
@pytest.mark.parametrize("width", [1, 5], ids=["decode", "verify"])
def test_real_shapes_on_the_gpu(context, dtype, width, monkeypatch):
    """Llama-3-8B's attention (32 query heads over 8 KV heads of 128), rows from ``context`` down to a few
    blocks, 16-position blocks shuffled over the pool."""
    ends = [context, context // 2 + 3, 3 * context // 4, 40]
    cache, generator = _scattered_cache(ends, 16, (2, 8, 128), dtype, seed=context)
    layout = RaggedLayout.build(_batch(ends, [width] * len(ends)), cache)
    q = _randn(len(ends) * width, 32, 128, generator=generator, dtype=dtype)
    expected = _attend(layout, q, cache.layers[0], "torch", monkeypatch)
    _assert_close_relative(_attend(layout, q, cache.layers[0], "auto", monkeypatch), expected)


@pytest.mark.gpu
@needs_cuda
def test_a_captured_cuda_graph_follows_new_positions_and_tables(monkeypatch):
    """Graph mode's static layout captured once: replays over other rows' lengths and blocks equal the torch path."""
    monkeypatch.setattr(attention, "attention_backend", "auto")
    rows, width, nb, size = 4, 5, 64, 16
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(rows * nb + 1, size, 2, 8, 128, generator=generator).bfloat16().cuda()
    positions = torch.zeros(rows, width, dtype=torch.int64, device="cuda")
    tables = torch.zeros(rows, nb, dtype=torch.int64, device="cuda")
    q = torch.zeros(rows * width, 32, 128, dtype=torch.bfloat16, device="cuda")

    def step():
        layout = RaggedLayout.static(positions, positions.flatten(), tables, 0, size)  # writes: none here
        return layout.attend(q, pool, 128**-0.5)

    step()  # compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        ends = torch.randint(width, nb * size, (rows,), generator=generator)
        positions.copy_(ends[:, None] - width + torch.arange(width))
        tables.copy_(torch.randperm(rows * nb, generator=generator).view(rows, nb) + 1)
        q.copy_(torch.randn(q.shape, generator=generator))
        graph.replay()
        monkeypatch.setattr(attention, "attention_backend", "torch")
        expected = step()
        monkeypatch.setattr(attention, "attention_backend", "auto")
        _assert_close_relative(out, expected)
