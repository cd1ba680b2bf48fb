"""Admission and slots: the waiting and running requests, and the outputs of finished ones.

A request waits until its grammar has compiled and a slot is free. Admission goes in arrival order,
but a request still compiling does not hold back the ones behind it; it gives the request a slot
(its rows of the target's KV cache, reset) and a row of the masker (its matcher, and a thinking
tracker over its prompt). A grammar that failed to compile finishes its request with "error"
before it runs. Finishing (a stop rule, an abort) frees the slot and the masker row; the output
waits for `pop_finished`.
"""

from __future__ import annotations

from tandem.engine.output import RequestOutput, finish_output
from tandem.engine.request import Request, thinking_tracker
from tandem.grammars.errors import GrammarError
from tandem.grammars.masks import SpeculativeMasker
from tandem.models.base import KVCache
from tandem.thinking import ThinkingMarkers


class Scheduler:
    """Which requests wait, which run, and in which slot. `running` is in admission order: the
    order of the step's rows."""

    def __init__(
        self, num_slots: int, masker: SpeculativeMasker, cache: KVCache, markers: ThinkingMarkers | None
    ) -> None:
        self.masker, self.cache, self.markers = masker, cache, markers
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._free_slots = list(range(num_slots))
        self._finished: dict[str, RequestOutput] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        """Move waiting requests whose grammar is ready into free slots, in arrival order."""
        for request in list(self.waiting):
            if not self._free_slots:
                return
            job = request.grammar_job
            if job is not None and not job.done():
                continue
            self.waiting.remove(request)
            try:
                matcher = None if job is None else job.result().new_matcher()
            except GrammarError as error:
                request.output.error = str(error)
                request.output.finish_reason = "error"
                self._finished[request.request_id] = request.output
                continue
            self.masker.add_row(request.request_id, matcher, thinking_tracker(self.markers, request.prompt))
            request.slot = self._free_slots.pop(0)
            self.cache.reset([request.slot])
            self.running.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a running request with `reason`."""
        self._close(request, reason)
        self.running.remove(request)

    def abort(self, request_id: str) -> None:
        """Drop a request, waiting or running (unknown or finished ids are ignored)."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    self._close(request, "abort")
                    queue.remove(request)
                    return

    def pop_finished(self, request_id: str) -> RequestOutput | None:
        """The output of a finished request, handed over once (None while it runs)."""
        return self._finished.pop(request_id, None)

    def _close(self, request: Request, reason: str) -> None:
        finish_output(request.output, request.text, reason)
        self._finished[request.request_id] = request.output
        if request.slot >= 0:
            self.masker.remove_row(request.request_id)
            self._free_slots.append(request.slot)
            request.slot = -1
