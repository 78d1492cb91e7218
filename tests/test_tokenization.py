"""Batched, parallel tokenization into a store: every example equals `finetune.data.reference.tokenize`'s (the per-row
reference) token for token and mask for mask, at every place a row can meet --seq-len, with 1 and 2 worker
processes; the loss masks mean what they should; bad rows are named as the reference names them."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from demo.tiny import CHAT_TEMPLATE
from finetune.data.reference import tokenize
from finetune.data.rows import DataError
from finetune.data.chat_shapes import SHAPE_CHECKS
from finetune.data.encoding import BatchTokenizer
from finetune.data.store import TokenizedData
from finetune.data.workers import MIN_ROWS_PER_WORKER, default_workers, tokenize_to_store

WORDS = "the quick brown fox jumps over a lazy dog 12345 ééé 漢字".split()


def words(n, offset=0):
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n))


def chat(*turns, system=None):
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": role, "content": content} for role, content in zip(roles, turns)]
    return {"messages": ([{"role": "system", "content": system}] if system else []) + messages}


# Rows whose tokens sweep across every seq_len used below: the cut falls inside a prompt, inside a completion,
# inside a user turn, inside an assistant turn, on a turn's boundary, and exactly at seq_len.
SWEEP = ([{"text": words(n)} for n in range(0, 40, 3)]
         + [{"prompt": words(n), "completion": " " + words(m, 3)} for n in (0, 2, 7, 13, 30) for m in (0, 1, 6, 15, 40)]
         + [chat(words(n), words(m, 5)) for n in (1, 4, 12, 30) for m in (0, 1, 5, 14, 35)]
         + [chat(words(2), words(3), words(4), words(n), system=words(s)) for n in (1, 9, 25) for s in (2, 11)]
         + [chat(*[words(k % 5 + 1, k) for k in range(12)])]
         + [{"text": "x" * 3000}, {"prompt": "  " * 900, "completion": "y"}, chat(" " * 2000, "z")])


def store_of(rows, tokenizer, seq_len, directory, **kw):
    directory.mkdir(exist_ok=True)
    return tokenize_to_store(rows, tokenizer, seq_len, directory, **kw)


def assert_equals_reference(store: TokenizedData, rows, tokenizer, seq_len):
    reference = tokenize([(f"row {i + 1}", row) for i, row in enumerate(rows)], tokenizer, seq_len)
    assert len(store) == len(reference)
    for e, expected in enumerate(reference):
        got = store.example(e)
        np.testing.assert_array_equal(got.ids, expected.ids, err_msg=f"ids of row {e}: {rows[e]}")
        np.testing.assert_array_equal(got.trained, expected.trained, err_msg=f"trained of row {e}: {rows[e]}")


@pytest.mark.parametrize("seq_len", [None, 8, 16, 33, 64])
def test_every_row_equals_the_per_row_reference(tmp_path, tokenizer, seq_len):
    store = store_of(SWEEP, tokenizer, seq_len, tmp_path, batch_rows=7)
    assert_equals_reference(store, SWEEP, tokenizer, seq_len)
    if seq_len is not None:
        assert (store.lengths() > seq_len).any() and (store.lengths() <= seq_len).any()
    assert store.meta["reference_path_rows"] == 0  # the tiny tokenizer's chats all take the one-rendering path


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_worker_processes_give_the_same_store(tmp_path, tokenizer, workers, monkeypatch):
    """This process and `workers - 1` spawned ones, each batch written in row order whoever tokenized it. This
    process is slowed down (the workers import the module afresh, unslowed): it tokenizes the first batches
    alone while the workers start, then some beside them."""
    rows = SWEEP * 3
    one = store_of(rows, tokenizer, 16, tmp_path / "one", batch_rows=5)
    here = []

    def slowly(self, raw_rows, tokenize=BatchTokenizer.__call__):
        here.append(len(raw_rows))
        time.sleep(0.25)
        return tokenize(self, raw_rows)

    monkeypatch.setattr(BatchTokenizer, "__call__", slowly)
    two = store_of(rows, tokenizer, 16, tmp_path / "two", batch_rows=5, workers=workers)
    assert 0 < sum(here) < len(rows)
    for name in ("ids", "trained", "starts"):
        np.testing.assert_array_equal(getattr(one, name), getattr(two, name), err_msg=name)
    assert_equals_reference(two, rows, tokenizer, 16)



def test_data_workers_gives_that_many_processes_and_0_one_per_core_for_enough_rows():
    assert default_workers(2, 10) == 2 and default_workers(3, 10**7) == 3
    cores = default_workers(0, 10**9)
    assert default_workers(0, 10) == 1 and default_workers(0, MIN_ROWS_PER_WORKER + 1) == min(2, cores)


@pytest.fixture
def out(tmp_path):
    directory = tmp_path / "store"
    directory.mkdir()
    return directory


def test_the_store_is_memory_mapped_and_counts_its_tokens(out, tokenizer):
    store = store_of(SWEEP[:10], tokenizer, 16, out)
    assert isinstance(store.ids, np.memmap) and isinstance(store.trained, np.memmap)
    assert store.ids.dtype == np.int32 and store.trained.dtype == bool and store.starts.dtype == np.int64
    assert store.starts[0] == 0 and store.starts[-1] == len(store.ids) == store.meta["tokens"]
    reopened = TokenizedData.open(out)
    np.testing.assert_array_equal(reopened.lengths(), np.diff(store.starts))


def test_prompt_tokens_are_not_trained(out, tokenizer):
    store = store_of([{"prompt": "add 2 + 3 =", "completion": " 5"}], tokenizer, None, out)
    example = store.example(0)
    prompt_len = 1 + len(tokenizer.encode("add 2 + 3 =", add_special_tokens=False))
    assert not example.trained[:prompt_len].any() and example.trained[prompt_len:].all()
    assert example.ids[-1] == tokenizer.eos_token_id


def test_chat_rows_train_exactly_each_assistant_turns_content_and_its_eot(out, tokenizer):
    """As in test_finetune_data, on this path: the expected ids and mask built piece by piece from the tiny
    template, independently of any rendering."""
    messages = [{"role": "system", "content": "answer the question"}, {"role": "user", "content": "reverse: a b"},
                {"role": "assistant", "content": "b a"}, {"role": "user", "content": "again"},
                {"role": "assistant", "content": "a b"}]
    example = store_of([{"messages": messages}], tokenizer, None, out).example(0)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    ids, trained = [tokenizer.bos_token_id], [False]
    for m in messages:
        header, body = encode(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"), encode(m["content"]) + [eot]
        ids += header + body
        trained += [False] * len(header) + [m["role"] == "assistant"] * len(body)
    assert example.ids.tolist() == ids
    np.testing.assert_array_equal(example.trained, trained)


# ---- chats whose prefix renderings do not line up with the whole rendering ---------------------------------

def merging_tokenizer():
    """A byte-level BPE with two merges. Two newlines: a rendering ending in "\\n\\n" tokenizes them as one token,
    while in the whole conversation (followed by a word) they are two, at a clean token boundary. " o": a
    rendering ending in a space has no token boundary after it in the whole conversation when "o" follows."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from demo.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + alphabet + ["ĊĊ", "Ġo"])}
    backend = Tokenizer(models.BPE(vocab, [("Ċ", "Ċ"), ("Ġ", "o")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                        eos_token="<|eot_id|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("seq_len", [None, 12])
def test_a_chat_whose_prefix_tokenizes_differently_takes_the_reference_path(out, seq_len):
    tokenizer = merging_tokenizer()
    assert len(tokenizer.encode("\n\n", add_special_tokens=False)) == 1
    rows = [chat("hi", "ok"), chat("a b", "b a", "again", "a b")]
    store = store_of(rows, tokenizer, seq_len, out)
    assert_equals_reference(store, rows, tokenizer, seq_len)
    assert store.meta["reference_path_rows"] == 2


def test_a_generation_prompt_ending_inside_a_token_takes_the_reference_path(out):
    """The prompt ends with a space the assistant's first word takes into its token: no token boundary there."""
    tokenizer = merging_tokenizer()
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + "
                               "'<|eot_id|>' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    rows = [chat("hi", "ok")]
    store = store_of(rows, tokenizer, None, out)
    assert_equals_reference(store, rows, tokenizer, None)
    assert store.meta["reference_path_rows"] == 1


# ---- a conversation costs one rendering ------------------------------------------------------------------

class CountingRenders:
    """The tokenizer, counting `apply_chat_template` calls on real conversations (not on a shape's placeholders)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.real = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, texts, **kw):
        return self._tokenizer(texts, **kw)

    def apply_chat_template(self, messages, **kw):
        self.real += not any("\ue000" in m["content"] for m in messages)
        return self._tokenizer.apply_chat_template(messages, **kw)


def test_a_conversation_costs_one_rendering_once_its_shape_is_checked(out, tokenizer):
    """Conversations of the same roles render once each, after the first SHAPE_CHECKS of them are also rendered
    prefix by prefix (two renderings per assistant turn) and agree."""
    two = [chat(words(n), words(n + 1, 3)) for n in range(1, 30)]  # 1 assistant turn
    three = [chat(words(2), words(3), words(n), words(4), system=words(n)) for n in range(1, 30)]  # 2 turns
    rows = [row for pair in zip(two, three) for row in pair]
    counting = CountingRenders(tokenizer)
    store = store_of(rows, counting, None, out, batch_rows=len(rows))  # one batch: one thread, exact counts
    assert_equals_reference(store, rows, tokenizer, None)
    assert counting.real == len(rows) + SHAPE_CHECKS * 2 * (1 + 2)


# contents trimmed, as Llama 3.1's own template does: a conversation with a content the template changes renders
# differently from its shape with its contents put in
TRIMMING_TEMPLATE = CHAT_TEMPLATE.replace("message['content']", "(message['content'] | trim)")


def test_a_conversation_the_template_changes_is_rendered_prefix_by_prefix(out, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", TRIMMING_TEMPLATE)  # the module's tokenizer, restored after
    rows = [chat(words(n), words(5, n)) for n in range(1, 8)] + [chat("  hi ", " ok  "), chat("hi", "ok \n")]
    counting = CountingRenders(tokenizer)
    store = store_of(rows, counting, None, out)
    assert_equals_reference(store, rows, tokenizer, None)
    assert store.meta["reference_path_rows"] == 0
    assert counting.real == len(rows) + (SHAPE_CHECKS + 2) * 2


def test_a_shape_its_first_conversations_disagree_with_is_not_used(out, tokenizer, monkeypatch):
    """A template whose generation prompt depends on the last message's content: for the first conversation
    the shape's boundaries are not those of the prefix renderings, so no conversation of that shape uses them
    (the fourth, after two that agree, would otherwise train its header)."""
    monkeypatch.setattr(tokenizer, "chat_template", CHAT_TEMPLATE.replace(
        "{% if add_generation_prompt %}", "{% if add_generation_prompt and messages[-1]['content'] != 'short' %}"))
    rows = [chat("short", "a"), chat("x", "b"), chat("y", "c"), chat("short", "d")]
    store = store_of(rows, tokenizer, None, out)
    assert_equals_reference(store, rows, tokenizer, None)


# ---- random rows ------------------------------------------------------------------------------------------

PIECES = list("ab 1\n\t.é漢") + ["<|eot_id|>", "<|start_header_id|>", "  ", "\n\n", " the", "fox"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
ROWS = st.one_of(
    st.builds(lambda t: {"text": t}, TEXT),
    st.builds(lambda p, c: {"prompt": p, "completion": c}, TEXT, TEXT),
    st.builds(lambda turns, system: chat(*turns, system=system),
              st.lists(TEXT, min_size=2, max_size=6).filter(lambda turns: len(turns) % 2 == 0),
              st.one_of(st.none(), TEXT.filter(bool))),
)


@settings(max_examples=60)
@given(rows=st.lists(ROWS, min_size=1, max_size=6), seq_len=st.one_of(st.none(), st.integers(1, 40)))
def test_random_rows_equal_the_reference(tmp_path_factory, tokenizer, rows, seq_len):
    directory = tmp_path_factory.mktemp("store")
    assert_equals_reference(store_of(rows, tokenizer, seq_len, directory, batch_rows=4), rows, tokenizer, seq_len)


# ---- a giant row costs what seq_len needs ------------------------------------------------------------------

class RecordingTokenizer:
    """The tokenizer, recording the length of every text it is handed (one call or a batch)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.seen = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, texts, **kw):
        self.seen.extend(len(t) for t in texts)
        return self._tokenizer(texts, **kw)

    def apply_chat_template(self, messages, **kw):
        self.seen.append(sum(len(m["content"]) for m in messages))
        return self._tokenizer.apply_chat_template(messages, **kw)


def test_a_giant_row_is_tokenized_only_as_far_as_seq_len_needs(out, tokenizer):
    giant = words(400_000)
    rows = [{"text": giant}, {"prompt": giant, "completion": "x"}, {"prompt": "p", "completion": giant},
            chat(giant, "ok"), chat("hi", giant)]
    recording = RecordingTokenizer(tokenizer)
    store = store_of(rows, recording, 64, out)
    assert len(giant) > 1_000_000 and max(recording.seen) < 5_000
    assert_equals_reference(store, rows, tokenizer, 64)


# ---- bad rows -----------------------------------------------------------------------------------------------

def where(i):
    return f"d.jsonl:{i + 1}"


BAD_ROWS = [
    ({"question": "no"}, "d.jsonl:6: no layout matches the keys question"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "d.jsonl:6: 'messages' has no assistant turn to train on"),
    ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "a"}]},
     "d.jsonl:6: 'messages' starts with an assistant turn; expected a system or user turn first"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
     "d.jsonl:6: each message needs string 'role' and 'content'"),
]


