"""Host data onto the device: values kept, one copy per staging chunk, and on CUDA no wait for the device."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.core.transfer import Staging, int64_tensor, to_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


@pytest.mark.parametrize("device", ["cpu", "meta", None])
def test_to_device_keeps_shape_dtype_and_values(device):
    host = torch.arange(12, dtype=torch.int32).view(3, 4)[:, 1:]  # a strided view, as MaskWalk sends
    out = to_device(host, device)
    assert out.device == torch.device(device or "cpu") and out.dtype == host.dtype and out.shape == host.shape
    if out.device.type == "cpu":
        assert torch.equal(out, host)


arrays = st.lists(
    st.one_of(
        st.tuples(st.just("int64"), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)),
        st.tuples(st.just("float32"), st.lists(st.floats(width=32, allow_nan=False), max_size=40)),
    ),
    max_size=12,
)


@given(arrays)
def test_staged_arrays_hold_their_values_after_one_copy(parts):
    staging = Staging("cpu")
    views = [getattr(staging, kind)(values) for kind, values in parts]
    assert staging.num_copies == (1 if any(values for _, values in parts) else 0)
    staging.send()
    for (kind, values), view in zip(parts, views):
        expected = torch.tensor(values, dtype=getattr(torch, kind))
        assert view.dtype == expected.dtype and torch.equal(view, expected)


def test_a_staging_past_its_chunk_copies_once_more_and_keeps_every_value():
    staging = Staging("cpu")
    small = staging.int64(range(10))
    large = staging.int64(range(Staging.CHUNK_WORDS - 5))  # does not fit what the first chunk has left
    after = staging.float32([0.5, 1.5, 2.5])  # two words: fits the second chunk
    assert staging.num_copies == 2
    staging.send()
    assert small.tolist() == list(range(10)) and large.tolist() == list(range(Staging.CHUNK_WORDS - 5))
    assert after.tolist() == [0.5, 1.5, 2.5]


def test_staged_values_land_at_send_and_fill_into_buffers():
    """Nothing is written before `send` (a read before it would see the buffer unfilled, on the CPU too), and
    `into` buffers take the values then."""
    persistent = torch.full((2, 3), -7, dtype=torch.int64)
    staging = Staging("cpu")
    view = staging.int64([1, 2, 3, 4, 5, 6], into=persistent)
    assert torch.equal(persistent, torch.full((2, 3), -7))
    staging.send()
    assert view.tolist() == [1, 2, 3, 4, 5, 6] and persistent.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_a_staging_sends_once():
    staging = Staging("cpu")
    staging.int64([1])
    staging.send()
    with pytest.raises(RuntimeError, match="sends once"):
        staging.send()
    with pytest.raises(RuntimeError, match="new Staging"):
        staging.int64([2])


@cuda
@pytest.mark.gpu
def test_a_staging_neither_waits_for_the_device_nor_reads_the_host_later():
    busy = torch.randn(4096, 4096, device="cuda")
    table = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a copy from pageable memory would raise here
    try:
        for _ in range(8):
            busy = busy @ busy  # queued work the copy must not wait for
            staging = Staging("cuda")
            ids = staging.int64(list(range(1000)))
            weights = staging.float32([0.25, -1.0, 3.0])
            staging.int64([9, 8, 7, 6], into=table)
            staging.send()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.tolist() == list(range(1000)) and weights.tolist() == [0.25, -1.0, 3.0]
    assert table.tolist() == [9, 8, 7, 6]


@cuda
@pytest.mark.gpu
def test_to_device_neither_waits_for_the_device_nor_reads_the_host_later():
    host = torch.arange(1 << 20)
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a copy from pageable memory would raise here
    try:
        for _ in range(8):
            busy = busy @ busy  # queued work the copies must not wait for
            out = to_device(host, "cuda")
            index = int64_tensor([1, 2, 3], "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host.zero_()  # the engine rewrites its host buffers at once: the copy must already own the values
    assert torch.equal(out.cpu(), torch.arange(1 << 20)) and index.tolist() == [1, 2, 3]
