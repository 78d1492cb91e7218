"""`tokenize_to_store`: rows tokenized in batches by this process and a pool of worker processes, streamed
into a store (`finetune.data.store`) in row order.

Parallelism is this process and a `multiprocessing` pool (spawned, so neither JAX's nor the tokenizer's
threads are forked) over batches of rows, the tokenizer sent to each worker once, rather than
`datasets.map(num_proc=...)`: results come back batch by batch in row order and are appended to the store's
files as they arrive, at most two batches per worker in flight (bounded memory, no Arrow copy of the tokens
to convert afterwards), and the progress bar counts rows and tokens exactly as they are written. This
process tokenizes batches too whenever the oldest one is not back yet, so the workers' start-up (imports,
receiving the tokenizer: a few seconds) costs little. Alone (little data, or `workers=1`), it tokenizes in two
threads: the batch encoding releases the GIL, so one thread's encoding runs beside the other's Python. The
objects alive before tokenizing starts are left out of garbage collection while it runs (`gc.freeze`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import itertools
import json
import math
import multiprocessing
import multiprocessing.pool
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from finetune.data.encoding import BatchTokenizer, Canonical, EncodedBatch
from finetune.data.layouts import AUTO, canonical as layout_canonical, is_preference
from finetune.data.reference import tokenize_examples
from finetune.data.store import STORE_VERSION, NpyAppender, TokenizedData

# Rows per batch handed to the tokenizer (and to a worker): big enough for the batch encoding and the
# inter-process traffic to pay off, small enough for a smooth progress bar and little memory in flight.
BATCH_ROWS = 256
# A worker process costs a few seconds to start (importing transformers, receiving the tokenizer): fewer
# rows than this per worker are tokenized faster by fewer processes.
MIN_ROWS_PER_WORKER = 20_000
# Spans the tokenizing process itself may run ahead of the oldest span not yet back from a worker (memory in flight).
LOCAL_AHEAD = 8


def _raw_rows(rows, lo: int, hi: int) -> list[dict]:
    """Rows `lo:hi` as dicts (a datasets.Dataset slices into columns)."""
    part = rows[lo:hi]
    if isinstance(part, dict):
        columns = list(part)
        return [dict(zip(columns, values)) for values in zip(*part.values())] if columns else [{}] * (hi - lo)
    return list(part)


# ---- worker processes ---------------------------------------------------------------------------------

_worker: dict = {}


def _start_worker(batch_tokenizer: BatchTokenizer, rows) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process: the pool is the parallelism
    _worker.update(batch=batch_tokenizer, rows=rows)
    gc.freeze()  # the imports and the tokenizer live as long as the worker: no collection need walk them again


def _work(lo: int, hi: int, raw_rows: list | None = None) -> EncodedBatch:
    return _worker["batch"](raw_rows if raw_rows is not None else _raw_rows(_worker["rows"], lo, hi))


def default_workers(requested: int, n_rows: int) -> int:
    """Processes to tokenize `n_rows` with: `requested` when given; else one per CPU core this process may
    use, fewer when there are too few rows for a worker's start-up to pay off (MIN_ROWS_PER_WORKER each)."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(n_rows / MIN_ROWS_PER_WORKER)))


def _results(batch: BatchTokenizer, rows, spans: Sequence[tuple[int, int]], workers: int) -> Iterator[EncodedBatch]:
    """Each span's batch, in order, tokenized by `workers` processes: this one and `workers - 1` spawned ones.
    This process tokenizes spans alone until a worker has started (imported what it needs and received the
    tokenizer: a few seconds), then hands spans to the workers, two per worker in flight, and takes the next
    span itself whenever the oldest one is not back yet, at most LOCAL_AHEAD spans ahead."""
    if workers <= 1 or len(spans) <= 1:
        yield from _in_two_threads(batch, rows, spans)
        return
    spans = iter(spans)
    import datasets

    shared = rows if isinstance(rows, datasets.Dataset) else None  # sent once; plain rows go with each batch
    context = multiprocessing.get_context("spawn")
    spawned = workers - 1
    with context.Pool(spawned, initializer=_start_worker, initargs=(batch, shared)) as pool:
        started = pool.apply_async(_started)
        for lo, hi in spans:
            yield batch(_raw_rows(rows, lo, hi))
            if started.ready():
                break
        yield from _beside_workers(batch, rows, spans, pool, spawned, shared)


def _beside_workers(batch: BatchTokenizer, rows, spans: Iterator[tuple[int, int]], pool, spawned: int,
                    shared) -> Iterator[EncodedBatch]:
    """The rest of `_results`, the workers running: two spans each in flight, and the next span tokenized here
    whenever the oldest one is not back yet."""
    pending: collections.deque = collections.deque()  # in span order: AsyncResults and this process's _Batches
    in_flight = 0  # AsyncResults in `pending`
    with _tokenizer_threads(False):  # this process's encodings one thread each, beside the workers
        while True:
            while in_flight < 2 * spawned and (span := next(spans, None)) is not None:
                lo, hi = span
                args = (lo, hi) if shared is not None else (lo, hi, _raw_rows(rows, lo, hi))
                pending.append(pool.apply_async(_work, args))
                in_flight += 1
            if not pending:
                return
            head = pending[0]
            waiting = isinstance(head, multiprocessing.pool.AsyncResult)
            if waiting and not head.ready() and len(pending) < LOCAL_AHEAD:
                span = next(spans, None)
                if span is not None:
                    pending.append(batch(_raw_rows(rows, *span)))
                    continue
            pending.popleft()
            in_flight -= waiting
            yield head.get() if waiting else head


