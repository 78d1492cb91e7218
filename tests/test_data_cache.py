"""The tokenized-data cache: a rerun reuses the entry; a changed row, tokenizer, sequence length or layout
builds another; a build that dies leaves nothing usable; processes sharing the directory build an entry once;
an entry's digest of its tokens is the same for the same tokens however they were built."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import write_jsonl

import finetune.data.cache
import finetune.data.workers
from finetune.data.rows import DataError
from finetune.data.cache import (DIGEST_FILE, cache_key, cache_root, cached_tokenization, key_name, load_tokenized,
                                 loaded_tokenizer_digest, tokens_digest)
from finetune.data.sources import open_source
from finetune.data.layouts import AUTO
from finetune.data.store import TokenizedData
from finetune.data.workers import tokenize_to_store

ROWS = [{"text": "the quick brown fox"}, {"prompt": "add 2 + 3 =", "completion": " 5"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


def load(data, tokenizer, cache, seq_len=32, layout=AUTO):
    return load_tokenized(open_source(str(data)), tokenizer, seq_len, layout, cache=str(cache))


def entries(cache):
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def test_a_rerun_hits_the_cache(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    first = load(data, tokenizer, tmp_path / "cache")
    again = load(data, tokenizer, tmp_path / "cache")
    assert (first.hit, again.hit) == (False, True) and first.directory == again.directory
    assert isinstance(again.data.ids, np.memmap)
    np.testing.assert_array_equal(first.data.ids, again.data.ids)
    assert entries(tmp_path / "cache") == [first.directory.name]


@pytest.mark.parametrize("edit", ["longer", "same size"])
def test_editing_one_row_misses(tmp_path, tokenizer, edit):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    first = load(data, tokenizer, tmp_path / "cache")
    stat = data.stat()
    rows = [dict(ROWS[0], text="the quick brown fox!" if edit == "longer" else "the quick brown box")] + ROWS[1:]
    write_jsonl(data, rows)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = load(data, tokenizer, tmp_path / "cache")
    assert not second.hit and second.directory != first.directory
    assert second.data.example(0).ids.tolist() != first.data.example(0).ids.tolist()


def copy_tokenizer(tiny_converted, out):
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_converted / name).exists():
            shutil.copy(tiny_converted / name, out / name)
    return out


def test_changing_the_tokenizer_misses(tmp_path, tiny_converted):
    from transformers import AutoTokenizer

    directory = copy_tokenizer(tiny_converted, tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    keys = {load(data, AutoTokenizer.from_pretrained(directory), tmp_path / "cache").directory}

    tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
    tokenizer_json["model"]["merges"] = tokenizer_json["model"]["merges"][:-1]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    keys.add(load(data, AutoTokenizer.from_pretrained(directory), tmp_path / "cache").directory)

    changed = AutoTokenizer.from_pretrained(directory)
    changed.chat_template = changed.chat_template.replace("\n\n", "\n")
    keys.add(load(data, changed, tmp_path / "cache").directory)
    assert len(keys) == 3


def test_a_tokenizer_loaded_from_a_directory_is_keyed_by_its_files_and_settings(tmp_path, tiny_converted):
    """`loaded_tokenizer_digest`: the same for a copy of the directory elsewhere; another for any file changed,
    a file added, or the chat template changed in memory."""
    from transformers import AutoTokenizer

    directory = copy_tokenizer(tiny_converted, tmp_path / "tok")
    (directory / "params").mkdir()  # a subdirectory (a checkpoint's weights) is not read
    (directory / "params" / "weights").write_bytes(b"0" * 100)

    def digest(path=directory):
        return loaded_tokenizer_digest(path, AutoTokenizer.from_pretrained(path))

    first = digest()
    assert digest(shutil.copytree(directory, tmp_path / "elsewhere")) == first
    (directory / "params" / "weights").write_bytes(b"1" * 100)
    assert digest() == first
    seen = {first}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        original = (directory / name).read_text()
        (directory / name).write_text(original.replace("\n", " ", 1))  # the same JSON and length, another byte
        seen.add(digest())
        (directory / name).write_text(original)
    (directory / "notes.txt").write_text("x")
    seen.add(digest())
    changed = AutoTokenizer.from_pretrained(directory)
    changed.chat_template = changed.chat_template.replace("\n\n", "\n")
    seen.add(loaded_tokenizer_digest(directory, changed))
    assert len(seen) == 5


def test_changing_seq_len_or_layout_misses(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "the quick brown fox"}, {"text": "jumps"}])
    runs = [load(data, tokenizer, tmp_path / "cache", seq_len, layout)
            for seq_len, layout in [(32, AUTO), (16, AUTO), (32, "text"), (32, AUTO)]]
    assert [run.hit for run in runs] == [False, False, False, True]
    assert len({run.directory for run in runs}) == 3


def test_a_build_that_fails_midway_leaves_no_entry(tmp_path, tokenizer, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS * 100)
    cache = tmp_path / "cache"
    appended = []

    def failing_append(self, values):
        appended.append(len(values))
        if len(appended) == 3:
            raise RuntimeError("disk full")
        original(self, values)

    original = finetune.data.store.NpyAppender.append
    monkeypatch.setattr(finetune.data.store.NpyAppender, "append", failing_append)
    with pytest.raises(RuntimeError, match="disk full"):
        load_tokenized(open_source(str(data)), tokenizer, 32, AUTO, cache=str(cache))
    assert entries(cache) == []  # neither an entry nor a temporary directory
    monkeypatch.undo()
    again = load(data, tokenizer, cache)
    assert not again.hit and len(again.data) == 300


SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from finetune.data.cache import cached_tokenization
    from finetune.data.workers import tokenize_to_store

    root, builds, pause = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])

    class Tok:  # enough of a tokenizer for text rows
        bos_token_id, eos_token_id, chat_template = 0, 1, None
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    def build(directory):
        with open(builds, "a") as f:
            f.write(f"{directory}\\n")
        (directory / "partial").write_text("x")
        time.sleep(pause)
        tokenize_to_store([{"text": "abc"}], Tok(), 8, directory)

    result = cached_tokenization(root, {"key": 1}, build)
    print(result.hit, result.directory, result.data.ids.tolist())
""")