@pytest.mark.parametrize("workers, bad, message", [(1, *case) for case in BAD_ROWS] + [(2, *BAD_ROWS[-1])])
def test_the_first_bad_row_is_named(out, tokenizer, workers, bad, message):
    """Rows 6 and 9 are bad, in different batches: the error names row 6, as the reference path words it."""
    rows = [{"text": words(i)} for i in range(12)]
    rows[5], rows[8] = bad, {"nothing": 1}
    with pytest.raises(DataError) as info:
        store_of(rows, tokenizer, 32, out, where=where, workers=workers, batch_rows=4)
    assert str(info.value).startswith(message)


def test_a_row_the_tokenizer_rejects_before_a_row_of_no_layout_is_the_one_named(out, tokenizer):
    rows = [{"text": "a"}, {"messages": [{"role": "user", "content": "hi"}]}, {"nothing": 1}]
    with pytest.raises(DataError, match="^d.jsonl:2: 'messages' has no assistant turn"):
        store_of(rows, tokenizer, 32, out, where=where)


def test_batch_tokenizer_matches_the_reference_on_canonical_rows(tokenizer):
    """The batch step alone (no store): a mixed batch of canonical rows."""
    batch = BatchTokenizer(tokenizer, 16)(SWEEP)
    reference = tokenize([("r", row) for row in SWEEP], tokenizer, 16)
    assert batch.fallbacks == 0 and batch.bad_row is None
    np.testing.assert_array_equal(batch.lengths, [len(e.ids) for e in reference])
    np.testing.assert_array_equal(batch.ids, np.concatenate([e.ids for e in reference]))
    np.testing.assert_array_equal(batch.trained, np.concatenate([e.trained for e in reference]))


