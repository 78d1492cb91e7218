"""`BatchTokenizer`: a batch of rows encoded together by the fast tokenizer, each example equal, token for token
and mask for mask, to what `finetune.data.reference.tokenize` (the per-row reference) gives it.

A canonical row is `{"text"}`, `{"prompt", "completion"}` or `{"messages"}` (see `finetune.data.layouts`); the
cut at `seq_len + 1` tokens keeps a giant row from being tokenized whole. A chat is rendered and encoded once:
the boundaries of its assistant turns come from its shape (`finetune.data.chat_shapes`), are mapped onto the
encoding by its offsets, and each is checked to tokenize as the prefix alone would; a row where any check
fails goes through the reference path instead. A preference pair (`{"chosen": row, "rejected": row}`) is two
examples, encoded among the batch's other rows; a chat side trains only its final turn (its last span).

With a prompt bound (`max_prompt`): a prompt-completion prompt is encoded from its end (`encode_limited`'s
`keep_end`), as the reference's `prompt_tail`; a chat whose first trained span starts within the bound is
untouched, and one whose prompt is longer (or whose first trained span was not found) is bounded and tokenized
by the reference path, which re-renders it (`finetune.data.reference.bound_chat_prompt`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import numpy as np
from jinja2 import TemplateError

from finetune.data.chat_shapes import (MAX_REMEMBERED_TAIL, MAX_REMEMBERED_TAILS, MAX_SHAPES, SHAPE_CHECKS, ChatPlan,
                                       ChatShape)
from finetune.data.layouts import AUTO, canonical as layout_canonical
from finetune.data.reference import (CHARS_PER_TOKEN, CUT_MARGIN, PAIR_KEYS, PROMPT_ONLY, first_characters, is_pair,
                                     prompt_tail, prompt_tail_limit, tokenize_pair, tokenize_reply, tokenize_row)
from finetune.data.rows import DataError, Example

Canonical = Callable[[dict, str, str], dict]
# An example's training targets: a mask over its tokens, or the [start, end) spans of its trained tokens.
Targets = np.ndarray | list[tuple[int, int]]


class _BadRow(Exception):
    def __init__(self, index: int):
        self.index = index


def _empty():
    return np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(0, np.int64)


@dataclasses.dataclass
class EncodedBatch:
    """One batch's examples, concatenated (one per row, two per preference pair); or the index within the batch
    of its first bad row."""

    ids: np.ndarray  # int32 [tokens]
    trained: np.ndarray  # bool [tokens]
    lengths: np.ndarray  # int64 [examples]
    fallbacks: int = 0  # rows tokenized (in part) by the per-row reference path
    bad_row: int | None = None
    prompts_cut: tuple[int, ...] = ()  # the rows (indices within the batch) whose prompt was bounded


class BatchTokenizer:
    """Tokenizes batches of raw rows: `canonical` gives each row's canonical form, then the batch is encoded
    together. Equal to `finetune.data.reference.tokenize` of the canonical rows."""

    def __init__(self, tokenizer, seq_len: int | None, layout: str = AUTO,
                 canonical: Canonical = layout_canonical, max_prompt: int | None = None):
        self.tokenizer, self.layout, self.canonical = tokenizer, layout, canonical
        self.limit = None if seq_len is None else seq_len + 1
        self.max_prompt = max_prompt
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self.eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        # The chat spans are found from offsets only where they are exact: a fast tokenizer that matches
        # its added tokens before anything else (see `_boundary`).
        self.fast_chat = (bool(getattr(tokenizer, "is_fast", False))
                          and not getattr(tokenizer, "split_special_tokens", False)
                          and getattr(tokenizer, "chat_template", None) is not None)
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) if self.fast_chat else {}
        self.added = {i: token.content for i, token in decoder.items()}
        self.shapes: dict[tuple, ChatShape | None] = {}
        self.tails: dict[str, list[int]] = {}

    def __call__(self, raw_rows: Sequence[dict]) -> EncodedBatch:
        rows, bad_layout = [], None
        for i, raw in enumerate(raw_rows):
            try:
                rows.append(self.canonical(raw, self.layout, ""))
            except DataError:
                bad_layout = i
                break
        try:
            examples, fallbacks, cut = self.tokenize(rows)  # the rows before a bad layout may hold an earlier bad row
        except _BadRow as bad:
            return EncodedBatch(*_empty(), bad_row=bad.index)
        if bad_layout is not None:
            return EncodedBatch(*_empty(), bad_row=bad_layout)
        lengths = np.fromiter((len(ids) for ids, _ in examples), np.int64, len(examples))
        ids = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in examples), np.int32, int(lengths.sum()))
        trained = np.zeros(len(ids), bool)
        for at, n, (_, targets) in zip(np.cumsum(lengths) - lengths, lengths, examples):
            if isinstance(targets, np.ndarray):
                trained[at:at + n] = targets
            else:
                for start, end in targets:
                    trained[at + start:at + end] = True
        return EncodedBatch(ids, trained, lengths, fallbacks, prompts_cut=cut)

    def tokenize(self, rows: Sequence[dict]) -> tuple[list[tuple[list[int], Targets]], int, tuple[int, ...]]:
        """(ids, targets) of each canonical row's examples (one per row, two per pair), how many rows went
        (in part) through the reference path, and the rows whose prompt was bounded. Raises _BadRow for the first
        row the reference path rejects."""
        # the examples to make: (row index, canonical row, how the reference path tokenizes it alone)
        units: list[tuple[int, dict, Callable]] = []
        broken = set()  # a pair that is not two rows: the reference path's error names what is wrong
        for r, row in enumerate(rows):
            if not is_pair(row):
                units.append((r, row, tokenize_row))
            elif all(isinstance(row.get(key), dict) for key in PAIR_KEYS) and not set(row) - set(PAIR_KEYS):
                units.extend((r, row[key], tokenize_reply) for key in PAIR_KEYS)
            else:
                broken.add(len(units))
                units.append((r, row, tokenize_pair))
        out: list[Any] = [None] * len(units)
        cut: set[int] = set()  # rows whose prompt was bounded
        forms = [row for _, row, _ in units]
        texts = [i for i, row in enumerate(forms) if "text" in row and i not in broken]
        pairs = [i for i, row in enumerate(forms) if "prompt" in row and i not in broken]
        chats = [i for i, row in enumerate(forms) if "messages" in row and i not in broken]
        limit, bos, eos = self.limit, self.bos, self.eos
        sub = (lambda n: None) if limit is None else (lambda n: limit - n)
        for i, ids in zip(texts, self.encode_limited([forms[i]["text"] for i in texts], [sub(len(bos))] * len(texts))):
            ids = bos + ids + eos
            out[i] = ids, [(0, len(ids))]
        prompt_texts = [forms[i]["prompt"] for i in pairs]
        if self.max_prompt is None:
            prompts = [bos + ids for ids in self.encode_limited(prompt_texts, [sub(len(bos))] * len(pairs))]
        else:
            tails = self.encode_limited(prompt_texts, [prompt_tail_limit(bos, self.max_prompt)] * len(pairs),
                                        keep_end=True)
            bounded = [prompt_tail(tail, bos, self.max_prompt) for tail in tails]
            prompts = [prompt[:limit] for prompt, _ in bounded]
            cut.update(units[i][0] for i, (_, was_cut) in zip(pairs, bounded) if was_cut)
        completions = self.encode_limited([forms[i]["completion"] for i in pairs], [sub(len(p)) for p in prompts])
        for i, prompt, completion in zip(pairs, prompts, completions):
            out[i] = prompt + completion + eos, [(len(prompt), len(prompt) + len(completion) + len(eos))]
        # units the reference path tokenizes: broken pairs, and prompts alone (a run's few prompts, no targets)
        fallback = set(broken) | {i for i, row in enumerate(forms) if PROMPT_ONLY in row}
        if chats:
            final_only = [units[i][2] is tokenize_reply for i in chats]
            for i, example in zip(chats, self.chats([forms[i]["messages"] for i in chats], final_only)):
                if example is None:
                    fallback.add(i)
                out[i] = example
        for i in sorted(fallback):  # in row order: the first row the reference path rejects is reported
            r, row, alone = units[i]
            try:
                example = alone("", row, self.tokenizer, limit, self.max_prompt)
            except DataError:
                raise _BadRow(r) from None
            if not isinstance(example, Example):
                raise RuntimeError("the reference path took a pair that is not two rows")
            out[i] = example.ids.tolist(), example.trained
            if example.prompt_cut:
                cut.add(r)
        return out, len({units[i][0] for i in fallback}), tuple(sorted(cut))

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

    def encode_limited(self, texts: list[str], limits: list[int | None], keep_end: bool = False) -> list[list[int]]:
        """`finetune.data.reference.encode_prefix(tokenizer, text, limit)` of each text (with `keep_end`,
        `encode_suffix`), in batched calls: the same prefixes (ends) of the texts (a character budget doubled until
        it yields enough tokens) in the same order."""
        out: list[Any] = [None] * len(texts)
        todo = []  # (index, character budget or None for the whole text)
        for i, (text, limit) in enumerate(zip(texts, limits)):
            if limit is not None and limit <= 0:
                out[i] = []
            else:
                todo.append((i, None if limit is None else CHARS_PER_TOKEN * (limit + CUT_MARGIN)))
        while todo:
            whole = [budget is None or budget >= len(texts[i]) for i, budget in todo]
            encoded = self.encode([texts[i] if w else texts[i][-budget:] if keep_end else texts[i][:budget]
                                   for (i, budget), w in zip(todo, whole)])
            again = []
            for (i, budget), w, ids in zip(todo, whole, encoded):
                limit = limits[i]
                if limit is None:
                    out[i] = ids
                elif w or len(ids) >= limit + CUT_MARGIN:
                    out[i] = ids[-limit:] if keep_end else ids[:limit]
                else:
                    again.append((i, budget * 2))
            todo = again
        return out

    def chats(self, conversations: list, final_only: Sequence[bool] | None = None
              ) -> list[tuple[list[int], Targets] | None]:
        """(ids, targets) of each conversation, None where the reference path must do it (a check failed, or
        the row is one the reference rejects). A conversation marked `final_only` (a preference reply) trains
        only its last message, an assistant turn: the last span, when the conversation kept it whole or cut."""
        if not self.fast_chat:
            return [None] * len(conversations)
        final_only = [False] * len(conversations) if final_only is None else final_only
        plans = [self._plan_chat(messages, final) for messages, final in zip(conversations, final_only)]
        rendered = [plan.rendering for plan in plans if plan is not None]
        encoding = self.tokenizer(rendered, add_special_tokens=False, return_attention_mask=False) if rendered else None
        encodings = iter(zip(encoding["input_ids"], encoding.encodings) if rendered else ())
        for plan in plans:
            if plan is not None:
                plan.ids, offsets = next(encodings)
                plan.find_spans(self, offsets)
        out = []
        for plan, messages, final in zip(plans, conversations, final_only):
            if plan is None or not plan.exact:
                out.append(None)
                continue
            ids, limit, spans = plan.ids, self.limit, plan.spans
            if plan.cut and len(ids) < limit + CUT_MARGIN:
                out.append(None)  # the reference path grows the character budget
                continue
            if final:
                # the last message's span, found when no earlier turn started at the cut; none when the cut
                # left that message out
                whole = len(plan.messages) == len(messages) and len(spans) == len(plan.boundaries)
                spans = spans[-1:] if whole else []
            if self.max_prompt is not None and (not spans or spans[0][0] > self.max_prompt):
                out.append(None)  # a prompt longer than the bound (or not seen): the reference path bounds it
                continue
            out.append((ids, spans) if limit is None else
                       (ids[:limit], [(start, min(end, limit)) for start, end in spans if start < limit]))
        return out

    def _plan_chat(self, messages, final_only: bool = False) -> "ChatPlan | None":
        if not isinstance(messages, list) or not messages:
            return None
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return None
        if not any(m["role"] == "assistant" for m in messages) or messages[0]["role"] == "assistant":
            return None
        if final_only and messages[-1]["role"] != "assistant":
            return None
        if self.limit is None:
            kept, cut = messages, False
        else:
            kept, cut = first_characters(messages, CHARS_PER_TOKEN * (self.limit + CUT_MARGIN))
        try:
            plan = ChatPlan(kept, cut, self.render(kept))
            plan.boundaries = self._boundaries(kept, plan.rendering)
        except TemplateError:
            return None  # the reference path names the row and the template's message
        return plan

    def render(self, messages: list, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _boundaries(self, messages: list, rendering: str) -> list[tuple[int, int]] | None:
        """Each assistant turn's (start, end) in characters of `rendering`: the lengths of the renderings of the
        messages before it with the generation prompt, and of those up to it. From the conversation's shape
        (see `ChatShape`) when `rendering` is that shape's rendering with these contents put in; else (or while
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

    def _shape(self, messages: list) -> "ChatShape | None":
        try:  # a message with only a role and content (the usual case) is keyed by its role
            key = tuple(m["role"] if len(m) == 2 else tuple(sorted((k, v) for k, v in m.items() if k != "content"))
                        for m in messages)
            hash(key)
        except TypeError:  # a field the template may read that is not a plain value
            return None
        if key not in self.shapes:
            if len(self.shapes) >= MAX_SHAPES:
                return None
            self.shapes[key] = ChatShape.of(self, messages, key)
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


