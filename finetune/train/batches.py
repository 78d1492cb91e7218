"""The batches of a run's steps: global batch `g` is a pure function of (seed, position), laid out over the
mesh, with each process reading only the rows its own devices hold."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from finetune.config import TrainConfig
from finetune.data.order import row_indices


def local_row_range(sharding: NamedSharding, batch_size: int, seq_len: int) -> tuple[int, int]:
    """The rows `[lo, hi)` of each global batch that this process's devices hold under `sharding`."""
    index_map = sharding.addressable_devices_indices_map((batch_size, seq_len))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop if idx[0].stop is not None else batch_size for idx in index_map.values()})
    return starts[0], stops[-1]


def global_batch(rows, indices_for, sharding: NamedSharding, batch_size: int,
                 seq_len: int | None = None) -> dict[str, jax.Array]:
    """The global batch as arrays laid out by `sharding`; this process reads only its own devices' rows.

    `rows` is anything with `take(index)` and `len()` (`finetune.data.reference.Rows`, packed rows); `indices_for(lo, hi)`
    gives the row indices of positions `[lo, hi)` of the batch. `seq_len` defaults to that of `rows`."""
    if seq_len is None:
        seq_len = rows.take(np.zeros(0, np.int64))["input_ids"].shape[1]
    lo, hi = local_row_range(sharding, batch_size, seq_len)
    local = rows.take(indices_for(lo, hi))
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, seq_len)) for k, v in local.items()}


def batch_at(rows, config: TrainConfig, sharding: NamedSharding, g: int) -> dict[str, jax.Array]:
    """Global training batch `g` (the `g`-th of the run's endless stream, counted from step 1): rows
    `g*B .. g*B+B-1` of the seeded epochs of `rows` (`finetune.data.order.row_indices`)."""
    return global_batch(rows, lambda lo, hi: row_indices(len(rows), config.seed, g, config.batch_size, lo, hi),
                        sharding, config.batch_size, config.seq_len)


def pair_batch(rows, sharding: NamedSharding, g: int, evaluation: bool = False) -> dict[str, jax.Array]:
    """Global batch `g` of pair rows (`finetune.data.pairs.PairRows`: training step `g`, or eval batch `g`); this
    process builds only the rows its devices hold, whole batch shards (a pair never leaves its shard)."""
    shape = (rows.rows_per_step, rows.seq_len)
    lo, hi = local_row_range(sharding, *shape)
    local = (rows.take_eval if evaluation else rows.take_step)(g, lo, hi)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}
