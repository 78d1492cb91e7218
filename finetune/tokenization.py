"""Batched, parallel tokenization of canonical rows into a TokenizedData store on disk.

A canonical row is `{"text"}`, `{"prompt", "completion"}` or `{"messages"}` (see `finetune.layouts`); its
example equals, token for token and mask for mask, what `finetune.data.tokenize` (the per-row reference)
gives it, including the cut at `seq_len + 1` tokens that keeps a giant row from being tokenized whole. Rows
are tokenized a batch at a time with the fast tokenizer's batch encoding. A chat is rendered once; its
assistant spans come from the character offsets of its prefix renderings (`apply_chat_template(tokenize=
False)`) mapped onto that one encoding, each boundary checked to tokenize as the prefix alone would; a row where
any check fails goes through the reference path instead.

Parallelism is a `multiprocessing` pool (spawned, so neither JAX's nor the tokenizer's threads are forked)
over batches of rows, the tokenizer sent to each worker once, rather than `datasets.map(num_proc=...)`:
results come back batch by batch in row order and are appended to the store's files as they arrive, at
most two batches per worker in flight (bounded memory, no Arrow copy of the tokens to convert afterwards),
and the progress bar counts rows and tokens exactly as they are written.

The store (one directory): `ids.npy` int32 [tokens] every example's ids concatenated, `trained.npy` bool
[tokens], `starts.npy` int64 [examples + 1] (example e is `ids[starts[e]:starts[e + 1]]` and comes from row
e), `meta.json` (counts and what the store was built from) written last.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import math
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from finetune.data import CHARS_PER_TOKEN, CUT_MARGIN, DataError, Example, _first_characters, _tokenize_row
from finetune.layouts import AUTO, canonical as layout_canonical

STORE_VERSION = 1
STORE_FILES = ("ids.npy", "trained.npy", "starts.npy", "meta.json")
# Rows per batch handed to the tokenizer (and to a worker): big enough for the batch encoding and the
# inter-process traffic to pay off, small enough for a smooth progress bar and little memory in flight.
BATCH_ROWS = 256
# A worker process costs a few seconds to start (importing transformers, receiving the tokenizer): fewer
# rows than this per worker are tokenized faster by fewer processes.
MIN_ROWS_PER_WORKER = 20_000

Canonical = Callable[[dict, str, str], dict]


@dataclasses.dataclass(frozen=True)
class TokenizedData:
    """A store of tokenized examples, its arrays memory-mapped (read-only)."""

    directory: Path
    ids: np.ndarray  # int32 [tokens]
    trained: np.ndarray  # bool [tokens]: whether each token is a training target
    starts: np.ndarray  # int64 [examples + 1]
    meta: dict

    @classmethod
    def open(cls, directory: str | Path) -> "TokenizedData":
        """The store in `directory`; ValueError when it is incomplete or of another version."""
        directory = Path(directory)
        try:
            meta = json.loads((directory / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{directory}: not a complete tokenized-data store ({e})") from None
        if meta.get("store_version") != STORE_VERSION:
            raise ValueError(f"{directory}: tokenized-data store version {meta.get('store_version')}, "
                             f"expected {STORE_VERSION}")
        ids, trained, starts = (_load(directory / name) for name in ("ids.npy", "trained.npy", "starts.npy"))
        if not (ids.dtype == np.int32 and trained.dtype == np.bool_ and starts.dtype == np.int64
                and len(ids) == len(trained) == starts[-1] == meta["tokens"] and len(starts) == meta["examples"] + 1):
            raise ValueError(f"{directory}: tokenized-data store arrays disagree with its meta.json")
        return cls(directory=directory, ids=ids, trained=trained, starts=starts, meta=meta)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        """int64 [examples]: each example's number of tokens."""
        return np.diff(self.starts)

    def example(self, e: int, where: str = "") -> Example:
        lo, hi = int(self.starts[e]), int(self.starts[e + 1])
        return Example(np.asarray(self.ids[lo:hi]), np.asarray(self.trained[lo:hi]), where)


