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

With a prompt bound (`max_prompt`, `--max-prompt-len`), the prompt of a prompt-completion row and of a chat (the
tokens before its first trained one: a preference side's prompt, or an SFT chat's turns before its first
assistant turn) keeps at most that many tokens, its end next to the reply: a prompt-completion prompt keeps BOS
and the last tokens of its text (`prompt_tail`); a chat keeps its leading system turns whole and drops whole old
turns, then the start of the oldest kept content, and is rendered again (`bound_chat_prompt`), so BOS, the system
turn and the template's headers are never cut. A prompt within the bound is untouched; the example says whether
its prompt was cut (`Example.prompt_cut`).
Training does not run this path: `tokenize` is the reference that `finetune.data.workers` (batched, in worker
processes, into a cached store) equals and falls back to row by row (`tokenize_row`), and `build_rows` the one
`finetune.data.packing` equals. The tests compare the two token for token and mask for mask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from jinja2 import TemplateError

from finetune.data.rows import DataError, Example, Rows, TruncationReport
from finetune.data.sources import open_source


def read_rows(spec: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) pairs of every row `spec` names (`finetune.data.sources.open_source`), read whole: for the
    per-row reference path and small files (the demo's test set), not for training data."""
    source = open_source(str(spec))
    return [(source.where(i), dict(row)) for i, row in enumerate(source.dataset)]


# The layouts a row may have, by the keys that make them; a row must match exactly one.
LAYOUTS = {"text": ("text",), "prompt+completion": ("prompt", "completion"), "messages": ("messages",)}
# A prompt alone (an online RL objective's prompt, a string or messages, `finetune.data.layouts`): no target.
PROMPT_ONLY = "prompt_only"
# The keys of a preference pair's two rows, in the order their examples come.
PAIR_KEYS = ("chosen", "rejected")

# Tokens dropped before a cut of a long row's text: a tokenizer may merge across the cut (a word, a run of
# spaces or digits, a special token split in two), so the tokens just before it may differ from the whole row's.
CUT_MARGIN = 32
# First characters of text tokenized per token a long row needs; doubled until the prefix yields enough tokens.
CHARS_PER_TOKEN = 8


def tokenize(rows: Sequence[tuple[str, dict[str, Any]]], tokenizer, seq_len: int | None = None,
             max_prompt: int | None = None) -> list[Example]:
    """Examples with loss masks, by each row's format. With `seq_len`, an example longer than that is
    tokenized only as far as its first `seq_len + 1` tokens (they equal the whole row's first tokens; the one
    beyond `seq_len` marks it as longer). With `max_prompt`, prompts are bounded to that many tokens (see the
    module docstring)."""
    limit = None if seq_len is None else seq_len + 1
    return [example for where, row in rows for example in tokenize_examples(where, row, tokenizer, limit, max_prompt)]


def is_pair(row: dict[str, Any]) -> bool:
    """Whether a canonical row is a preference pair (it has a chosen or a rejected side)."""
    return any(row.get(key) is not None for key in PAIR_KEYS)


def tokenize_examples(where: str, row: dict[str, Any], tokenizer, limit: int | None = None,
                      max_prompt: int | None = None) -> list[Example]:
    """The examples of one canonical row: one for an SFT row, two (chosen, rejected) for a preference pair."""
    if is_pair(row):
        return list(tokenize_pair(where, row, tokenizer, limit, max_prompt))
    return [tokenize_row(where, row, tokenizer, limit, max_prompt)]


def tokenize_pair(where: str, row: dict[str, Any], tokenizer, limit: int | None = None,
                  max_prompt: int | None = None) -> tuple[Example, Example]:
    """A preference pair's chosen and rejected examples (`tokenize_reply` of each side)."""
    sides = [row.get(key) for key in PAIR_KEYS]
    if not all(isinstance(side, dict) for side in sides) or set(row) - set(PAIR_KEYS):
        raise DataError(f"{where}: a preference pair expects exactly a 'chosen' and a 'rejected' row; found keys "
                        f"{sorted(row)}")
    chosen, rejected = (tokenize_reply(where, side, tokenizer, limit, max_prompt) for side in sides)
    return chosen, rejected


def tokenize_reply(where: str, row: dict[str, Any], tokenizer, limit: int | None = None,
                   max_prompt: int | None = None) -> Example:
    """One side of a preference pair: a prompt-completion row exactly as `tokenize_row` gives it; a messages row
    ending in the assistant reply as `tokenize_row` gives it, with only that final turn trained."""
    layout = _layout(where, row)
    if layout == "prompt+completion":
        return tokenize_row(where, row, tokenizer, limit, max_prompt)
    if layout == "messages":
        return _tokenize_chat(where, row["messages"], tokenizer, limit, final_only=True, max_prompt=max_prompt)
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


def encode_suffix(tokenizer, text: str, limit: int) -> list[int]:
    """`tokenizer.encode(text)[-limit:]` (nothing for a limit of 0), handing the tokenizer an end of `text` of about
    `CHARS_PER_TOKEN` characters per token (more for text that yields fewer tokens) instead of the whole text:
    `encode_prefix` from the other end."""
    def encode(piece: str) -> list[int]:
        return tokenizer.encode(piece, add_special_tokens=False)

    if limit <= 0:
        return []
    budget = CHARS_PER_TOKEN * (limit + CUT_MARGIN)
    while budget < len(text):
        ids = encode(text[-budget:])
        if len(ids) >= limit + CUT_MARGIN:
            return ids[-limit:]
        budget *= 2
    return encode(text)[-limit:]


def prompt_tail(tail: list[int], bos: list[int], max_prompt: int) -> tuple[list[int], bool]:
    """A prompt-completion prompt bounded to `max_prompt` tokens: BOS and the last tokens of its text, from `tail`
    (`encode_suffix` of the text with a limit of `prompt_tail_limit`); and whether any were left out."""
    keep = max(max_prompt - len(bos), 0)
    return bos + tail[max(len(tail) - keep, 0):], len(tail) > keep


def prompt_tail_limit(bos: list[int], max_prompt: int) -> int:
    """The tokens of a prompt's text `prompt_tail` needs: those it keeps and one more, which tells a cut."""
    return max(max_prompt - len(bos), 0) + 1


def bound_chat_prompt(messages: list[dict], max_prompt: int, prompt_tokens: Callable[[list[dict]], int],
                      final_only: bool = False) -> tuple[list[dict], bool]:
    """The conversation with its prompt (the messages before its first trained one: the final message with
    `final_only`, else the first assistant turn) bounded to `max_prompt` tokens as `prompt_tokens` counts them
    (its rendering with the generation prompt); and whether it was cut. Leading system turns stay whole; whole old
    turns go first, each time up to the next user turn (the kept prompt starts with a user turn); then the start
    of the oldest kept content, characters at a time, as many as the bound needs (a search: the kept contents fit,
    one more character does not). A prompt whose system turns and headers alone exceed the bound keeps them and no
    content."""
    first = len(messages) - 1 if final_only else next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt, rest = messages[:first], messages[first:]
    if prompt_tokens(prompt) <= max_prompt:
        return messages, False
    system = 0
    while system < len(prompt) and prompt[system]["role"] == "system":
        system += 1
    starts = [k for k in range(system + 1, len(prompt)) if prompt[k]["role"] == "user"]
    for k in starts:
        if prompt_tokens(prompt[:system] + prompt[k:]) <= max_prompt:
            return prompt[:system] + prompt[k:] + rest, True
    head, body = prompt[:system], prompt[starts[-1] if starts else system:]

    def fits(chars: int) -> bool:
        return prompt_tokens(head + last_characters(body, chars)) <= max_prompt

    # the whole body is known not to fit; gallop up from max_prompt characters, then bisect
    lo, hi = 0, sum(len(m["content"]) for m in body)
    chars = min(max_prompt, hi)
    while chars < hi:
        if not fits(chars):
            hi = chars
            break
        lo, chars = chars, 2 * chars
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return head + last_characters(body, lo) + rest, True


def last_characters(messages: list[dict], chars: int) -> list[dict]:
    """The messages with only the last `chars` characters of their contents, in order, kept (the earlier ones'
    contents emptied first)."""
    kept = []
    for m in reversed(messages):
        n = min(len(m["content"]), chars)
        kept.append({**m, "content": m["content"][len(m["content"]) - n:]})
        chars -= n
    return kept[::-1]


def _layout(where: str, row: dict[str, Any]) -> str:
    """The one layout `row` has (a key whose value is None is absent: tables fill missing columns with it)."""
    if set(row) == {PROMPT_ONLY} and isinstance(row[PROMPT_ONLY], (str, list)):
        return "prompt"
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


def tokenize_row(where: str, row: dict[str, Any], tokenizer, limit: int | None = None,
                 max_prompt: int | None = None) -> Example:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    layout = _layout(where, row)
    if layout == "text":
        ids = bos + encode_prefix(tokenizer, row["text"], None if limit is None else limit - len(bos)) + eos
        return Example(np.asarray(ids, np.int32), np.ones(len(ids), bool), where)
    if layout == "prompt+completion":
        cut = False
        if max_prompt is None:
            prompt = bos + encode_prefix(tokenizer, row["prompt"], None if limit is None else limit - len(bos))
        else:
            tail = encode_suffix(tokenizer, row["prompt"], prompt_tail_limit(bos, max_prompt))
            prompt, cut = prompt_tail(tail, bos, max_prompt)
            prompt = prompt[:limit]
        rest = None if limit is None else limit - len(prompt)
        completion = encode_prefix(tokenizer, row["completion"], rest) + eos
        trained = [False] * len(prompt) + [True] * len(completion)
        return Example(np.asarray(prompt + completion, np.int32), np.asarray(trained), where, cut)
    if layout == "prompt":
        return _tokenize_prompt(where, row[PROMPT_ONLY], tokenizer, bos, max_prompt)
    return _tokenize_chat(where, row["messages"], tokenizer, limit, max_prompt=max_prompt)


def _tokenize_prompt(where: str, prompt: str | list, tokenizer, bos: list[int], max_prompt: int | None) -> Example:
    """A prompt alone, nothing trained: a string as a prompt-completion row's prompt (BOS and its text, as
    `tokenizer(prompt)` gives it), messages as a chat's prompt (its rendering with the generation prompt), each
    bounded to `max_prompt` tokens as those are."""
    if isinstance(prompt, str):
        if max_prompt is None:
            ids, cut = bos + encode_prefix(tokenizer, prompt, None), False
        else:
            tail = encode_suffix(tokenizer, prompt, prompt_tail_limit(bos, max_prompt))
            ids, cut = prompt_tail(tail, bos, max_prompt)
        return Example(np.asarray(ids, np.int32), np.zeros(len(ids), bool), where, cut)
    for m in prompt:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: each message of 'prompt' needs string 'role' and 'content'")
    if not prompt or prompt[0]["role"] == "assistant":
        found = "starts with an assistant turn" if prompt else "has no message"
        raise DataError(f"{where}: 'prompt' {found}; expected a system or user turn first")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a messages 'prompt' needs a tokenizer with a chat template")
    cut = False
    try:
        if max_prompt is not None:
            reply = {"role": "assistant", "content": ""}  # where the completion goes: the prompt is what precedes it
            bounded, cut = bound_chat_prompt(prompt + [reply], max_prompt,
                                             lambda p: len(_render(tokenizer, p, True)), final_only=True)
            prompt = bounded[:-1]
        ids = _render(tokenizer, prompt, True)
    except TemplateError as error:
        raise DataError(f"{where}: the chat template refuses the prompt: {error}") from None
    return Example(np.asarray(ids, np.int32), np.zeros(len(ids), bool), where, cut)


def _tokenize_chat(where: str, messages: list, tokenizer, limit: int | None = None, final_only: bool = False,
                   max_prompt: int | None = None) -> Example:
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
    prompt_cut = False
    if max_prompt is not None:
        def prompt_tokens(prompt: list[dict]) -> int:
            return len(_render(tokenizer, prompt, True))

        messages, prompt_cut = bound_chat_prompt(messages, max_prompt, prompt_tokens, final_only)
    # the index of the one turn trained (a cut conversation that lost it trains none)
    final = len(messages) - 1 if final_only else None
    if limit is None:
        example = _render_chat(where, messages, tokenizer, final=final)
        return Example(example.ids, example.trained, where, prompt_cut)
    budget = CHARS_PER_TOKEN * (limit + CUT_MARGIN)
    while True:
        kept, cut = first_characters(messages, budget)
        example = _render_chat(where, kept, tokenizer, stop=limit if cut else None, final=final)
        if not cut or len(example.ids) >= limit + CUT_MARGIN:
            return Example(example.ids[:limit], example.trained[:limit], where, prompt_cut)
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
    untrained: only the first `stop` tokens are wanted); with `final`, only message `final` (when present). A
    template that raises on the conversation (Gemma 3's on roles that do not alternate) is the row's error."""
    try:
        return _chat_example(where, messages, tokenizer, stop, final)
    except TemplateError as error:
        raise DataError(f"{where}: the chat template refuses the conversation: {error}") from None


def _chat_example(where: str, messages: list[dict], tokenizer, stop: int | None, final: int | None) -> Example:
    def render(msgs, generation_prompt=False) -> list[int]:
        return _render(tokenizer, msgs, generation_prompt)

    ids = render(messages)
    trained = np.zeros(len(ids), bool)
    # The generation prompt may end inside a token of the reply (its tokens then need not begin `ids`), but its text
    # must begin the conversation's: a template that renders it otherwise (Mistral's, which puts the system message
    # into the last user turn only) has no such boundary.
    whole_text = _render_text(tokenizer, messages)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or (final is not None and i != final):
            continue
        prompt_begins = whole_text.startswith(_render_text(tokenizer, messages[:i], True))
        start, upto = len(render(messages[:i], True)), render(messages[: i + 1])
        end = len(upto)
        if stop is not None and start >= stop:
            break
        if not prompt_begins or upto != ids[:end]:
            turn = sum(m["role"] == "assistant" for m in messages[: i + 1])
            part = (f"before assistant turn {turn}, with the generation prompt," if not prompt_begins
                    else f"through assistant turn {turn}")
            raise DataError(f"{where}: the chat template renders the conversation {part} differently from the whole "
                            "conversation, so its tokens cannot be told apart (README, \"Chat templates of other "
                            "families\")")
        trained[start:end] = True
    return Example(np.asarray(ids, np.int32), trained, where)


def _render_text(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """The chat template's rendering of `messages` as text."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    """The ids of the chat template's rendering of `messages`."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5


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
