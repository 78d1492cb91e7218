"""The per-row reference tokenizer: rows -> tokens with a loss mask -> fixed-length rows, one row at a time.

Row formats: `{"text": ...}` (every token trained), `{"prompt": ..., "completion": ...}` (prompt tokens
masked out of the loss), `{"messages": [{"role", "content"}, ...]}` (rendered with the tokenizer's chat
template; only assistant turns trained); a row must match exactly one of them. A preference pair
`{"chosen": row, "rejected": row}` (`finetune.data.layouts`) gives two examples, chosen then rejected, each side
tokenized as that row alone is, except that a chat side trains only its final message (the reply: the tokens
of the whole rendering after the rendering of the prompt with the generation prompt). Rows are packed several to a
sequence (`segment_ids` keep attention within each document, positions restart) or padded one to a sequence.
An example longer than the sequence is cut to it; given the sequence length, `tokenize` tokenizes a long row only
as far as it needs (`encode_prefix`), so a giant row costs what the sequence holds, not what the row holds.
Training does not run this path: `tokenize` is the reference that `finetune.data.workers` (batched, in worker
processes, into a cached store) equals and falls back to row by row (`tokenize_row`), and `build_rows` the one
`finetune.data.packing` equals. The tests compare the two token for token and mask for mask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from finetune.data.rows import DataError, Example, Rows, TruncationReport
from finetune.data.sources import open_source


def read_rows(spec: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) pairs of every row `spec` names (`finetune.data.sources.open_source`), read whole: for the
    per-row reference path and small files (the demo's test set), not for training data."""
    source = open_source(str(spec))
    return [(source.where(i), dict(row)) for i, row in enumerate(source.dataset)]


# The layouts a row may have, by the keys that make them; a row must match exactly one.
LAYOUTS = {"text": ("text",), "prompt+completion": ("prompt", "completion"), "messages": ("messages",)}
# The keys of a preference pair's two rows, in the order their examples come.
PAIR_KEYS = ("chosen", "rejected")

# Tokens dropped before a cut of a long row's text: a tokenizer may merge across the cut (a word, a run of
# spaces or digits, a special token split in two), so the tokens just before it may differ from the whole row's.
CUT_MARGIN = 32
# First characters of text tokenized per token a long row needs; doubled until the prefix yields enough tokens.
CHARS_PER_TOKEN = 8


def tokenize(rows: Sequence[tuple[str, dict[str, Any]]], tokenizer, seq_len: int | None = None) -> list[Example]:
    """Examples with loss masks, by each row's format. With `seq_len`, an example longer than that is
    tokenized only as far as its first `seq_len + 1` tokens (they equal the whole row's first tokens; the one
    beyond `seq_len` marks it as longer)."""
    limit = None if seq_len is None else seq_len + 1
    return [example for where, row in rows for example in tokenize_examples(where, row, tokenizer, limit)]


def is_pair(row: dict[str, Any]) -> bool:
    """Whether a canonical row is a preference pair (it has a chosen or a rejected side)."""
    return any(row.get(key) is not None for key in PAIR_KEYS)


def tokenize_examples(where: str, row: dict[str, Any], tokenizer, limit: int | None = None) -> list[Example]:
    """The examples of one canonical row: one for an SFT row, two (chosen, rejected) for a preference pair."""
    if is_pair(row):
        return list(tokenize_pair(where, row, tokenizer, limit))
    return [tokenize_row(where, row, tokenizer, limit)]


def tokenize_pair(where: str, row: dict[str, Any], tokenizer, limit: int | None = None) -> tuple[Example, Example]:
    """A preference pair's chosen and rejected examples (`tokenize_reply` of each side)."""
    sides = [row.get(key) for key in PAIR_KEYS]
    if not all(isinstance(side, dict) for side in sides) or set(row) - set(PAIR_KEYS):
        raise DataError(f"{where}: a preference pair expects exactly a 'chosen' and a 'rejected' row; found keys "
                        f"{sorted(row)}")
    chosen, rejected = (tokenize_reply(where, side, tokenizer, limit) for side in sides)
    return chosen, rejected


def tokenize_reply(where: str, row: dict[str, Any], tokenizer, limit: int | None = None) -> Example:
    """One side of a preference pair: a prompt-completion row exactly as `tokenize_row` gives it; a messages row
    ending in the assistant reply as `tokenize_row` gives it, with only that final turn trained."""
    layout = _layout(where, row)
    if layout == "prompt+completion":
        return tokenize_row(where, row, tokenizer, limit)
    if layout == "messages":
        return _tokenize_chat(where, row["messages"], tokenizer, limit, final_only=True)
    raise DataError(f"{where}: a preference reply expects 'prompt' and 'completion' strings or a 'messages' list; "
                    f"found keys {sorted(row)}")


def encode_prefix(tokenizer, text: str, limit: int | None) -> list[int]:
    """`tokenizer.encode(text)[:limit]`, handing the tokenizer a prefix of `text` of about `CHARS_PER_TOKEN`
    characters per token (more for text that yields fewer tokens) instead of the whole text."""
    def encode(piece: str) -> list[int]:
        return tokenizer.encode(piece, add_special_tokens=False)

    if limit is None:
        return encode(text)
    if limit <= 0:
        return []
    budget = CHARS_PER_TOKEN * (limit + CUT_MARGIN)
    while budget < len(text):
        ids = encode(text[:budget])
        if len(ids) >= limit + CUT_MARGIN:
            return ids[:limit]
        budget *= 2
    return encode(text)[:limit]


