"""transformers' rope types for Llama-family models (linear, dynamic, yarn, longrope; default and llama3
have their own tests): frequencies and cos/sin scale equal to ``ROPE_INIT_FUNCTIONS``' (float32, within
1e-6 relative), and a tiny ``LlamaForCausalLM`` of each type gives the logits of tandem's Llama 3 provider
loaded from its ``save_pretrained`` (max abs diff <= 1e-4, fp32), on rows past the lengths where dynamic
and longrope change their frequencies, decoded by transformers token by token."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers import LlamaConfig as HFLlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem.models import ForwardBatch, load_target
from tandem.models.config import LlamaConfig, RopeParameters
from tandem.models.rope import rope_attention_factor, rope_inv_freq

TOL = 1e-4
MAX_LEN = 16  # dynamic's max_position_embeddings and longrope's original one: rows of 40 tokens pass it
HEAD_DIM = 16
ROPES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, {"max_position_embeddings": MAX_LEN}),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_LEN, "beta_fast": 8.0},
        {"max_position_embeddings": 4 * MAX_LEN},
    ),
    "yarn-head-dim-32": (  # head_dim differs from hidden / heads
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAX_LEN},
        {"max_position_embeddings": 4 * MAX_LEN, "head_dim": 32},
    ),
    "longrope": (
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [1.5 + 0.5 * i for i in range(HEAD_DIM // 2)],
            "original_max_position_embeddings": MAX_LEN,
        },
        {"max_position_embeddings": 4 * MAX_LEN},
    ),
}


def hf_config(name: str) -> HFLlamaConfig:
    rope, overrides = ROPES[name]
    settings = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return HFLlamaConfig(**{**settings, **overrides, "rope_parameters": {"rope_theta": 10000.0, **rope}})


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("length", [None, 8, 40])
def test_frequencies_and_scale_are_transformers(name, length):
    config = hf_config(name)
    expected, expected_scale = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu", length)
    ours = LlamaConfig.from_dict(config.to_dict())
    lengths = None if length is None else torch.tensor([length])
    inv_freq = rope_inv_freq(ours.rope, ours.head_dim, lengths)
    torch.testing.assert_close(inv_freq if length is None else inv_freq[0], expected, rtol=1e-6, atol=0)
    assert rope_attention_factor(ours.rope, ours.head_dim) == pytest.approx(expected_scale, rel=1e-9)


def test_dynamic_and_longrope_change_only_past_their_length():
    for name in ("dynamic", "longrope"):
        rope = LlamaConfig.from_dict(hf_config(name).to_dict()).rope
        table = rope_inv_freq(rope, HEAD_DIM, torch.arange(1, 41))
        assert torch.equal(table[:MAX_LEN], rope_inv_freq(rope, HEAD_DIM).expand(MAX_LEN, -1))
        assert not torch.allclose(table[MAX_LEN], table[MAX_LEN - 1])


@pytest.fixture(scope="module", params=list(ROPES))
def pair(request, tmp_path_factory, save_llama):
    """(tandem's target, the transformers model) of a tiny Llama with that rope type."""
    path = tmp_path_factory.mktemp(request.param)
    rope, overrides = ROPES[request.param]
    hf = save_llama(path, rope_parameters={"rope_theta": 10000.0, **rope}, num_hidden_layers=2, **overrides)
    return load_target(path), hf


def hf_token_by_token(model, row: list[int]) -> torch.Tensor:
    """transformers' logits ``[L, V]``, one token per forward (how it decodes, its dynamic frequencies following)."""
    cache, logits = DynamicCache(config=model.config), []
    with torch.no_grad():
        for position, token in enumerate(row):
            out = model(torch.tensor([[token]]), cache=cache, position_ids=torch.tensor([[position]]))
            logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


def test_logits_match_transformers_as_a_prefill_and_in_speculative_chunks(pair):
    target, hf = pair
    row = torch.randint(512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = hf_token_by_token(hf, row)
    prefill = target.forward(ForwardBatch.from_rows([row], [0], [0]), target.new_cache(1, 48)).logits
    assert (prefill - expected).abs().max().item() <= TOL
    cache, chunks, start = target.new_cache(1, 48), [], 0
    for size in (10, 5, 1, 3, 1, 4, 16):  # a prefill, then verify-sized and decode steps across MAX_LEN
        chunks.append(target.forward(ForwardBatch.from_rows([row[start : start + size]], [start], [0]), cache).logits)
        start += size
    assert (torch.cat(chunks) - expected).abs().max().item() <= TOL


def test_a_rope_type_without_its_entries_is_refused():
    with pytest.raises(
        ValueError, match=r"rope_type 'longrope' lacks \['long_factor', 'original_max_position_embeddings'\]"
    ):
        RopeParameters.from_dict({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}).check(
            LlamaConfig.rope_types, "Llama"
        )
    with pytest.raises(ValueError, match="rope_type 'su' is not supported for Llama"):
        LlamaConfig.from_dict(dict(hf_config("linear").to_dict(), rope_scaling={"type": "su"}, rope_parameters=None))
