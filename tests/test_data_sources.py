"""Where training rows come from: a file, a directory or glob of shards (the rows, in the order, of one file
holding them all), or a dataset id found offline in the HF datasets cache; each row named by its file and line
(or row) for reports; bad bytes and lines named exactly; a fingerprint that changes when the data does."""

import json
import logging
import os

import datasets
import pytest

from conftest import write_jsonl

from finetune.data import sources as data_sources
from finetune.data.rows import DataError
from finetune.data.sources import open_source

ROWS = [{"text": f"row {i}", "n": i} for i in range(23)]


@pytest.fixture(autouse=True)
def own_datasets_cache(tmp_path, monkeypatch):
    """The Arrow caches `datasets` writes for the files read here go to the test's directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def rows_of(source):
    return source.dataset.to_list()


def write_shards(directory, rows, sizes, name="shard-{:02d}.jsonl"):
    """`rows` split into consecutive shards of `sizes` rows; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for k, size in enumerate(sizes):
        paths.append(write_jsonl(directory / name.format(k), rows[start:start + size]))
        start += size
    assert start == len(rows)
    return paths


# ---- files, directories, globs -----------------------------------------------------------------------

def test_a_directory_and_a_glob_of_shards_give_the_rows_of_one_file_in_its_order(tmp_path, capfd):
    whole = open_source(str(write_jsonl(tmp_path / "all.jsonl", ROWS)))
    assert capfd.readouterr().err == ""  # no log lines or progress bars
    write_shards(tmp_path / "shards", ROWS, [5, 1, 10, 7])
    as_directory = open_source(str(tmp_path / "shards"))
    as_glob = open_source(str(tmp_path / "shards" / "shard-*.jsonl"))
    assert rows_of(whole) == ROWS
    assert rows_of(as_directory) == ROWS and rows_of(as_glob) == ROWS
    assert len(whole) == len(as_directory) == len(as_glob) == 23
    # each row named by its shard and line
    assert as_directory.where(0) == f"{tmp_path / 'shards' / 'shard-00.jsonl'}:1"
    assert as_directory.where(5) == f"{tmp_path / 'shards' / 'shard-01.jsonl'}:1"
    assert as_glob.where(22) == f"{tmp_path / 'shards' / 'shard-03.jsonl'}:7"
    assert whole.where(22) == f"{tmp_path / 'all.jsonl'}:23"


def test_files_are_read_in_plain_string_order_of_their_paths(tmp_path):
    """shard-10 sorts before shard-2 (zero-padded names sort as numbers); subdirectories are read too, by
    their path; hidden files and files of other kinds are left out."""
    root = tmp_path / "d"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    write_jsonl(root / "shard-2.jsonl", [{"text": "two"}])
    write_jsonl(root / "shard-10.jsonl", [{"text": "ten"}])
    write_jsonl(root / "sub" / "a.jsonl", [{"text": "sub"}])
    write_jsonl(root / ".hidden" / "x.jsonl", [{"text": "hidden"}])
    write_jsonl(root / ".x.jsonl", [{"text": "hidden file"}])
    (root / "README.md").write_text("# not data\n")
    assert [r["text"] for r in rows_of(open_source(str(root)))] == ["ten", "two", "sub"]
    assert [r["text"] for r in rows_of(open_source(str(root / "shard-*.jsonl")))] == ["ten", "two"]
    assert [r["text"] for r in rows_of(open_source(str(root / "**" / "*.jsonl")))] == ["ten", "two", "sub"]


def test_jsonl_parquet_and_csv_shards_are_read_together(tmp_path):
    root = tmp_path / "mixed"
    root.mkdir()
    write_jsonl(root / "part-0.jsonl", [{"text": "a"}, {"text": "b"}])
    datasets.Dataset.from_dict({"text": ["c", "d", "e"]}).to_parquet(str(root / "part-1.parquet"))
    (root / "part-2.csv").write_text("text\nf\n\"g, with a comma\"\n")
    (root / "part-3.json").write_text(json.dumps([{"text": "h"}]))
    source = open_source(str(root))
    assert [r["text"] for r in rows_of(source)] == ["a", "b", "c", "d", "e", "f", "g, with a comma", "h"]
    assert [source.where(i) for i in (1, 2, 4, 6, 7)] == [
        f"{root / 'part-0.jsonl'}:2", f"{root / 'part-1.parquet'} row 1", f"{root / 'part-1.parquet'} row 3",
        f"{root / 'part-2.csv'} row 2", f"{root / 'part-3.json'} row 1"]


