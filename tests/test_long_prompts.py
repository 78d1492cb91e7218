"""Long prompts under --max-prompt-len: a prompt-completion prompt keeps BOS and its text's last tokens; a chat
keeps its system turn and headers, drops whole old turns, then the start of the oldest kept content, and is
rendered again; every reply token survives where the option is off it would be lost; the batched path equals the
per-row reference; the option keys the cache, the precomputed reference and --resume, and is off by default."""

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import write_jsonl

from finetune.config import ConfigFileError, TrainConfig
from finetune.data.cache import cache_key
from finetune.data.layouts import canonical
from finetune.data.prepare import load_data
from finetune.data.reference import tokenize
from finetune.data.workers import tokenize_to_store
from finetune.run.policy import IMMUTABLE
from test_tokenization import SWEEP, chat, merging_tokenizer, words


def msg(role, content):
    return {"role": role, "content": content}


def rendered(tokenizer, messages, generation_prompt=False):
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def only(rows, tokenizer, seq_len=None, max_prompt=None):
    (example,) = tokenize([("w", row) for row in rows], tokenizer, seq_len, max_prompt)
    return example


# ---- prompt-completion ---------------------------------------------------------------------------------------------

def test_a_long_prompt_keeps_bos_and_its_texts_last_tokens_and_every_completion_token(tokenizer):
    prompt, completion = words(300), " " + words(6, 3)
    example = only([{"prompt": prompt, "completion": completion}], tokenizer, 64, 20)
    tail = encode(tokenizer, prompt)[-19:]
    reply = encode(tokenizer, completion) + [tokenizer.eos_token_id]
    assert example.ids.tolist() == [tokenizer.bos_token_id] + tail + reply
    assert example.trained.tolist() == [False] * 20 + [True] * len(reply)
    assert example.prompt_cut
    # without the bound the same row is cut with its start at --seq-len: not one reply token is left
    uncut = only([{"prompt": prompt, "completion": completion}], tokenizer, 64)
    assert len(uncut.ids) > 64 and not uncut.trained[1:64].any() and not uncut.prompt_cut


@pytest.mark.parametrize("row", [{"prompt": words(12), "completion": " " + words(3)}, {"text": words(200)},
                                 chat(words(5), words(4), system=words(3))])
def test_a_prompt_within_the_bound_and_a_text_row_are_untouched(tokenizer, row):
    bounded, free = only([row], tokenizer, 64, 40), only([row], tokenizer, 64)
    np.testing.assert_array_equal(bounded.ids, free.ids)
    np.testing.assert_array_equal(bounded.trained, free.trained)
    assert not bounded.prompt_cut


def test_an_alpaca_row_is_bounded_as_its_prompt_completion_row(tokenizer):
    row = {"instruction": words(200), "input": words(30, 2), "output": "5"}
    alpaca = only([canonical(row, "alpaca", "w")], tokenizer, 64, 32)
    same = canonical(row, "alpaca", "w")
    assert alpaca.ids.tolist() == ([tokenizer.bos_token_id] + encode(tokenizer, same["prompt"])[-31:]
                                   + encode(tokenizer, "5") + [tokenizer.eos_token_id])
    assert alpaca.prompt_cut


# ---- chats ---------------------------------------------------------------------------------------------------------

SYSTEM = msg("system", "be brief")
OLD = [msg("user", words(80)), msg("assistant", words(40, 2)), msg("user", words(30, 4)), msg("assistant", "ok")]
LAST = msg("user", "reverse: a b")


def test_a_chat_drops_whole_old_turns_first_up_to_a_user_turn(tokenizer):
    """The pair's prompt: system, two old exchanges, the last question. Bounded to what the system turn, the
    newest old exchange and the question take, it is that chat, token for token."""
    reply = msg("assistant", "b a")
    keep = [SYSTEM] + OLD[2:] + [LAST]
    bound = len(rendered(tokenizer, keep, True))
    assert bound < len(rendered(tokenizer, [SYSTEM] + OLD + [LAST], True))
    pair = {"chosen": {"messages": [SYSTEM] + OLD + [LAST, reply]}, "rejected": {"messages": [SYSTEM] + OLD + [LAST, reply]}}
    chosen, _ = tokenize([("w", pair)], tokenizer, None, bound)
    want, _ = tokenize([("w", {"chosen": {"messages": keep + [reply]}, "rejected": {"messages": keep + [reply]}})],
                       tokenizer)
    np.testing.assert_array_equal(chosen.ids, want.ids)
    np.testing.assert_array_equal(chosen.trained, want.trained)
    assert chosen.prompt_cut and not want.prompt_cut


