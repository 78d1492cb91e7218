"""The batch stream: a pure function of (seed, position).

Batch `g` holds rows `g*B .. g*B+B-1` of an endless sequence of epochs, each a seeded permutation of the rows.
A checkpoint stores `g`; nothing else is needed to resume exactly. Each process builds only the rows its
devices hold (`finetune.train.batches`).
"""

from __future__ import annotations

import numpy as np


def row_indices(n_rows: int, seed: int, batch_index: int, batch_size: int, start: int = 0,
                stop: int | None = None, shuffle: bool = True) -> np.ndarray:
    """Indices into the rows of global batch `batch_index`, positions `[start, stop)` within it."""
    stop = batch_size if stop is None else stop
    stream = np.arange(batch_index * batch_size + start, batch_index * batch_size + stop)
    epochs, offsets = np.divmod(stream, n_rows)
    if not shuffle:
        return offsets
    out = np.empty_like(offsets)
    for epoch in np.unique(epochs):
        permutation = np.random.default_rng([seed, int(epoch)]).permutation(n_rows)
        out[epochs == epoch] = permutation[offsets[epochs == epoch]]
    return out