def _load(path: Path) -> np.ndarray:
    with open(path, "rb") as f:  # mmap cannot map zero bytes: an empty array is read instead
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, _ = read(f)
    return np.load(path, mmap_mode="r" if math.prod(shape) else None)


class _NpyAppender:
    """A 1-D .npy file written in pieces; the header is rewritten with the final length on `close` (numpy
    pads every header so that a length can grow to 21 digits in place)."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self.file = open(path, "wb")
        self.header_size = self._write_header()

    def _write_header(self) -> int:
        self.file.seek(0)
        np.lib.format.write_array_header_1_0(self.file, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                         "fortran_order": False, "shape": (self.length,)})
        return self.file.tell()

    def append(self, values: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(values, self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        end = self.file.tell()
        if self._write_header() != self.header_size:
            raise RuntimeError(f"{self.path}: the .npy header changed size")
        self.file.seek(end)
        self.file.close()


@dataclasses.dataclass
class _Batch:
    """One batch's examples, concatenated; or the index within the batch of its first bad row."""

    ids: np.ndarray  # int32 [tokens]
    trained: np.ndarray  # bool [tokens]
    lengths: np.ndarray  # int64 [rows]
    fallbacks: int = 0  # rows tokenized by the per-row reference path
    bad_row: int | None = None