def _layout(where: str, row: dict[str, Any]) -> str:
    """The one layout `row` has (a key whose value is None is absent: tables fill missing columns with it)."""
    found = [key for keys in LAYOUTS.values() for key in keys if row.get(key) is not None]
    layouts = [name for name, keys in LAYOUTS.items() if any(row.get(key) is not None for key in keys)]
    if len(layouts) > 1:
        raise DataError(f"{where}: keys {', '.join(found)}: expected exactly one of the layouts "
                        f"{' | '.join(LAYOUTS)}")
    text, prompt, completion, messages = (row.get(k) for k in ("text", "prompt", "completion", "messages"))
    if layouts == ["text"] and isinstance(text, str):
        return "text"
    if layouts == ["prompt+completion"] and isinstance(prompt, str) and isinstance(completion, str):
        return "prompt+completion"
    if layouts == ["messages"] and isinstance(messages, list):
        return "messages"
    raise DataError(f"{where}: expected a 'text' string, 'prompt' and 'completion' strings, or a 'messages' list; "
                    f"found keys {sorted(row)}")


def tokenize_row(where: str, row: dict[str, Any], tokenizer, limit: int | None = None) -> Example:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    layout = _layout(where, row)
    if layout == "text":
        ids = bos + encode_prefix(tokenizer, row["text"], None if limit is None else limit - len(bos)) + eos
        return Example(np.asarray(ids, np.int32), np.ones(len(ids), bool), where)
    if layout == "prompt+completion":
        prompt = bos + encode_prefix(tokenizer, row["prompt"], None if limit is None else limit - len(bos))
        rest = None if limit is None else limit - len(prompt)
        completion = encode_prefix(tokenizer, row["completion"], rest) + eos
        trained = [False] * len(prompt) + [True] * len(completion)
        return Example(np.asarray(prompt + completion, np.int32), np.asarray(trained), where)
    return _tokenize_chat(where, row["messages"], tokenizer, limit)


def _tokenize_chat(where: str, messages: list, tokenizer, limit: int | None = None, final_only: bool = False
                   ) -> Example:
    """A conversation's tokens, each assistant turn trained; with `final_only`, only its last message (which
    must be an assistant turn)."""
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: each message needs string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn to train on")
    if messages[0]["role"] == "assistant":  # its tokens start after the rendering of no message, which has none
        raise DataError(f"{where}: 'messages' starts with an assistant turn; expected a system or user turn first")
    if final_only and messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: a preference reply's conversation must end with the assistant reply; it ends "
                        f"with a {messages[-1]['role']} turn")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a 'messages' row needs a tokenizer with a chat template")
    # the index of the one turn trained (a cut conversation that lost it trains none)
    final = len(messages) - 1 if final_only else None
    if limit is None:
        return _render_chat(where, messages, tokenizer, final=final)
    budget = CHARS_PER_TOKEN * (limit + CUT_MARGIN)
    while True:
        kept, cut = first_characters(messages, budget)
        example = _render_chat(where, kept, tokenizer, stop=limit if cut else None, final=final)
        if not cut or len(example.ids) >= limit + CUT_MARGIN:
            return Example(example.ids[:limit], example.trained[:limit], where)
        budget *= 2


def first_characters(messages: list[dict], budget: int) -> tuple[list[dict], bool]:
    """The conversation up to its first `budget` characters of content (each message counting one more),
    the message reaching the budget cut there and those after it left out; and whether anything was."""
    kept = []
    for i, m in enumerate(messages):
        if budget < len(m["content"]) or (budget == len(m["content"]) and i + 1 < len(messages)):
            return kept + [{**m, "content": m["content"][:budget]}], True
        kept.append(m)
        budget -= len(m["content"]) + 1
    return kept, False


def _render_chat(where: str, messages: list[dict], tokenizer, stop: int | None = None, final: int | None = None
                 ) -> Example:
    """The conversation's tokens, each assistant turn trained (those starting at `stop` or later are left
    untrained: only the first `stop` tokens are wanted); with `final`, only message `final` (when present)."""
    def render(msgs, generation_prompt=False) -> list[int]:
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5

    ids = render(messages)
    trained = np.zeros(len(ids), bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or (final is not None and i != final):
            continue
        start, upto = len(render(messages[:i], True)), render(messages[: i + 1])
        if stop is not None and start >= stop:
            break
        end = len(upto)
        if upto != ids[:end]:
            raise DataError(f"{where}: the chat template renders a conversation differently from its prefixes; "
                            "cannot tell which tokens are the assistant's")
        trained[start:end] = True
    return Example(np.asarray(ids, np.int32), trained, where)


def truncation_report(examples: Sequence[Example], seq_len: int) -> TruncationReport:
    """Which examples `build_rows(examples, seq_len)` cuts, and which of those keep no target (the target of
    token i is token i + 1: an example's targets within the sequence are `trained[1:seq_len]`)."""
    truncated = [e for e in examples if len(e.ids) > seq_len]
    lost = [e for e in truncated if not e.trained[1:seq_len].any()]
    return TruncationReport(seq_len=seq_len, examples=len(examples), truncated=len(truncated),
                            first_truncated=truncated[0].where if truncated else None, lost=len(lost),
                            first_lost=lost[0].where if lost else None,
                            with_targets=sum(bool(e.trained[1:seq_len].any()) for e in examples))


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
        if not n:  # an empty example holds no token and no target: no segment
            continue
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
