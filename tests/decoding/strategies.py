"""Hypothesis strategies and random inputs shared by the acceptance tests (torch and Triton)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from tandem.core.bitmask import pack_bitmask
from tandem.decoding import SamplingTensors

FILTERS = ("none", "temperature", "top_k", "top_p", "min_p")


@st.composite
def filter_settings(draw, vocab_size: int) -> dict:
    """One sampling filter (or none) with a value drawn from its useful range."""
    kind = draw(st.sampled_from(FILTERS))
    settings = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    if kind == "temperature":
        settings["temperature"] = draw(st.sampled_from([0.5, 0.7, 1.5]))
    elif kind == "top_k":
        settings["top_k"] = draw(st.integers(1, vocab_size))
    elif kind == "top_p":
        settings["top_p"] = draw(st.sampled_from([0.3, 0.6, 0.9]))
    elif kind == "min_p":
        settings["min_p"] = draw(st.sampled_from([0.05, 0.2, 0.5]))
    return settings


def random_allowed(generator: torch.Generator, shape: tuple[int, ...], density: float = 0.6) -> torch.Tensor:
    """bool [..., V] with at least one allowed token per row."""
    allowed = torch.rand(shape, generator=generator) < density
    first = torch.randint(shape[-1], shape[:-1], generator=generator)
    allowed.scatter_(-1, first.unsqueeze(-1), True)
    return allowed


def mixed_rows(count: int, *, seed: int, k: int, vocab_size: int):
    """A mixed batch of ``count`` rows: greedy / stochastic with top-k, top-p or min-p; masked / unmasked
    (every third row); thinking / not, per position; drafts sampled from their ``q``.

    Returns ``(logits [B, k+1, V], drafts [B, k], q [B, k, V], bitmask [B, k+1, W], sampling, in_thinking [B, k+1])``.
    """
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, k + 1, vocab_size, generator=generator) * 2
    allowed = random_allowed(generator, (count, k + 1, vocab_size), density=0.5)
    allowed[torch.arange(count) % 3 == 0] = True  # unmasked rows
    q = torch.randn(count, k, vocab_size, generator=generator).softmax(-1)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(count, k)
    index = torch.arange(count)
    sampling = SamplingTensors(
        temperature=torch.where(index % 4 == 0, 0.0, 0.9),
        top_k=torch.where(index % 5 == 1, 10, 0),
        top_p=torch.where(index % 5 == 2, 0.8, 1.0),
        min_p=torch.where(index % 5 == 3, 0.05, 0.0),
        seed=torch.randint(2**62, (count,), generator=generator),
    )
    thinking = torch.rand(count, k + 1, generator=generator) < 0.5
    return logits, drafts, q, pack_bitmask(allowed), sampling, thinking
