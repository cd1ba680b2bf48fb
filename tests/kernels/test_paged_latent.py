"""DeepSeek-V3's MLA attends through the paged-attention kernel where the backend says so (`attend_latent` ->
`RaggedLayout.attend_paged`, one latent head whose first entries are the values), with the torch path's logits;
the kernel's latent path (each key tile read once: its value part and its rotary part, two products) equals
gather + sdpa.

On the CPU the kernel runs under Triton's interpreter (this directory's conftest), so shapes and the target are tiny;
real shapes run on a GPU only."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import paged_attention
from tandem.models import attention
from tandem.models.attention import RaggedLayout
from tandem.models.deepseek_v3 import attend_latent
from tandem.models.loading import load_target
from tests.kernels.test_paged_attention import (
    DEVICE,
    TOLERANCE,
    _assert_close_relative,
    _batch,
    _randn,
    _scattered_cache,
    assert_triton_logits_equal_torch_logits,
    needs_cuda,
)
from tests.models.test_deepseek_v3 import save_reference, tiny_config

# A latent of 40 value entries (not a power of two) and 12 rotary ones past them, read by 12 query heads.
VALUE_DIM, LATENT_DIM, HEADS = 40, 52, 12


def _latent_step(ends: list[int], width: int, dtype, monkeypatch):
    """Rows ending at ``ends`` with ``width`` new tokens each over shuffled 4-position blocks of random latents: the
    layout, the latents ``[num_blocks, 4, LATENT_DIM]``, queries ``[T, HEADS, LATENT_DIM]`` and the torch path's
    attention (gather + sdpa)."""
    cache, generator = _scattered_cache(ends, 4, (LATENT_DIM,), dtype)
    layout = RaggedLayout.build(_batch(ends, [width] * len(ends)), cache)
    q = _randn(len(ends) * width, HEADS, LATENT_DIM, generator=generator, dtype=dtype)
    monkeypatch.setattr(attention, "attention_backend", "torch")
    return layout, cache.layers[0], q, attend_latent(layout, q, cache.layers[0], VALUE_DIM, 0.1)


class _Launches:
    """Stands in for `_partial_kernel`, recording each launch's keyword arguments (its constants)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("width", [1, 5], ids=["decode", "verify"])
def test_the_latent_kernel_equals_gather_and_sdpa(width, splits, dtype, monkeypatch):
    """Rows of different lengths, a decode step (12 pairs of query and head: one tile) and a verify step (60: two),
    the keys in one split or in three (some empty for the short rows)."""
    layout, latents, q, expected = _latent_step([45, 9, 30], width, dtype, monkeypatch)
    a = layout.addressing
    got = paged_attention.paged_attention_triton(
        layout.to_grid(q), latents[:, :, None], latents[:, :, None, :VALUE_DIM], layout.block_tables(),
        layout.positions, scale=0.1, key_start=a.key_start, key_end=a.key_end, key_offset=a.key_offset, splits=splits,
    )  # fmt: skip
    torch.testing.assert_close(layout.from_grid(got), expected, **TOLERANCE[dtype])


def test_attend_latent_reads_the_latents_through_the_latent_kernel(monkeypatch):
    """`attend_latent` launches the latent path (the value tile also the keys' first entries, BLOCK_DK only the
    rotary entries past them); values held apart from the keys take the generic kernel (the whole key padded to a
    power of two), which gives the same attention; Llama's keys and values are never taken for latents."""
    layout, latents, q, expected = _latent_step([45, 9, 30], 5, torch.float32, monkeypatch)
    launches = _Launches(paged_attention._partial_kernel)
    monkeypatch.setattr(paged_attention, "_partial_kernel", launches)
    monkeypatch.setattr(attention, "attention_backend", "triton")
    got = attend_latent(layout, q, latents, VALUE_DIM, 0.1)
    apart = layout.attend_paged(q, latents[:, :, None], latents[:, :, None, :VALUE_DIM].clone(), 0.1)
    assert [(c["LATENT"], c["BLOCK_DK"], c["BLOCK_DV"]) for c in launches.calls] == [(True, 16, 64), (False, 64, 64)]
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(apart, got, **TOLERANCE[torch.float32])
    pool = torch.zeros(3, 4, 2, 2, 16)
    assert not paged_attention.values_in_keys(pool[:, :, 0], pool[:, :, 1])


def test_a_deepseek_target_over_scattered_blocks_gives_the_torch_paths_logits(tmp_path, monkeypatch):
    """Prefill, verify and decode steps of two rows over out-of-order blocks: every MLA layer through the kernel
    (counted), logits as the torch path's (float32: both accumulate in float32)."""
    save_reference(tmp_path, tiny_config(num_hidden_layers=2))  # a dense layer, then a MoE one
    target = load_target(tmp_path, device=DEVICE)
    kernel_calls = []
    attend_paged = RaggedLayout.attend_paged

    def counted(layout, *args, **kwargs):
        kernel_calls.append(attention.attention_backend)
        return attend_paged(layout, *args, **kwargs)

    monkeypatch.setattr(RaggedLayout, "attend_paged", counted)
    steps = assert_triton_logits_equal_torch_logits(target, monkeypatch)
    assert kernel_calls == ["triton"] * 2 * steps  # each layer of each triton step, none of the torch ones


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("context", [4096, 16384])
@pytest.mark.parametrize("width", [1, 5], ids=["decode", "verify"])
def test_deepseek_v3_shapes_on_the_gpu(width, context, monkeypatch):
    """DeepSeek-V3's MLA (128 query heads over one 576-entry latent head, the values its first 512) in bfloat16,
    rows from ``context`` positions down to a few blocks over shuffled 64-position blocks: the kernel as the torch
    path."""
    ends = [context, context // 2 + 3, 3 * context // 4, 40]
    cache, generator = _scattered_cache(ends, 64, (576,), torch.bfloat16)
    layout = RaggedLayout.build(_batch(ends, [width] * len(ends)), cache)
    query = _randn(len(ends) * width, 128, 576, generator=generator, dtype=torch.bfloat16)
    out = {}
    for backend in ("torch", "auto"):
        monkeypatch.setattr(attention, "attention_backend", backend)
        out[backend] = attend_latent(layout, query, cache.layers[0], 512, 192**-0.5)
    assert out["auto"].shape == (len(ends) * width, 128, 512)
    _assert_close_relative(out["auto"], out["torch"])
