"""`PairRows`: the rows a preference step reads, each step's pairs laid out so that a pair's chosen and rejected
sequences sit in the same micro-batch of the same batch shard, each sequence marked with its slot.

A step takes `batch_size` (B) pairs, positions j = 0 .. B-1 of the pair stream (`finetune.data.order.row_indices`
over the kept pairs, as SFT takes rows). With W batch shards (dp x fsdp) and A micro-batches (grad_accum), B must
be a multiple of A·W, and position j goes to shard d = j // (B/W); within it, q = j % (B/W) goes to micro-batch
m = q % A as its group's pair i = q // A. The P_g = B / (A·W) pairs of group (d, m) are 2·P_g sequences (chosen,
rejected, each cut to seq_len T) in R_g rows of T tokens, R_g the same for every group and step:
- unpacked: R_g = 2·P_g, a sequence per row (chosen of pair i in row 2i, rejected in row 2i + 1), padded;
- packed: first-fit-decreasing into rows of T, a segment per sequence; first fit leaves at most one row half
  full or less, so a group whose lengths sum to s fits in floor(2s / T) + 1 rows: R_g is that for the largest
  sum a group can have (below), at most 2·P_g.
A step's R = A·W·R_g rows: shard d holds the block of rows d·(R/W) .. (d+1)·(R/W) - 1, and in it micro-batch m
the block rows m, m + A, m + 2A, ... (the step takes micro-batch m as rows m, m + A, ... of the batch), so
group (d, m)'s rows are block rows m + A·k, k < R_g.

The largest sum a group can have: of its 2·P_g sequences' lengths, a pair repeated in a group once per epoch its
positions reach (a group straddling the end of an epoch may hold a pair twice, the stream being endless seeded
epochs), so S is the sum of the 2·P_g longest lengths among the kept pairs' sequences, each counted as often
as a group's positions can reach epochs (once when P_g = 1; twice while a group's span of the stream is at most
the number of pairs).

Arrays per row, as `finetune.data.packing.PackedRows.take` makes them (input_ids, targets, loss_mask,
segment_ids, positions: a segment per sequence, numbered from 1 in each row, positions restarting, no target
across sequences), and `sequence` int32: each token's slot within its micro-batch, 2·(d·P_g + i) for the chosen
sequence of pair i of group (d, m), + 1 for the rejected; -1 on padding. Evaluation walks the eval pairs once in
order, the last step filled with empty pairs (no rows' tokens, no slot).

With the reference's log-probabilities precomputed (`with_reference`: one float32 value per example of the store,
`finetune.data.reference_logps`), the rows also hold `reference_logp` float32: each sequence's value on its first
trained position, zero elsewhere, so the step's masked sum over a slot (`finetune.step.preference.sequence_sums`)
gives back exactly that value, wherever the sequence's rows lie.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from finetune.data.order import row_indices
from finetune.data.packing import PackedRows, TokenStore
from finetune.data.rows import DataError

# The arrays of a step's rows, each [rows, seq_len].
FIELDS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions", "sequence")
REFERENCE_FIELD = "reference_logp"  # with a precomputed reference


def check_pair_batch(batch_size: int, grad_accum: int, ways: int) -> int:
    """Pairs per group, B / (A·W); DataError when B is not a multiple of A·W."""
    if min(batch_size, grad_accum, ways) < 1:
        raise ValueError(f"batch size, grad_accum and ways must be positive, got {batch_size}, {grad_accum}, {ways}")
    if batch_size % (grad_accum * ways):
        raise DataError(f"--batch-size {batch_size} pairs must be a multiple of --grad-accum {grad_accum} x "
                        f"{ways} batch shards (dp x fsdp) = {grad_accum * ways}: each micro-batch of each shard "
                        "holds whole pairs")
    return batch_size // (grad_accum * ways)


def needed_rows_per_group(store: TokenStore, pairs: np.ndarray, seq_len: int, *, pack: bool, batch_size: int,
                          grad_accum: int = 1, ways: int = 1, repeats: int | None = None) -> int:
    """R_g: rows of `seq_len` that hold any group of pairs of a step (see the module docstring). `repeats`: how
    often a group may hold one pair; by default as often as a group's positions can reach epochs of the stream
    of `pairs`."""
    per_group = check_pair_batch(batch_size, grad_accum, ways)
    if not pack:
        return 2 * per_group
    pairs = np.asarray(pairs, np.int64).reshape(-1)
    if repeats is None:
        # a group's first and last positions are (P_g - 1)·A apart in the stream: they reach at most
        # ceil(that / n) + 1 epochs, each holding a pair once
        distance = (per_group - 1) * grad_accum
        repeats = min(per_group, -(-distance // max(len(pairs), 1)) + 1)
    lengths = np.minimum(np.diff(np.asarray(store.starts, np.int64)), seq_len)
    sequences = np.sort(np.concatenate([lengths[2 * pairs], lengths[2 * pairs + 1]]))[::-1]
    largest = int(np.repeat(sequences[:2 * per_group], repeats)[:2 * per_group].sum())
    return min(2 * per_group, 2 * largest // seq_len + 1)


@dataclasses.dataclass(frozen=True)
class PairRows:
    """The kept `pairs` of a store of preference pairs (pair p: examples 2p chosen, 2p + 1 rejected), as the
    rows of steps of `batch_size` pairs (see the module docstring)."""

    store: TokenStore
    pairs: np.ndarray  # int64 [n]: the pairs, in the order the stream indexes them
    seq_len: int
    pack: bool
    batch_size: int
    grad_accum: int
    ways: int
    rows_per_group: int
    seed: int = 0
    reference_logps: np.ndarray | None = None  # float32 [examples of the store]: the precomputed reference

    def with_reference(self, values: np.ndarray) -> "PairRows":
        """These rows with the reference's log-probability of each example of the store (float32 [examples]; a
        kept pair's two values must be numbers): steps then carry them in `reference_logp`."""
        values = np.asarray(values, np.float32)
        if values.shape != (len(self.store.starts) - 1,):
            raise ValueError(f"reference values for {values.shape} examples, the store has {len(self.store.starts) - 1}")
        if np.isnan(values[2 * self.pairs]).any() or np.isnan(values[2 * self.pairs + 1]).any():
            raise ValueError("no reference value for a sequence of a kept pair")
        return dataclasses.replace(self, reference_logps=values)

    @classmethod
    def build(cls, store: TokenStore, pairs: np.ndarray, seq_len: int, *, pack: bool, batch_size: int,
              grad_accum: int = 1, ways: int = 1, seed: int = 0, rows_per_group: int | None = None) -> "PairRows":
        """The rows of `pairs` (kept pair indices, see `finetune.data.pair_filter.keep_pairs`). `rows_per_group`:
        R_g when several sets of pairs share one batch shape (training and evaluation): at least what each
        needs (`needed_rows_per_group`); a group that does not fit raises AssertionError as it is packed."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        pairs = np.asarray(pairs, np.int64).reshape(-1)
        if not pairs.size:
            raise DataError("no preference pairs to train on")
        n_pairs = (len(store.starts) - 1) // 2
        if not (0 <= pairs.min() and pairs.max() < n_pairs):
            raise IndexError(f"pair index out of range for a store of {n_pairs} pairs")
        if rows_per_group is None:
            rows_per_group = needed_rows_per_group(store, pairs, seq_len, pack=pack, batch_size=batch_size,
                                                   grad_accum=grad_accum, ways=ways)
        elif not 1 <= rows_per_group <= 2 * check_pair_batch(batch_size, grad_accum, ways):
            raise ValueError(f"rows_per_group {rows_per_group} outside 1 .. 2 x the pairs of a group")
        elif not pack and rows_per_group != 2 * check_pair_batch(batch_size, grad_accum, ways):
            raise ValueError("unpacked pairs take a row per sequence: rows_per_group is 2 x the pairs of a group")
        return cls(store=store, pairs=pairs, seq_len=seq_len, pack=pack, batch_size=batch_size,
                   grad_accum=grad_accum, ways=ways, rows_per_group=rows_per_group, seed=seed)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def pairs_per_group(self) -> int:
        return self.batch_size // (self.grad_accum * self.ways)

    @property
    def rows_per_step(self) -> int:
        """R: the rows of a step's global batch."""
        return self.grad_accum * self.ways * self.rows_per_group

    @property
    def eval_steps(self) -> int:
        """Steps that cover every pair once, in order (the last one filled with empty pairs)."""
        return math.ceil(len(self) / self.batch_size)

    def eval_pairs(self, g: int) -> int:
        """The real (not empty) pairs of evaluation step `g`."""
        return max(0, min(self.batch_size, len(self) - g * self.batch_size))

    def take_step(self, g: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Global rows `[lo, hi)` of training step `g` (positions g·B .. g·B + B - 1 of the seeded stream of
        pairs); `lo`, `hi` multiples of R/W: only those shards' groups are built."""
        per_shard = self.batch_size // self.ways

        def shard_pairs(d: int) -> np.ndarray:
            index = row_indices(len(self), self.seed, g, self.batch_size, d * per_shard, (d + 1) * per_shard)
            return self.pairs[index]

        return self._take(shard_pairs, lo, hi)

    def take_eval(self, g: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Global rows `[lo, hi)` of evaluation step `g`: pairs g·B .. g·B + B - 1 in order, past the last one
        empty pairs (no tokens, no slot)."""
        per_shard = self.batch_size // self.ways

        def shard_pairs(d: int) -> np.ndarray:
            position = g * self.batch_size + d * per_shard + np.arange(per_shard)
            return np.where(position < len(self), self.pairs[np.minimum(position, len(self) - 1)], -1)

        return self._take(shard_pairs, lo, hi)

    def eval_examples(self, g: int) -> np.ndarray:
        """int64 [grad_accum, 2 x pairs per micro-batch]: the example in each sequence slot of each micro-batch of
        evaluation step `g` (-1: an empty pair's), as `take_eval` lays them out."""
        A, P, W = self.grad_accum, self.pairs_per_group, self.ways
        position = g * self.batch_size + np.arange(self.batch_size)  # shard d's pair q at d·(B/W) + q
        pair = np.where(position < len(self), self.pairs[np.minimum(position, len(self) - 1)], -1)
        q = np.arange(self.batch_size) % (self.batch_size // W)
        d, m, i = np.arange(self.batch_size) // (self.batch_size // W), q % A, q // A
        examples = np.full((A, 2 * W * P), -1, np.int64)
        for side in (0, 1):
            examples[m, 2 * (d * P + i) + side] = np.where(pair >= 0, 2 * pair + side, -1)
        return examples

    def _take(self, shard_pairs, lo: int, hi: int | None) -> dict[str, np.ndarray]:
        """The rows `[lo, hi)` of the step whose shard d holds the pairs `shard_pairs(d)` (-1: an empty pair)."""
        total, per_shard_rows = self.rows_per_step, self.rows_per_step // self.ways
        hi = total if hi is None else hi
        if not (0 <= lo <= hi <= total and lo % per_shard_rows == 0 and hi % per_shard_rows == 0):
            raise IndexError(f"rows [{lo}, {hi}) of a step of {total} rows: expected whole shards of "
                             f"{per_shard_rows} rows")
        A, P = self.grad_accum, self.pairs_per_group
        tables = []  # per group: (local row, offset, example, length, slot) of each sequence
        for d in range(lo // per_shard_rows, hi // per_shard_rows):
            pairs_d = shard_pairs(d)
            for m in range(A):
                group = pairs_d[m::A]  # its pair i is shard position i·A + m
                rows, offsets, examples, lengths, slots = self._group(group, 2 * d * P)
                tables.append((d * per_shard_rows + m + A * rows - lo, offsets, examples, lengths, slots))
        row, offset, example, length, slot = (np.concatenate([t[k] for t in tables] + [np.zeros(0, np.int64)])
                                              for k in range(5))
        order = np.lexsort((offset, row))
        row, offset, example, length, slot = (a[order] for a in (row, offset, example, length, slot))
        n_rows = hi - lo
        row_segments = np.searchsorted(row, np.arange(n_rows + 1), side="left").astype(np.int64)
        packed = PackedRows(store=self.store, seq_len=self.seq_len, segment_example=example.astype(np.int64),
                            segment_length=length.astype(np.int32), segment_offset=offset.astype(np.int32),
                            row_segments=row_segments)
        out = packed.take(np.arange(n_rows))
        # each token's segment in the table (padding: one past its end, whose slot is -1)
        segment_ids = out["segment_ids"]
        index = np.where(segment_ids > 0, row_segments[:-1, None] + segment_ids - 1, len(slot))
        out["sequence"] = np.append(slot, -1)[index].astype(np.int32)
        if self.reference_logps is not None:
            out[REFERENCE_FIELD] = self._reference_field(index, out["loss_mask"], example)
        return out

    def _reference_field(self, segment: np.ndarray, loss_mask: np.ndarray, example: np.ndarray) -> np.ndarray:
        """float32 [rows, seq_len]: each sequence's reference value on its first trained position (every sequence
        of a kept pair has one), zero elsewhere; `segment`: each token's sequence in the step's table (padding:
        past its end), `example`: each sequence's example."""
        segment, trained = segment.reshape(-1), loss_mask.reshape(-1) > 0
        at = np.flatnonzero(trained & (segment < len(example)))
        sequences, first = np.unique(segment[at], return_index=True)
        field = np.zeros(segment.shape, np.float32)
        field[at[first]] = self.reference_logps[example[sequences]]
        return field.reshape(loss_mask.shape)

    def _group(self, group: np.ndarray, first_slot: int) -> tuple[np.ndarray, ...]:
        """(row within the group, offset in the row, example, length, slot) of each sequence of a group of pairs
        (-1: an empty pair, no sequence), its pair i's sequences in slots first_slot + 2i and + 1."""
        real = np.flatnonzero(group >= 0)
        examples = np.stack([2 * group[real], 2 * group[real] + 1], axis=1).reshape(-1)
        slots = first_slot + np.stack([2 * real, 2 * real + 1], axis=1).reshape(-1)
        starts = np.asarray(self.store.starts, np.int64)
        lengths = np.minimum(starts[examples + 1] - starts[examples], self.seq_len)
        if not self.pack:
            rows = slots - first_slot  # sequence k of the group in row k
            return rows, np.zeros(len(rows), np.int64), examples, lengths, slots
        rows, offsets = first_fit_decreasing(lengths, self.seq_len)
        if len(rows) and rows.max() >= self.rows_per_group:
            raise AssertionError(f"a group of {len(real)} pairs packed into {rows.max() + 1} rows, more than the "
                                 f"{self.rows_per_group} any group was sized for")
        return rows, offsets, examples, lengths, slots


def first_fit_decreasing(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, offset in the row) of each item of `lengths` (each at most `seq_len`) packed first-fit-decreasing
    into rows of `seq_len`: longest first (ties in order), each into the first row it fits in."""
    rows, offsets = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    fill = np.zeros(len(lengths), np.int64)
    used = 0
    for k in np.argsort(-np.asarray(lengths), kind="stable"):
        fits = np.flatnonzero(fill[:used] + lengths[k] <= seq_len)
        row = int(fits[0]) if fits.size else used
        used += not fits.size
        rows[k], offsets[k] = row, fill[row]
        fill[row] += lengths[k]
    return rows, offsets
