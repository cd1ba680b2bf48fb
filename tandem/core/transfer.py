"""Host data onto the device without making the host wait for the device, in as few copies as a step allows.

The engine builds every batch, sampling table and mask on the host while the device still runs
the previous work; a copy that waited for that work would serialise the two (docs/DESIGN.md,
"Overlap"). Every host-to-device copy on the step path goes through :func:`to_device` or a
:class:`Staging`, which gathers the many small arrays of one phase of a step (its batch, the forwards' plans:
the graph runner's or the eager layouts' write indices and block tables, its drafts and sampling tables) into one
pinned buffer and sends them in one copy.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device | str | None) -> Tensor:
    """``host`` (a CPU tensor) on ``device``, without making the host wait for the device.

    A copy from pageable memory (``tensor.to("cuda")``, ``torch.tensor(..., device="cuda")``)
    waits until every kernel already queued on the stream has run, which would stall the host at
    each batch it builds. Staged in pinned memory, the copy is queued ``non_blocking`` instead;
    the caching host allocator keeps the pinned copy alive until the stream has read it.
    """
    device = torch.device(device) if device is not None else host.device
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def int64_tensor(values: Sequence[int], device: torch.device | str | None = None) -> Tensor:
    """``[len(values)]`` int64 from Python ints, on ``device`` through :func:`to_device`.

    ``torch.tensor`` converts a list element by element, which adds up over a long sequence;
    through ``array('q')`` it is one copy."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return to_device(torch.frombuffer(array.array("q", values), dtype=torch.int64), device)


class Staging:
    """Host arrays bound for one device, sent together: one copy per :attr:`CHUNK_WORDS` 8-byte words (one in all
    for a step's small arrays), from pinned memory without waiting (:func:`to_device`'s reasons).

    Each :meth:`int64` / :meth:`float32` call returns at once the device tensor its values will fill (a view of
    the chunk's device buffer), and :meth:`send` queues the copies. So a staged tensor may be passed around and
    stored before :meth:`send`, but no device work may read it before: work queued earlier would read the
    buffer unfilled (on the CPU as on CUDA: the values land at :meth:`send` there too, so CPU tests see such a
    read). ``into`` names a persistent buffer that :meth:`send` fills from the copy (the block table, say).
    A staging sends once; each chunk's device buffer is its own allocation, alive while a view of it is.
    """

    CHUNK_WORDS = 4096  # a chunk's size unless one array needs more: a step's batch and plans fit in one

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self._chunks: list[tuple[array.array, Tensor]] = []  # (host words, device buffer [capacity] int64), sent
        self._words, self._buffer = array.array("q"), None  # the chunk being filled (its buffer made on demand)
        self._into: list[tuple[Tensor, Tensor]] = []  # (staged view, persistent destination)
        self._sent = False

    def int64(self, values: Sequence[int], *, into: Tensor | None = None) -> Tensor:
        """``[len(values)]`` int64 on the device, holding ``values`` from :meth:`send` on (and ``into``, a
        persistent int64 buffer of as many elements, then too)."""
        view = self._reserve(len(values))
        self._words.extend(values)
        if into is not None:
            self._into.append((view, into))
        return view

    def float32(self, values: Sequence[float]) -> Tensor:
        """``[len(values)]`` float32 on the device, holding ``values`` from :meth:`send` on."""
        packed = array.array("f", values)
        if len(packed) % 2:
            packed.append(0.0)  # whole words: the next array starts 8-byte aligned
        view = self._reserve(len(packed) // 2)
        self._words.frombytes(packed.tobytes())
        return view.view(torch.float32)[: len(values)]

    def send(self) -> None:
        """Queue the copies (one per chunk), then the fills of the ``into`` buffers. Reads nothing back."""
        if self._sent:
            raise RuntimeError("a Staging sends once; stage the next values in a new one")
        self._sent = True
        for words, buffer in [*self._chunks, (self._words, self._buffer)]:
            if words:
                host = torch.frombuffer(words, dtype=torch.int64)
                if buffer.device.type == "cuda":
                    host = host.pin_memory()
                buffer[: len(words)].copy_(host, non_blocking=True)
        for view, into in self._into:
            into.copy_(view.view_as(into))

    @property
    def num_copies(self) -> int:
        """The host-to-device copies :meth:`send` makes (or made)."""
        return sum(1 for words, _ in [*self._chunks, (self._words, None)] if words)

    def _reserve(self, n: int) -> Tensor:
        """The device view that the next ``n`` words of the current chunk (a new one if they do not fit) fill."""
        if self._sent:
            raise RuntimeError("this Staging has sent its values; stage new ones in a new Staging")
        used = len(self._words)
        if self._buffer is None or used + n > len(self._buffer):
            if self._buffer is not None:
                self._chunks.append((self._words, self._buffer))
                self._words, used = array.array("q"), 0
            self._buffer = torch.empty(max(self.CHUNK_WORDS, n), dtype=torch.int64, device=self.device)
        return self._buffer[used : used + n]
