"""MaskPipeline: same masks as a direct fill, inline or on its worker; a buffer is never rewritten while a copy
reads it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tandem.engine.mask_pipeline import MaskPipeline
from tandem.grammars.backends import BACKENDS
from tandem.grammars.masks import SpeculativeMasker
from tandem.grammars.spec import GrammarSpec
from tandem.thinking import ThinkingMarkers, ThinkingTracker
from tests.grammars.conftest import PERSON_SCHEMA, PERSON_TEXTS

K = 3


def make_masker(tokenizer, hf_tokenizer):
    """Three rows: grammar, grammar after reasoning, no grammar."""
    new_matcher = BACKENDS["llguidance"].compile(GrammarSpec.json_schema(PERSON_SCHEMA), tokenizer)
    markers = ThinkingMarkers.from_tokenizer(hf_tokenizer)
    masker = SpeculativeMasker(tokenizer.vocab_size, len(hf_tokenizer))
    masker.add_row(0, new_matcher())
    masker.add_row(1, new_matcher(), ThinkingTracker(markers, [markers.open_id]))
    masker.add_row(2, None)
    return masker, markers


def scripted_steps(tokenizer, markers, steps=4):
    """Per step: drafts [3, K] (zero-padded past the answer) and the tokens each row commits."""
    answers = [
        tokenizer.encode(PERSON_TEXTS[1]),
        [markers.close_id] + tokenizer.encode(PERSON_TEXTS[0]),
        tokenizer.encode("free text here"),
    ]
    for step in range(steps):
        drafts = [a[step * K : (step + 1) * K] for a in answers]
        drafts = [d + [0] * (K - len(d)) for d in drafts]
        yield torch.tensor(drafts), [a[step * K : (step + 1) * K] for a in answers]


@pytest.mark.parametrize("worker", [None, True])
def test_pipeline_masks_equal_direct_masks(tokenizer, hf_tokenizer, worker):
    direct, markers = make_masker(tokenizer, hf_tokenizer)
    piped, _ = make_masker(tokenizer, hf_tokenizer)
    pipeline = MaskPipeline(piped, max_batch=4, k=K, worker=worker)
    for drafts, commits in scripted_steps(tokenizer, markers):
        expected = torch.zeros(3, K + 1, direct.width, dtype=torch.int32)
        expected_thinking = torch.zeros(3, K + 1, dtype=torch.bool)
        expected_nothing = direct.fill([0, 1, 2], drafts, expected, expected_thinking)
        bitmask, in_thinking, nothing = pipeline.submit([0, 1, 2], drafts).wait()
        assert torch.equal(bitmask, expected) and torch.equal(in_thinking, expected_thinking)
        assert torch.equal(nothing, expected_nothing)
        for row, tokens in enumerate(commits):
            direct.commit(row, tokens)
            piped.commit(row, tokens)
    pipeline.close()


@pytest.mark.parametrize("worker", [None, False, True])
def test_cpu_masks_fill_inline_unless_a_worker_is_asked_for(tokenizer, hf_tokenizer, monkeypatch, worker):
    masker, markers = make_masker(tokenizer, hf_tokenizer)
    threads = []
    fill = masker.fill
    monkeypatch.setattr(masker, "fill", lambda *args: threads.append(threading.current_thread()) or fill(*args))
    pipeline = MaskPipeline(masker, max_batch=4, k=K, worker=worker)
    drafts, _ = next(scripted_steps(tokenizer, markers))
    pipeline.submit([0, 1, 2], drafts).wait()
    assert (threads == [threading.current_thread()]) == (not worker)
    # A failure reaches wait(), inline as from the worker: here a row the masker does not hold.
    handle = pipeline.submit([0, 1, 7], drafts)
    with pytest.raises(KeyError):
        handle.wait()
    pipeline.close()


class SlowCopier:
    """A fake device copy that reads its host buffer over `delay` seconds, like a DMA in flight."""

    def __init__(self, delay: float):
        self.delay = delay
        self.corrupted = []

    def copy(self, slot, bitmask, in_thinking):
        snapshot = bitmask.clone()
        done = threading.Event()

        def dma():
            time.sleep(self.delay)
            if not torch.equal(bitmask, snapshot):  # the worker rewrote it mid-copy
                self.corrupted.append(slot)
            done.set()

        threading.Thread(target=dma, daemon=True).start()
        ticket = type(
            "Ticket", (), {"synchronize": lambda self: done.wait(), "make_consumer_wait": lambda self: None}
        )()
        return snapshot, in_thinking.clone(), ticket


@pytest.mark.parametrize("worker", [False, True])
@pytest.mark.parametrize("guarded", [True, False])
def test_worker_never_writes_a_buffer_whose_copy_is_in_flight(tokenizer, hf_tokenizer, guarded, worker, monkeypatch):
    masker, markers = make_masker(tokenizer, hf_tokenizer)
    copier = SlowCopier(delay=0.2)
    pipeline = MaskPipeline(masker, max_batch=4, k=K, copier=copier, worker=worker)
    if not guarded:  # prove the check can fail: drop the guard and the copy gets corrupted
        monkeypatch.setattr(
            pipeline, "_in_flight", type("NoGuard", (list,), {"__setitem__": lambda *a: None})([None, None])
        )
    for drafts, commits in scripted_steps(tokenizer, markers):
        pipeline.submit([0, 1, 2], drafts).wait()
        for row, tokens in enumerate(commits):
            masker.commit(row, tokens)
    time.sleep(0.3)
    pipeline.close()
    assert (copier.corrupted == []) == guarded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_pipeline_matches_direct_masks(tokenizer, hf_tokenizer):
    direct, markers = make_masker(tokenizer, hf_tokenizer)
    piped, _ = make_masker(tokenizer, hf_tokenizer)
    pipeline = MaskPipeline(piped, max_batch=4, k=K, device="cuda")
    for drafts, commits in scripted_steps(tokenizer, markers):
        expected = torch.zeros(3, K + 1, direct.width, dtype=torch.int32)
        direct.fill([0, 1, 2], drafts, expected, torch.zeros(3, K + 1, dtype=torch.bool))
        bitmask, _, _ = pipeline.submit([0, 1, 2], drafts).wait()
        assert bitmask.is_cuda and torch.equal(bitmask.cpu(), expected)
        for row, tokens in enumerate(commits):
            direct.commit(row, tokens)
            piped.commit(row, tokens)
    pipeline.close()
