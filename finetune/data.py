"""Training data: rows -> tokens with a loss mask -> fixed-length rows -> a resumable stream of batches.

Row formats: `{"text": ...}` (every token trained), `{"prompt": ..., "completion": ...}` (prompt tokens
masked out of the loss), `{"messages": [{"role", "content"}, ...]}` (rendered with the tokenizer's chat
template; only assistant turns trained). Rows are packed several to a sequence (`segment_ids` keep
attention within each document, positions restart) or padded one to a sequence.

The stream is a pure function of (seed, position): batch `g` holds rows `g*B .. g*B+B-1` of an endless
sequence of epochs, each a seeded permutation of the rows. A checkpoint stores `g`; nothing else is needed
to resume exactly. Each process builds only the rows its devices hold.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxmodel.errors import UserError


class DataError(ValueError, UserError):
    """Bad training data; the message names the file (and line) and what was expected."""


@dataclasses.dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int32 [n]
    trained: np.ndarray  # bool [n]: whether each token is a training target


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


def read_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) pairs; `where` is `file:line` for JSONL so errors can point at the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not found")
    rows: list[tuple[str, dict[str, Any]]] = []
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
                rows.append((f"{path}:{number}", row))
    else:
        kinds = {".json": "json", ".parquet": "parquet", ".csv": "csv"}
        if path.suffix not in kinds:
            raise DataError(f"{path}: unsupported data file (expected .jsonl, .json, .parquet or .csv)")
        import datasets

        table = datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train")
        rows = [(f"{path} row {i + 1}", dict(row)) for i, row in enumerate(table)]
    if not rows:
        raise DataError(f"{path}: no rows (the dataset is empty)")
    return rows


def tokenize(rows: Sequence[tuple[str, dict[str, Any]]], tokenizer) -> list[Example]:
    """Examples with loss masks, by each row's format."""
    return [_tokenize_row(where, row, tokenizer) for where, row in rows]


def _tokenize_row(where: str, row: dict[str, Any], tokenizer) -> Example:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if isinstance(row.get("text"), str):
        ids = bos + tokenizer.encode(row["text"], add_special_tokens=False) + eos
        return Example(np.asarray(ids, np.int32), np.ones(len(ids), bool))
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        prompt = bos + tokenizer.encode(row["prompt"], add_special_tokens=False)
        completion = tokenizer.encode(row["completion"], add_special_tokens=False) + eos
        trained = [False] * len(prompt) + [True] * len(completion)
        return Example(np.asarray(prompt + completion, np.int32), np.asarray(trained))
    if isinstance(row.get("messages"), list):
        return _tokenize_chat(where, row["messages"], tokenizer)
    raise DataError(f"{where}: expected a 'text' string, 'prompt' and 'completion' strings, or a 'messages' list; "
                    f"found keys {sorted(row)}")


def _tokenize_chat(where: str, messages: list, tokenizer) -> Example:
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: each message needs string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn to train on")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a 'messages' row needs a tokenizer with a chat template")

    def render(msgs, generation_prompt=False) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5

    ids = render(messages)
    trained = np.zeros(len(ids), bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, upto = len(render(messages[:i], True)), render(messages[: i + 1])
        end = len(upto)
        if upto != ids[:end]:
            raise DataError(f"{where}: the chat template renders a conversation differently from its prefixes; "
                            "cannot tell which tokens are the assistant's")
        trained[start:end] = True
    return Example(np.asarray(ids, np.int32), trained)


def build_rows(examples: Sequence[Example], seq_len: int, *, pack: bool) -> tuple[Rows, int]:
    """Fixed-length rows from examples; returns the rows and how many examples were truncated."""
    fields = {name: [] for name in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    truncated = 0
    row = _empty_row(seq_len)
    fill, segment = 0, 0

    def flush():
        nonlocal row, fill, segment
        for name in fields:
            fields[name].append(row[name])
        row, fill, segment = _empty_row(seq_len), 0, 0

    for example in examples:
        ids, trained = example.ids, example.trained
        if len(ids) > seq_len:
            ids, trained = ids[:seq_len], trained[:seq_len]
            truncated += 1
        n = len(ids)
        if fill and (not pack or fill + n > seq_len):
            flush()
        segment += 1
        span = slice(fill, fill + n)
        row["input_ids"][span] = ids
        row["targets"][fill:fill + n - 1] = ids[1:]
        row["loss_mask"][fill:fill + n - 1] = trained[1:]
        row["segment_ids"][span] = segment
        row["positions"][span] = np.arange(n)
        fill += n
    if fill:
        flush()
    rows = Rows(**{name: np.stack(values) for name, values in fields.items()})
    if not rows.loss_mask.any():
        raise DataError("no token of the data is a training target (every example is prompt only?)")
    return rows, truncated


def _empty_row(seq_len: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.zeros(seq_len, np.int32), "targets": np.zeros(seq_len, np.int32),
            "loss_mask": np.zeros(seq_len, np.float32), "segment_ids": np.zeros(seq_len, np.int32),
            "positions": np.zeros(seq_len, np.int32)}


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
