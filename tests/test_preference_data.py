"""Preference data: the layouts of chosen/rejected pairs and their errors; a pair tokenized as two SFT examples (a
chat side training only its final reply), the batched path equal to the per-row reference; pairs dropped when a
side keeps no target; `PairRows`' layout of a step (a pair's two sequences in one group, slots 2k and 2k + 1,
packed or not); what a run loads, and the objective checked against the data."""

import json
import re
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import write_jsonl

from demo.tiny import save_tokenizer
from finetune.config import TrainConfig
from finetune.data.cache import cache_key
from finetune.data.layouts import DATA_FORMATS, PREFERENCE_LAYOUTS, canonical, detect, is_preference
from finetune.data.order import row_indices
from finetune.data.pair_filter import keep_pairs
from finetune.data.pairs import PairRows, first_fit_decreasing, needed_rows_per_group
from finetune.data.prepare import load_data
from finetune.data.reference import tokenize
from finetune.data.rows import DataError, Example
from finetune.data.sources import open_source
from finetune.data.workers import tokenize_to_store
from test_tokenization import merging_tokenizer  # a tokenizer whose chats take the reference path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny checkpoint's tokenizer (byte-level BPE, Llama 3's chat format), without building a checkpoint."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)


WORDS = "the quick brown fox jumps over a lazy dog 12345 ééé 漢字".split()


def words(n, offset=0):
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n))


def msg(role, content):
    return {"role": role, "content": content}


def where(i):
    return f"d.jsonl:{i + 1}"


# ---- layouts --------------------------------------------------------------------------------------------------

STRING_PAIR = {"prompt": "add 2 + 3 =", "chosen": " 5", "rejected": " 6"}
CHAT_PROMPT = [msg("system", "be brief"), msg("user", "reverse: a b"), msg("assistant", "b a"), msg("user", "again")]
CHAT_PAIR = {"prompt": CHAT_PROMPT, "chosen": [msg("assistant", "a b")], "rejected": "b a"}
CONVERSATION_PAIR = {"chosen": CHAT_PROMPT + [msg("assistant", "a b")],
                     "rejected": CHAT_PROMPT + [msg("assistant", "x")]}


# LLaMA-Factory's layouts of the pairs above: ShareGPT-style (`conversations` ending with the user's turn, each
# reply one {from, value} message, an optional `system` column) and Alpaca-style (strings).
SHAREGPT_PAIR = {"conversations": [{"from": "human", "value": "reverse: a b"}, {"from": "gpt", "value": "b a"},
                                   {"from": "human", "value": "again"}],
                 "chosen": {"from": "gpt", "value": "a b"}, "rejected": {"from": "gpt", "value": "b a"},
                 "system": "be brief"}
ALPACA_PAIR = {"instruction": "Add the numbers.", "input": "2 and 3", "chosen": " 5", "rejected": " 6"}


def test_the_preference_layouts_are_data_format_names():
    assert set(PREFERENCE_LAYOUTS) == {"preference", "preference-chat", "preference-conversations",
                                       "preference-sharegpt", "preference-alpaca"}
    assert all(name in DATA_FORMATS for name in PREFERENCE_LAYOUTS)
    assert all(is_preference(name) for name in PREFERENCE_LAYOUTS)
    assert not any(is_preference(name) for name in ("auto", "text", "prompt-completion", "messages", "sharegpt"))


@pytest.mark.parametrize("rows, layout, report", [
    ([STRING_PAIR], "preference", "3 pairs, layout preference (prompt, chosen, rejected)"),
    ([CHAT_PAIR | {"rejected": [msg("assistant", "b a")]}], "preference-chat",
     "3 pairs, layout preference-chat (prompt, chosen, rejected)"),
    ([CONVERSATION_PAIR], "preference-conversations", "3 pairs, layout preference-conversations (chosen, rejected)"),
    # a prompt text beside whole conversations (as UltraFeedback's binarized rows): the conversations hold it
    ([CONVERSATION_PAIR | {"prompt": "again"}], "preference-conversations",
     "3 pairs, layout preference-conversations (chosen, rejected); column prompt not used"),
    # LLaMA-Factory's: `conversations` with the replies (one message each), `instruction` with the replies
    ([SHAREGPT_PAIR], "preference-sharegpt", "3 pairs, layout preference-sharegpt (conversations, chosen, rejected, "
                                             "system)"),
    ([{k: v for k, v in SHAREGPT_PAIR.items() if k != "system"} | {"id": 1}], "preference-sharegpt",
     "3 pairs, layout preference-sharegpt (conversations, chosen, rejected); column id not used"),
    ([ALPACA_PAIR], "preference-alpaca", "3 pairs, layout preference-alpaca (instruction, input, chosen, rejected)"),
    ([ALPACA_PAIR | {"system": "s", "history": [["q", "a"]]}], "preference-alpaca",
     "3 pairs, layout preference-alpaca (instruction, input, chosen, rejected, system); column history not used"),
])
def test_auto_detects_the_preference_layouts_from_the_columns(tmp_path, rows, layout, report):
    source = open_source(str(write_jsonl(tmp_path / "d.jsonl", rows * 3)))
    detection = detect(source.dataset.column_names, source.description, features=source.dataset.features)
    assert detection.layout == layout and detection.report(3) == report
    for i, row in enumerate(source.dataset):
        assert set(canonical(row, detection.layout, source.where(i))) == {"chosen", "rejected"}


def test_columns_without_their_types_are_string_pairs_and_other_layouts_stay_as_they_were():
    assert detect(["prompt", "chosen", "rejected"], "d.jsonl").layout == "preference"
    assert detect(["chosen", "rejected", "id"], "d.jsonl").layout == "preference-conversations"
    # a column of another layout besides prompt: the data is not pairs
    assert detect(["prompt", "completion", "chosen", "rejected"], "d.jsonl").layout == "prompt-completion"
    assert detect(["text", "chosen", "rejected"], "d.jsonl").layout == "text"


