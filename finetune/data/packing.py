"""Fixed-length training rows packed from a tokenized store, read from its memory-mapped arrays per batch.

`PackedRows.build` packs a selection of the store's examples into the rows `finetune.data.reference.build_rows` makes
of them (greedy, in order; an example longer than the sequence cut to it; an empty one left out) but keeps
only a segment table.

Memory: per selected example 16 bytes (its example index int64, its length and offset in the row int32),
per row 8 (its first segment, int64), per token nothing. Building reads the store's `starts` and, until it
finds a training target, `trained` in blocks of SCAN_BLOCK_TOKENS; it allocates about 60 bytes per example
and 2 MB for a block at its peak. `take` builds the five `[rows, seq_len]` arrays of the rows asked for,
reading only those rows' tokens from the store's `ids` and `trained` (so each process reads only its own
devices' rows) and allocating a few arrays the size of the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Protocol

import numpy as np

from finetune.data.rows import DataError, TruncationReport

# Tokens of `trained` read at a time when looking for training targets (an int32 count per token).
SCAN_BLOCK_TOKENS = 1 << 18


class TokenStore(Protocol):
    """Tokenized examples, concatenated: example e is `ids[starts[e]:starts[e + 1]]`."""

    ids: np.ndarray  # int32 [tokens]
    trained: np.ndarray  # bool [tokens]: whether each token is a training target
    starts: np.ndarray  # int64 [examples + 1]


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Rows of `seq_len` tokens; row r holds segments `row_segments[r]:row_segments[r + 1]`, numbered from 1.
    Rows past the last packed one (`padded_to_multiple`) hold no segment: all padding."""

    store: TokenStore
    seq_len: int
    segment_example: np.ndarray  # int64 [segments]: the store example each segment holds
    segment_length: np.ndarray  # int32 [segments]: its tokens in the row (cut to seq_len)
    segment_offset: np.ndarray  # int32 [segments]: where it starts within its row
    row_segments: np.ndarray  # int64 [rows + 1]

    @classmethod
    def build(cls, store: TokenStore, examples: np.ndarray, seq_len: int, pack: bool) -> "PackedRows":
        """Rows of `store`'s `examples` (indices, in this order), several to a row when `pack`, else one;
        raises DataError when no token of them is a training target within `seq_len`."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        examples = np.asarray(examples, np.int64).reshape(-1)
        lengths = np.diff(np.asarray(store.starts, np.int64))
        if lengths.size and lengths.min() < 0:
            raise DataError("a tokenized store's example starts decrease: the store is damaged")
        if examples.size and not (0 <= examples.min() and examples.max() < len(lengths)):
            raise IndexError(f"example index out of range for a store of {len(lengths)} examples")
        # an empty example holds no token and no target: it has no segment
        examples = examples[lengths[examples] > 0]
        length = np.minimum(lengths[examples], seq_len)
        del lengths
        row_first = _row_starts(length, seq_len) if pack else np.arange(len(examples), dtype=np.int64)
        offset = np.cumsum(length) - length
        offset -= np.repeat(offset[row_first], np.diff(np.append(row_first, len(examples))))
        if not _any_target(store, examples, seq_len):
            raise DataError("no token of the data is a training target (every example is prompt only?)")
        return cls(store=store, seq_len=seq_len, segment_example=examples, segment_length=length.astype(np.int32),
                   segment_offset=offset.astype(np.int32), row_segments=np.append(row_first, len(examples)))

    def __len__(self) -> int:
        return len(self.row_segments) - 1

    def padded_to_multiple(self, multiple: int) -> "PackedRows":
        """These rows plus all-padding rows (no loss, no attention) up to a multiple of `multiple`; the extra
        rows hold no segment and take no memory."""
        extra = -len(self) % multiple
        return dataclasses.replace(self, row_segments=np.append(self.row_segments,
                                                                np.full(extra, self.row_segments[-1])))

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at `index` (any order, repeats allowed) as input_ids, targets, loss_mask, segment_ids and
        positions, each `[*index.shape, seq_len]`: the arrays `build_rows` gives for the same rows."""
        index = np.asarray(index)
        if index.size and index.dtype.kind not in "iu":
            raise IndexError(f"row indices must be integers, got {index.dtype}")
        rows_b = index.reshape(-1).astype(np.int64)
        n_rows, seq_len = len(self), self.seq_len
        if rows_b.size and not (-n_rows <= rows_b.min() and rows_b.max() < n_rows):
            raise IndexError(f"row index out of range for {n_rows} rows")
        rows_b %= max(n_rows, 1)
        batch = len(rows_b)
        # the segments of the rows asked for: s of them, each with its row in the batch
        first_b = self.row_segments[rows_b]
        count_b = self.row_segments[rows_b + 1] - first_b
        s = int(count_b.sum())
        within_s = np.arange(s) - np.repeat(np.cumsum(count_b) - count_b, count_b)
        segment_s = np.repeat(first_b, count_b) + within_s
        row_s = np.repeat(np.arange(batch), count_b)
        length_s = self.segment_length[segment_s].astype(np.int64)
        source_s = np.asarray(self.store.starts[self.segment_example[segment_s]], np.int64)
        # each of their tokens: where it comes from in the store, where it goes in the flat batch
        t = int(length_s.sum())
        segment_t = np.repeat(np.arange(s), length_s)
        position_t = np.arange(t) - np.repeat(np.cumsum(length_s) - length_s, length_s)
        source_t = source_s[segment_t] + position_t
        dest_t = row_s[segment_t] * seq_len + self.segment_offset[segment_s][segment_t] + position_t
        input_ids, trained = np.zeros(batch * seq_len, np.int32), np.zeros(batch * seq_len, bool)
        input_ids[dest_t] = self.store.ids[source_t]
        trained[dest_t] = self.store.trained[source_t]
        segment_ids, positions = np.zeros(batch * seq_len, np.int32), np.zeros(batch * seq_len, np.int32)
        segment_ids[dest_t] = within_s[segment_t] + 1
        positions[dest_t] = position_t
        # token i's target is token i + 1 of the same document: none for a document's last token
        has_next = dest_t[position_t + 1 < length_s[segment_t]]
        targets, loss_mask = np.zeros(batch * seq_len, np.int32), np.zeros(batch * seq_len, np.float32)
        targets[has_next] = input_ids[has_next + 1]
        loss_mask[has_next] = trained[has_next + 1]
        shape = (*index.shape, seq_len)
        return {"input_ids": input_ids.reshape(shape), "targets": targets.reshape(shape),
                "loss_mask": loss_mask.reshape(shape), "segment_ids": segment_ids.reshape(shape),
                "positions": positions.reshape(shape)}


