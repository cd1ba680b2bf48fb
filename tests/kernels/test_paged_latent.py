"""DeepSeek-V3's MLA attends through the paged-attention kernel where the backend says so (`attend_latent` ->
`RaggedLayout.attend_paged`, one latent head whose first entries are the values), with the torch path's logits.

On the CPU the kernel runs under Triton's interpreter (this directory's conftest), so the target is tiny."""

from __future__ import annotations

from tandem.models import attention
from tandem.models.attention import RaggedLayout
from tandem.models.loading import load_target
from tests.kernels.test_paged_attention import DEVICE, assert_triton_logits_equal_torch_logits
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
