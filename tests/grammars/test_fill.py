"""`Matcher.fill_bitmask` for every backend: it writes exactly its row, and allows EOS iff EOS would be accepted."""

from __future__ import annotations

import pytest
import torch

from tandem.core.bitmask import bitmask_width
from tandem.grammars.backends import BACKENDS
from tandem.grammars.backends.base import set_token_bit
from tandem.grammars.spec import GrammarSpec
from tests.grammars.conftest import PERSON_SCHEMA, PERSON_TEXTS

SENTINEL = -0x5A5A5A5B  # a pattern no mask row takes by chance
# (spec, an accepted text): an object, which stops at its last brace; a number, which may end or go on.
CASES = [
    (GrammarSpec.json_schema(PERSON_SCHEMA), PERSON_TEXTS[1]),
    (GrammarSpec.json_schema({"type": "integer"}), "-31415926535"),
]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fill_writes_its_row_only_and_allows_eos_iff_it_is_accepted(tokenizer, backend, case):
    spec, text = CASES[case]
    new_matcher = BACKENDS[backend].compile(spec, tokenizer)
    tokens = tokenizer.encode(text)
    eos, width = tokenizer.eos_token_id, bitmask_width(tokenizer.vocab_size)
    matcher, ends = new_matcher(), []
    for i, token in enumerate([*tokens, eos]):
        buffer = torch.full((3, width), SENTINEL, dtype=torch.int32)
        matcher.fill_bitmask(buffer, 1)
        assert (buffer[[0, 2]] == SENTINEL).all(), f"{backend} wrote outside row 1 at position {i}"
        probe = new_matcher()
        assert all(probe.accept_token(t) for t in tokens[:i])
        can_end = probe.accept_token(eos)
        ends.append(can_end)
        assert bool(int(buffer[1, eos // 32]) >> (eos % 32) & 1) == can_end, f"{backend}: EOS bit at position {i}"
        assert matcher.accept_token(token)
    assert ends[-1] and not ends[0]
    assert case == 0 or sum(ends) > 2, "the integer may end after each digit and still go on"
    buffer = torch.full((2, width), SENTINEL, dtype=torch.int32)
    matcher.fill_bitmask(buffer, 0)
    assert (buffer[0] == 0).all() and (buffer[1] == SENTINEL).all(), "after EOS the row allows nothing"


def test_llguidance_refuses_a_row_past_the_buffer_instead_of_writing_there(tokenizer):
    matcher = BACKENDS["llguidance"].compile(CASES[0][0], tokenizer)()
    width = bitmask_width(tokenizer.vocab_size)
    buffer = torch.zeros(4, width, dtype=torch.int32)
    with pytest.raises(ValueError, match="no row 4"):
        matcher.fill_bitmask(buffer, 4)
    with pytest.raises(ValueError, match="no row 1"):
        matcher.fill_bitmask(torch.zeros(2, width - 1, dtype=torch.int32), 1)  # rows too narrow
    matcher.fill_bitmask(buffer, 3)
    assert buffer[3].any() and not buffer[:3].any()


@pytest.mark.parametrize("token", [0, 5, 31, 32, 63, 95])
def test_set_token_bit_sets_one_bit_including_the_sign_bit(token):
    row = torch.zeros(3, dtype=torch.int32)
    set_token_bit(row, token)
    set_token_bit(row, token)  # idempotent
    bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    assert bits.nonzero().flatten().tolist() == [token]