def _row_starts(length: np.ndarray, seq_len: int) -> np.ndarray:
    """The first example of each packed row, as `build_rows` fills them: an example starts a new row when it
    does not fit in what is left of the current one."""
    n = len(length)
    end = np.cumsum(length)
    # a row starting at example i takes examples up to the first j whose end passes begin[i] + seq_len
    next_start = np.searchsorted(end, end - length + seq_len, side="right")
    starts = np.empty(n, np.int64)
    i, rows = 0, 0
    while i < n:  # one step per row, over precomputed jumps
        starts[rows] = i
        rows += 1
        i = int(next_start[i])
    return starts[:rows]


def _target_blocks(store: TokenStore, seq_len: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first example, whether each example of a block has a training target within `seq_len`), over
    consecutive blocks of the store's examples spanning at most about SCAN_BLOCK_TOKENS tokens each."""
    starts = np.asarray(store.starts, np.int64)
    n = len(starts) - 1
    first = 0
    while first < n:
        stop = max(first + 1, int(np.searchsorted(starts, starts[first] + SCAN_BLOCK_TOKENS, side="right")) - 1)
        stop = min(stop, n)
        # the target of token i is token i + 1: an example's targets within the sequence are trained[1:seq_len]
        lo = np.minimum(starts[first:stop] + 1, starts[n])
        hi = np.maximum(lo, starts[first:stop] + np.minimum(np.diff(starts[first:stop + 1]), seq_len))
        base, top = int(starts[first]), int(hi[-1])
        count = np.zeros(top - base + 1, np.int32)
        np.cumsum(store.trained[base:top], out=count[1:])
        yield first, count[hi - base] > count[lo - base]
        first = stop


def targets_within(store: TokenStore, seq_len: int) -> np.ndarray:
    """bool [examples]: whether each example of the store has a training target within `seq_len` tokens."""
    blocks = [has for _, has in _target_blocks(store, seq_len)]
    return np.concatenate(blocks) if blocks else np.zeros(0, bool)


def _any_target(store: TokenStore, examples: np.ndarray, seq_len: int) -> bool:
    """Whether any of `examples` has a training target within `seq_len`; reads the store only up to the
    first block holding one."""
    if not examples.size:
        return False
    chosen = np.zeros(len(store.starts) - 1, bool)
    chosen[examples] = True
    return any((has & chosen[first:first + len(has)]).any() for first, has in _target_blocks(store, seq_len))


def truncation_report_from_store(store: TokenStore, examples: np.ndarray, seq_len: int,
                                 where: Callable[[int], str]) -> TruncationReport:
    """`finetune.data.reference.truncation_report` of the store's `examples` (indices, in order) from the store's
    lengths and trained bits; `where(e)` names example e's row."""
    examples = np.asarray(examples, np.int64).reshape(-1)
    truncated = np.diff(np.asarray(store.starts, np.int64))[examples] > seq_len
    has_targets = targets_within(store, seq_len)[examples]
    lost = truncated & ~has_targets

    def first(mask: np.ndarray) -> str | None:
        return where(int(examples[np.argmax(mask)])) if mask.any() else None

    return TruncationReport(seq_len=seq_len, examples=len(examples), truncated=int(truncated.sum()),
                            first_truncated=first(truncated), lost=int(lost.sum()), first_lost=first(lost),
                            with_targets=int(has_targets.sum()))
