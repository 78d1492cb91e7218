"""What finetune-lora says about its data: truncation counted in one warning, targets lost to --seq-len,
giant rows tokenized only as far as --seq-len needs, and one-line errors for unreadable files, bad bytes and
rows that match more than one layout. Nothing is created in --out before any of these errors."""

import json
import zlib

import numpy as np
import pytest

from conftest import write_jsonl

from finetune.cli import main
from finetune.config import TrainConfig
from finetune.data.reference import build_rows, read_rows, tokenize
from finetune.data.rows import DataError
from finetune.data.prepare import load_data

# Two adapters per layer and no rematerialisation: the one run here compiles faster (what it checks does
# not depend on either).
@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    """Tokenized data is cached under the test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


FAST = ["--targets", "q_proj,v_proj", "--remat", "none", "--dtype", "float32", "--checkpoint-every", "100"]



def run_cli(tiny_converted, data, out, *extra):
    return main(["--model", str(tiny_converted), "--data", str(data), "--out", str(out), "--steps", "1",
                 "--batch-size", "8", "--seq-len", "32", "--no-progress", *FAST, *extra])


LONG_TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)  # ~180 tokens


def short(i):
    return {"prompt": f"add {i} + 1 =", "completion": f" {i + 1}"}


# ---- truncation and lost targets ----------------------------------------------------------------------

@pytest.mark.slow
def test_truncated_examples_and_lost_targets_are_counted_in_one_warning(tmp_path, tiny_converted, capsys, monkeypatch):
    import finetune.train.loop

    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)  # MFU is not under test
    data = write_jsonl(tmp_path / "d.jsonl", [short(1), short(2), {"text": LONG_TEXT}, short(3),
                                              {"prompt": LONG_TEXT, "completion": " yes"}, short(4),
                                              {"prompt": "q", "completion": LONG_TEXT},
                                              {"prompt": LONG_TEXT + " again", "completion": " no"}])
    assert run_cli(tiny_converted, data, tmp_path / "run") == 0
    captured = capsys.readouterr()
    warning, summary, adapter = captured.err.splitlines()  # no attention line: no kernel was weighed on a CPU
    assert warning == (
        f"finetune-lora: warning: 4 of 8 examples are longer than --seq-len 32 and were cut to it (first: {data}:3); "
        f"2 of them lost all their training targets (first: {data}:5)")
    assert summary.startswith("finetune-lora: data: 8 rows, ") and "; 4 truncated, 2 with no targets; " in summary
    assert adapter.startswith("finetune-lora: adapter: ") and " trainable parameters; " in adapter
    assert captured.out.startswith("trained 1 steps")


def test_nothing_is_reported_when_every_example_fits(tmp_path, tokenizer, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [short(i) for i in range(5)])
    load_data(TrainConfig(model="m", data=str(data), out=str(tmp_path / "run"), seq_len=32, progress=False), tokenizer)
    (summary,) = capsys.readouterr().err.splitlines()
    assert summary.startswith("finetune-lora: data: ") and "; 0 truncated, 0 with no targets; " in summary


def test_held_out_rows_are_counted_too(tmp_path, tokenizer, capsys):
    """--eval-data's examples are in the same one warning line."""
    data = write_jsonl(tmp_path / "d.jsonl", [short(i) for i in range(5)])
    held_out = write_jsonl(tmp_path / "e.jsonl", [short(9), {"text": LONG_TEXT}])
    load_data(TrainConfig(model="m", data=str(data), eval_data=str(held_out), out="o", seq_len=32, progress=False),
              tokenizer)
    assert capsys.readouterr().err.splitlines()[0] == (
        f"finetune-lora: warning: 1 of 7 examples are longer than --seq-len 32 and were cut to it "
        f"(first: {held_out}:2); 0 of them lost all their training targets")


@pytest.mark.parametrize("which", ["data", "eval-data"])
def test_data_whose_every_target_is_cut_off_is_an_error(tmp_path, tiny_converted, capsys, which):
    long_prompts = write_jsonl(tmp_path / "long.jsonl", [{"prompt": LONG_TEXT, "completion": " a"},
                                                         {"prompt": LONG_TEXT + " b", "completion": " b"}])
    fine = write_jsonl(tmp_path / "fine.jsonl", [short(i) for i in range(4)])
    data, extra = (long_prompts, []) if which == "data" else (fine, ["--eval-data", str(long_prompts)])
    out = tmp_path / "run"
    assert run_cli(tiny_converted, data, out, *extra) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"finetune-lora: error: {long_prompts}: no token of the data is a training target within --seq-len 32: "
        f"2 of 2 examples lost all their targets to truncation (first: {long_prompts}:1)"]
    assert not out.exists()


