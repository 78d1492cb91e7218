"""Packed rows read from a tokenized store equal the in-memory rows of `build_rows`, built in O(examples) memory."""

import tempfile
import tracemalloc
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.data.reference import build_rows, truncation_report

from finetune.data.rows import DataError, Example
from finetune.data.packing import PackedRows, targets_within, truncation_report_from_store

FIELDS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")


def write_store(directory: Path, examples: list[Example]) -> types.SimpleNamespace:
    """The examples as a store (ids.npy, trained.npy, starts.npy), opened memory-mapped."""
    directory.mkdir(parents=True, exist_ok=True)
    lengths = [len(e.ids) for e in examples]
    np.save(directory / "ids.npy", np.concatenate([e.ids for e in examples] + [np.zeros(0, np.int32)]).astype(np.int32))
    np.save(directory / "trained.npy", np.concatenate([e.trained for e in examples] + [np.zeros(0, bool)]).astype(bool))
    np.save(directory / "starts.npy", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64))
    return types.SimpleNamespace(**{name: np.load(directory / f"{name}.npy", mmap_mode="r")
                                    for name in ("ids", "trained", "starts")})


def assert_same_batch(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in FIELDS:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@st.composite
def packing_cases(draw):
    """A store of examples (lengths 0..3*seq_len, any trained pattern), a selection of them in any order,
    seq_len and pack."""
    seq_len = draw(st.integers(1, 12))
    n = draw(st.integers(1, 12))
    examples = []
    for i in range(n):
        length = draw(st.integers(0, 3 * seq_len))
        ids = np.asarray(draw(st.lists(st.integers(1, 2**31 - 1), min_size=length, max_size=length)), np.int32)
        trained = np.asarray(draw(st.lists(st.booleans(), min_size=length, max_size=length)), bool)
        examples.append(Example(ids, trained, f"data.jsonl:{i + 1}"))
    selection = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=2 * n))
    return examples, np.asarray(selection, np.int64), seq_len, draw(st.booleans())


@pytest.mark.slow
@given(case=packing_cases(), data=st.data())
@settings(max_examples=300)
def test_take_equals_build_rows(case, data):
    """Any rows, in any order, repeated or not, and the virtual padding rows: exactly build_rows' arrays."""
    examples, selection, seq_len, pack = case
    chosen = [examples[i] for i in selection if len(examples[i].ids)]  # build_rows cannot take an empty one
    with tempfile.TemporaryDirectory() as tmp:
        store = write_store(Path(tmp), examples)
        try:
            want, _ = build_rows(chosen, seq_len, pack=pack)
        except (DataError, ValueError):  # ValueError: no rows at all (nothing to stack)
            with pytest.raises(DataError, match="no token of the data is a training target"):
                PackedRows.build(store, selection, seq_len, pack)
            return
        rows = PackedRows.build(store, selection, seq_len, pack)
        assert len(rows) == len(want) and rows.seq_len == seq_len
        assert_same_batch(rows.take(np.arange(len(want))), want.take(np.arange(len(want))))
        index = np.asarray(data.draw(st.lists(st.integers(-len(want), len(want) - 1), max_size=3 * len(want))),
                           np.int64)
        assert_same_batch(rows.take(index), want.take(index))
        multiple = data.draw(st.integers(1, 5))
        padded, want_padded = rows.padded_to_multiple(multiple), want.padded_to_multiple(multiple)
        assert len(padded) == len(want_padded) and padded.seq_len == seq_len
        index = np.asarray(data.draw(st.lists(st.integers(0, len(want_padded) - 1), max_size=12)), np.int64)
        assert_same_batch(padded.take(index), want_padded.take(index))


@pytest.mark.slow
@given(case=packing_cases())
@settings(max_examples=200)
def test_truncation_report_equals_the_in_memory_one(case):
    examples, selection, seq_len, _ = case
    with tempfile.TemporaryDirectory() as tmp:
        store = write_store(Path(tmp), examples)
        got = truncation_report_from_store(store, selection, seq_len, where=lambda e: examples[e].where)
    assert got == truncation_report([examples[i] for i in selection], seq_len)


def test_an_empty_example_has_no_segment(tmp_path):
    """An example of no tokens (no BOS, EOS or text) is left out: the documents around it keep consecutive
    segment numbers, and it neither starts nor ends a row."""
    empty = Example(np.zeros(0, np.int32), np.zeros(0, bool))
    a, b = Example(np.array([1, 2], np.int32), np.ones(2, bool)), Example(np.array([3], np.int32), np.ones(1, bool))
    store = write_store(tmp_path, [empty, a, b])
    for pack in (True, False):
        want, _ = build_rows([a, b], 4, pack=pack)
        rows = PackedRows.build(store, np.array([0, 1, 0, 2, 0]), 4, pack)
        assert len(rows) == len(want)
        assert_same_batch(rows.take(np.arange(len(want))), want.take(np.arange(len(want))))


