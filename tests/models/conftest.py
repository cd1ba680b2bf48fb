"""Tiny Hugging Face checkpoints written into tmp_path: the references every provider is compared against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_TIED_LLAMA = {  # a Llama config whose head is its embedding matrix, biases in attention and MLP
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "mlp_bias": True,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short, so llama3 scaling changes most frequencies
}


def tiny_llama_config(**overrides):
    """A 64-wide, 4-layer GQA Llama with llama3 RoPE scaling (overridable)."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(LLAMA3_ROPE),
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def save_tiny_llama(path: Path, *, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a randomly initialised tiny ``LlamaForCausalLM`` (fp32) to ``path``; return the HF model."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    with torch.no_grad():  # HF initialises norms to ones: perturb them so the norm weights are tested
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


@pytest.fixture(scope="session")
def llama3_rope() -> dict:
    """The llama3 RoPE scaling settings the tiny Llamas use."""
    return dict(LLAMA3_ROPE)


@pytest.fixture(scope="session")
def save_llama():
    """``save_llama(path, *, seed=0, max_shard_size=None, **config_overrides) -> LlamaForCausalLM``."""
    return save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama 3 (untied head, GQA, llama3 RoPE)."""
    path = tmp_path_factory.mktemp("llama")
    save_tiny_llama(path)
    return path


# ---------------------------------------------------------------- plain reference draft forwards (no cache)
def _rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta):
    """Half-split RoPE of ``x: [n, heads, d]`` at ``positions: [n]``."""
    d = x.shape[-1]
    angles = positions.float()[:, None] / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat([-second, first], -1) * sin


def reference_attention(x, w, prefix, positions, num_heads, num_kv_heads, theta):
    """Full causal GQA attention of ``x: [n, in]`` with weights ``w[prefix + 'q_proj.weight']`` etc."""
    n = len(x)
    q = (x @ w[prefix + "q_proj.weight"].T).view(n, num_heads, -1)
    k = (x @ w[prefix + "k_proj.weight"].T).view(n, num_kv_heads, -1)
    v = (x @ w[prefix + "v_proj.weight"].T).view(n, num_kv_heads, -1)
    q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    k, v = (t.repeat_interleave(num_heads // num_kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    return out @ w[prefix + "o_proj.weight"].T


def reference_mlp(x, w, prefix):
    gate, up = x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


@pytest.fixture(scope="session")
def reference():
    """Plain torch building blocks for the draft references: rms, attention, mlp."""
    from types import SimpleNamespace

    return SimpleNamespace(rms=_rms, attention=reference_attention, mlp=reference_mlp)


class ForcedTokens:
    """A :class:`~tandem.models.base.DraftConstraint` allowing exactly one token per row and position.

    ``forced [B, k]``; records what the draft advanced it with.
    """

    def __init__(self, forced: list[list[int]], vocab_size: int):
        self.forced, self.vocab_size, self.seen = forced, vocab_size, []

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(len(self.forced), self.vocab_size, dtype=torch.bool)
        mask[torch.arange(len(self.forced)), [row[len(self.seen)] for row in self.forced]] = True
        return mask

    def advance(self, tokens: torch.Tensor) -> None:
        self.seen.append(tokens.tolist())

    def check(self, proposal) -> None:
        """The draft proposed the forced tokens, and told the constraint each one in order."""
        assert proposal.tokens.tolist() == self.forced
        assert self.seen == [list(column) for column in zip(*self.forced)]


class FavouredTokens:
    """A :class:`~tandem.models.base.LogitAdjuster` adding +1000 to one token per row and position.

    ``favoured [B, k]``; records the proposals so far it was called with.
    """

    def __init__(self, favoured: list[list[int]]):
        self.favoured, self.calls = favoured, []

    def __call__(self, logits: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
        self.calls.append(proposed.tolist())
        bonus = torch.zeros_like(logits)
        bonus[torch.arange(len(logits)), [row[proposed.shape[1]] for row in self.favoured]] = 1000.0
        return logits + bonus

    def check(self, proposal) -> None:
        """The draft proposed the favoured tokens, and showed each call the proposals before it."""
        tokens = proposal.tokens.tolist()
        assert tokens == self.favoured
        assert self.calls == [[row[:i] for row in tokens] for i in range(len(tokens[0]))]