def without_nones(value):
    """`value` without the None-valued keys of its dicts (what a table fills in where a row has no such key)."""
    if isinstance(value, dict):
        return {k: without_nones(v) for k, v in value.items() if v is not None}
    return [without_nones(v) for v in value] if isinstance(value, list) else value


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "name": "bot"}]


@pytest.mark.parametrize("shards", [
    [[{"text": "a"}], [{"messages": CHAT[:1]}], [{"messages": CHAT}]],  # a chat whose turns' keys differ
    [[{"text": "a"}], [{"messages": CHAT[:1]}], [{"messages": CHAT[1:]}]],  # turns of different keys per shard
    [[{"messages": CHAT}], [{"messages": CHAT[:1]}, {"text": "b"}]],
    [[{"text": "a", "n": 1}], [{"text": "b", "n": "two"}]],  # a column of different types
], ids=["mixed turns in a shard", "turns per shard", "mixed first", "types"])
def test_shards_whose_columns_differ_give_the_rows_of_one_file(tmp_path, shards):
    """A column or struct field missing from a shard reads as None, or the value is kept as the JSON it was."""
    root = tmp_path / "d"
    root.mkdir()
    for k, rows in enumerate(shards):
        write_jsonl(root / f"{k}.jsonl", rows)
    rows = [row for shard in shards for row in shard]
    one_file = rows_of(open_source(str(write_jsonl(tmp_path / "one.jsonl", rows))))
    got = rows_of(open_source(str(root)))
    assert without_nones(got) == without_nones(one_file) == rows


def test_a_key_first_seen_after_the_first_chunk_of_a_jsonl_file_is_read(tmp_path, monkeypatch):
    """datasets infers the columns from a file's first chunk; rows mixing layouts deep in a file still read."""
    monkeypatch.setattr(data_sources, "JSON_CHUNK_BYTES", 1 << 10)
    rows = [{"text": f"t{i}"} for i in range(200)] + [{"prompt": "p", "completion": "c"}]
    source = open_source(str(write_jsonl(tmp_path / "d.jsonl", rows)))
    assert rows_of(source)[-1] == {"text": None, "prompt": "p", "completion": "c"}
    assert rows_of(source)[0] == {"text": "t0", "prompt": None, "completion": None}
    assert len(source) == 201


def test_blank_lines_and_a_byte_order_mark_keep_line_numbers_exact(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n\n  \n{"text": "b"}\n\r\n{"text": "c"}\n\n')
    source = open_source(str(path))
    assert [r["text"] for r in rows_of(source)] == ["a", "b", "c"]
    assert [source.where(i) for i in range(3)] == [f"{path}:1", f"{path}:4", f"{path}:6"]


def test_a_line_holding_two_objects_is_an_error_when_a_row_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"} {"text": "c"}\n')
    with pytest.raises(DataError) as info:
        open_source(str(path)).where(0)
    assert str(info.value) == f"{path}: expected one JSON object per line (3 rows were read from 2 non-blank lines)"


# ---- bad input: one line naming the file (and line) --------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (b'{"text": "ok"}\n{"text": "broken\n', "2: not valid JSON (Invalid control character at)"),
    (b'{"text": "ok"}\n\n[1, 2]\n', "3: expected a JSON object, got list"),
    (b'"a string"\n', "1: expected a JSON object, got str"),
    (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "2: not valid UTF-8 (byte 0xe9 at column 14)"),
    (b'{"text": "ok"}\n{"text": "x"} trailing\n', "2: not valid JSON (Extra data)"),
], ids=["broken", "array", "string", "latin-1", "extra"])
def test_a_bad_jsonl_line_is_named_with_its_file_and_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        open_source(str(path))
    assert str(info.value) == f"{path}:{message}"