def test_a_chosen_column_without_a_rejected_one_is_one_line():
    with pytest.raises(DataError) as info:
        detect(["prompt", "chosen"], "d.jsonl")
    assert str(info.value) == ("d.jsonl: columns prompt, chosen: a preference layout needs both a chosen and a "
                               "rejected reply per row, and there is no 'rejected' column; add it (or, to fine-tune "
                               "on one reply per prompt, name the columns prompt and completion)")


def test_columns_of_llama_factorys_pairs_without_types_are_its_layouts_and_an_sft_alpaca_stays_one():
    assert detect(["conversations", "chosen", "rejected"], "d.jsonl").layout == "preference-sharegpt"
    assert detect(["instruction", "input", "chosen", "rejected", "system"], "d.jsonl").layout == "preference-alpaca"
    assert detect(["instruction", "output", "chosen", "rejected"], "d.jsonl").layout == "alpaca"
    assert detect(["conversations", "instruction", "chosen", "rejected"], "d.jsonl").layout == "auto"
    with pytest.raises(DataError, match="there is no 'rejected' column"):
        detect(["conversations", "chosen"], "d.jsonl")


def test_a_named_preference_layout_needs_its_columns():
    assert detect(["prompt", "chosen", "rejected"], "d.jsonl", "preference-chat").layout == "preference-chat"
    with pytest.raises(DataError, match="^d.jsonl: --data-format preference needs the columns prompt, chosen, "
                                        "rejected; found columns chosen, rejected$"):
        detect(["chosen", "rejected"], "d.jsonl", "preference")
    assert detect(["conversations", "chosen", "rejected"], "d.jsonl",
                  "preference-sharegpt").layout == "preference-sharegpt"
    with pytest.raises(DataError, match="^d.jsonl: --data-format preference-alpaca needs the columns instruction, "
                                        "chosen, rejected; found columns input, chosen, rejected$"):
        detect(["input", "chosen", "rejected"], "d.jsonl", "preference-alpaca")


def test_pairs_become_two_canonical_rows():
    assert canonical(STRING_PAIR, "preference", "w") == {
        "chosen": {"prompt": "add 2 + 3 =", "completion": " 5"},
        "rejected": {"prompt": "add 2 + 3 =", "completion": " 6"}}
    assert canonical(CHAT_PAIR, "preference-chat", "w") == {
        "chosen": {"messages": CHAT_PROMPT + [msg("assistant", "a b")]},
        "rejected": {"messages": CHAT_PROMPT + [msg("assistant", "b a")]}}
    assert canonical(CONVERSATION_PAIR, "preference-conversations", "w") == {
        "chosen": {"messages": CONVERSATION_PAIR["chosen"]}, "rejected": {"messages": CONVERSATION_PAIR["rejected"]}}
    out = canonical(CHAT_PAIR, "preference-chat", "w")
    assert json.loads(json.dumps(out)) == out


@pytest.mark.parametrize("layout, row, message", [
    ("preference", {"prompt": "p", "chosen": "c"},
     "layout preference expects 'prompt', 'chosen' and 'rejected' strings; found prompt (str), chosen (str); every "
     "pair needs a chosen and a rejected reply: add the rejected reply or drop the row"),
    ("preference", {"prompt": "p", "chosen": "c", "rejected": None},
     "layout preference expects 'prompt', 'chosen' and 'rejected' strings; found prompt (str), chosen (str); every "
     "pair needs a chosen and a rejected reply: add the rejected reply or drop the row"),
    ("preference", {"prompt": "p", "chosen": "c", "rejected": 3},
     "layout preference expects 'prompt', 'chosen' and 'rejected' strings; found prompt (str), chosen (str), "
     "rejected (int); for chat rows use --data-format preference-chat (a messages prompt) or "
     "preference-conversations (whole conversations)"),
    ("preference-chat", {"prompt": CHAT_PROMPT, "chosen": "c", "rejected": 3},
     "layout preference-chat expects a 'prompt' messages list and 'chosen' and 'rejected' replies (a list holding "
     "one assistant message, or a string); found prompt (list), chosen (str), rejected (int); each value must be a "
     "string or a messages list"),
    ("preference-chat", {"prompt": CHAT_PROMPT, "chosen": [msg("user", "hi"), msg("assistant", "c")],
                         "rejected": "r"},
     "layout preference-chat expects 'chosen' to be the assistant reply (a list holding one assistant message, or "
     "a string); found a list of 2 messages with roles user, assistant; for whole conversations use --data-format "
     "preference-conversations"),
    ("preference-conversations", {"chosen": CONVERSATION_PAIR["chosen"]},
     "layout preference-conversations expects 'chosen' and 'rejected' conversations (messages lists); found chosen "
     "(list); every pair needs a chosen and a rejected reply: add the rejected reply or drop the row"),
    ("preference-conversations", {"chosen": [msg("user", "a"), msg("assistant", "b")],
                                  "rejected": [msg("user", "c"), msg("assistant", "b")]},
     "layout preference-conversations expects 'chosen' and 'rejected' to share their prompt turns (the same "
     "messages up to the reply); they differ from the first message"),
    ("preference-conversations", {"chosen": [msg("user", "a"), msg("assistant", "b"), msg("user", "more")],
                                  "rejected": [msg("user", "a"), msg("assistant", "c")]},
     "layout preference-conversations expects each conversation to end with one assistant reply after the 1 "
     "shared prompt messages; 'chosen' has assistant, user there"),
    ("preference-conversations", {"chosen": [msg("user", "a"), msg("assistant", "b")],
                                  "rejected": [msg("user", "a"), msg("assistant", "b")]},
     "layout preference-conversations expects each conversation to end with one assistant reply after the 2 "
     "shared prompt messages; 'chosen' has nothing there"),
])
def test_a_pair_that_does_not_fit_its_layout_is_one_line_with_the_fix(layout, row, message):
    with pytest.raises(DataError) as info:
        canonical(row, layout, "d.jsonl:4")
    assert str(info.value) == f"d.jsonl:4: {message}"


# ---- LLaMA-Factory's layouts -------------------------------------------------------------------------------------

