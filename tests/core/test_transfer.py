"""Host data onto the device: values kept, and on CUDA no wait for the device."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem.core.transfer import int64_tensor, to_device

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