class BatchTokenizer:
    """Tokenizes batches of raw rows: `canonical` gives each row's canonical form, then the batch is encoded
    together. Equal to `finetune.data.tokenize` of the canonical rows."""

    def __init__(self, tokenizer, seq_len: int | None, layout: str = AUTO,
                 canonical: Canonical = layout_canonical):
        self.tokenizer, self.layout, self.canonical = tokenizer, layout, canonical
        self.limit = None if seq_len is None else seq_len + 1
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        # The chat spans are found from offsets only where they are exact: a fast tokenizer that matches
        # its added tokens before anything else (see `_boundary`).
        self.fast_chat = (bool(getattr(tokenizer, "is_fast", False))
                          and not getattr(tokenizer, "split_special_tokens", False)
                          and getattr(tokenizer, "chat_template", None) is not None)
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) if self.fast_chat else {}
        self.added = {i: token.content for i, token in decoder.items()}
        self.added_ids = np.array(sorted(self.added), np.int64)

    def __call__(self, raw_rows: Sequence[dict]) -> _Batch:
        rows, bad_layout = [], None
        for i, raw in enumerate(raw_rows):
            try:
                rows.append(self.canonical(raw, self.layout, ""))
            except DataError:
                bad_layout = i
                break
        try:
            examples, fallbacks = self.tokenize(rows)  # the rows before a bad layout may hold an earlier bad row
        except _BadRow as bad:
            return _Batch(*_empty(), bad_row=bad.index)
        if bad_layout is not None:
            return _Batch(*_empty(), bad_row=bad_layout)
        lengths = np.fromiter((len(ids) for ids, _ in examples), np.int64, len(examples))
        ids = np.fromiter((t for ids, _ in examples for t in ids), np.int32, int(lengths.sum()))
        trained = np.concatenate([t for _, t in examples]) if examples else np.zeros(0, bool)
        return _Batch(ids, trained.astype(bool, copy=False), lengths, fallbacks)

    def tokenize(self, rows: Sequence[dict]) -> tuple[list[tuple[list[int], np.ndarray]], int]:
        """(ids, trained) of each canonical row, and how many went through the reference path. Raises
        _BadRow for the first row the reference path rejects."""
        out: list[Any] = [None] * len(rows)
        texts = [i for i, row in enumerate(rows) if "text" in row]
        pairs = [i for i, row in enumerate(rows) if "prompt" in row]
        chats = [i for i, row in enumerate(rows) if "messages" in row]
        limit, bos, eos = self.limit, self.bos, self.eos
        sub = (lambda n: None) if limit is None else (lambda n: limit - n)
        for i, ids in zip(texts, self.encode_prefixes([rows[i]["text"] for i in texts], [sub(len(bos))] * len(texts))):
            ids = bos + ids + eos
            out[i] = ids, np.ones(len(ids), bool)
        prompts = [bos + ids for ids in
                   self.encode_prefixes([rows[i]["prompt"] for i in pairs], [sub(len(bos))] * len(pairs))]
        completions = self.encode_prefixes([rows[i]["completion"] for i in pairs], [sub(len(p)) for p in prompts])
        for i, prompt, completion in zip(pairs, prompts, completions):
            completion = completion + eos
            out[i] = prompt + completion, np.repeat([False, True], [len(prompt), len(completion)])
        fallback = set()
        if chats:
            for i, example in zip(chats, self.chats([rows[i]["messages"] for i in chats])):
                if example is None:
                    fallback.add(i)
                out[i] = example
        for i in sorted(fallback):  # in row order: the first row the reference path rejects is reported
            try:
                example = _tokenize_row("", rows[i], self.tokenizer, limit)
            except DataError:
                raise _BadRow(i) from None
            out[i] = example.ids.tolist(), example.trained
        return out, len(fallback)

    def encode(self, texts: list[str], offsets: bool = False):
        """The tokenizer's batch encoding of `texts` (no special tokens added): the ids, or the encoding with
        offsets. Equal to `tokenizer.encode(text, add_special_tokens=False)` of each text."""
        if not texts:
            return {"input_ids": [], "offset_mapping": []} if offsets else []
        if not callable(self.tokenizer):  # a tokenizer object with `encode` only
            return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        out = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                             return_offsets_mapping=offsets)
        return out if offsets else out["input_ids"]

    def encode_prefixes(self, texts: list[str], limits: list[int | None]) -> list[list[int]]:
        """`finetune.data.encode_prefix(tokenizer, text, limit)` of each text, in batched calls: the same
        prefixes (a character budget doubled until it yields enough tokens) in the same order."""
        out: list[Any] = [None] * len(texts)
        todo = []  # (index, character budget or None for the whole text)
        for i, (text, limit) in enumerate(zip(texts, limits)):
            if limit is not None and limit <= 0:
                out[i] = []
            else:
                todo.append((i, None if limit is None else CHARS_PER_TOKEN * (limit + CUT_MARGIN)))
        while todo:
            whole = [budget is None or budget >= len(texts[i]) for i, budget in todo]
            encoded = self.encode([texts[i] if w else texts[i][:budget] for (i, budget), w in zip(todo, whole)])
            again = []
            for (i, budget), w, ids in zip(todo, whole, encoded):
                limit = limits[i]
                if limit is None:
                    out[i] = ids
                elif w or len(ids) >= limit + CUT_MARGIN:
                    out[i] = ids[:limit]
                else:
                    again.append((i, budget * 2))
            todo = again
        return out

    def chats(self, conversations: list) -> list[tuple[list[int], np.ndarray] | None]:
        """(ids, trained) of each conversation, None where the reference path must do it (a check failed, or
        the row is one the reference rejects)."""
        if not self.fast_chat:
            return [None] * len(conversations)
        plans = [self._plan_chat(messages) for messages in conversations]
        rendered = [plan.rendering for plan in plans if plan is not None]
        encoding = self.encode(rendered, offsets=True)
        encodings = iter(zip(encoding["input_ids"], encoding["offset_mapping"]))
        tails = []  # (plan, rendering slice, expected ids)
        for plan in plans:
            if plan is not None:
                plan.ids, offsets = next(encodings)
                plan.find_spans(self, offsets, tails)
        for (plan, text, expected), got in zip(tails, self.encode([text for _, text, _ in tails])):
            plan.exact &= got == expected
        out = []
        for plan in plans:
            if plan is None or not plan.exact:
                out.append(None)
                continue
            ids, limit = plan.ids, self.limit
            if plan.cut and len(ids) < limit + CUT_MARGIN:
                out.append(None)  # the reference path grows the character budget
                continue
            trained = np.zeros(len(ids), bool)
            for start, end in plan.spans:
                trained[start:end] = True
            out.append((ids, trained) if limit is None else (ids[:limit], trained[:limit]))
        return out

    def _plan_chat(self, messages) -> "_ChatPlan | None":
        if not isinstance(messages, list) or not messages:
            return None
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return None
        if not any(m["role"] == "assistant" for m in messages) or messages[0]["role"] == "assistant":
            return None
        if self.limit is None:
            kept, cut = messages, False
        else:
            kept, cut = _first_characters(messages, CHARS_PER_TOKEN * (self.limit + CUT_MARGIN))
        return _ChatPlan(kept, cut, self.render(kept))

    def render(self, messages: list, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


@dataclasses.dataclass(eq=False)
class _ChatPlan:
    """One conversation on the fast path: its one rendering, then its encoding and assistant spans."""

    messages: list
    cut: bool
    rendering: str
    ids: list[int] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    exact: bool = True

    def find_spans(self, batch: BatchTokenizer, offsets: list[tuple[int, int]], tails: list) -> None:
        """Each assistant turn's tokens `[start, end)`: `start` the number of tokens of the conversation before
        it rendered with the generation prompt, `end` of the conversation up to it, found in the one encoding
        (as `finetune.data._render_chat` does, with `stop` the token limit when the conversation was cut)."""
        starts = [s for s, _ in offsets]
        is_added = np.isin(np.asarray(self.ids, np.int64), batch.added_ids)
        # after_added[k]: the index just past the last added token among the first k tokens (0 if none)
        after_added = np.maximum.accumulate(np.where(is_added, np.arange(1, len(self.ids) + 1), 0))
        stop = batch.limit if self.cut else None
        for i, message in enumerate(self.messages):
            if message["role"] != "assistant":
                continue
            start = self._boundary(batch, batch.render(self.messages[:i], True), starts, offsets, after_added, tails)
            if start is None:
                return
            if stop is not None and start >= stop:
                break
            end = self._boundary(batch, batch.render(self.messages[: i + 1]), starts, offsets, after_added, tails)
            if end is None:
                return
            self.spans.append((start, end))

    def _boundary(self, batch, prefix: str, starts, offsets, after_added, tails) -> int | None:
        """How many tokens `prefix` (a rendering of the first messages) tokenizes to, read from the encoding of
        the whole rendering: the tokens before its end. Exact when the encoding has a token boundary there
        and the text from the last added token before it (an added token is matched before anything else is
        tokenized, and the text on either side of it is tokenized apart) tokenizes to the same tokens alone;
        that last check is queued in `tails`. Marks the plan inexact (None) otherwise."""
        p = len(prefix)
        k = bisect.bisect_left(starts, p)
        # a quick rejection (a token across the end of the prefix); the check in `tails` decides
        if not self.rendering.startswith(prefix) or (k and offsets[k - 1][1] > p):
            self.exact = False
            return None
        j = int(after_added[k - 1]) if k else 0
        a = 0
        if j:
            a, e = offsets[j - 1]
            if self.rendering[a:e] != batch.added[self.ids[j - 1]]:
                self.exact = False
                return None
            j -= 1
        tails.append((self, self.rendering[a:p], self.ids[j:k]))
        return k


class _BadRow(Exception):
    def __init__(self, index: int):
        self.index = index


def _empty():
    return np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int64)


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