LF_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def sharegpt_as_preference_chat(row):
    """A preference-sharegpt row written by hand in the preference-chat layout: the system column a system turn
    first, each {from, value} a {role, content}."""
    system = [msg("system", row["system"])] if row.get("system") else []
    prompt = system + [msg(LF_ROLES[t["from"]], t["value"]) for t in row["conversations"]]
    return {"prompt": prompt, **{key: [msg("assistant", row[key]["value"])] for key in ("chosen", "rejected")}}


def llama_factory_rows():
    """Rows of both of LLaMA-Factory's preference layouts (their demo set's shapes: one to several turns ending
    with the user's, a system turn in the conversation or a system column, or neither), whose sequences meet the
    seq_lens below in their prompt, their reply and at a turn's boundary."""
    sharegpt = []
    for n in (1, 4, 12, 30, 200):
        for m in (0, 1, 5, 14):
            for shape in range(3):
                turns = [{"from": "human", "value": words(n)}]
                if shape == 1:
                    turns = [{"from": "gpt" if k % 2 else "human", "value": words(k + 2, k)} for k in range(4)] + turns
                row = {"conversations": turns, "chosen": {"from": "gpt", "value": words(m, 5)},
                       "rejected": {"from": "gpt", "value": words(m + 3, 1)}}
                if shape == 2:
                    row["conversations"] = [{"from": "system", "value": words(6)}] + turns
                sharegpt.append(row | ({"system": words(4, 2)} if shape == 1 else {}))
    alpaca = [{"instruction": words(n), "input": words(k, 3) if k else None, "chosen": " " + words(m, 3),
               "rejected": words(m + 2, 5), **({"system": words(s, 1)} if s else {})}
              for n in (1, 7, 30) for k in (0, 5) for m in (0, 6, 40) for s in (0, 4)]
    return {"preference-sharegpt": sharegpt, "preference-alpaca": alpaca}


def test_llama_factory_pairs_become_two_canonical_rows():
    assert canonical(SHAREGPT_PAIR, "preference-sharegpt", "w") == canonical(CHAT_PAIR, "preference-chat", "w")
    assert canonical(SHAREGPT_PAIR, "preference-sharegpt", "w") == canonical(
        sharegpt_as_preference_chat(SHAREGPT_PAIR), "preference-chat", "w")
    stanford = ("Below is an instruction that describes a task, paired with an input that provides further "
                "context. Write a response that appropriately completes the request.\n\n### Instruction:\nAdd the "
                "numbers.\n\n### Input:\n2 and 3\n\n### Response:\n")
    assert canonical(ALPACA_PAIR, "preference-alpaca", "w") == {"chosen": {"prompt": stanford, "completion": " 5"},
                                                                "rejected": {"prompt": stanford, "completion": " 6"}}


@pytest.mark.parametrize("seq_len", [None, 16, 64])
def test_llama_factory_sharegpt_pairs_are_the_same_pairs_in_preference_chat_token_for_token(tmp_path, tokenizer,
                                                                                            seq_len):
    rows = llama_factory_rows()["preference-sharegpt"]
    (tmp_path / "lf").mkdir()
    (tmp_path / "chat").mkdir()
    store = tokenize_to_store(rows, tokenizer, seq_len, tmp_path / "lf", layout="preference-sharegpt", batch_rows=7)
    same = tokenize_to_store([sharegpt_as_preference_chat(row) for row in rows], tokenizer, seq_len,
                             tmp_path / "chat", layout="preference-chat", batch_rows=7)
    for name in ("ids", "trained", "starts"):
        np.testing.assert_array_equal(getattr(store, name), getattr(same, name), err_msg=name)
    assert_store_equals_reference(store, rows, "preference-sharegpt", tokenizer, seq_len)


@pytest.mark.parametrize("seq_len", [None, 16, 64, 200])
def test_llama_factory_alpaca_pairs_are_each_side_the_same_alpaca_row_token_for_token(tmp_path, tokenizer, seq_len):
    rows = llama_factory_rows()["preference-alpaca"]
    sft = [{k: v for k, v in row.items() if k not in ("chosen", "rejected")} | {"output": row[side]}
           for row in rows for side in ("chosen", "rejected")]
    (tmp_path / "pairs").mkdir()
    (tmp_path / "sft").mkdir()
    store = tokenize_to_store(rows, tokenizer, seq_len, tmp_path / "pairs", layout="preference-alpaca", batch_rows=7)
    sft_store = tokenize_to_store(sft, tokenizer, seq_len, tmp_path / "sft", layout="alpaca", batch_rows=7)
    for name in ("ids", "trained", "starts"):
        np.testing.assert_array_equal(getattr(store, name), getattr(sft_store, name), err_msg=name)
    assert_store_equals_reference(store, rows, "preference-alpaca", tokenizer, seq_len)


def lf_turn(speaker, value):
    return {"from": speaker, "value": value}


