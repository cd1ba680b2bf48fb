"""Hypothesis strategies shared by the acceptance tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

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
