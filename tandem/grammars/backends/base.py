"""The Matcher protocol every grammar backend implements, and the compiled-grammar record.

A matcher tracks how much of the output a grammar has consumed. Calls that change state say so;
a rejected token never changes state, so a mask walk can probe drafts and roll back exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.grammars.spec import GrammarSpec


class Matcher(Protocol):
    def accept_token(self, token: int) -> bool:
        """Advance by `token` if the grammar allows it (mutates); return False and change nothing if not."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (mutates); 0 is a no-op."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into `bitmask[index]`; does not change state.

        bitmask: [N, W] int32, CPU, contiguous, W = ceil(V / 32). A terminated matcher writes all zeros.
        """

    def is_terminated(self) -> bool:
        """Whether the grammar accepted EOS (nothing more may follow); does not change state."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled by one backend for one tokenizer; `new_matcher()` starts a fresh walk."""

    spec: GrammarSpec
    backend: str
    new_matcher: Callable[[], Matcher]
    compile_seconds: float


def token_bit(token: int) -> int:
    """`token`'s bit in its bitmask word (word `token >> 5`) as an int32 value: bit 31 is the sign bit."""
    return ((1 << (token & 31)) ^ 0x80000000) - 0x80000000


def set_token_bit(row: torch.Tensor, token: int) -> None:
    """Allow `token` in one bitmask row (int32 [W], CPU); mutates `row`."""
    # Through numpy: on a tensor element, `|=` is three dispatched torch ops.
    row.numpy()[token >> 5] |= token_bit(token)


class EosTerminatedMatcher:
    """Shared EOS handling for backends whose native matcher does not end on EOS.

    EOS is accepted iff the grammar may end here; it is recorded here and never fed to the native
    matcher. Subclasses implement `_advance` (False and no change if forbidden), `_rollback`,
    `_fill` (native mask into an int32 [W] row; a backend whose native mask needs no EOS fix-up
    overrides `fill_bitmask` instead) and `_can_end`.
    """

    def __init__(self, eos_token_id: int):
        self._eos = eos_token_id
        self._ended = False

    def accept_token(self, token: int) -> bool:
        if self._ended:
            return False
        if token == self._eos:
            self._ended = self._can_end()
            return self._ended
        return self._advance(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens:
            self._rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        if self._ended:
            row.zero_()
            return
        self._fill(row)
        if self._can_end():
            set_token_bit(row, self._eos)

    def is_terminated(self) -> bool:
        return self._ended

    def _advance(self, token: int) -> bool:
        raise NotImplementedError

    def _rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def _fill(self, row: torch.Tensor) -> None:
        raise NotImplementedError

    def _can_end(self) -> bool:
        raise NotImplementedError