def test_packing_keeps_documents_apart(tmp_path):
    a = Example(np.array([1, 2, 3], np.int32), np.array([False, True, True]))
    b = Example(np.array([4, 5], np.int32), np.array([True, True]))
    store = write_store(tmp_path, [a, b])
    rows = PackedRows.build(store, np.array([0, 1]), 8, pack=True)
    assert len(rows) == 1
    batch = rows.take(np.array([0]))
    np.testing.assert_array_equal(batch["input_ids"][0], [1, 2, 3, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 1, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(batch["positions"][0], [0, 1, 2, 0, 1, 0, 0, 0])
    # targets never cross a document boundary: token 3 (end of a) predicts nothing
    np.testing.assert_array_equal(batch["targets"][0], [2, 3, 0, 5, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"][0], [1, 1, 0, 1, 0, 0, 0, 0])
    padded = PackedRows.build(store, np.array([0, 1]), 8, pack=False)
    assert len(padded) == 2 and padded.take(np.array([1]))["segment_ids"].tolist() == [[1, 1, 0, 0, 0, 0, 0, 0]]


def test_long_examples_are_cut_to_the_sequence(tmp_path):
    store = write_store(tmp_path, [Example(np.arange(10, dtype=np.int32), np.ones(10, bool))])
    rows = PackedRows.build(store, np.array([0]), 4, pack=True)
    assert rows.take(np.array([0]))["input_ids"].tolist() == [[0, 1, 2, 3]]
    assert rows.take(np.array([0]))["targets"].tolist() == [[1, 2, 3, 0]]


def test_the_selection_decides_which_examples_and_their_order(tmp_path):
    examples = [Example(np.full(3, i + 1, np.int32), np.ones(3, bool)) for i in range(4)]
    rows = PackedRows.build(write_store(tmp_path, examples), np.array([3, 1]), 8, pack=True)
    assert rows.take(np.array([0]))["input_ids"].tolist() == [[4, 4, 4, 2, 2, 2, 0, 0]]


def test_no_training_target_is_an_error(tmp_path):
    prompt_only = Example(np.array([1, 2, 3], np.int32), np.array([True, False, False]))
    store = write_store(tmp_path, [prompt_only, Example(np.array([4, 5], np.int32), np.array([False, True]))])
    with pytest.raises(DataError, match="no token of the data is a training target"):
        PackedRows.build(store, np.array([0]), 8, pack=True)
    assert len(PackedRows.build(store, np.array([0, 1]), 8, pack=True)) == 1
    # the only target is cut off by the sequence length
    with pytest.raises(DataError, match="no token of the data is a training target"):
        PackedRows.build(store, np.array([1]), 1, pack=True)


def test_targets_within_the_sequence_per_example(tmp_path):
    examples = [Example(np.arange(4, dtype=np.int32), np.array(t, bool))
                for t in ([True, False, False, False], [False, False, False, True], [False, True, False, False])]
    store = write_store(tmp_path, examples)
    assert targets_within(store, 3).tolist() == [False, False, True]
    assert targets_within(store, 4).tolist() == [False, True, True]


class RecordingArray:
    """An array that records which of its elements were read."""

    def __init__(self, array: np.ndarray):
        self.array, self.read = array, np.zeros(len(array), bool)
        self.shape, self.dtype = array.shape, array.dtype

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, key):
        self.read[key] = True
        return self.array[key]


def test_take_reads_only_the_tokens_of_the_rows_asked_for(tmp_path):
    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(1, 100, n).astype(np.int32), rng.random(n) < 0.5)
                for n in rng.integers(1, 20, 200)]
    store = write_store(tmp_path, examples)
    recording = types.SimpleNamespace(ids=RecordingArray(store.ids), trained=RecordingArray(store.trained),
                                      starts=store.starts)
    rows = PackedRows.build(recording, np.arange(len(examples)), 32, pack=True)
    want, _ = build_rows(examples, 32, pack=True)
    index = np.array([5, 2, 5])
    recording.ids.read[:], recording.trained.read[:] = False, False
    assert_same_batch(rows.take(index), want.take(index))
    # the tokens of rows 2 and 5: their input ids are the first tokens of their documents, in order
    expected = np.zeros(len(store.ids), bool)
    for r in (2, 5):
        first, last = rows.row_segments[r], rows.row_segments[r + 1]
        for e, n in zip(rows.segment_example[first:last], rows.segment_length[first:last]):
            expected[store.starts[e]:store.starts[e] + n] = True
    np.testing.assert_array_equal(recording.ids.read, expected)
    np.testing.assert_array_equal(recording.trained.read, expected)


@pytest.fixture(scope="module")
def large_store(tmp_path_factory):
    """About 10M tokens in 100k examples (lengths 1..199), written to disk and memory-mapped."""
    lengths = np.random.default_rng(0).integers(1, 200, 100_000)
    directory = tmp_path_factory.mktemp("store")
    total = int(lengths.sum())
    np.save(directory / "ids.npy", (np.arange(total) % 30_000).astype(np.int32))
    np.save(directory / "trained.npy", np.ones(total, bool))
    np.save(directory / "starts.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return types.SimpleNamespace(**{name: np.load(directory / f"{name}.npy", mmap_mode="r")
                                    for name in ("ids", "trained", "starts")})


@pytest.mark.parametrize("pack", [True, False])
def test_building_allocates_per_example_not_per_token(large_store, pack):
    """Peak allocations while building for 10M tokens in 100k examples stay under 1 byte per token (100 bytes
    per example: a few int64 arrays per example and a bounded read block), so no array of even one byte per
    token fits in it."""
    tokens, n = len(large_store.ids), len(large_store.starts) - 1
    tracemalloc.start()
    try:
        rows = PackedRows.build(large_store, np.arange(n), 2048, pack)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < tokens, f"{peak / tokens:.2f} bytes per token"
    assert len(rows) == n if not pack else tokens / 2048 < len(rows) < n
