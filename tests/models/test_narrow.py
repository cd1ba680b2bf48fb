"""Matmul weights stored in bfloat16 and widened per call (`narrow_exact_weights`): the shipped demo
checkpoints are bfloat16, so a float32 model narrowed from them computes the wide model's logits up
to float32 summation order (sgemm's depends on the weight's layout) and the same drafts, through
`F.linear` and through the CPU kernel; weights bfloat16 cannot hold exactly keep their dtype. A tied embedding is
narrowed too (its head), unless no kernel reads it and it is too large to widen per call."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.assets import ASSETS_DIR
from tandem.kernels import cpu_linear
from tandem.llm import LLM
from tandem.models import ForwardBatch, load_draft, load_target
from tandem.models import linear as linear_module
from tandem.models.base import DraftInput
from tandem.models.config import LlamaConfig
from tandem.models.deepseek_v3 import MultiHeadLatentAttention
from tandem.models.linear import Linear, MergedLinear, narrow_exact_weights
from tandem.models.llama3 import Llama3
from tandem.models.moe import RoutedExperts
from tandem.models.norm import RMSNorm
from tests.models.conftest import TINY_TIED_LLAMA

PAIRS = [
    ("demo-llama", ASSETS_DIR / "demo-llama-eagle3"),
    ("demo-llama", ASSETS_DIR / "demo-llama-eagle"),
    ("demo-deepseek", "mtp"),
]


def narrowable_dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    return {
        f"{type(m).__name__}.{name}": getattr(m, name).dtype
        for m in module.modules()
        for name in getattr(m, "narrowable", ())
    }


@pytest.mark.parametrize(
    "kernel",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(not cpu_linear.available(), reason="the CPU kernel is not built or needs AVX2"),
        ),
    ],
    ids=["F.linear", "kernel"],
)
@pytest.mark.parametrize("model, draft_kind", PAIRS, ids=lambda p: getattr(p, "name", p))
@torch.inference_mode()
def test_narrowed_target_and_draft_compute_the_wide_results(model, draft_kind, kernel, monkeypatch):
    monkeypatch.setattr(cpu_linear, "_AVAILABLE", kernel)
    target = load_target(ASSETS_DIR / model, dtype=torch.float32)
    draft = load_draft(draft_kind, target)
    wide_target, wide_draft = copy.deepcopy((target, draft))  # one copy: the draft's copy uses the target's
    assert narrow_exact_weights(target) > 0 and narrow_exact_weights(draft) > 0
    assert set(narrowable_dtypes(target).values()) == set(narrowable_dtypes(draft).values()) == {torch.bfloat16}
    norms = [m.weight.dtype for model in (target, draft) for m in model.modules() if isinstance(m, RMSNorm)]
    assert set(norms) == {torch.float32}  # only matmul weights are narrowed
    latent_ups = [m.kv_b_proj.weight.dtype for m in target.modules() if isinstance(m, MultiHeadLatentAttention)]
    assert set(latent_ups) <= {torch.float32}  # MLA's kv_b is read by bmm, which would widen it per call

    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(8, target.vocab_size, (n,), generator=g).tolist() for n in (9, 5)]
    results = []
    for t, d in ((target, draft), (wide_target, wide_draft)):
        cache, draft_cache = t.new_cache(2, 32), d.new_cache(2, 32)
        prefill = ForwardBatch.from_rows(rows, [0, 0], [0, 1])
        out = t.forward(prefill, cache, return_hidden=d.hidden_kind == "last", return_aux=d.hidden_kind == "aux")
        hidden = out.hidden if d.hidden_kind == "last" else out.aux_hidden
        tail = ForwardBatch.from_rows([row[1:] for row in rows], [1, 1], [0, 1])  # (h_{p-1}, x_p) pairs
        ends = {len(rows[0]) - 1, len(hidden) - 1}  # each row's last position pairs with no token yet
        keep = torch.tensor([i for i in range(len(hidden)) if i not in ends])
        proposal = d.propose(DraftInput(tail, hidden[keep], None), draft_cache, 4)
        results.append((out.logits, hidden, proposal.tokens))
    (logits, hidden, tokens), (wide_logits, wide_hidden, wide_tokens) = results
    torch.testing.assert_close(logits, wide_logits, rtol=1e-4, atol=1e-4)
    # Summation order's rounding scales with the largest activations (the aux layers' reach a few hundred): an
    # element near zero in such a row is off by as much as its neighbours, not by a share of itself.
    torch.testing.assert_close(hidden, wide_hidden, rtol=1e-4, atol=1e-6 * wide_hidden.abs().max().item())
    assert torch.equal(tokens, wide_tokens)


def test_weights_bfloat16_cannot_hold_keep_their_dtype():
    layers = torch.nn.Sequential(Linear(4, 3), MergedLinear(4, {"a": 2, "b": 1}), RoutedExperts(4, 2, 3))
    with torch.no_grad():
        for param in layers.parameters():
            param.copy_(torch.randn(param.shape).bfloat16().float())
        layers[0].weight[0, 0] = 1 + 2**-20  # needs more mantissa than bfloat16's 8 bits
    assert narrow_exact_weights(layers) == 3
    assert narrowable_dtypes(layers) == {
        "Linear.weight": torch.float32,
        "MergedLinear.weight": torch.bfloat16,
        "RoutedExperts.gate_up": torch.bfloat16,
        "RoutedExperts.down": torch.bfloat16,
    }
    assert layers[0].bias.dtype == torch.float32  # biases are not listed
    x = torch.randn(2, 4)
    assert layers[1](x).dtype == torch.float32


def test_llm_narrows_a_float32_model_on_the_cpu_only():
    llm = LLM("demo-llama", "eagle3", device="cpu")
    assert set(narrowable_dtypes(llm.target).values()) == {torch.bfloat16}
    assert set(narrowable_dtypes(llm.draft).values()) == {torch.bfloat16}
    bf16 = LLM("demo-llama", device="cpu", dtype=torch.bfloat16)  # nothing narrower to keep
    assert set(narrowable_dtypes(bf16.target).values()) == {torch.bfloat16}


def _tied_llama() -> Llama3:
    """``TINY_TIED_LLAMA`` in float32 with bfloat16-exact random weights, as a bfloat16 checkpoint loads."""
    model = Llama3(LlamaConfig.from_dict(TINY_TIED_LLAMA), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())).bfloat16())
    return model.eval()


@pytest.mark.skipif(not cpu_linear.available(), reason="the CPU kernel is not built or needs AVX2")
@torch.inference_mode()
def test_a_tied_embedding_is_narrowed_and_still_looks_up_float32_rows():
    """The matrix is the head too: narrowed, the head runs through the kernel (the wide model's logits up to
    summation order) and lookups widen their rows exactly; the cache keeps the model's dtype."""
    model, wide = _tied_llama(), _tied_llama()
    narrow_exact_weights(model)
    embedding = model.model.embed_tokens
    assert embedding.weight.dtype == torch.bfloat16 and embedding.weight.stride() == (1, TINY_TIED_LLAMA["vocab_size"])
    ids = torch.tensor([0, 7, 255, 7])
    assert torch.equal(model.embed(ids), wide.embed(ids)) and model.embed(ids).dtype == torch.float32
    assert model.new_cache(1, 8).layers[0].dtype == torch.float32
    rows = [[3, 1, 4, 1, 5], [9, 2, 6]]
    outs = [m.forward(ForwardBatch.from_rows(rows, [0, 0], [0, 1]), m.new_cache(2, 8)) for m in (model, wide)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_without_the_kernel_a_matrix_too_large_to_widen_per_call_stays_float32(monkeypatch):
    """`linear` would widen it into a fresh copy at every call (README: 2-10x a float32 matmul from 16M elements):
    past WIDEN_MAX_ELEMENTS a weight keeps its dtype, smaller ones are narrowed; with the kernel all are."""
    monkeypatch.setattr(cpu_linear, "_AVAILABLE", False)
    monkeypatch.setattr(
        linear_module, "WIDEN_MAX_ELEMENTS", TINY_TIED_LLAMA["vocab_size"] * TINY_TIED_LLAMA["hidden_size"] - 1
    )
    model = _tied_llama()
    narrow_exact_weights(model)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    dtypes = narrowable_dtypes(model)
    assert dtypes.pop("VocabParallelEmbedding.weight") == torch.float32 and set(dtypes.values()) == {torch.bfloat16}
    monkeypatch.setattr(cpu_linear, "_AVAILABLE", True)
    narrow_exact_weights(model)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