def _in_two_threads(batch: BatchTokenizer, rows, spans: Sequence[tuple[int, int]]) -> Iterator[EncodedBatch]:
    """Each span's batch, in order, tokenized in two threads of this process: the fast tokenizer's batch
    encoding releases the GIL, so one thread's encoding runs beside the other's Python (rendering, checks).
    The threads share `batch`'s caches of shapes and tails (a race only repeats a check) and only read the
    tokenizer."""
    def tokenize(lo: int, hi: int) -> EncodedBatch:
        return batch(_raw_rows(rows, lo, hi))

    # each encoding on one thread: the two threads are the parallelism
    with concurrent.futures.ThreadPoolExecutor(2) as pool, _tokenizer_threads(False):
        spans = iter(spans)
        pending = collections.deque(pool.submit(tokenize, lo, hi) for lo, hi in itertools.islice(spans, 4))
        while pending:
            result = pending.popleft().result()
            pending.extend(pool.submit(tokenize, lo, hi) for lo, hi in itertools.islice(spans, 1))
            yield result


@contextlib.contextmanager
def _collections_skip_older_objects() -> Iterator[None]:
    """The objects alive when the block starts (the process's modules, a model, a dataset: millions of them)
    left out of garbage collection until it ends (`gc.freeze`), so a collection walks only the objects the
    block makes. Nothing is frozen when something else froze objects already."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _started() -> bool:
    return True


@contextlib.contextmanager
def _tokenizer_threads(parallel: bool) -> Iterator[None]:
    """The fast tokenizer's batch encodings multithreaded or not in this process, while in the block (the
    library reads TOKENIZERS_PARALLELISM at each call)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def tokenize_to_store(rows, tokenizer, seq_len: int | None, directory: str | Path, *, layout: str = AUTO,
                      canonical: Canonical = layout_canonical, where: Callable[[int], str] = lambda i: f"row {i + 1}",
                      workers: int = 1, progress: bool = False, batch_rows: int = BATCH_ROWS,
                      meta: dict | None = None, max_prompt: int | None = None) -> TokenizedData:
    """Tokenize `rows` (a datasets.Dataset or a sequence of raw row dicts; `canonical(row, layout, where)`
    gives each one's canonical form) into a store in the existing empty `directory`, `workers` processes at a
    time. A preference layout's row is two examples, chosen (2r) then rejected (2r + 1), and the store's
    meta.json says `"examples_per_row": 2`. With `max_prompt` (prompts bounded to that many tokens), meta.json
    counts the rows whose prompt was cut (`prompts_cut`) and gives the first one's index (`first_prompt_cut`).
    A bad row raises the DataError the reference path gives it, naming `where(i)` of the first one.
    Workers are spawned: a script that calls this with `workers > 1` needs multiprocessing's
    `if __name__ == "__main__":` guard (the console scripts have it)."""
    directory = Path(directory)
    batch = BatchTokenizer(tokenizer, seq_len, layout, canonical, max_prompt)
    spans = [(lo, min(lo + batch_rows, len(rows))) for lo in range(0, len(rows), batch_rows)]
    from tqdm import tqdm

    writers = [NpyAppender(directory / "ids.npy", np.int32), NpyAppender(directory / "trained.npy", np.bool_)]
    lengths, tokens, fallbacks, began = [], 0, 0, time.perf_counter()
    prompts_cut, first_prompt_cut = 0, None
    try:
        with _collections_skip_older_objects(), \
                tqdm(total=len(rows), unit=" rows", desc="tokenize", disable=not progress, leave=False) as bar:
            for (lo, hi), result in zip(spans, _results(batch, rows, spans, workers)):
                if result.bad_row is not None:
                    _raise_row_error(rows, lo + result.bad_row, batch, where)
                writers[0].append(result.ids)
                writers[1].append(result.trained)
                lengths.append(result.lengths)
                tokens += len(result.ids)
                fallbacks += result.fallbacks
                if result.prompts_cut:
                    prompts_cut += len(result.prompts_cut)
                    first_prompt_cut = lo + result.prompts_cut[0] if first_prompt_cut is None else first_prompt_cut
                bar.update(hi - lo)
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - began, 1e-9):,.0f} tokens/s", refresh=False)
    finally:
        for writer in writers:
            writer.close()
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    per_row = 2 if is_preference(layout) else 1
    if len(lengths) != per_row * len(rows):
        raise RuntimeError(f"{len(rows)} rows of layout {layout} gave {len(lengths)} examples, not {per_row} each")
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    np.save(directory / "starts.npy", starts)
    # an SFT store's meta.json stays as it was: one example per row goes without saying
    pairs = {"examples_per_row": per_row} if per_row != 1 else {}
    bounded = ({"max_prompt_len": max_prompt, "prompts_cut": prompts_cut, "first_prompt_cut": first_prompt_cut}
               if max_prompt is not None else {})
    info = {"store_version": STORE_VERSION, "examples": len(lengths), **pairs, "tokens": tokens, "seq_len": seq_len,
            "layout": layout, **bounded, "reference_path_rows": fallbacks,
            "seconds": round(time.perf_counter() - began, 3), **(meta or {})}
    (directory / "meta.json").write_text(json.dumps(info, indent=1) + "\n")
    return TokenizedData.open(directory)


def _raise_row_error(rows, index: int, batch: BatchTokenizer, where: Callable[[int], str]) -> None:
    """Raise the error row `index` has, naming it: its layout's, or the reference path's."""
    (raw,) = _raw_rows(rows, index, index + 1)
    row = batch.canonical(raw, batch.layout, where(index))
    tokenize_examples(where(index), row, batch.tokenizer, batch.limit, batch.max_prompt)
    raise RuntimeError(f"{where(index)}: rejected in a batch but not alone")
