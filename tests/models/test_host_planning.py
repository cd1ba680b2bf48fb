"""A forward plans on the host: layouts and cache checks read :class:`RowSpans`, never the device.

The providers here run on the meta device, where reading a tensor's values raises: a
``.tolist()``, ``int(tensor)`` or unsized ``repeat_interleave`` in a forward or in chained
drafting (each a device sync on a GPU, which stalls the mask overlap) fails these tests.
MoE layers keep their per-expert token counts on the device too (``F.grouped_mm``).
"""

from __future__ import annotations

import json

import torch

from tandem.llm import resolve_model
from tandem.models import DraftInput, ForwardBatch
from tandem.models.config import DeepseekV3Config, Eagle3Config, EagleConfig, LlamaConfig
from tandem.models.deepseek_v3 import DeepseekV3
from tandem.models.drafts.eagle import Eagle
from tandem.models.drafts.eagle3 import Eagle3
from tandem.models.drafts.mtp import MultiTokenPredictor
from tandem.models.llama3 import Llama3

META = {"dtype": torch.float32, "device": "meta"}


def demo_config(name: str, **overrides) -> dict:
    config = json.loads((resolve_model(name) / "config.json").read_text())
    return {**config, **overrides}


def prefill_then_verify(target, cache, *, return_hidden=False, return_aux=False):
    """A ragged prefill of three rows, then a ragged verify step: the engine's two kinds of forward."""
    prefill = ForwardBatch.from_rows([[1, 2, 3], [4], [5, 6]], [0, 0, 0], [2, 0, 1], device="meta")
    target.forward(prefill, cache)
    verify = ForwardBatch.from_rows([[3, 7, 8], [4, 9], [6]], [2, 0, 1], [2, 0, 1], device="meta")
    out = target.forward(verify, cache, return_hidden=return_hidden, return_aux=return_aux)
    assert out.logits.shape == (6, target.vocab_size) and out.logits.is_meta
    assert cache.lengths == [2, 2, 5]
    return out


def chain(draft, hidden_width: int, k: int = 4, dtype: torch.dtype = torch.float32):
    """Committed pairs of three ragged rows, then ``k - 1`` chained single-token steps."""
    cache = draft.new_cache(3, 32)
    batch = ForwardBatch.from_rows([[2, 3], [4], [6, 7, 8]], [1, 1, 1], [2, 0, 1], device="meta")
    hidden = torch.zeros(batch.num_tokens, hidden_width, dtype=dtype, device="meta")
    proposal = draft.propose(DraftInput(batch, hidden, None), cache, k)
    assert proposal.tokens.shape == (3, k) and proposal.tokens.is_meta
    assert cache.lengths == [2 + k - 1, 4 + k - 1, 3 + k - 1]  # slots 0, 1, 2: their row's end, k - 1 chained


def test_llama_and_its_eagle_drafts_never_read_the_device():
    target = Llama3(LlamaConfig.from_dict(demo_config("demo-llama")), **META)
    out = prefill_then_verify(target, target.new_cache(3, 32), return_hidden=True, return_aux=True)
    assert out.hidden.is_meta and out.aux_hidden.is_meta
    draft_dir = resolve_model("demo-llama").parent
    eagle_config = json.loads((draft_dir / "demo-llama-eagle" / "config.json").read_text())
    chain(Eagle(EagleConfig.from_dict(eagle_config), target, **META), target.hidden_size)
    eagle3_config = json.loads((draft_dir / "demo-llama-eagle3" / "config.json").read_text())
    chain(Eagle3(Eagle3Config.from_dict(eagle3_config), target, **META), len(target.aux_layer_ids) * target.hidden_size)


def test_deepseek_and_its_mtp_layer_never_read_the_device():
    """In bfloat16, the dtype whose grouped matmul the meta kernels (like CUDA's) accept."""
    config = demo_config("demo-deepseek")
    assert config["first_k_dense_replace"] < config["num_hidden_layers"]  # MoE layers, the MTP layer's too
    target = DeepseekV3(DeepseekV3Config.from_dict(config), dtype=torch.bfloat16, device="meta")
    prefill_then_verify(target, target.new_cache(3, 32), return_hidden=True)
    chain(
        MultiTokenPredictor(DeepseekV3Config.from_dict(config), target, dtype=torch.bfloat16, device="meta"),
        target.hidden_size,
        dtype=torch.bfloat16,
    )
