"""The shape of a conversation: where its assistant turns start and end, from one rendering per shape.

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
"""

from __future__ import annotations

import dataclasses

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
class ChatShape:
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
    def of(cls, batch, messages: list, key: tuple) -> "ChatShape | None":
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
class ChatPlan:
    """One conversation on the fast path: its one rendering and its turns' character boundaries, then its
    encoding and assistant spans in tokens."""

    messages: list
    cut: bool
    rendering: str
    boundaries: list[tuple[int, int]] | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    exact: bool = True

    def find_spans(self, batch, encoding) -> None:
        """Each assistant turn's tokens `[start, end)`: `start` the number of tokens of the conversation before
        it rendered with the generation prompt, `end` of the conversation up to it, found in the one encoding
        (as `finetune.data.reference._render_chat` does, with `stop` the token limit when the conversation was cut)."""
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


