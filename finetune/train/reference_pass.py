"""--precompute-reference: the reference's log-probability of every kept sequence of a preference run's data,
computed in one pass before training (or read from the data cache, `finetune.data.reference_logps`) and handed to
the rows, so that no step runs the reference's forward.

The pass walks every kept pair of each store once, as evaluation does, in batches of the run's shape on the run's
mesh, and runs the step's own reference computation on them (`finetune.step.train_step.reference_sums`). A store
of --eval-fraction's split is walked whole, so the training pairs and the held-out ones get their values in one
pass. Every process runs the pass (its result is replicated) unless every process finds the values stored.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from finetune.config import TrainConfig
from finetune.data.cache import CachedData
from finetune.data.pair_filter import keep_pairs
from finetune.data.pairs import PairRows, needed_rows_per_group
from finetune.data.prepare import RunData
from finetune.data.reference_logps import load_reference, reference_key, store_reference
from finetune.step.train_step import reference_batch_sums
from finetune.train.batches import pair_batch


def with_precomputed_reference(config: TrainConfig, run_data: RunData, train_rows: PairRows,
                               eval_rows: PairRows | None, graphdef, lora, base, reference, mesh, batch_sharding
                               ) -> tuple[PairRows, PairRows | None]:
    """`train_rows` and `eval_rows` carrying the reference's values, read from the cache or computed now with the
    initial `lora` state (its shape; its values are never used) and `reference` (the frozen initial adapter, or
    None for the base model)."""
    main = jax.process_index() == 0
    step = jax.jit(lambda lora, base, reference, batch: reference_batch_sums(
        graphdef, lora, base, reference, batch, config.batch_size, config.grad_accum, config.loss_chunk),
        out_shardings=NamedSharding(mesh, PartitionSpec()))

    def values(cached: CachedData, where) -> np.ndarray:
        key = reference_key(config, cached.digest)
        examples = len(cached.data)
        stored = load_reference(cached.directory, key, examples)
        if _everywhere(stored is not None):
            if main:
                print(f"finetune-lora: reference: cache hit ({cached.directory})", file=sys.stderr)
            return stored
        started = time.perf_counter()
        walk = _walk(config, cached, where, train_rows.ways)
        computed = np.full(examples, np.nan, np.float32)
        from tqdm import tqdm

        with jax.set_mesh(mesh):
            for g in tqdm(range(walk.eval_steps), desc="reference", disable=not (config.progress and main)):
                sums = np.asarray(jax.device_get(step(lora, base, reference, pair_batch(walk, batch_sharding, g,
                                                                                       evaluation=True))))
                slots = walk.eval_examples(g)
                computed[slots[slots >= 0]] = sums[slots >= 0]
        store_reference(cached.directory, key, computed)
        if main:
            print(f"finetune-lora: reference: {2 * len(walk):,} sequences computed in "
                  f"{time.perf_counter() - started:.1f} s (cache miss, stored in {cached.directory})", file=sys.stderr)
        return computed

    train_values = values(run_data.data.cached, run_data.data.source.where)
    train_rows = train_rows.with_reference(train_values)
    if eval_rows is not None:
        held_out = run_data.held_out
        same = held_out is run_data.data  # --eval-fraction: the walk above covered the held-out pairs
        eval_rows = eval_rows.with_reference(train_values if same else values(held_out.cached, held_out.source.where))
    return train_rows, eval_rows


def _walk(config: TrainConfig, cached: CachedData, where, ways: int) -> PairRows:
    """Every pair of the store that trains within --seq-len, once, in batches of the run's shape."""
    store = cached.data
    kept, _ = keep_pairs(store, np.arange(len(store) // 2), config.seq_len, where)
    shape = dict(pack=config.pack, batch_size=config.batch_size, grad_accum=config.grad_accum, ways=ways)
    rows_per_group = needed_rows_per_group(store, kept, config.seq_len, repeats=1, **shape)
    return PairRows.build(store, kept, config.seq_len, rows_per_group=rows_per_group, **shape)


def _everywhere(flag: bool) -> bool:
    """Whether `flag` holds on every process (a collective: every process calls it)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))