@pytest.mark.parametrize("row, message", [
    (SHAREGPT_PAIR | {"chosen": [lf_turn("gpt", "a b"), lf_turn("gpt", "b a")]},
     "layout preference-sharegpt expects 'chosen' to be one message {from, value} (the reply); found a list of 2 "
     "messages"),
    (SHAREGPT_PAIR | {"rejected": "b a"},
     "layout preference-sharegpt expects 'rejected' to be one message {from, value} (the reply); found str"),
    (SHAREGPT_PAIR | {"rejected": None},
     "layout preference-sharegpt expects a 'conversations' list and 'chosen' and 'rejected' replies (one message "
     "{from, value} each); found conversations (list), chosen (dict), system (str); every pair needs a chosen and "
     "a rejected reply: add the rejected reply or drop the row"),
    (SHAREGPT_PAIR | {"chosen": lf_turn("human", "a b")},
     "'chosen': expected 'from' gpt or assistant (the reply) and a string 'value'; found {'from': 'human', "
     "'value': 'a b'}"),
    (SHAREGPT_PAIR | {"conversations": [lf_turn("human", "hi"), lf_turn("observation", "42"), lf_turn("human", "ok")]},
     "conversations turn 2: expected 'from' (system, human, gpt, user or assistant) and a string 'value'; found "
     "{'from': 'observation', 'value': '42'}"),
    (SHAREGPT_PAIR | {"conversations": [lf_turn("human", "hi"), lf_turn("gpt", "yo")]},
     "layout preference-sharegpt expects 'conversations' to end with a user turn (the prompt the replies answer); "
     "it ends with an assistant turn"),
    ({"conversations": [], "chosen": SHAREGPT_PAIR["chosen"], "rejected": SHAREGPT_PAIR["rejected"]},
     "layout preference-sharegpt expects 'conversations' to end with a user turn (the prompt the replies answer); "
     "it has no user turn"),
    ({"instruction": "i", "chosen": "c"},
     "layout preference-alpaca expects 'instruction', 'chosen' and 'rejected' strings and optional 'input' and "
     "'system' strings; found instruction (str), chosen (str); every pair needs a chosen and a rejected reply: add "
     "the rejected reply or drop the row"),
    ({"instruction": "i", "chosen": "c", "rejected": {"from": "gpt", "value": "r"}},
     "layout preference-alpaca expects 'instruction', 'chosen' and 'rejected' strings and optional 'input' and "
     "'system' strings; found instruction (str), chosen (str), rejected (dict); for replies given as messages use "
     "the layout preference-sharegpt (a 'conversations' prompt)"),
])
def test_a_llama_factory_pair_that_does_not_fit_its_layout_is_one_line(row, message):
    layout = "preference-sharegpt" if "conversations" in row else "preference-alpaca"
    with pytest.raises(DataError) as info:
        canonical(row, layout, "d.json row 4")
    assert str(info.value) == f"d.json row 4: {message}"


def test_llama_factorys_demo_file_shape_trains_under_dpo_and_a_bad_row_is_named(tmp_path, tokenizer, capsys):
    """A JSON array file as LLaMA-Factory ships its demo pairs (each reply a struct): detected, loaded as pairs; a
    bad row in it is one line naming the file and row."""
    rows = llama_factory_rows()["preference-sharegpt"][:24]
    data = tmp_path / "dpo_demo.json"
    data.write_text(json.dumps([{k: v for k, v in row.items() if k != "system"} for row in rows]))
    train, _ = load_data(config(data, tmp_path, seq_len=64), tokenizer)
    assert isinstance(train, PairRows) and len(train) == 24
    assert re.search(r"data: 24 pairs, layout preference-sharegpt \(conversations, chosen, rejected\); ",
                     capsys.readouterr().err)
    bad = [{k: v for k, v in row.items() if k != "system"} for row in rows]
    bad[9]["chosen"] = {"from": "human", "value": "x"}
    data.write_text(json.dumps(bad))
    with pytest.raises(DataError) as info:
        load_data(config(data, tmp_path, seq_len=64), tokenizer)
    assert str(info.value) == (f"{data} row 10: 'chosen': expected 'from' gpt or assistant (the reply) and a string "
                               "'value'; found {'from': 'human', 'value': 'x'}")


@pytest.mark.parametrize("bad, message", [
    ({"chosen": [lf_turn("gpt", "a b")]}, "layout preference-sharegpt expects 'chosen' to be one message {from, value} "
                                          "(the reply); found a list of 1 messages"),
    ({"rejected": None}, "every pair needs a chosen and a rejected reply: add the rejected reply or drop the row"),
    ({"conversations": [lf_turn("human", "hi"), lf_turn("function_call", "f()"), lf_turn("human", "ok")]},
     "conversations turn 2: expected 'from' (system, human, gpt, user or assistant) and a string 'value'; found "
     "{'from': 'function_call', 'value': 'f()'}"),
])
def test_a_bad_llama_factory_row_in_a_jsonl_file_is_named_by_its_line(tmp_path, tokenizer, bad, message):
    rows = [{k: v for k, v in row.items() if k != "system"} for row in llama_factory_rows()["preference-sharegpt"][:9]]
    rows[6] = {**rows[6], **bad}
    source = open_source(str(write_jsonl(tmp_path / "d.jsonl", rows)))
    layout = detect(source.dataset.column_names, source.description, features=source.dataset.features).layout
    assert layout == "preference-sharegpt"
    (tmp_path / "store").mkdir()
    with pytest.raises(DataError) as info:
        tokenize_to_store(source.dataset, tokenizer, 32, tmp_path / "store", layout=layout, where=source.where,
                          batch_rows=4)
    assert str(info.value).startswith(f"{tmp_path / 'd.jsonl'}:7: ") and str(info.value).endswith(message)
    assert "\n" not in str(info.value)


def test_llama_factorys_alpaca_pairs_load_under_dpo(tmp_path, tokenizer, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", llama_factory_rows()["preference-alpaca"])
    train, _ = load_data(config(data, tmp_path, seq_len=512), tokenizer)
    assert isinstance(train, PairRows) and len(train) == len(llama_factory_rows()["preference-alpaca"])
    assert "layout preference-alpaca (instruction, input, chosen, rejected, system); " in capsys.readouterr().err


def test_a_row_missing_its_rejected_reply_is_named_by_its_line(tmp_path, tokenizer):
    rows = [STRING_PAIR] * 5 + [{"prompt": "p", "chosen": "c"}] + [STRING_PAIR] * 3
    source = open_source(str(write_jsonl(tmp_path / "d.jsonl", rows)))
    (tmp_path / "store").mkdir()
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'd.jsonl'}:6: layout preference expects")):
        tokenize_to_store(source.dataset, tokenizer, 32, tmp_path / "store", layout="preference",
                          where=source.where, batch_rows=4)


# ---- tokenization -----------------------------------------------------------------------------------------------

def test_a_string_pair_is_two_prompt_completion_rows(tokenizer):
    pair = canonical(STRING_PAIR, "preference", "w")
    chosen, rejected = tokenize([("w", pair)], tokenizer)
    sft = tokenize([("w", {"prompt": "add 2 + 3 =", "completion": c}) for c in (" 5", " 6")], tokenizer)
    for got, want in zip((chosen, rejected), sft):
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.trained, want.trained)
    assert chosen.where == rejected.where == "w"


