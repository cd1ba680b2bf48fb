"""DeepSeek-V3's MLA attends through the paged-attention kernel where the backend says so (`attend_latent` ->
`RaggedLayout.attend_paged`, one latent head whose first entries are the values), with the torch path's logits.

On the CPU the kernel runs under Triton's interpreter (this directory's conftest), so the target is tiny; real shapes
run on a GPU only."""

from __future__ import annotations

import pytest
import torch

from tandem.models import attention
from tandem.models.attention import RaggedLayout
from tandem.models.deepseek_v3 import attend_latent
from tandem.models.loading import load_target
from tests.kernels.test_paged_attention import (
    DEVICE,
    _assert_close_relative,
    _batch,
    _randn,
    _scattered_cache,
    assert_triton_logits_equal_torch_logits,
    needs_cuda,
)
from tests.models.test_deepseek_v3 import save_reference, tiny_config


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
@pytest.mark.parametrize("width", [1, 5], ids=["decode", "verify"])
def test_deepseek_v3_shapes_on_the_gpu(width, monkeypatch):
    """DeepSeek-V3's MLA (128 query heads over one 576-entry latent head, the values its first 512) in bfloat16,
    rows from 4096 positions down to a few blocks over shuffled 64-position blocks: the kernel as the torch path."""
    ends = [4096, 2051, 3072, 40]
    cache, generator = _scattered_cache(ends, 64, (576,), torch.bfloat16)
    layout = RaggedLayout.build(_batch(ends, [width] * len(ends)), cache)
    query = _randn(len(ends) * width, 128, 576, generator=generator, dtype=torch.bfloat16)
    out = {}
    for backend in ("torch", "auto"):
        monkeypatch.setattr(attention, "attention_backend", backend)
        out[backend] = attend_latent(layout, query, cache.layers[0], 512, 192**-0.5)
    assert out["auto"].shape == (len(ends) * width, 128, 512)
    _assert_close_relative(out["auto"], out["torch"])