# ---- a giant row costs what --seq-len needs ------------------------------------------------------------

class RecordingTokenizer:
    """The tokenizer, recording how many characters each call is handed."""

    def __init__(self, tokenizer):
        self._tokenizer, self.seen = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text, **kw):
        self.seen.append(len(text))
        return self._tokenizer.encode(text, **kw)

    def __call__(self, texts, **kw):  # a batch
        self.seen.extend(len(text) for text in texts)
        return self._tokenizer(texts, **kw)

    def apply_chat_template(self, messages, **kw):
        self.seen.append(sum(len(m["content"]) for m in messages))
        return self._tokenizer.apply_chat_template(messages, **kw)


def assert_same_rows(taken, rows):
    """`taken` (a dict of arrays, from `take`) holds the same rows as `rows` (a finetune.data.reference.Rows)."""
    for name in ("input_ids", "targets", "loss_mask", "segment_ids", "positions"):
        np.testing.assert_array_equal(taken[name], getattr(rows, name), err_msg=name)


@pytest.mark.slow
def test_a_giant_row_is_tokenized_only_as_far_as_seq_len_needs(tmp_path, tokenizer):
    """A 2 MB line: the training rows equal those of the whole line tokenized, and the tokenizer is never
    handed more than a few thousand characters."""
    rng = np.random.default_rng(0)
    words = np.array("the quick brown fox 12345 jumps over lazy dog llama ééé 漢字 \n\n".split(" "))
    giant = " ".join(rng.choice(words, 450_000))
    assert len(giant) > 2_000_000
    data = write_jsonl(tmp_path / "d.jsonl", [short(1), {"text": giant}, {"prompt": giant, "completion": " x"},
                                              short(2)])
    config = TrainConfig(model="m", data=str(data), out="o", seq_len=64, progress=False)
    recording = RecordingTokenizer(tokenizer)
    train, _ = load_data(config, recording)
    assert max(recording.seen) < 5_000
    uncapped, _ = build_rows(tokenize(read_rows(data), tokenizer), 64, pack=True)
    assert_same_rows(train.take(np.arange(len(train))), uncapped)


CUTS = {  # texts a tokenizer may merge across a cut in different ways
    "words": " ".join(["the quick brown fox jumps over the lazy dog"] * 3000),
    "one letter": "a" * 100_000,
    "spaces": "x" + " " * 100_000 + "y",
    "digits": "1234567890" * 10_000,
    "newlines": "the\n\n\n" * 20_000,
    "cjk": "漢字かな交じり文" * 12_000,
    "accents": "e\u0301" * 50_000,
    "specials": "<|eot_id|>a<|start_header_id|>" * 4_000,
}


@pytest.mark.parametrize("kind", CUTS)
@pytest.mark.parametrize("seq_len", [16, 257])
def test_capped_rows_equal_the_first_tokens_of_the_whole_row(tokenizer, kind, seq_len):
    text = CUTS[kind]
    rows = [("d.jsonl:1", {"text": text}), ("d.jsonl:2", {"prompt": text, "completion": "x"}),
            ("d.jsonl:3", {"prompt": "p", "completion": text})]
    recording = RecordingTokenizer(tokenizer)
    capped = tokenize(rows, recording, seq_len)
    assert max(recording.seen) < len(text) // 4
    whole = tokenize(rows, tokenizer)
    for a, b in zip(capped, whole):
        assert len(a.ids) > seq_len
        np.testing.assert_array_equal(a.ids[:seq_len], b.ids[:seq_len])
        np.testing.assert_array_equal(a.trained[:seq_len], b.trained[:seq_len])


class WordTokenizer:
    """A tokenizer whose tokens near the end depend on what follows: a word followed by a space is one token, the
    text's last word one token per character (like a merge that needs the next character, reaching far back)."""

    bos_token_id, eos_token_id, chat_template = 0, 1, None

    def __init__(self):
        self.seen = []

    def encode(self, text, add_special_tokens=False):
        self.seen.append(len(text))
        *words, last = text.split(" ")
        return [1000 + zlib.crc32(w.encode()) % 100_000 for w in words] + [ord(c) for c in last]


