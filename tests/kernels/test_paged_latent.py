"""DeepSeek-V3's MLA attends through the paged-attention kernel where the backend says so (`attend_latent` ->
`RaggedLayout.attend_paged`, one latent head whose first entries are the values), with the torch path's logits.

On the CPU the kernel runs under Triton's interpreter (this directory's conftest), so the target is tiny."""

from __future__ import annotations

import torch

from tandem.models import attention
from tandem.models.attention import RaggedLayout
from tandem.models.base import BlockTable, ForwardBatch
from tandem.models.loading import load_target
from tests.kernels.test_paged_attention import DEVICE
from tests.models.test_deepseek_v3 import save_reference, tiny_config


def test_a_deepseek_target_over_scattered_blocks_gives_the_torch_paths_logits(tmp_path, monkeypatch):
    """Prefill, verify and decode steps of two rows over out-of-order blocks: every MLA layer through the kernel
    (counted), logits as the torch path's (float32: both accumulate in float32)."""
    save_reference(tmp_path, tiny_config(num_hidden_layers=2))  # a dense layer, then a MoE one
    target = load_target(tmp_path, device=DEVICE)
    caches = []
    for _ in range(2):
        table = BlockTable(2, 32, 4, 12, DEVICE)
        for slot, blocks in enumerate([[8, 6, 4, 2, 1], [3, 5, 7, 9, 10]]):
            table.set_blocks(slot, blocks)
        caches.append(target.new_cache(2, 32, table=table))
    kernel_calls = []
    attend_paged = RaggedLayout.attend_paged

    def counted(layout, *args, **kwargs):
        kernel_calls.append(attention.attention_backend)
        return attend_paged(layout, *args, **kwargs)

    monkeypatch.setattr(RaggedLayout, "attend_paged", counted)
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
    assert kernel_calls == ["triton"] * 2 * len(steps)  # each layer of each triton step, none of the torch ones
