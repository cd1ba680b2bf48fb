"""The provider contract's helpers."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.models.base import int64_tensor


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300))
def test_int64_tensor_equals_torch_tensor(values):
    out = int64_tensor(values)
    assert out.dtype == torch.int64 and out.shape == (len(values),)
    assert torch.equal(out, torch.tensor(values, dtype=torch.int64))


def test_int64_tensor_owns_its_values():
    values = [3, -1, 7]
    out = int64_tensor(values)
    values[0] = 99
    del values
    assert out.tolist() == [3, -1, 7]