def test_tokens_near_a_cut_are_dropped_when_the_tokenizer_merges_across_it():
    text = " ".join(f"{i:030d}" for i in range(5000))  # 30-character words, one token each
    rows = [("d.jsonl:1", {"text": text})]
    tokenizer = WordTokenizer()
    (capped,) = tokenize(rows, tokenizer, 16)
    assert max(tokenizer.seen) < len(text) // 10
    (whole,) = tokenize(rows, WordTokenizer())
    np.testing.assert_array_equal(capped.ids[:16], whole.ids[:16])


@pytest.mark.parametrize("conversation", [
    [{"role": "user", "content": CUTS["words"]}, {"role": "assistant", "content": "ok"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": CUTS["words"]}],
    [{"role": "system", "content": "be brief"}]
    + [{"role": r, "content": "the fox"} for r in ["user", "assistant"]] * 200,
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 300,
], ids=["long user turn", "long assistant turn", "many turns", "many tiny turns"])
@pytest.mark.slow
def test_capped_chats_equal_the_first_tokens_of_the_whole_chat(tokenizer, conversation):
    rows = [("c.jsonl:1", {"messages": conversation})]
    recording = RecordingTokenizer(tokenizer)
    (capped,) = tokenize(rows, recording, 64)
    assert max(recording.seen) < 10_000
    (whole,) = tokenize(rows, tokenizer)
    assert len(capped.ids) > 64
    np.testing.assert_array_equal(capped.ids[:64], whole.ids[:64])
    np.testing.assert_array_equal(capped.trained[:64], whole.trained[:64])


# ---- unreadable files and bad bytes --------------------------------------------------------------------

def test_bytes_that_are_not_utf8_are_named_with_their_line(tmp_path, tiny_converted, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    out = tmp_path / "run"
    assert run_cli(tiny_converted, data, out) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"finetune-lora: error: {data}:2: not valid UTF-8 (byte 0xe9 at column 14)"]
    assert not out.exists()


def test_a_zero_byte_parquet_file_is_one_line(tmp_path, tiny_converted, capsys):
    data = tmp_path / "d.parquet"
    data.write_bytes(b"")
    out = tmp_path / "run"
    assert run_cli(tiny_converted, data, out) == 1
    assert capsys.readouterr().err.splitlines() == [f"finetune-lora: error: {data}: no rows (the dataset is empty)"]
    assert not out.exists()


@pytest.mark.parametrize("name, content, kind", [
    ("d.csv", b'text\n"the quick\n', "csv"),
    ("d.parquet", b"PAR1 not really", "parquet"),
    ("d.json", b'[{"text": "a"', "json"),
])
def test_an_unreadable_data_file_is_one_line_naming_it(tmp_path, tiny_converted, capsys, name, content, kind):
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "run"
    assert run_cli(tiny_converted, data, out) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"finetune-lora: error: {data}: not a readable {kind} file (") and line.endswith(")")
    assert not out.exists()


# ---- one layout per row ------------------------------------------------------------------------------

@pytest.mark.parametrize("row, keys", [
    ({"text": "a", "prompt": "b", "completion": "c"}, "text, prompt, completion"),
    ({"text": "a", "prompt": "b"}, "text, prompt"),
    ({"messages": [{"role": "assistant", "content": "x"}], "text": "a"}, "text, messages"),
    ({"prompt": "b", "completion": "c", "messages": []}, "prompt, completion, messages"),
])
def test_a_row_matching_two_layouts_is_an_error(tmp_path, tokenizer, row, keys):
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, row]))
    with pytest.raises(DataError) as info:
        tokenize(rows, tokenizer)
    assert str(info.value) == (f"{tmp_path / 'd.jsonl'}:2: keys {keys}: expected exactly one of the layouts "
                               "text | prompt+completion | messages")


def test_a_row_matching_two_layouts_stops_the_cli(tmp_path, tiny_converted, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [short(1), {"text": "a", "prompt": "b", "completion": "c"}])
    out = tmp_path / "run"
    assert run_cli(tiny_converted, data, out) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"finetune-lora: error: {data}:2: keys text, prompt, completion match several layouts "
        "(text | prompt-completion); choose one with --data-format"]
    assert not out.exists()


def test_columns_a_table_fills_with_nulls_are_not_a_second_layout(tmp_path, tokenizer):
    """A .json file mixing layouts row by row: `datasets` gives every row every column, None where absent."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "the fox"}, {"prompt": "add 1 + 1 =", "completion": " 2"}]))
    text, pair = tokenize(read_rows(path), tokenizer)
    assert text.trained.all() and not pair.trained.all()