def test_a_chat_pair_trains_only_its_final_reply(tokenizer):
    """The ids of the SFT messages row of prompt + reply, and of its trained tokens only the final turn's: the
    reply's content and its end-of-turn token, after the rendering of the prompt with the generation prompt."""
    chosen, rejected = tokenize([("w", canonical(CHAT_PAIR, "preference-chat", "w"))], tokenizer)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    for got, reply in ((chosen, "a b"), (rejected, "b a")):
        (sft,) = tokenize([("w", {"messages": CHAT_PROMPT + [msg("assistant", reply)]})], tokenizer)
        np.testing.assert_array_equal(got.ids, sft.ids)
        prompt = tokenizer.apply_chat_template(CHAT_PROMPT, tokenize=True, add_generation_prompt=True)
        start = len(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)  # a BatchEncoding in transformers 5
        want = sft.trained.copy()
        want[:start] = False
        np.testing.assert_array_equal(got.trained, want)
        assert sft.trained[:start].any()  # SFT trains the earlier assistant turn; the pair does not
        assert got.ids[got.trained].tolist() == tokenizer.encode(reply, add_special_tokens=False) + [eot]


def pair_rows():
    """Raw rows of each preference layout whose sequences meet the seq_lens below in their prompt, their reply
    and at a turn's boundary; chats whose prompt is long enough that a cut one leaves the reply out."""
    strings = [{"prompt": words(n), "chosen": " " + words(m, 3), "rejected": words(m + 2, 5)}
               for n in (0, 2, 7, 13, 30) for m in (0, 1, 6, 15, 40)]
    chats = [{"prompt": ([msg("system", words(s))] if s else []) + [msg("user", words(n))]
              + ([msg("assistant", words(3)), msg("user", words(2, 4))] if n % 2 else []),
              "chosen": [msg("assistant", words(m, 5))], "rejected": words(m + 3, 1)}
             for n in (1, 4, 12, 30, 200) for m in (0, 1, 5, 14, 35) for s in (0, 6)]
    conversations = [{"chosen": [msg("user", words(n)), msg("assistant", words(2)), msg("user", words(3, n)),
                                 msg("assistant", words(m))],
                      "rejected": [msg("user", words(n)), msg("assistant", words(2)), msg("user", words(3, n)),
                                   msg("assistant", words(m + 4, 2))]}
                     for n in (1, 9, 25) for m in (1, 7, 30)]
    return {"preference": strings, "preference-chat": chats, "preference-conversations": conversations}


def assert_store_equals_reference(store, rows, layout, tokenizer, seq_len):
    reference = tokenize([(where(i), canonical(row, layout, where(i))) for i, row in enumerate(rows)], tokenizer,
                         seq_len)
    assert len(store) == len(reference) == 2 * len(rows)
    for e, expected in enumerate(reference):
        got = store.example(e)
        np.testing.assert_array_equal(got.ids, expected.ids, err_msg=f"ids of example {e}: {rows[e // 2]}")
        np.testing.assert_array_equal(got.trained, expected.trained, err_msg=f"trained of example {e}: {rows[e // 2]}")


@pytest.mark.parametrize("layout", ["preference", "preference-chat", "preference-conversations"])
@pytest.mark.parametrize("seq_len", [None, 8, 16, 33, 64])
def test_the_batched_path_equals_the_per_row_reference(tmp_path, tokenizer, layout, seq_len):
    rows = pair_rows()[layout]
    store = tokenize_to_store(rows, tokenizer, seq_len, tmp_path, layout=layout, batch_rows=7)
    assert_store_equals_reference(store, rows, layout, tokenizer, seq_len)
    assert store.meta["examples_per_row"] == 2 and store.meta["examples"] == 2 * len(rows)
    assert store.examples_per_row == 2
    assert store.meta["reference_path_rows"] == 0  # the tiny tokenizer's chats take the one-rendering path
    if seq_len is not None:
        assert (store.lengths() > seq_len).any() and (seq_len < 33 or (store.lengths() <= seq_len).any())