def test_bytes_that_are_not_utf8_past_the_first_chunk_are_named_every_time(tmp_path, monkeypatch):
    """`datasets` checks only a file's first chunk is UTF-8; the rest is checked once, when first read, and a
    bad file leaves nothing in the cache to be read without the check."""
    monkeypatch.setattr(data_sources, "JSON_CHUNK_BYTES", 1 << 10)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' * 150 + b'{"text": "caf\xe9"}\n' + b'{"text": "fine"}\n' * 10)
    for _ in range(2):
        with pytest.raises(DataError) as info:
            open_source(str(path))
        assert str(info.value) == f"{path}:151: not valid UTF-8 (byte 0xe9 at column 14)"


def test_a_bad_line_in_a_shard_names_the_shard(tmp_path):
    root = tmp_path / "d"
    write_shards(root, ROWS, [20, 3])
    (root / "shard-01.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
    with pytest.raises(DataError) as info:
        open_source(str(root))
    assert str(info.value).startswith(f"{root / 'shard-01.jsonl'}:3: not valid JSON (")


@pytest.mark.parametrize("name, content", [("d.jsonl", b""), ("d.jsonl", b"\n\n  \n"), ("d.csv", b"text\n"),
                                           ("d.parquet", b"")], ids=["zero bytes", "blank lines", "header", "parquet"])
def test_an_empty_file_is_one_line(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        open_source(str(path))
    assert str(info.value) == f"{path}: no rows (the dataset is empty)"


def test_empty_shards_hold_no_rows_and_an_empty_set_is_one_line(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    (root / "a.jsonl").write_text("")
    write_jsonl(root / "b.jsonl", [{"text": "b"}])
    (root / "c.jsonl").write_text("\n")
    (root / "d.csv").write_text("text\n")
    assert rows_of(open_source(str(root))) == [{"text": "b"}]
    (root / "b.jsonl").write_text("")
    with pytest.raises(DataError) as info:
        open_source(str(root))
    assert str(info.value) == f"{root}: no rows (the dataset is empty)"


def test_a_directory_without_data_files_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DataError) as info:
        open_source(str(tmp_path))
    assert str(info.value) == f"{tmp_path}: no .jsonl, .json, .parquet or .csv files in the directory"


def test_an_unsupported_file_is_one_line(tmp_path):
    (tmp_path / "d.txt").write_text("hi")
    with pytest.raises(DataError) as info:
        open_source(str(tmp_path / "d.txt"))
    assert str(info.value) == f"{tmp_path / 'd.txt'}: unsupported data file (expected .jsonl, .json, .parquet or .csv)"


@pytest.mark.parametrize("spec, detail", [
    ("{tmp}/missing.jsonl", "no such file or directory"),
    ("{tmp}/shards-*.jsonl", "no .jsonl, .json, .parquet or .csv file matches the glob"),
])
def test_a_spec_that_names_nothing_is_one_line(tmp_path, spec, detail):
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(DataError) as info:
        open_source(spec)
    assert str(info.value) == f"{spec}: not a file, directory, glob or dataset in the HF datasets cache ({detail})"


def test_a_subset_is_refused_for_files(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError) as info:
        open_source(str(path), subset="a")
    assert str(info.value) == f"{path}: a subset ('a') applies only to a dataset id"


# ---- fingerprints ------------------------------------------------------------------------------------

def test_a_files_fingerprint_is_its_path_size_and_mtime(tmp_path):
    root = tmp_path / "d"
    paths = write_shards(root, ROWS, [10, 13])
    fingerprint = open_source(str(root)).fingerprint()
    assert fingerprint == {"files": [{"path": str(p.resolve()), "size": p.stat().st_size,
                                      "mtime_ns": p.stat().st_mtime_ns} for p in paths]}
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert open_source(str(root / "*.jsonl")).fingerprint() == fingerprint
    os.utime(paths[1], ns=(paths[1].stat().st_atime_ns, paths[1].stat().st_mtime_ns + 1))
    assert open_source(str(root)).fingerprint() != fingerprint


# ---- dataset ids from the HF datasets cache ---------------------------------------------------------

@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory):
    """An HF datasets cache holding `user/tiny_chat` (subsets `a`: train and test splits, `b`: train) as a
    download from the Hub leaves it: `user___tiny_chat/<subset>/0.0.0/<hash>/tiny_chat-<split>.arrow`."""
    root = tmp_path_factory.mktemp("hf")
    source = root / "src" / "tiny_chat"
    for subset, split, rows in [("a", "train", [{"text": f"a{i}"} for i in range(5)]),
                                ("a", "test", [{"text": "a-test"}]),
                                ("b", "train", [{"instruction": "say b", "output": "b"}])]:
        (source / subset).mkdir(parents=True, exist_ok=True)
        write_jsonl(source / subset / f"{split}.jsonl", rows)
    (source / "README.md").write_text("---\nconfigs:\n"
                                      "- config_name: a\n  data_files:\n"
                                      "  - split: train\n    path: a/train.jsonl\n"
                                      "  - split: test\n    path: a/test.jsonl\n"
                                      "- config_name: b\n  data_files:\n"
                                      "  - split: train\n    path: b/train.jsonl\n---\n")
    cache = root / "cache"
    for subset in "ab":
        datasets.load_dataset_builder(str(source), subset, cache_dir=str(cache)).download_and_prepare()
    (cache / "tiny_chat").rename(cache / "user___tiny_chat")  # the name a Hub id's download has
    return cache


@pytest.fixture
def offline_cache(datasets_cache, monkeypatch):
    """The cache above as the default one, the hub NOT in offline mode, and every attempt to open a network
    connection recorded (the test fails if there is one)."""
    import socket

    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    yield datasets_cache
    assert attempts == []


def test_a_dataset_id_is_read_from_the_datasets_cache_offline(offline_cache, capfd):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("datasets").addHandler(handler)
    try:
        source = open_source("user/tiny_chat", subset="a")
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert capfd.readouterr().err == "" and records == []  # no progress bars or log lines
    assert rows_of(source) == [{"text": f"a{i}"} for i in range(5)]
    assert source.where(2) == "user/tiny_chat (subset a, split train) row 3"
    assert source.description == "user/tiny_chat (subset a, split train)"
    assert rows_of(open_source("user/tiny_chat", subset="a", split="test")) == [{"text": "a-test"}]
    assert rows_of(open_source("user/tiny_chat", subset="b")) == [{"instruction": "say b", "output": "b"}]
    assert os.environ.get("HF_HUB_OFFLINE") is None and not datasets.config.HF_HUB_OFFLINE  # put back


def test_a_dataset_ids_fingerprint_names_it_and_follows_its_cache_files(offline_cache):
    train = open_source("user/tiny_chat", subset="a").fingerprint()
    assert open_source("user/tiny_chat", subset="a").fingerprint() == train
    assert train["dataset"] == "user/tiny_chat" and train["subset"] == "a" and train["split"] == "train"
    assert json.loads(json.dumps(train)) == train
    assert open_source("user/tiny_chat", subset="a", split="test").fingerprint() != train
    assert open_source("user/tiny_chat", subset="b").fingerprint() != train


@pytest.mark.parametrize("spec, subset, split, detail", [
    ("user/missing", None, "train", "not in the datasets cache at {cache}"),
    ("user/tiny_chat", "c", "train", "Couldn't find cache for user/tiny_chat for config 'c'; Available configs in "
                                     "the cache: ['a', 'b']"),
    ("user/tiny_chat", "a", "validation", "Unknown split \"validation\". Should be one of ['train', 'test']."),
])
def test_a_dataset_id_that_is_not_cached_is_one_line(offline_cache, spec, subset, split, detail):
    with pytest.raises(DataError) as info:
        open_source(spec, subset=subset, split=split)
    assert str(info.value) == (f"{spec}: not a file, directory, glob or dataset in the HF datasets cache "
                               f"({detail.format(cache=offline_cache)})")


def test_a_dataset_id_with_several_cached_subsets_needs_one_named(offline_cache):
    with pytest.raises(DataError) as info:
        open_source("user/tiny_chat")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("user/tiny_chat: not a file, directory, glob or dataset in the HF datasets "
                                      "cache (There are multiple 'user/tiny_chat' configurations in the cache: ")
