"""MaskPipeline: compute the next step's grammar masks while the target forward runs.

    handle = pipeline.submit(row_ids, drafts)   # returns at once; a worker thread fills masks
    logits = target(...)                        # meanwhile, on the device
    bitmask, in_thinking, allows_nothing = handle.wait()

The worker fills one of two pinned host buffers (they alternate by step), then on CUDA enqueues a
`non_blocking` copy into a device scratch buffer on a side stream and records an event; `wait()`
joins the worker and makes the *current stream* wait on that event: no device-wide sync. Before the
worker rewrites a host buffer it waits for the copy that last read it (that one event only), and
the side stream waits until the consumer stream is past the step that last used the device buffer.

On the CPU the host runs the forward itself, so there is no idle host to hide the masks behind: by
default `submit` fills them before it returns (no thread, no copy: consumers read the host buffer). A
worker thread there took turns with the forward's Python for the GIL, and each hand-off (the thread that
wants the GIL back waits for the other to let go, up to `sys.getswitchinterval()`) cost more than the
overlap won (README, "Why each fast path exists"). `worker=True` keeps the thread on the CPU too (a
benchmark's simulated forward, which leaves the host idle).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from tandem.core.transfer import to_device
from tandem.grammars.masks import SpeculativeMasker


class CopyTicket(Protocol):
    def synchronize(self) -> None:
        """Block the calling host thread until the copy has read its host buffer."""

    def make_consumer_wait(self) -> None:
        """Order the consumer (current stream) after the copy, without blocking the host."""


class Copier(Protocol):
    def copy(
        self, slot: int, bitmask: torch.Tensor, in_thinking: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, CopyTicket | None]:
        """Start moving a filled host buffer pair to where the sampler reads it; returns those views."""


class CudaCopier:
    """Pinned host -> device scratch copies on a side stream, ordered by events."""

    def __init__(self, device: torch.device, shape: tuple[int, int, int]):
        self.stream = torch.cuda.Stream(device)
        self._bitmask = [torch.empty(math.prod(shape), dtype=torch.int32, device=device) for _ in range(2)]
        self._thinking = [torch.empty(math.prod(shape[:2]), dtype=torch.bool, device=device) for _ in range(2)]
        self._consumed: list[torch.cuda.Event | None] = [None, None]

    def copy(self, slot, bitmask, in_thinking):
        with torch.cuda.stream(self.stream):
            if self._consumed[slot] is not None:  # the consumer is done with this device buffer
                self.stream.wait_event(self._consumed[slot])
            device_bitmask = self._bitmask[slot][: bitmask.numel()].view(bitmask.shape)
            device_thinking = self._thinking[slot][: in_thinking.numel()].view(in_thinking.shape)
            device_bitmask.copy_(bitmask, non_blocking=True)
            device_thinking.copy_(in_thinking, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return device_bitmask, device_thinking, _CudaTicket(self, slot, done)

    def mark_consumed(self, slot: int, event: torch.cuda.Event) -> None:
        """The consumer is done with `slot`'s device buffers once `event` has passed: the next copy
        into them waits for it."""
        self._consumed[slot] = event


class _CudaTicket:
    def __init__(self, copier: CudaCopier, slot: int, event: torch.cuda.Event):
        self._copier, self._slot, self._event = copier, slot, event

    def synchronize(self) -> None:
        self._event.synchronize()

    def make_consumer_wait(self) -> None:
        stream = torch.cuda.current_stream()
        stream.wait_event(self._event)
        # Everything the consumer enqueued for the previous step (the other slot) precedes this
        # point, so this event marks that slot's device buffer free for reuse.
        consumed = torch.cuda.Event()
        consumed.record(stream)
        self._copier.mark_consumed(1 - self._slot, consumed)


class MaskHandle:
    """A step's masks in the making; `wait()` returns them."""

    def __init__(self, future: Future):
        self._future = future

    @classmethod
    def ready(cls, bitmask: torch.Tensor, in_thinking: torch.Tensor, device: torch.device) -> MaskHandle:
        """A handle to masks built already (bitmask [B, k+1, W] int32, in_thinking [B, k+1] bool, CPU)."""
        future = Future()
        future.set_result((to_device(bitmask, device), to_device(in_thinking, device), (bitmask == 0).all(-1), None))
        return cls(future)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bitmask [B, k+1, W] int32, in_thinking [B, k+1] bool, allows_nothing [B, k+1] bool CPU).

        bitmask and in_thinking are on the pipeline's device (on CPU: views of a host buffer, valid
        until the step after next is submitted); re-raises the worker's exception.
        """
        bitmask, in_thinking, allows_nothing, ticket = self._future.result()
        if ticket is not None:
            ticket.make_consumer_wait()
        return bitmask, in_thinking, allows_nothing


class MaskPipeline:
    """Double-buffered mask computation for batches up to `max_batch` rows: on one worker thread, or inline
    (`worker=False`; None: a thread unless `device` is the CPU, see the module docstring)."""

    def __init__(
        self,
        masker: SpeculativeMasker,
        max_batch: int,
        k: int,
        device: torch.device | str = "cpu",
        copier: Copier | None = None,
        *,
        worker: bool | None = None,
    ):
        self.masker = masker
        self.device = torch.device(device)
        shape = (max_batch, k + 1, masker.width)
        pin = self.device.type == "cuda"
        # Flat, so that a step with fewer than k drafts per row gets contiguous [B, width + 1, W] views.
        self._bitmask = [torch.zeros(math.prod(shape), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._thinking = [torch.zeros(math.prod(shape[:2]), dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self._copier = copier if copier is not None else (CudaCopier(self.device, shape) if pin else None)
        self._in_flight: list[CopyTicket | None] = [None, None]  # last copy out of each host buffer
        self._slot = 0
        if worker is None:
            worker = self.device.type != "cpu"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks") if worker else None

    def submit(
        self, row_ids: Sequence[Hashable], drafts: torch.Tensor, remaining: Sequence[int | None] | None = None
    ) -> MaskHandle:
        """Start filling masks for `row_ids` with drafts [B, w] int64 CPU (w <= k) and the rows' remaining
        budgets (closing masks, `SpeculativeMasker.fill`); returns at once with a worker thread, else once they
        are filled (a failure is raised by `wait()` either way).

        The masker must not be committed to until this step's `wait()` returned.
        """
        slot, self._slot = self._slot, 1 - self._slot
        args = slot, list(row_ids), drafts, remaining
        if self._worker is not None:
            return MaskHandle(self._worker.submit(self._fill, *args))
        future = Future()
        try:
            future.set_result(self._fill(*args))
        except Exception as error:  # handed to wait(), as the worker's would be
            future.set_exception(error)
        return MaskHandle(future)

    def _fill(self, slot: int, row_ids: list, drafts: torch.Tensor, remaining: Sequence[int | None] | None):
        if self._in_flight[slot] is not None:  # never overwrite a buffer a copy still reads
            self._in_flight[slot].synchronize()
        batch, positions = len(row_ids), drafts.shape[1] + 1
        bitmask = self._bitmask[slot][: batch * positions * self.masker.width].view(batch, positions, -1)
        in_thinking = self._thinking[slot][: batch * positions].view(batch, positions)
        allows_nothing = self.masker.fill(row_ids, drafts, bitmask, in_thinking, remaining)
        if self._copier is None:
            return bitmask, in_thinking, allows_nothing, None
        bitmask, in_thinking, ticket = self._copier.copy(slot, bitmask, in_thinking)
        self._in_flight[slot] = ticket
        return bitmask, in_thinking, allows_nothing, ticket

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
