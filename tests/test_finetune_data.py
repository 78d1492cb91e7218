"""The data pipeline: row formats and their loss masks, packing without leakage, order, bad rows."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import write_jsonl

from finetune.config import TrainConfig
from finetune.data.order import row_indices
from finetune.data.reference import build_rows, read_rows, tokenize
from finetune.data.rows import DataError, Example
from finetune.data.prepare import load_data
from jaxmodel import load_pretrained



def test_prompt_tokens_are_not_trained(tmp_path, tokenizer):
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "add 2 + 3 =", "completion": " 5"}]))
    (example,) = tokenize(rows, tokenizer)
    prompt_len = 1 + len(tokenizer.encode("add 2 + 3 =", add_special_tokens=False))
    assert not example.trained[:prompt_len].any() and example.trained[prompt_len:].all()
    assert example.ids[-1] == tokenizer.eos_token_id


def test_chat_rows_train_exactly_each_assistant_turns_content_and_its_eot(tmp_path, tokenizer):
    """Trained tokens are each assistant turn's content tokens and the `<|eot_id|>` closing it; the header
    (`<|start_header_id|>assistant<|end_header_id|>\\n\\n`), the system and user turns and BOS are not."""
    messages = [{"role": "system", "content": "answer the question"}, {"role": "user", "content": "reverse: a b"},
                {"role": "assistant", "content": "b a"}, {"role": "user", "content": "again"},
                {"role": "assistant", "content": "a b"}]
    (example,) = tokenize(read_rows(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])), tokenizer)

    # The expected ids and mask built piece by piece from demo/tiny.py's template, independently of the
    # prefix renderings the data path uses.
    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    ids, trained, headers = [tokenizer.bos_token_id], [False], []
    for m in messages:
        header = encode(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n")
        body = encode(m["content"]) + [eot]
        if m["role"] == "assistant":
            headers.append(range(len(ids), len(ids) + len(header)))
        ids += header + body
        trained += [False] * len(header) + [m["role"] == "assistant"] * len(body)
    assert example.ids.tolist() == ids
    np.testing.assert_array_equal(example.trained, trained)
    # spelled out: both assistant headers (start, "assistant", end, two newlines) are untrained
    assert [len(h) for h in headers] == [5, 5] and not any(example.trained[i] for h in headers for i in h)
    assert example.ids[example.trained].tolist() == encode("b a") + [eot] + encode("a b") + [eot]


def test_text_rows_train_everything(tmp_path, tokenizer):
    (example,) = tokenize(read_rows(write_jsonl(tmp_path / "t.jsonl", [{"text": "the quick fox"}])), tokenizer)
    assert example.trained.all() and example.ids[0] == tokenizer.bos_token_id


def test_packing_keeps_documents_apart():
    a = Example(np.array([1, 2, 3], np.int32), np.array([False, True, True]))
    b = Example(np.array([4, 5], np.int32), np.array([True, True]))
    rows, truncated = build_rows([a, b], 8, pack=True)
    assert len(rows) == 1 and truncated == 0
    np.testing.assert_array_equal(rows.input_ids[0], [1, 2, 3, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(rows.segment_ids[0], [1, 1, 1, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(rows.positions[0], [0, 1, 2, 0, 1, 0, 0, 0])
    # targets never cross a document boundary: token 3 (end of a) predicts nothing
    np.testing.assert_array_equal(rows.targets[0][:5], [2, 3, 0, 5, 0])
    np.testing.assert_array_equal(rows.loss_mask[0], [1, 1, 0, 1, 0, 0, 0, 0])
    padded, _ = build_rows([a, b], 8, pack=False)
    assert len(padded) == 2 and padded.segment_ids[1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]


@pytest.mark.slow
def test_a_packed_document_sees_only_itself(tiny_converted):
    model = load_pretrained(tiny_converted)
    rng = np.random.default_rng(0)
    a, b = rng.integers(6, 512, 7), rng.integers(6, 512, 5)
    rows, _ = build_rows([Example(a.astype(np.int32), np.ones(7, bool)), Example(b.astype(np.int32), np.ones(5, bool))],
                         16, pack=True)
    packed = model(jnp.asarray(rows.input_ids), positions=jnp.asarray(rows.positions),
                   segment_ids=jnp.asarray(rows.segment_ids))
    alone = model(jnp.asarray(b[None]))
    np.testing.assert_allclose(np.asarray(packed[0, 7:12]), np.asarray(alone[0]), atol=1e-5)


def test_long_examples_are_truncated_and_counted():
    rows, truncated = build_rows([Example(np.arange(10, dtype=np.int32), np.ones(10, bool))], 4, pack=True)
    assert truncated == 1 and rows.input_ids.tolist() == [[0, 1, 2, 3]]


def test_order_is_a_seeded_permutation_per_epoch():
    first = row_indices(10, seed=3, batch_index=0, batch_size=10)
    assert sorted(first) == list(range(10))
    assert np.array_equal(first, row_indices(10, seed=3, batch_index=0, batch_size=10))
    assert not np.array_equal(first, row_indices(10, seed=4, batch_index=0, batch_size=10))
    # a batch straddling two epochs; any slice of a batch equals that slice of the whole batch
    whole = row_indices(10, seed=3, batch_index=1, batch_size=8)
    np.testing.assert_array_equal(whole[2:6], row_indices(10, seed=3, batch_index=1, batch_size=8, start=2, stop=6))


@pytest.mark.parametrize("lines, message", [
    (['{"text": "ok"}', '{"text": "broken'], "d.jsonl:2: not valid JSON"),
    (['{"text": "ok"}', '', '[1, 2]'], "d.jsonl:3: expected a JSON object"),
    (['{"question": "no"}'], "d.jsonl:1: expected a 'text' string, 'prompt' and 'completion' strings, or a 'messages'"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], "d.jsonl:1: 'messages' has no assistant turn"),
    (['{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "a"}]}'],
     "d.jsonl:1: 'messages' starts with an assistant turn; expected a system or user turn first"),
    ([], "d.jsonl: no rows (the dataset is empty)"),
])
def test_bad_rows_are_named_with_their_line(tmp_path, tokenizer, lines, message):
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError) as info:
        tokenize(read_rows(path), tokenizer)
    assert message in str(info.value)


def test_other_file_formats_go_through_datasets(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}]))
    assert len(tokenize(read_rows(path), tokenizer)) == 2


# ---- the cached, batched path equals the per-row one -------------------------------------------------------

def mixed_rows():
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    rows = []
    for i in range(40):
        rows.append([{"text": f"the fox {i}" + (" " + long if i % 7 == 0 else "")},
                     {"prompt": f"add {i} + 1 =" + (" " + long if i % 9 == 0 else ""), "completion": f" {i + 1}"},
                     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"hi {i}"},
                                   {"role": "assistant", "content": "hello" + (" " + long if i % 5 == 0 else "")},
                                   {"role": "user", "content": "again"}, {"role": "assistant", "content": f"{i}"}]},
                     ][i % 3])
    return rows


@pytest.mark.parametrize("pack", [True, False])
def test_load_data_gives_the_rows_of_the_per_row_path(tmp_path, tokenizer, capsys, pack):
    """Training and held-out rows (--eval-fraction: the same rows held out) equal build_rows of the per-row
    tokenization, on a first run (tokenized now) and a second (from the cache)."""
    data = write_jsonl(tmp_path / "d.jsonl", mixed_rows())
    config = TrainConfig(model="m", data=str(data), out="o", seq_len=32, eval_fraction=0.25, pack=pack, batch_size=4,
                         progress=False, data_cache=str(tmp_path / "cache"))
    pairs = read_rows(data)
    order = np.random.default_rng(config.seed).permutation(len(pairs))
    n_eval = max(1, int(len(pairs) * config.eval_fraction))
    expected_train, _ = build_rows(tokenize([pairs[i] for i in sorted(order[n_eval:])], tokenizer, 32), 32, pack=pack)
    expected_eval, _ = build_rows(tokenize([pairs[i] for i in sorted(order[:n_eval])], tokenizer, 32), 32, pack=pack)
    for run in ("miss", "hit"):
        train, held_out = load_data(config, tokenizer)
        for rows, expected in ((train, expected_train), (held_out, expected_eval.padded_to_multiple(4))):
            taken = rows.take(np.arange(len(rows)))
            assert len(rows) == len(expected)
            for name in ("input_ids", "targets", "loss_mask", "segment_ids", "positions"):
                np.testing.assert_array_equal(taken[name], getattr(expected, name), err_msg=name)
        summary = capsys.readouterr().err.splitlines()[-1]
        assert summary.startswith("finetune-lora: data: 40 rows, ")
        assert f"; cache {run} ({tmp_path / 'cache'}/" in summary


def test_the_summary_line(tmp_path, tokenizer, capsys):
    data = write_jsonl(tmp_path / "d.jsonl",
                       [{"prompt": f"add {i} + 1 =", "completion": f" {i + 1}"} for i in range(30)])
    held_out = write_jsonl(tmp_path / "e.jsonl", [{"text": "the quick brown fox"}] * 3)
    config = TrainConfig(model="m", data=str(data), eval_data=str(held_out), out="o", seq_len=32, batch_size=4,
                         progress=False, data_cache=str(tmp_path / "cache"))
    train, evaluation = load_data(config, tokenizer)
    (line,) = capsys.readouterr().err.splitlines()
    tokens = sum(len(e.ids) for e in tokenize(read_rows(data), tokenizer))
    entry = {json.loads((e / "meta.json").read_text())["key"]["data"]["files"][0]["path"]: e
             for e in (tmp_path / "cache").iterdir() if e.is_dir()}
    line, seconds = line.rsplit("; ", 1)
    assert line == (f"finetune-lora: data: 30 rows, layout prompt-completion (prompt, completion); {tokens} tokens -> "
                    f"{len(train)} packed rows of 32 (+ 1 held out, from 3 rows); 0 truncated, 0 with no targets; "
                    f"cache miss ({entry[str(data)]}); --eval-data cache miss ({entry[str(held_out)]})")
    assert re.fullmatch(r"prepared in \d+\.\d s", seconds)
    assert len(evaluation) == 4  # one row, padded to a whole batch
