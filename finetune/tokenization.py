"""Batched, parallel tokenization of canonical rows into a TokenizedData store on disk.

A canonical row is `{"text"}`, `{"prompt", "completion"}` or `{"messages"}` (see `finetune.layouts`); its
example equals, token for token and mask for mask, what `finetune.data.tokenize` (the per-row reference)
gives it, including the cut at `seq_len + 1` tokens that keeps a giant row from being tokenized whole. Rows
are tokenized a batch at a time with the fast tokenizer's batch encoding.

A chat is rendered and encoded once. The reference takes an assistant turn's tokens from the lengths of the
encoded renderings of the conversation's prefixes (up to the turn with the generation prompt, and up to its
end). Here those prefixes' lengths in characters come from the conversation's shape (its roles): the
template renders the shape once with a placeholder for each content, and a conversation whose rendering is
exactly that rendering with its contents put in has its boundaries where the shape's are, shifted by its
contents' lengths. A shape is used alone after its first SHAPE_CHECKS conversations were also rendered prefix
by prefix and agreed; a conversation whose rendering differs (a template that changes contents, e.g. trims
them) is rendered prefix by prefix. The character boundaries are mapped onto the encoding by its offsets,
each checked to tokenize as the prefix alone would; a row where any check fails goes through the reference
path instead. Exact for templates that render a conversation from its roles and put each content in as it
is; a template whose prefix renderings depend on the contents in a way its whole rendering does not show
is exact only on the conversations checked prefix by prefix.

Parallelism is this process and a `multiprocessing` pool (spawned, so neither JAX's nor the tokenizer's
threads are forked) over batches of rows, the tokenizer sent to each worker once, rather than
`datasets.map(num_proc=...)`: results come back batch by batch in row order and are appended to the store's
files as they arrive, at most two batches per worker in flight (bounded memory, no Arrow copy of the tokens
to convert afterwards), and the progress bar counts rows and tokens exactly as they are written. This
process tokenizes batches too whenever the oldest one is not back yet, so the workers' start-up (imports,
receiving the tokenizer: a few seconds) costs little. Alone (little data, or `workers=1`), it tokenizes in two
threads: the batch encoding releases the GIL, so one thread's encoding runs beside the other's Python. The
objects alive before tokenizing starts are left out of garbage collection while it runs (`gc.freeze`).

The store (one directory): `ids.npy` int32 [tokens] every example's ids concatenated, `trained.npy` bool
[tokens], `starts.npy` int64 [examples + 1] (example e is `ids[starts[e]:starts[e + 1]]` and comes from row
e), `meta.json` (counts and what the store was built from) written last.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import multiprocessing
import multiprocessing.pool
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
# Spans the tokenizing process itself may run ahead of the oldest span not yet back from a worker (memory in flight).
LOCAL_AHEAD = 8

Canonical = Callable[[dict, str, str], dict]
# An example's training targets: a mask over its tokens, or the [start, end) spans of its trained tokens.
Targets = np.ndarray | list[tuple[int, int]]


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
        self.shapes: dict[tuple, _Shape | None] = {}
        self.tails: dict[str, list[int]] = {}

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
        ids = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in examples), np.int32, int(lengths.sum()))
        trained = np.zeros(len(ids), bool)
        for at, n, (_, targets) in zip(np.cumsum(lengths) - lengths, lengths, examples):
            if isinstance(targets, np.ndarray):
                trained[at:at + n] = targets
            else:
                for start, end in targets:
                    trained[at + start:at + end] = True
        return _Batch(ids, trained, lengths, fallbacks)

    def tokenize(self, rows: Sequence[dict]) -> tuple[list[tuple[list[int], Targets]], int]:
        """(ids, targets) of each canonical row, and how many went through the reference path. Raises
        _BadRow for the first row the reference path rejects."""
        out: list[Any] = [None] * len(rows)
        texts = [i for i, row in enumerate(rows) if "text" in row]
        pairs = [i for i, row in enumerate(rows) if "prompt" in row]
        chats = [i for i, row in enumerate(rows) if "messages" in row]
        limit, bos, eos = self.limit, self.bos, self.eos
        sub = (lambda n: None) if limit is None else (lambda n: limit - n)
        for i, ids in zip(texts, self.encode_prefixes([rows[i]["text"] for i in texts], [sub(len(bos))] * len(texts))):
            ids = bos + ids + eos
            out[i] = ids, [(0, len(ids))]
        prompts = [bos + ids for ids in
                   self.encode_prefixes([rows[i]["prompt"] for i in pairs], [sub(len(bos))] * len(pairs))]
        completions = self.encode_prefixes([rows[i]["completion"] for i in pairs], [sub(len(p)) for p in prompts])
        for i, prompt, completion in zip(pairs, prompts, completions):
            out[i] = prompt + completion + eos, [(len(prompt), len(prompt) + len(completion) + len(eos))]
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

    def chats(self, conversations: list) -> list[tuple[list[int], Targets] | None]:
        """(ids, targets) of each conversation, None where the reference path must do it (a check failed, or
        the row is one the reference rejects)."""
        if not self.fast_chat:
            return [None] * len(conversations)
        plans = [self._plan_chat(messages) for messages in conversations]
        rendered = [plan.rendering for plan in plans if plan is not None]
        encoding = self.tokenizer(rendered, add_special_tokens=False, return_attention_mask=False) if rendered else None
        encodings = iter(zip(encoding["input_ids"], encoding.encodings) if rendered else ())
        for plan in plans:
            if plan is not None:
                plan.ids, offsets = next(encodings)
                plan.find_spans(self, offsets)
        out = []
        for plan in plans:
            if plan is None or not plan.exact:
                out.append(None)
                continue
            ids, limit = plan.ids, self.limit
            if plan.cut and len(ids) < limit + CUT_MARGIN:
                out.append(None)  # the reference path grows the character budget
                continue
            out.append((ids, plan.spans) if limit is None else
                       (ids[:limit], [(start, min(end, limit)) for start, end in plan.spans if start < limit]))
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
        plan = _ChatPlan(kept, cut, self.render(kept))
        plan.boundaries = self._boundaries(kept, plan.rendering)
        return plan

    def render(self, messages: list, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _boundaries(self, messages: list, rendering: str) -> list[tuple[int, int]] | None:
        """Each assistant turn's (start, end) in characters of `rendering`: the lengths of the renderings of the
        messages before it with the generation prompt, and of those up to it. From the conversation's shape
        (see `_Shape`) when `rendering` is that shape's rendering with these contents put in; else (or while
        the shape is being checked on its first conversations) from rendering each prefix, None when a prefix
        is not the start of `rendering`."""
        shape = self._shape(messages)
        from_shape = shape.boundaries(messages, rendering) if shape is not None else None
        if from_shape is not None and shape.checked >= SHAPE_CHECKS:
            return from_shape
        rendered = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start, end = self.render(messages[:i], True), self.render(messages[: i + 1])
                if not (rendering.startswith(start) and rendering.startswith(end)):
                    return None
                rendered.append((len(start), len(end)))
        if from_shape is not None:
            if from_shape == rendered:
                shape.checked += 1
            else:
                self.shapes[shape.key] = None  # the template does not render this shape from its roles alone
        return rendered

    def _shape(self, messages: list) -> "_Shape | None":
        try:  # a message with only a role and content (the usual case) is keyed by its role
            key = tuple(m["role"] if len(m) == 2 else tuple(sorted((k, v) for k, v in m.items() if k != "content"))
                        for m in messages)
            hash(key)
        except TypeError:  # a field the template may read that is not a plain value
            return None
        if key not in self.shapes:
            if len(self.shapes) >= MAX_SHAPES:
                return None
            self.shapes[key] = _Shape.of(self, messages, key)
        return self.shapes[key]

    def tail_ids(self, text: str) -> list[int]:
        """`text` encoded alone, remembered (the texts between an added token and a turn's boundary are
        mostly the same few: a header's end, an end-of-turn token)."""
        ids = self.tails.get(text)
        if ids is None:
            (ids,) = self.encode([text])
            if len(text) <= MAX_REMEMBERED_TAIL and len(self.tails) < MAX_REMEMBERED_TAILS:
                self.tails[text] = ids
        return ids


# How many conversations of each shape are also rendered prefix by prefix, and must agree, before the shape's
# boundaries are used alone.
SHAPE_CHECKS = 2
MAX_SHAPES = 4096
MAX_REMEMBERED_TAIL, MAX_REMEMBERED_TAILS = 256, 4096
# Stands for message i's content when a shape is rendered: private-use characters, which a template passes on
# as they are.
_MARK = "\ue000"


def _placeholder(i: int) -> str:
    return f"{_MARK}{i}\ue001"


@dataclasses.dataclass(eq=False)
class _Shape:
    """A conversation shape: its messages' roles (and any other fields) without their contents. Rendered
    once with a placeholder for each content, as `literals[0] + content_0 + literals[1] + ... + literals[n]`,
    and each assistant turn's boundaries as (contents before it, characters of the literals before it).
    A conversation of this shape whose own rendering is exactly that, its contents put in, has its turns'
    boundaries there: the template rendered it from its roles alone, with each content as it is."""

    key: tuple
    literals: list[str]
    turns: list[tuple[tuple[int, int], tuple[int, int]]]
    checked: int = 0

    @classmethod
    def of(cls, batch: BatchTokenizer, messages: list, key: tuple) -> "_Shape | None":
        marked = [{**m, "content": _placeholder(i)} for i, m in enumerate(messages)]
        try:
            whole = batch.render(marked)
            literals, rest = [], whole
            for i in range(len(marked)):
                before, found, rest = rest.partition(_placeholder(i))
                if not found or _MARK in before:
                    return None
                literals.append(before)
            if _MARK in rest:
                return None
            literals.append(rest)

            def position(prefix: str) -> tuple[int, int] | None:
                """(placeholders before the end of `prefix`, characters of literals before it)."""
                if not whole.startswith(prefix):
                    return None
                n = prefix.count(_MARK)
                at = len(prefix) - sum(len(_placeholder(i)) for i in range(n))
                # past the n-th placeholder's end, within the literal after it (not inside the placeholder)
                return (n, at) if sum(map(len, literals[:n])) <= at <= sum(map(len, literals[: n + 1])) else None

            turns = []
            for i, m in enumerate(marked):
                if m["role"] == "assistant":
                    start, end = position(batch.render(marked[:i], True)), position(batch.render(marked[: i + 1]))
                    if start is None or end is None:
                        return None
                    turns.append((start, end))
        except Exception:  # the template rejects the placeholders: conversations of this shape render prefixes
            return None
        return cls(key, literals, turns)

    def boundaries(self, messages: list, rendering: str) -> list[tuple[int, int]] | None:
        """The turns' character boundaries in `rendering`, or None when it is not this shape's rendering of
        these contents."""
        contents = [m["content"] for m in messages]
        pieces = [None] * (2 * len(contents) + 1)
        pieces[::2], pieces[1::2] = self.literals, contents
        if rendering != "".join(pieces):
            return None
        before = [0]
        for c in contents:
            before.append(before[-1] + len(c))
        return [(before[sn] + sa, before[en] + ea) for (sn, sa), (en, ea) in self.turns]


@dataclasses.dataclass(eq=False)
class _ChatPlan:
    """One conversation on the fast path: its one rendering and its turns' character boundaries, then its
    encoding and assistant spans in tokens."""

    messages: list
    cut: bool
    rendering: str
    boundaries: list[tuple[int, int]] | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    exact: bool = True

    def find_spans(self, batch: BatchTokenizer, encoding) -> None:
        """Each assistant turn's tokens `[start, end)`: `start` the number of tokens of the conversation before
        it rendered with the generation prompt, `end` of the conversation up to it, found in the one encoding
        (as `finetune.data._render_chat` does, with `stop` the token limit when the conversation was cut)."""
        if self.boundaries is None:
            self.exact = False
            return
        stop = batch.limit if self.cut else None
        for start_chars, end_chars in self.boundaries:
            start = self._boundary(batch, start_chars, encoding)
            if start is None:
                return
            if stop is not None and start >= stop:
                break
            end = self._boundary(batch, end_chars, encoding)
            if end is None:
                return
            self.spans.append((start, end))

    def _boundary(self, batch, p: int, encoding) -> int | None:
        """How many tokens the rendering's first `p` characters (a rendering of the first messages) tokenize
        to, read from the encoding of the whole rendering (a `tokenizers.Encoding`: its character offsets
        asked for where needed, not listed): the tokens before `p`. Exact when the encoding has a token
        boundary there and the text from the last added token before it (an added token is matched before
        anything else is tokenized, and the text on either side of it is tokenized apart) tokenizes to the
        same tokens alone. Marks the plan inexact (None) otherwise."""
        if p == len(self.rendering):
            k = len(self.ids)
        else:
            k = encoding.char_to_token(p)  # the first token holding character p
            if k is None or encoding.token_to_chars(k)[0] != p:  # no token, or one across the boundary
                self.exact = False
                return None
            while k and encoding.token_to_chars(k - 1)[0] >= p:  # earlier tokens of no text of their own
                k -= 1
        if k and encoding.token_to_chars(k - 1)[1] > p:  # a token across the end of the prefix
            self.exact = False
            return None
        j = k
        while j and self.ids[j - 1] not in batch.added:
            j -= 1
        a = 0
        if j:
            a, e = encoding.token_to_chars(j - 1)
            if self.rendering[a:e] != batch.added[self.ids[j - 1]]:
                self.exact = False
                return None
            j -= 1
        if batch.tail_ids(self.rendering[a:p]) != self.ids[j:k]:
            self.exact = False
            return None
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
    gc.freeze()  # the imports and the tokenizer live as long as the worker: no collection need walk them again


def _work(lo: int, hi: int, raw_rows: list | None = None) -> _Batch:
    return _worker["batch"](raw_rows if raw_rows is not None else _raw_rows(_worker["rows"], lo, hi))


def default_workers(requested: int, n_rows: int) -> int:
    """Processes to tokenize `n_rows` with: `requested` when given; else one per CPU core this process may
    use, fewer when there are too few rows for a worker's start-up to pay off (MIN_ROWS_PER_WORKER each)."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(n_rows / MIN_ROWS_PER_WORKER)))


def _results(batch: BatchTokenizer, rows, spans: Sequence[tuple[int, int]], workers: int) -> Iterator[_Batch]:
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
                    shared) -> Iterator[_Batch]:
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


def _in_two_threads(batch: BatchTokenizer, rows, spans: Sequence[tuple[int, int]]) -> Iterator[_Batch]:
    """Each span's batch, in order, tokenized in two threads of this process: the fast tokenizer's batch
    encoding releases the GIL, so one thread's encoding runs beside the other's Python (rendering, checks).
    The threads share `batch`'s caches of shapes and tails (a race only repeats a check) and only read the
    tokenizer."""
    def tokenize(lo: int, hi: int) -> _Batch:
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
