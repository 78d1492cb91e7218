"""The data pipeline's shared types: `DataError`, a tokenized `Example`, fixed-length `Rows` and the
`TruncationReport` of cutting examples to the sequence length."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmodel.errors import UserError


class DataError(ValueError, UserError):
    """Bad training data; the message names the file (and line) and what was expected."""


@dataclasses.dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32 [n]
    trained: np.ndarray  # bool [n]: whether each token is a training target
    where: str = ""  # the row it came from (`file:line`), for reports
    prompt_cut: bool = False  # its prompt was bounded (`--max-prompt-len`), its start left out


@dataclasses.dataclass(frozen=True)
class Rows:
    """Fixed-length training rows, `[n_rows, seq_len]` each."""

    input_ids: np.ndarray  # int32
    targets: np.ndarray  # int32: the next token within the same document (0 where there is none)
    loss_mask: np.ndarray  # float32: 1 where `targets` counts in the loss
    segment_ids: np.ndarray  # int32: document number within the row, from 1; 0 is padding
    positions: np.ndarray  # int32: position within the document

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)}

    def padded_to_multiple(self, multiple: int) -> "Rows":
        """Rows plus all-padding rows (no loss, no attention) up to a multiple of `multiple`."""
        extra = -len(self) % multiple
        return Rows(**{f.name: np.concatenate([getattr(self, f.name),
                                               np.zeros((extra, self.input_ids.shape[1]), getattr(self, f.name).dtype)])
                       for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True)
class TruncationReport:
    """What cutting examples to `seq_len` does: how many are cut, how many of those keep no training target,
    and the first row of each kind."""

    seq_len: int
    examples: int
    truncated: int
    first_truncated: str | None
    lost: int  # cut, and none of the targets left
    first_lost: str | None
    with_targets: int  # examples with a target within seq_len

    def warning(self) -> str | None:
        """One line for the user when examples are cut (None when none is)."""
        if not self.truncated:
            return None
        lost = f" (first: {self.first_lost})" if self.lost else ""
        return (f"{self.truncated} of {self.examples} examples are longer than --seq-len {self.seq_len} and were cut "
                f"to it (first: {self.first_truncated}); {self.lost} of them lost all their training targets{lost}")

    def require_targets(self, source: str) -> None:
        """Raise DataError naming `source` when no example has a training target left."""
        if self.with_targets:
            return
        if self.lost:
            raise DataError(f"{source}: no token of the data is a training target within --seq-len {self.seq_len}: "
                            f"{self.lost} of {self.examples} examples lost all their targets to truncation "
                            f"(first: {self.first_lost})")
        raise DataError(f"{source}: no token of the data is a training target (every example is prompt only?)")