class WordTokenizer:
    """A tokenizer whose tokens near the end depend on what follows: a word followed by a space is one token, the
    text's last word one token per character (a merge that needs the next character, reaching far back)."""

    bos_token_id, eos_token_id, chat_template = 0, 1, None

    def encode(self, text, add_special_tokens=False):
        *words, last = text.split(" ")
        return [1000 + sum(map(ord, w)) % 100_000 for w in words] + [ord(c) for c in last]


def test_tokens_near_a_cut_are_dropped_when_the_tokenizer_merges_across_it():
    """The first character budget yields more than seq_len tokens, but fewer than the margin more: the budget
    grows, as the reference's does."""
    text = " ".join(f"{i:030d}" for i in range(5000))  # 30-character words, one token each
    rows = [{"text": text}, {"prompt": text, "completion": "a"}, {"prompt": "p", "completion": text}]
    batch = BatchTokenizer(WordTokenizer(), 16)(rows)
    reference = tokenize([("r", row) for row in rows], WordTokenizer(), 16)
    np.testing.assert_array_equal(batch.lengths, [len(e.ids) for e in reference])
    np.testing.assert_array_equal(batch.ids, np.concatenate([e.ids for e in reference]))
    np.testing.assert_array_equal(batch.trained, np.concatenate([e.trained for e in reference]))