def test_then_the_start_of_the_oldest_kept_content_goes_and_the_prompt_is_rendered_again(tokenizer):
    """One long question: the system turn, BOS and the headers stay; the question keeps its end, as many
    characters as fit (one more does not); the reply is trained whole."""
    question = words(400)
    reply = msg("assistant", "the answer is fox")
    bound = 40
    chosen, rejected = tokenize([("w", {key: {"messages": [SYSTEM, msg("user", question), reply]}
                                        for key in ("chosen", "rejected")})], tokenizer, 64, bound)
    start = int(np.argmax(chosen.trained))
    assert start <= bound and chosen.prompt_cut
    assert chosen.ids[chosen.trained].tolist() == encode(tokenizer, "the answer is fox") + [
        tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    kept = next(c for c in range(len(question) + 1)
                if rendered(tokenizer, [SYSTEM, msg("user", question[len(question) - c:]), reply]) == chosen.ids.tolist())
    assert 0 < kept < len(question)

    def prompt_tokens(chars):
        return len(rendered(tokenizer, [SYSTEM, msg("user", question[len(question) - chars:])], True))

    assert prompt_tokens(kept) <= bound < prompt_tokens(kept + 1)
    head = rendered(tokenizer, [SYSTEM])
    assert chosen.ids[:len(head)].tolist() == head  # BOS and the system turn, whole
    np.testing.assert_array_equal(chosen.ids, rejected.ids)


def test_an_sft_chats_prompt_is_its_turns_before_the_first_assistant_turn(tokenizer):
    row = chat(words(300), words(5, 2), words(4), words(3, 1), system="be brief")
    example = only([row], tokenizer, 128, 30)
    messages = row["messages"]
    first = int(np.argmax(example.trained))
    assert first <= 30 and example.prompt_cut
    # every assistant turn's tokens (the second within --seq-len) are trained
    for turn in (messages[2], messages[4]):
        assert encode(tokenizer, turn["content"]) in [example.ids[i:i + len(encode(tokenizer, turn["content"]))]
                                                      .tolist() for i in range(len(example.ids))]
    assert len(only([row], tokenizer, 128).ids) == 129 and not only([row], tokenizer, 128).trained[1:128].any()


def test_a_prompt_whose_system_turn_alone_exceeds_the_bound_keeps_it_and_no_content(tokenizer):
    system = msg("system", words(60))
    example = only([{"messages": [system, msg("user", words(20)), msg("assistant", "ok")]}], tokenizer, None, 10)
    want = only([{"messages": [system, msg("user", ""), msg("assistant", "ok")]}], tokenizer)
    np.testing.assert_array_equal(example.ids, want.ids)
    np.testing.assert_array_equal(example.trained, want.trained)


# ---- the pair the option exists for ------------------------------------------------------------------------------

def lf_pair(question_words):
    """A LLaMA-Factory ShareGPT pair: two old exchanges, then a question of `question_words` words."""
    turns = [{"from": "human", "value": words(6)}, {"from": "gpt", "value": words(3, 1)},
             {"from": "human", "value": words(question_words, 3)}]
    return {"conversations": turns, "chosen": {"from": "gpt", "value": words(12, 2)},
            "rejected": {"from": "gpt", "value": words(9, 5)}, "system": "be brief"}


def config(data, tmp_path, **kw):
    return TrainConfig(**{"model": "m", "data": str(data), "out": "o", "seq_len": 128, "batch_size": 2,
                          "progress": False, "data_cache": str(tmp_path / "cache"), "objective": "dpo", **kw})


def test_a_long_prompt_pair_is_kept_with_every_reply_token_and_its_prompts_end(tmp_path, tokenizer, capsys):
    rows = [lf_pair(3), lf_pair(400), lf_pair(5), lf_pair(300)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    train, _ = load_data(config(data, tmp_path), tokenizer)
    assert train.pairs.tolist() == [0, 2]  # the long prompts fill --seq-len: no reply token left
    assert "2 dropped; cache miss" in capsys.readouterr().err
    train, _ = load_data(config(data, tmp_path, max_prompt_len=80), tokenizer)
    assert train.pairs.tolist() == [0, 1, 2, 3]
    line = capsys.readouterr().err.splitlines()[-1]
    assert re.search(rf"; 0 truncated, 0 dropped; 2 prompts cut to --max-prompt-len 80 \(first: {data}:2\); cache "
                     "miss", line), line
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    for p, row in enumerate(rows):
        for side, key in enumerate(("chosen", "rejected")):
            example = train.store.example(2 * p + side)
            assert example.ids[example.trained].tolist() == encode(tokenizer, row[key]["value"]) + [eot]
            question = encode(tokenizer, row["conversations"][-1]["value"])
            start = int(np.argmax(example.trained))
            turn = [msg("user", "x")]
            header = rendered(tokenizer, turn, True)[len(rendered(tokenizer, turn)):]  # the generation prompt
            prompt_end = example.ids[:start].tolist()
            assert prompt_end[-len(header):] == header and start <= 80
            # before it the question's end and its <|eot_id|>
            assert prompt_end[-len(header) - 1 - 3:-len(header)] == question[-3:] + [eot]


# ---- the batched path equals the reference ---------------------------------------------------------------------

PAIRS = [{"prompt": words(n), "chosen": " " + words(3), "rejected": words(4, 2)} for n in (2, 30, 200)]
CHAT_PAIRS = [{"chosen": {"messages": [SYSTEM] + OLD[:k] + [msg("user", words(n)), msg("assistant", "a b")]},
               "rejected": {"messages": [SYSTEM] + OLD[:k] + [msg("user", words(n)), msg("assistant", words(9))]}}
              for k in (0, 2, 4) for n in (3, 60, 500)]


def assert_store_equals_reference(store, rows, tokenizer, seq_len, max_prompt):
    reference = tokenize([(f"row {i + 1}", row) for i, row in enumerate(rows)], tokenizer, seq_len, max_prompt)
    assert len(store) == len(reference)
    for e, expected in enumerate(reference):
        got = store.example(e)
        np.testing.assert_array_equal(got.ids, expected.ids, err_msg=f"ids of example {e}")
        np.testing.assert_array_equal(got.trained, expected.trained, err_msg=f"trained of example {e}")
    per_row = len(reference) // len(rows)
    cut = [i for i in range(len(rows)) if any(e.prompt_cut for e in reference[per_row * i:per_row * (i + 1)])]
    assert store.meta["prompts_cut"] == len(cut) and store.meta["max_prompt_len"] == max_prompt
    assert store.meta["first_prompt_cut"] == (cut[0] if cut else None)


@pytest.mark.parametrize("seq_len, max_prompt", [(None, 12), (64, 12), (64, 40), (33, 20), (16, 8)])
def test_the_batched_path_equals_the_reference_with_a_bound(tmp_path, tokenizer, seq_len, max_prompt):
    (tmp_path / "sft").mkdir()
    (tmp_path / "pairs").mkdir()
    sft = tokenize_to_store(SWEEP, tokenizer, seq_len, tmp_path / "sft", batch_rows=7, max_prompt=max_prompt)
    assert_store_equals_reference(sft, SWEEP, tokenizer, seq_len, max_prompt)
    assert 0 < sft.meta["prompts_cut"] < len(SWEEP)
    # only the chats whose prompt is cut take the reference path
    assert sft.meta["reference_path_rows"] <= sft.meta["prompts_cut"]
    rows = [canonical(row, "preference", "w") for row in PAIRS] + CHAT_PAIRS
    pairs = tokenize_to_store(rows, tokenizer, seq_len, tmp_path / "pairs", layout="preference", batch_rows=4,
                              canonical=lambda row, *_: row, max_prompt=max_prompt)
    assert_store_equals_reference(pairs, rows, tokenizer, seq_len, max_prompt)


def test_chats_on_the_reference_path_are_bounded_as_it_bounds_them(tmp_path):
    tokenizer = merging_tokenizer()
    store = tokenize_to_store(CHAT_PAIRS, tokenizer, 64, tmp_path, layout="preference", batch_rows=4,
                              canonical=lambda row, *_: row, max_prompt=30)
    assert_store_equals_reference(store, CHAT_PAIRS, tokenizer, 64, 30)
    assert store.meta["reference_path_rows"] == len(CHAT_PAIRS) and store.meta["prompts_cut"] > 0


PIECES = list("ab 1\n\t.é漢") + ["<|eot_id|>", "<|start_header_id|>", "  ", "\n\n", " the", "fox"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)
ROWS = st.one_of(
    st.builds(lambda p, c: {"prompt": p, "completion": c}, TEXT, TEXT),
    st.builds(lambda turns, system: chat(*turns, system=system),
              st.lists(TEXT, min_size=2, max_size=6).filter(lambda turns: len(turns) % 2 == 0),
              st.one_of(st.none(), TEXT.filter(bool))),
)


@settings(max_examples=40)
@given(rows=st.lists(ROWS, min_size=1, max_size=5), seq_len=st.one_of(st.none(), st.integers(12, 40)),
       max_prompt=st.integers(1, 11))
def test_random_rows_equal_the_reference_with_a_bound(tmp_path_factory, tokenizer, rows, seq_len, max_prompt):
    store = tokenize_to_store(rows, tokenizer, seq_len, tmp_path_factory.mktemp("store"), batch_rows=2,
                              max_prompt=max_prompt)
    assert_store_equals_reference(store, rows, tokenizer, seq_len, max_prompt)


# ---- the option ----------------------------------------------------------------------------------------------------

def test_the_option_is_off_by_default_and_below_seq_len():
    assert TrainConfig().max_prompt_len == 0
    TrainConfig(model="m", data="d", out="o", seq_len=64, max_prompt_len=63).validate()
    with pytest.raises(ConfigFileError, match="^--max-prompt-len 64 must be below --seq-len 64: the reply needs room "
                                              "after the prompt$"):
        TrainConfig(model="m", data="d", out="o", seq_len=64, max_prompt_len=64).validate()
    with pytest.raises(ConfigFileError, match="^--max-prompt-len must be 0 or a positive integer, got -1$"):
        TrainConfig(model="m", data="d", out="o", max_prompt_len=-1).validate()


def test_it_keys_the_cache_only_when_set_and_a_resume_cannot_change_it(tokenizer):
    plain = cache_key({"files": []}, tokenizer, "preference", 64)
    assert cache_key({"files": []}, tokenizer, "preference", 64, max_prompt=None) == plain
    assert "max_prompt_len" not in plain  # entries built before the option keep their keys
    assert cache_key({"files": []}, tokenizer, "preference", 64, max_prompt=32)["max_prompt_len"] == 32
    assert "max_prompt_len" in IMMUTABLE


def test_a_run_recorded_before_the_option_resumes_with_it_off(tmp_path):
    """A run_config.json without the option reads as the option off: a resume without it changes nothing."""
    import dataclasses

    from finetune.run.policy import compare
    from finetune.run.reading import read_run_config

    config = TrainConfig(model="m", data="d", out="o")
    recorded = dataclasses.asdict(config)
    del recorded["max_prompt_len"]
    (tmp_path / "run_config.json").write_text(json.dumps(recorded))
    assert compare(read_run_config(tmp_path), config) == ({}, {})
    refused, _ = compare(read_run_config(tmp_path), dataclasses.replace(config, max_prompt_len=64))
    assert refused == {"max_prompt_len": (0, 64)}


def test_it_keys_the_precomputed_reference_only_when_set(tmp_path):
    from finetune.data.reference_logps import reference_key

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "jax_checkpoint.json"):
        (model / name).write_text(json.dumps({}))
    base = dict(model=str(model), data="d", out="o", objective="dpo", seq_len=64)
    plain = reference_key(TrainConfig(**base), "sha256:0")
    assert "max_prompt_len" not in plain
    assert reference_key(TrainConfig(**base, max_prompt_len=0), "sha256:0") == plain
    assert reference_key(TrainConfig(**base, max_prompt_len=32), "sha256:0") == {**plain, "max_prompt_len": 32}
