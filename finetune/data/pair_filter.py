"""Which preference pairs train at a sequence length: a pair whose chosen or rejected sequence keeps no training
target within it is dropped (a preference loss compares the log-probabilities of both replies: a side with no
target has none, and would turn the loss into NaN), and the pairs cut to it are counted, for one warning line.

A pure function of a store of pairs (example 2p the chosen and 2p + 1 the rejected reply of pair p): no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from finetune.data.packing import TokenStore, targets_within
from finetune.data.rows import DataError


@dataclasses.dataclass(frozen=True)
class PairReport:
    """What cutting pairs to `seq_len` does: how many pairs keep both sides trained but have a sequence cut to
    its start (`truncated`), how many lose every target of a side and are dropped, and the first of each."""

    seq_len: int
    pairs: int
    truncated: int  # kept, a sequence longer than seq_len cut to its start
    first_truncated: str | None
    dropped: int  # a side with no training target within seq_len: never reaches a batch
    first_dropped: str | None

    @property
    def kept(self) -> int:
        return self.pairs - self.dropped

    def warning(self) -> str | None:
        """One line for the user when pairs are cut or dropped (None when none is)."""
        parts = []
        if self.truncated:
            parts.append(f"{self.truncated} of {self.pairs} pairs have a sequence longer than --seq-len "
                         f"{self.seq_len}, cut to it (first: {self.first_truncated})")
        if self.dropped:
            parts.append(f"{self.dropped} of {self.pairs} pairs were dropped: their chosen or rejected sequence has "
                         f"no training target within --seq-len {self.seq_len} (first: {self.first_dropped})")
        return "; ".join(parts) or None

    def require_pairs(self, source: str) -> None:
        """Raise DataError naming `source` when no pair is left to train on."""
        if self.kept:
            return
        if self.dropped:
            raise DataError(f"{source}: no pair keeps a training target in both its chosen and rejected sequences "
                            f"within --seq-len {self.seq_len}: all {self.pairs} were dropped (first: "
                            f"{self.first_dropped}); raise --seq-len, or bound the prompts with --max-prompt-len")
        raise DataError(f"{source}: no preference pairs to train on")

    def __add__(self, other: "PairReport") -> "PairReport":
        """One report of the pairs of `self` followed by those of `other`."""
        return PairReport(seq_len=self.seq_len, pairs=self.pairs + other.pairs,
                          truncated=self.truncated + other.truncated,
                          first_truncated=self.first_truncated or other.first_truncated,
                          dropped=self.dropped + other.dropped, first_dropped=self.first_dropped or other.first_dropped)


def keep_pairs(store: TokenStore, pairs: np.ndarray, seq_len: int, where: Callable[[int], str]
               ) -> tuple[np.ndarray, PairReport]:
    """The pairs among `pairs` (pair indices, in order) whose chosen and rejected examples both have a training
    target within `seq_len` (the target of token i is token i + 1: targets `trained[1:seq_len]`), in order, and
    the report; `where(p)` names pair p's row."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    pairs = np.asarray(pairs, np.int64).reshape(-1)
    starts = np.asarray(store.starts, np.int64)
    if (len(starts) - 1) % 2:
        raise ValueError(f"a store of preference pairs holds two examples per pair, not {len(starts) - 1} examples")
    if pairs.size and not (0 <= pairs.min() and pairs.max() < (len(starts) - 1) // 2):
        raise IndexError(f"pair index out of range for a store of {(len(starts) - 1) // 2} pairs")
    has = targets_within(store, seq_len)
    lengths = np.diff(starts)
    chosen, rejected = 2 * pairs, 2 * pairs + 1
    keep = has[chosen] & has[rejected]
    truncated = keep & ((lengths[chosen] > seq_len) | (lengths[rejected] > seq_len))

    def first(mask: np.ndarray) -> str | None:
        return where(int(pairs[np.argmax(mask)])) if mask.any() else None

    report = PairReport(seq_len=seq_len, pairs=len(pairs), truncated=int(truncated.sum()),
                        first_truncated=first(truncated), dropped=int((~keep).sum()), first_dropped=first(~keep))
    return pairs[keep], report