PIECES = list("ab 1\n\t.é漢") + ["<|eot_id|>", "<|start_header_id|>", "  ", "\n\n", " the", "fox"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
TURNS = st.lists(TEXT, min_size=1, max_size=5).filter(lambda turns: len(turns) % 2)
PAIRS = st.one_of(
    st.builds(lambda p, c, r: ("preference", {"prompt": p, "chosen": c, "rejected": r}), TEXT, TEXT, TEXT),
    st.builds(lambda turns, c, r: ("preference-chat", {
        "prompt": [msg("user" if k % 2 == 0 else "assistant", t) for k, t in enumerate(turns)],
        "chosen": [msg("assistant", c)], "rejected": r}), TURNS, TEXT, TEXT),
)


@settings(max_examples=40)
@given(pairs=st.lists(PAIRS, min_size=1, max_size=5), seq_len=st.one_of(st.none(), st.integers(1, 40)))
def test_random_pairs_equal_the_reference(tmp_path_factory, tokenizer, pairs, seq_len):
    layout = pairs[0][0]
    rows = [row for kind, row in pairs if kind == layout]
    store = tokenize_to_store(rows, tokenizer, seq_len, tmp_path_factory.mktemp("store"), layout=layout,
                              batch_rows=2)
    assert_store_equals_reference(store, rows, layout, tokenizer, seq_len)


def test_the_store_holds_chosen_then_rejected_and_an_sft_store_is_as_before(tmp_path, tokenizer):
    rows = pair_rows()["preference"][:4]
    sft = [{"prompt": row["prompt"], "completion": row[side]} for row in rows for side in ("chosen", "rejected")]
    (tmp_path / "pairs").mkdir()
    (tmp_path / "sft").mkdir()
    store = tokenize_to_store(rows, tokenizer, None, tmp_path / "pairs", layout="preference")
    sft_store = tokenize_to_store(sft, tokenizer, None, tmp_path / "sft")
    for name in ("ids", "trained", "starts"):
        np.testing.assert_array_equal(getattr(store, name), getattr(sft_store, name), err_msg=name)
    assert "examples_per_row" not in sft_store.meta and sft_store.examples_per_row == 1


@pytest.mark.parametrize("seq_len", [None, 12])
def test_chat_pairs_on_the_reference_path_equal_it(tmp_path, seq_len):
    tokenizer = merging_tokenizer()
    rows = pair_rows()["preference-chat"][:6]
    store = tokenize_to_store(rows, tokenizer, seq_len, tmp_path, layout="preference-chat")
    assert_store_equals_reference(store, rows, "preference-chat", tokenizer, seq_len)
    assert store.meta["reference_path_rows"] == 6


@pytest.mark.parametrize("workers", [1, 2])
def test_the_first_bad_pair_is_named(tmp_path, tokenizer, workers):
    """Rows 6 and 9 are bad, in different batches: the error names row 6, as the reference path words it."""
    rows = pair_rows()["preference-chat"][:12]
    rows[5] = {**rows[5], "prompt": [msg("assistant", "hi")] + rows[5]["prompt"]}
    rows[8] = {**rows[8], "prompt": [msg("user", 3)]}
    with pytest.raises(DataError) as info:
        tokenize_to_store(rows, tokenizer, 32, tmp_path, layout="preference-chat", where=where, workers=workers,
                          batch_rows=4)
    assert str(info.value) == ("d.jsonl:6: 'messages' starts with an assistant turn; expected a system or user turn "
                               "first")


def test_a_pair_that_is_not_two_rows_is_named_by_the_reference_path(tmp_path, tokenizer):
    rows = [canonical(STRING_PAIR, "preference", "w")] * 3 + [{"chosen": "x", "rejected": {"prompt": "p"}}]
    with pytest.raises(DataError, match=r"^d.jsonl:4: a preference pair expects exactly a 'chosen' and a 'rejected' "
                                        r"row; found keys \['chosen', 'rejected'\]$"):
        tokenize_to_store(rows, tokenizer, 16, tmp_path, layout="preference", canonical=lambda row, *_: row,
                          where=where)


def test_the_cache_key_tells_pairs_from_rows(tokenizer):
    keys = {layout: cache_key({"files": []}, tokenizer, layout, 32) for layout in ("prompt-completion", "preference")}
    assert keys["preference"] != keys["prompt-completion"] and keys["preference"]["layout"] == "preference"


# ---- which pairs train -----------------------------------------------------------------------------------------

def store_of(examples):
    """Examples as an in-memory store (ids, trained, starts)."""
    lengths = [len(e.ids) for e in examples]
    return types.SimpleNamespace(ids=np.concatenate([e.ids for e in examples]).astype(np.int32),
                                 trained=np.concatenate([e.trained for e in examples]).astype(bool),
                                 starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def example(prompt, reply, first=1):
    """`prompt` untrained tokens then `reply` trained ones."""
    n = prompt + reply
    return Example(np.arange(first, first + n, dtype=np.int32), np.arange(n) >= prompt)


def test_a_pair_with_a_side_left_without_targets_is_dropped_and_counted():
    T = 8
    store = store_of([example(2, 3), example(2, 4),  # pair 0: fits
                      example(3, 9), example(2, 2),  # pair 1: chosen cut, keeps targets
                      example(2, 2), example(8, 5),  # pair 2: rejected's prompt fills T: dropped
                      example(7, 1), example(2, 1),  # pair 3: chosen's one target is token 7 (its target, within T)
                      example(1, 0), example(1, 2)])  # pair 4: chosen has no reply at all: dropped
    kept, report = keep_pairs(store, np.arange(5), T, lambda p: f"d.jsonl:{p + 1}")
    np.testing.assert_array_equal(kept, [0, 1, 3])
    assert (report.pairs, report.kept, report.truncated, report.dropped) == (5, 3, 1, 2)
    assert report.warning() == ("1 of 5 pairs have a sequence longer than --seq-len 8, cut to it (first: d.jsonl:2); "
                                "2 of 5 pairs were dropped: their chosen or rejected sequence has no training target "
                                "within --seq-len 8 (first: d.jsonl:3)")
    kept, report = keep_pairs(store, np.array([2, 4]), T, lambda p: f"d.jsonl:{p + 1}")
    assert not kept.size
    with pytest.raises(DataError, match=r"^d.jsonl: no pair keeps a training target in both its chosen and rejected "
                                        r"sequences within --seq-len 8: all 2 were dropped \(first: d.jsonl:3\)"):
        report.require_pairs("d.jsonl")
    assert keep_pairs(store, np.arange(2), 64, str)[1].warning() is None


# ---- the rows of a step --------------------------------------------------------------------------------------

def random_pairs(n, seq_len, seed=0):
    """A store of n pairs, lengths 2 .. 2·seq_len, each side with a target within seq_len."""
    rng = np.random.default_rng(seed)
    examples, first = [], 1
    for _ in range(2 * n):
        length = int(rng.integers(2, 2 * seq_len + 1))
        trained = rng.random(length) < 0.5
        trained[int(rng.integers(1, min(length, seq_len)))] = True
        examples.append(Example(np.arange(first, first + length, dtype=np.int32), trained))
        first += length
    return store_of(examples)


def expected_slots(rows: PairRows, pairs_at):
    """(shard, micro-batch, slot, store example) of each sequence of a step whose positions hold `pairs_at`."""
    B, A, W, P = rows.batch_size, rows.grad_accum, rows.ways, rows.pairs_per_group
    out = []
    for j, p in enumerate(pairs_at):
        d, q = divmod(j, B // W)
        m, i = q % A, q // A
        if p >= 0:
            out += [(d, m, 2 * (d * P + i) + side, 2 * p + side) for side in (0, 1)]
    return out


def assert_step_layout(rows: PairRows, batch, pairs_at):
    """Every sequence of the step in its group's rows, once, contiguous, its tokens and trained targets the
    example's (cut to seq_len); padding has no slot; no other token."""
    store, T, A, W = rows.store, rows.seq_len, rows.grad_accum, rows.ways
    R = rows.rows_per_step
    assert batch["input_ids"].shape == (R, T) and all(v.shape == (R, T) for v in batch.values())
    assert batch["sequence"].dtype == np.int32
    np.testing.assert_array_equal(batch["sequence"] < 0, batch["segment_ids"] == 0)
    shard_of, micro_of = np.arange(R) // (R // W), np.arange(R) % A
    covered = np.zeros((R, T), bool)
    for d, m, slot, e in expected_slots(rows, pairs_at):
        micro = micro_of == m
        at = (batch["sequence"] == slot) & micro[:, None]
        (row,) = np.flatnonzero(at.any(axis=1))  # one row of the micro-batch holds it ...
        assert shard_of[row] == d  # ... a row of its own shard
        (cols,) = np.nonzero(at[row])
        ids, trained = store.ids[store.starts[e]:store.starts[e + 1]][:T], \
            store.trained[store.starts[e]:store.starts[e + 1]][:T]
        n = len(ids)
        np.testing.assert_array_equal(cols, cols[0] + np.arange(n))
        span = slice(cols[0], cols[0] + n)
        np.testing.assert_array_equal(batch["input_ids"][row, span], ids)
        np.testing.assert_array_equal(batch["positions"][row, span], np.arange(n))
        np.testing.assert_array_equal(batch["targets"][row, span][:-1], ids[1:])
        np.testing.assert_array_equal(batch["loss_mask"][row, span], np.append(trained[1:], False))
        assert batch["targets"][row, span][-1] == 0
        covered[row, span] = True
    np.testing.assert_array_equal(covered, batch["sequence"] >= 0)  # nothing but the step's sequences
    assert not batch["loss_mask"][~covered].any() and not batch["input_ids"][~covered].any()


def per_slot_tokens(rows: PairRows, batch):
    """{(micro-batch, slot): sorted (input_id, position, target, loss) tuples}."""
    micro = np.arange(rows.rows_per_step) % rows.grad_accum
    out = {}
    for r, t in zip(*np.nonzero(batch["sequence"] >= 0)):
        key = (micro[r], batch["sequence"][r, t])
        out.setdefault(key, []).append(tuple(int(batch[k][r, t]) for k in ("input_ids", "positions", "targets"))
                                       + (float(batch["loss_mask"][r, t]),))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("n, T, B, A, W", [(13, 16, 8, 2, 2), (5, 8, 4, 1, 1), (40, 32, 12, 3, 2), (3, 10, 6, 1, 3),
                                           (30, 24, 16, 4, 1), (9, 12, 8, 1, 8)])
def test_a_step_puts_each_pair_in_one_group_packed_or_not(n, T, B, A, W):
    store = random_pairs(n, T, seed=n)
    kept = np.arange(n)[::-1].copy()  # any kept pairs, in any order
    steps = {}
    for pack in (True, False):
        rows = PairRows.build(store, kept, T, pack=pack, batch_size=B, grad_accum=A, ways=W, seed=7)
        P = B // (A * W)
        assert rows.rows_per_step == A * W * rows.rows_per_group and len(rows) == n
        if pack:
            assert rows.rows_per_group == needed_rows_per_group(store, kept, T, pack=True, batch_size=B,
                                                                grad_accum=A, ways=W) <= 2 * P
        else:
            assert rows.rows_per_group == 2 * P and rows.rows_per_step == 2 * B
        for g in (0, 1, 5):
            batch = rows.take_step(g)
            assert_step_layout(rows, batch, kept[row_indices(n, 7, g, B)])
            steps[pack, g] = per_slot_tokens(rows, batch)
            per_shard = rows.rows_per_step // W
            for lo in range(0, rows.rows_per_step, per_shard):  # a process's shards alone: the same rows
                for hi in range(lo, rows.rows_per_step + 1, per_shard):
                    part = rows.take_step(g, lo, hi)
                    for name, whole in batch.items():
                        np.testing.assert_array_equal(part[name], whole[lo:hi], err_msg=name)
    for g in (0, 1, 5):
        assert steps[True, g] == steps[False, g]


def test_packing_saves_rows_when_sequences_are_short():
    store = random_pairs(50, 4)  # lengths up to 8, seq_len 64
    rows = PairRows.build(store, np.arange(50), 64, pack=True, batch_size=16)
    assert rows.rows_per_group < 32 and rows.rows_per_step == rows.rows_per_group
    assert_step_layout(rows, rows.take_step(3), row_indices(50, 0, 3, 16))


def test_a_group_holding_a_pair_twice_across_an_epoch_boundary_fits():
    """Three pairs, two a step: steps straddle epochs, and a group may hold the long pair twice. Counting each pair
    once, S = 12 + 12 + 2 + 2 would size a group at floor(2·28 / 20) + 1 = 3 rows; four sequences of 12 need 4."""
    store = store_of([example(1, 11), example(1, 11), example(1, 1), example(1, 1), example(1, 1), example(1, 1)])
    rows = PairRows.build(store, np.arange(3), 20, pack=True, batch_size=2)
    assert rows.rows_per_group == 4
    twice = 0
    for g in range(60):
        pairs_at = row_indices(3, 0, g, 2)
        twice += bool(pairs_at[0] == pairs_at[1] == 0)
        assert_step_layout(rows, rows.take_step(g), pairs_at)
    assert twice


def test_first_fit_decreasing_leaves_at_most_one_row_half_empty():
    rng = np.random.default_rng(1)
    for _ in range(200):
        T = int(rng.integers(1, 40))
        lengths = rng.integers(1, T + 1, int(rng.integers(1, 30)))
        rows, offsets = first_fit_decreasing(lengths, T)
        fill = np.bincount(rows, lengths)
        assert (fill <= T).all() and (fill * 2 <= T).sum() <= 1
        assert len(fill) <= 2 * lengths.sum() // T + 1
        for r in range(len(fill)):  # the segments of a row do not overlap
            ends = sorted(zip(offsets[rows == r], offsets[rows == r] + lengths[rows == r]))
            assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))


def test_evaluation_walks_every_pair_once_then_empty_pairs():
    store = random_pairs(11, 16, seed=3)
    kept = np.array([0, 2, 3, 5, 6, 7, 8, 9, 10])
    rows = PairRows.build(store, kept, 16, pack=True, batch_size=4, grad_accum=2, ways=2)
    assert rows.eval_steps == 3 and [rows.eval_pairs(g) for g in range(3)] == [4, 4, 1]
    for g in range(3):
        position = g * 4 + np.arange(4)
        pairs_at = np.where(position < len(kept), kept[np.minimum(position, len(kept) - 1)], -1)
        batch = rows.take_eval(g)
        assert_step_layout(rows, batch, pairs_at)
        half = rows.rows_per_step // 2
        np.testing.assert_array_equal(rows.take_eval(g, half, 2 * half)["sequence"], batch["sequence"][half:])
    assert set(np.unique(rows.take_eval(2)["sequence"])) == {-1, 0, 1}  # the last pair, then empty ones


@pytest.mark.parametrize("B, A, W", [(6, 4, 1), (8, 1, 3), (4, 2, 4)])
def test_a_batch_of_pairs_that_does_not_split_into_whole_groups_is_one_line(B, A, W):
    with pytest.raises(DataError) as info:
        PairRows.build(random_pairs(4, 8), np.arange(4), 8, pack=True, batch_size=B, grad_accum=A, ways=W)
    assert str(info.value) == (f"--batch-size {B} pairs must be a multiple of --grad-accum {A} x {W} batch shards "
                               f"(dp x fsdp) = {A * W}: each micro-batch of each shard holds whole pairs")


def test_a_process_asks_for_whole_shards():
    rows = PairRows.build(random_pairs(8, 8), np.arange(8), 8, pack=False, batch_size=4, ways=2)
    with pytest.raises(IndexError, match="whole shards"):
        rows.take_step(0, 1, 4)


# ---- what a run loads ----------------------------------------------------------------------------------------

def config(data, tmp_path, **kw):
    return TrainConfig(**{"model": "m", "data": str(data), "out": "o", "seq_len": 32, "batch_size": 4,
                          "progress": False, "data_cache": str(tmp_path / "cache"), "objective": "dpo", **kw})


def test_a_run_loads_pairs_as_pair_rows_with_one_summary_and_warning_line(tmp_path, tokenizer, capsys):
    rows = [{"prompt": f"add {i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2}"} for i in range(30)]
    rows[4] = {**rows[4], "chosen": " " + words(60)}  # cut to 32, kept
    rows[7] = {**rows[7], "prompt": words(60)}  # both replies past 32: dropped
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    for run in ("miss", "hit"):
        train, evaluation = load_data(config(data, tmp_path, eval_fraction=0.2), tokenizer, ways=2)
        assert isinstance(train, PairRows) and isinstance(evaluation, PairRows)
        assert len(train) + len(evaluation) == 29 and 7 not in train.pairs and 7 not in evaluation.pairs
        assert train.rows_per_group == evaluation.rows_per_group and train.ways == 2
        assert_step_layout(train, train.take_step(2), train.pairs[row_indices(len(train), 0, 2, 4)])
        warning, line = capsys.readouterr().err.splitlines()
        assert warning == (f"finetune-lora: warning: 1 of 30 pairs have a sequence longer than --seq-len 32, cut to "
                           f"it (first: {data}:5); 1 of 30 pairs were dropped: their chosen or rejected sequence has "
                           f"no training target within --seq-len 32 (first: {data}:8)")
        assert re.fullmatch(
            rf"finetune-lora: data: 30 pairs, layout preference \(prompt, chosen, rejected\); [\d.]+k? tokens -> "
            rf"{train.rows_per_step} packed rows of 32 per step of 4 pairs \(\+ {len(evaluation)} held-out pairs, "
            rf"\d+ steps\); 1 truncated, 1 dropped; cache {run} \(.*\); prepared in \d+\.\d s", line), line


def test_pairs_take_the_rows_of_the_per_row_path(tmp_path, tokenizer, capsys):
    rows = pair_rows()["preference-chat"][:16]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    train, _ = load_data(config(data, tmp_path, pack=False, seq_len=64, data_format="auto"), tokenizer)
    reference = tokenize([(where(i), canonical(row, "preference-chat", where(i))) for i, row in enumerate(rows)],
                         tokenizer, 64)
    for e, expected in enumerate(reference):
        got = train.store.example(e)
        np.testing.assert_array_equal(got.ids, expected.ids)
        np.testing.assert_array_equal(got.trained, expected.trained)
    assert "layout preference-chat" in capsys.readouterr().err


def test_sft_rows_under_a_preference_objective_and_pairs_under_sft_are_one_line(tmp_path, tokenizer):
    sft = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError) as info:
        load_data(config(sft, tmp_path), tokenizer)
    assert str(info.value) == (
        f"{sft}: --objective dpo trains on chosen/rejected pairs, but the rows are not pairs (layout "
        f"prompt-completion; columns prompt, completion) (first row: {sft}:1): give a preference layout (preference "
        "(prompt, chosen, rejected) | preference-chat (prompt (messages), chosen, rejected) | "
        "preference-conversations (chosen, rejected (whole conversations)) | preference-sharegpt (conversations, "
        "chosen, rejected (one message each), system (optional)) | preference-alpaca (instruction, input (optional), "
        "chosen, rejected, system (optional))) or use --objective sft")
    pairs = write_jsonl(tmp_path / "p.jsonl", [STRING_PAIR])
    with pytest.raises(DataError) as info:
        load_data(config(pairs, tmp_path, objective="sft"), tokenizer)
    assert str(info.value) == (
        f"{pairs}: the rows are preference pairs (layout preference) (first row: {pairs}:1), which --objective sft "
        "cannot train on: choose a preference objective (--objective dpo, ipo, simpo or orpo) or give rows of an "
        "SFT layout")
    with pytest.raises(DataError, match="--batch-size 4 pairs must be a multiple of --grad-accum 1 x 3 batch"):
        load_data(config(pairs, tmp_path), tokenizer, ways=3)