def run_script(cache, builds, pause):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(cache), str(builds), str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_two_processes_build_one_entry(tmp_path):
    cache, builds = tmp_path / "cache", tmp_path / "builds.txt"
    processes = [run_script(cache, builds, 1.0) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [err for _, err in outputs]
    lines = sorted(out.strip() for out, _ in outputs)
    entry = cache / key_name({"key": 1})
    assert lines == [f"False {entry} [0, 97, 98, 99, 1]", f"True {entry} [0, 97, 98, 99, 1]"]
    assert len(builds.read_text().splitlines()) == 1
    assert entries(cache) == [entry.name]


@pytest.mark.slow
def test_a_killed_build_leaves_nothing_usable_and_is_cleared(tmp_path):
    cache, builds = tmp_path / "cache", tmp_path / "builds.txt"
    process = run_script(cache, builds, 60.0)
    deadline = time.monotonic() + 60
    while not (builds.exists() and builds.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate()
    (temporary,) = entries(cache)
    assert temporary.startswith(".") and "building" in temporary  # a half-written entry, under another name
    assert run_script(cache, builds, 0.0).communicate(timeout=120)[0].startswith("False ")
    assert entries(cache) == [key_name({"key": 1})]


def test_an_unwritable_cache_directory_is_one_line_naming_it(tmp_path):
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "cache"
    with pytest.raises(DataError) as info:
        cached_tokenization(root, {"key": 1}, lambda directory: None)
    assert str(info.value).startswith(f"{root}: cannot create or write the tokenized-data cache here (")
    assert "--data-cache" in str(info.value) and "\n" not in str(info.value)


def test_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "llama-jax" / "data"
    assert cache_root("~/elsewhere") == cache_root("~/elsewhere").expanduser()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "llama-jax" / "data"


def test_the_key_names_what_it_was_built_from(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cached = load(data, tokenizer, tmp_path / "cache")
    parts = cache_key(open_source(str(data)).fingerprint(), tokenizer, AUTO, 32)
    assert cached.directory.name == key_name(parts) and cached.data.meta["key"] == parts
    assert parts["data"]["files"][0]["path"] == str(data.resolve())


# ---- the digest of an entry's tokens ---------------------------------------------------------------------


def in_memory(ids, trained, starts) -> TokenizedData:
    return TokenizedData(Path("."), np.asarray(ids, np.int32), np.asarray(trained, bool), np.asarray(starts, np.int64),
                         {})


def test_the_digest_is_sha256_of_the_boundaries_ids_and_targets_in_chunks(monkeypatch):
    """Hashed a few elements at a time, it equals sha256 of each whole array after a line naming it."""
    rng = np.random.default_rng(0)
    starts = np.array([0, 3, 3, 10, 17])
    data = in_memory(rng.integers(0, 500, 17), rng.integers(0, 2, 17), starts)
    monkeypatch.setattr(finetune.data.cache, "HASH_CHUNK_BYTES", 8)
    whole = hashlib.sha256(b"starts <i8 5\n" + starts.astype("<i8").tobytes() + b"ids <i4 17\n"
                           + data.ids.astype("<i4").tobytes() + b"trained |b1 17\n" + data.trained.tobytes())
    assert tokens_digest(data) == f"sha256:{whole.hexdigest()}"


def test_the_digest_changes_with_any_token_target_or_boundary():
    ids, trained, starts = [5, 6, 7, 8, 9], [False, True, True, False, True], [0, 3, 5]
    digest = tokens_digest(in_memory(ids, trained, starts))
    assert tokens_digest(in_memory(ids, trained, starts)) == digest
    changed = {"a token": in_memory([5, 6, 7, 8, 10], trained, starts),
               "a target": in_memory(ids, [False, True, True, True, True], starts),
               "a boundary": in_memory(ids, trained, [0, 2, 5]),
               "an example more": in_memory(ids, trained, [0, 3, 5, 5])}
    digests = {what: tokens_digest(data) for what, data in changed.items()}
    assert len(set(digests.values()) | {digest}) == len(changed) + 1, digests


def test_the_same_tokens_have_the_same_digest_however_they_were_built(tmp_path, tokenizer):
    """1 or 2 tokenizing processes, a hit, another cache directory, the file touched or copied elsewhere."""
    data = write_jsonl(tmp_path / "d.jsonl", ROWS * 40)
    first = load(data, tokenizer, tmp_path / "cache")
    assert json.loads((first.directory / DIGEST_FILE).read_text()) == {"digest": first.digest}
    assert first.digest == tokens_digest(first.data)
    (tmp_path / "two").mkdir()
    two = tokenize_to_store(open_source(str(data)).dataset, tokenizer, 32, tmp_path / "two", workers=2,
                            batch_rows=16)
    np.testing.assert_array_equal(two.ids, first.data.ids)
    assert tokens_digest(two) == first.digest
    hit = load(data, tokenizer, tmp_path / "cache")
    elsewhere = load(data, tokenizer, tmp_path / "other-cache")
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1_000_000_000))
    touched = load(data, tokenizer, tmp_path / "cache")
    copied = load(shutil.copy(data, tmp_path / "copy.jsonl"), tokenizer, tmp_path / "cache")
    assert (hit.hit, elsewhere.hit, touched.hit, copied.hit) == (True, False, False, False)
    assert len({first.directory, touched.directory, copied.directory}) == 3
    assert {hit.digest, elsewhere.digest, touched.digest, copied.digest} == {first.digest}
    assert load(write_jsonl(data, ROWS * 40 + ROWS[:1]), tokenizer, tmp_path / "cache").digest != first.digest


def test_the_digest_is_computed_once_per_entry(tmp_path, tokenizer, monkeypatch):
    """At the build; a hit reads it. An entry without one (made by an older version) gets it at its next use."""
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    built = load(data, tokenizer, tmp_path / "cache")
    with monkeypatch.context() as m:
        m.setattr(finetune.data.cache, "tokens_digest", lambda data: pytest.fail("hashed on a hit"))
        assert load(data, tokenizer, tmp_path / "cache").digest == built.digest
    (built.directory / DIGEST_FILE).unlink()
    again = load(data, tokenizer, tmp_path / "cache")
    assert again.hit and again.digest == built.digest
    assert json.loads((built.directory / DIGEST_FILE).read_text()) == {"digest": built.digest}