def _work(lo: int, hi: int, raw_rows: list | None = None) -> _Batch:
    return _worker["batch"](raw_rows if raw_rows is not None else _raw_rows(_worker["rows"], lo, hi))


def default_workers(requested: int, n_rows: int) -> int:
    """Processes to tokenize `n_rows` with: `requested` (0: one per CPU core this process may use), fewer
    when there are too few rows for a worker's start-up to pay off."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(requested or cores, math.ceil(n_rows / MIN_ROWS_PER_WORKER)))


def _results(batch: BatchTokenizer, rows, spans: list[tuple[int, int]], workers: int) -> Iterator[_Batch]:
    """Each span's batch, in order; in `workers` spawned processes when more than one."""
    if workers <= 1 or len(spans) <= 1:
        for lo, hi in spans:
            yield batch(_raw_rows(rows, lo, hi))
        return
    import datasets

    shared = rows if isinstance(rows, datasets.Dataset) else None  # sent once; plain rows go with each batch
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(workers, len(spans)), initializer=_start_worker, initargs=(batch, shared)) as pool:
        pending: collections.deque = collections.deque()
        queue = iter(spans)

        def submit():
            for lo, hi in queue:
                args = (lo, hi) if shared is not None else (lo, hi, _raw_rows(rows, lo, hi))
                pending.append(pool.apply_async(_work, args))
                return

        for _ in range(2 * workers):
            submit()
        while pending:
            result = pending.popleft().get()
            submit()
            yield result


def tokenize_to_store(rows, tokenizer, seq_len: int | None, directory: str | Path, *, layout: str = AUTO,
                      canonical: Canonical = layout_canonical, where: Callable[[int], str] = lambda i: f"row {i + 1}",
                      workers: int = 1, progress: bool = False, batch_rows: int = BATCH_ROWS,
                      meta: dict | None = None) -> TokenizedData:
    """Tokenize `rows` (a datasets.Dataset or a sequence of raw row dicts; `canonical(row, layout, where)`
    gives each one's canonical form) into a store in the existing empty `directory`, `workers` processes at a
    time. A bad row raises the DataError the reference path gives it, naming `where(i)` of the first one.
    Workers are spawned: a script that calls this with `workers > 1` needs multiprocessing's
    `if __name__ == "__main__":` guard (the console scripts have it)."""
    directory = Path(directory)
    batch = BatchTokenizer(tokenizer, seq_len, layout, canonical)
    spans = [(lo, min(lo + batch_rows, len(rows))) for lo in range(0, len(rows), batch_rows)]
    from tqdm import tqdm

    writers = [_NpyAppender(directory / "ids.npy", np.int32), _NpyAppender(directory / "trained.npy", np.bool_)]
    lengths, tokens, fallbacks, began = [], 0, 0, time.perf_counter()
    try:
        with tqdm(total=len(rows), unit=" rows", desc="tokenize", disable=not progress, leave=False) as bar:
            for (lo, hi), result in zip(spans, _results(batch, rows, spans, workers)):
                if result.bad_row is not None:
                    _raise_row_error(rows, lo + result.bad_row, batch, where)
                writers[0].append(result.ids)
                writers[1].append(result.trained)
                lengths.append(result.lengths)
                tokens += len(result.ids)
                fallbacks += result.fallbacks
                bar.update(hi - lo)
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - began, 1e-9):,.0f} tokens/s", refresh=False)
    finally:
        for writer in writers:
            writer.close()
    starts = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.concatenate(lengths) if lengths else np.zeros(0, np.int64), out=starts[1:])
    np.save(directory / "starts.npy", starts)
    info = {"store_version": STORE_VERSION, "examples": len(rows), "tokens": tokens, "seq_len": seq_len,
            "layout": layout, "reference_path_rows": fallbacks,
            "seconds": round(time.perf_counter() - began, 3), **(meta or {})}
    (directory / "meta.json").write_text(json.dumps(info, indent=1) + "\n")
    return TokenizedData.open(directory)


def _raise_row_error(rows, index: int, batch: BatchTokenizer, where: Callable[[int], str]) -> None:
    """Raise the error row `index` has, naming it: its layout's, or the reference path's."""
    (raw,) = _raw_rows(rows, index, index + 1)
    row = batch.canonical(raw, batch.layout, where(index))
    _tokenize_row(where(index), row, batch.tokenizer, batch.limit)
    raise RuntimeError(f"{where(index)}: rejected in a batch but not alone")
