"""Row layouts: text, prompt-completion, messages, alpaca and sharegpt rows mapped to the three forms the
tokenizer takes; `auto` detected from the columns (and per row where several layouts share a dataset); rows
that match several layouts or none are one line."""

import json

import datasets
import numpy as np
import pytest

from conftest import write_jsonl

from finetune.data.reference import read_rows, tokenize

from finetune.data.rows import DataError
from finetune.data.sources import open_source
from finetune.data.layouts import DATA_FORMATS, LAYOUTS, canonical, detect

ACCEPTED = ("text (text) | prompt-completion (prompt, completion) | messages (messages) | "
            "alpaca (instruction, input (optional), output, system (optional)) | "
            "sharegpt (conversations, system (optional))")


def test_the_layouts_are_the_data_format_choices():
    import typing

    from finetune.config import TrainConfig

    choices = typing.get_args(typing.get_type_hints(TrainConfig)["data_format"])
    assert list(choices) == list(DATA_FORMATS)


# ---- alpaca ------------------------------------------------------------------------------------------

def test_alpaca_rows_render_the_stanford_alpaca_prompt():
    row = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    assert canonical(row, "alpaca", "w") == {
        "prompt": "Below is an instruction that describes a task, paired with an input that provides further context. "
                  "Write a response that appropriately completes the request.\n\n"
                  "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n",
        "completion": "5"}
    without_input = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                     "the request.\n\n### Instruction:\nName a colour.\n\n### Response:\n")
    for row in [{"instruction": "Name a colour.", "output": "red"},
                {"instruction": "Name a colour.", "input": "", "output": "red"},
                {"instruction": "Name a colour.", "input": None, "output": "red"}]:
        assert canonical(row, "alpaca", "w") == {"prompt": without_input, "completion": "red"}


def test_an_alpaca_system_column_takes_the_place_of_the_templates_first_paragraph():
    """The Stanford template's opening sentence is its system prompt: a row's `system` replaces it, with or
    without an input; an empty or missing one keeps it."""
    row = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "system": "You add numbers."}
    assert canonical(row, "alpaca", "w")["prompt"] == ("You add numbers.\n\n### Instruction:\nAdd the numbers.\n\n"
                                                       "### Input:\n2 and 3\n\n### Response:\n")
    row = {"instruction": "Name a colour.", "output": "red", "system": "Answer in one word."}
    assert canonical(row, "alpaca", "w")["prompt"] == ("Answer in one word.\n\n### Instruction:\nName a colour.\n\n"
                                                       "### Response:\n")
    plain = canonical({"instruction": "Name a colour.", "output": "red"}, "alpaca", "w")
    for system in ("", None):
        assert canonical({"instruction": "Name a colour.", "output": "red", "system": system}, "alpaca", "w") == plain


def test_alpaca_trains_the_output_only(tokenizer):
    row = {"instruction": "Add the numbers.", "input": "2 and 3", "output": " 5 is the sum"}
    (example,) = tokenize([("w", canonical(row, "alpaca", "w"))], tokenizer)
    output = tokenizer.encode(" 5 is the sum", add_special_tokens=False) + [tokenizer.eos_token_id]
    np.testing.assert_array_equal(example.ids[example.trained], output)
    assert example.trained[-len(output):].all() and not example.trained[:-len(output)].any()


# ---- sharegpt ----------------------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 2 + 4?"},
        {"role": "assistant", "content": "6"}]


def sharegpt(messages, names=None):
    names = names or {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


def test_sharegpt_rows_become_messages():
    assert canonical(sharegpt(CHAT), "sharegpt", "w") == {"messages": CHAT}
    same_names = {"system": "system", "user": "user", "assistant": "assistant"}
    assert canonical(sharegpt(CHAT, same_names), "sharegpt", "w") == {"messages": CHAT}


def test_a_sharegpt_system_column_is_the_chats_system_turn(tokenizer):
    """As LLaMA-Factory reads its ShareGPT rows: the `system` column is a system turn before the conversation."""
    row = {**sharegpt(CHAT[1:]), "system": "Be brief."}
    assert canonical(row, "sharegpt", "w") == {"messages": CHAT}
    (with_column,) = tokenize([("w", canonical(row, "sharegpt", "w"))], tokenizer)
    (as_messages,) = tokenize([("w", {"messages": CHAT})], tokenizer)
    np.testing.assert_array_equal(with_column.ids, as_messages.ids)
    np.testing.assert_array_equal(with_column.trained, as_messages.trained)
    for system in ("", None):
        assert canonical({**sharegpt(CHAT[1:]), "system": system}, "sharegpt", "w") == {"messages": CHAT[1:]}


def test_sharegpt_trains_exactly_like_the_same_chat_as_messages(tokenizer):
    (as_sharegpt,) = tokenize([("w", canonical(sharegpt(CHAT), "sharegpt", "w"))], tokenizer)
    (as_messages,) = tokenize([("w", {"messages": CHAT})], tokenizer)
    np.testing.assert_array_equal(as_sharegpt.ids, as_messages.ids)
    np.testing.assert_array_equal(as_sharegpt.trained, as_messages.trained)
    assert as_sharegpt.trained.any() and not as_sharegpt.trained.all()


def test_sharegpt_from_a_parquet_file_trains_like_messages_from_jsonl(tmp_path, tokenizer):
    """Arrow gives each turn every key a turn has anywhere (None where absent): they are not the chat's."""
    turns = sharegpt(CHAT)["conversations"]
    turns[1] = {**turns[1], "weight": 1.0}
    datasets.Dataset.from_list([{"conversations": turns}]).to_parquet(str(tmp_path / "c.parquet"))
    source = open_source(str(tmp_path / "c.parquet"))
    layout = detect(source.dataset.column_names, source.description).layout
    assert layout == "sharegpt"
    (example,) = tokenize([(source.where(0), canonical(source.dataset[0], layout, source.where(0)))], tokenizer)
    (reference,) = tokenize(read_rows(write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}])), tokenizer)
    np.testing.assert_array_equal(example.ids, reference.ids)
    np.testing.assert_array_equal(example.trained, reference.trained)


# ---- detection ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("columns, layout, report", [
    (["text"], "text", "1,000 rows, layout text (text)"),
    (["prompt", "completion", "id"], "prompt-completion",
     "1,000 rows, layout prompt-completion (prompt, completion); column id not used"),
    (["messages"], "messages", "1,000 rows, layout messages (messages)"),
    (["instruction", "input", "output"], "alpaca", "1,000 rows, layout alpaca (instruction, input, output)"),
    (["output", "instruction"], "alpaca", "1,000 rows, layout alpaca (instruction, output)"),
    (["conversations", "id"], "sharegpt", "1,000 rows, layout sharegpt (conversations); column id not used"),
    (["conversations", "system"], "sharegpt", "1,000 rows, layout sharegpt (conversations, system)"),
    (["instruction", "input", "output", "system", "history"], "alpaca",
     "1,000 rows, layout alpaca (instruction, input, output, system); column history not used"),
    (["text", "messages"], "auto", "1,000 rows, layouts text (text) and messages (messages), decided per row"),
    (["text", "messages", "id", "source"], "auto", "1,000 rows, layouts text (text) and messages (messages), "
                                                   "decided per row; columns id, source not used"),
])
def test_auto_detects_the_layout_from_the_columns(columns, layout, report):
    detection = detect(columns, "d.jsonl")
    assert detection.layout == layout
    assert detection.report(1000) == report


def test_a_named_layout_reports_its_columns():
    detection = detect(["instruction", "input", "output", "text"], "d.jsonl", "alpaca")
    assert detection.layout == "alpaca"
    assert detection.report(3) == "3 rows, layout alpaca (instruction, input, output); column text not used"


def test_columns_of_no_layout_are_one_line():
    with pytest.raises(DataError) as info:
        detect(["question", "answer"], "d.jsonl")
    assert str(info.value) == f"d.jsonl: no layout matches the columns question, answer; expected one of {ACCEPTED}"


def test_a_named_layout_whose_columns_are_missing_is_one_line():
    with pytest.raises(DataError) as info:
        detect(["text", "instruction"], "d.jsonl", "alpaca")
    assert str(info.value) == ("d.jsonl: --data-format alpaca needs the columns instruction, output; "
                               "found columns text, instruction")


# ---- one layout per row ------------------------------------------------------------------------------

@pytest.mark.parametrize("row, message", [
    ({"text": "a", "prompt": "b", "completion": "c"},
     "keys text, prompt, completion match several layouts (text | prompt-completion); choose one with --data-format"),
    ({"instruction": "i", "input": "", "output": "o", "text": "### Instruction: i"},
     "keys text, instruction, output match several layouts (text | alpaca); choose one with --data-format"),
    ({"messages": [], "conversations": []},
     "keys messages, conversations match several layouts (messages | sharegpt); choose one with --data-format"),
    ({"question": "q", "answer": "a"}, f"no layout matches the keys question, answer; expected one of {ACCEPTED}"),
    ({"text": None, "messages": None}, f"no layout matches the keys text, messages; expected one of {ACCEPTED}"),
])
def test_under_auto_a_row_matching_several_layouts_or_none_is_one_line(row, message):
    with pytest.raises(DataError) as info:
        canonical(row, "auto", "d.jsonl:2")
    assert str(info.value) == f"d.jsonl:2: {message}"


def test_a_named_layout_settles_a_row_matching_several():
    row = {"instruction": "Name a colour.", "output": "red", "text": "### Instruction: Name a colour. red"}
    assert canonical(row, "alpaca", "w")["completion"] == "red"
    assert canonical(row, "text", "w") == {"text": row["text"]}
    assert canonical({"text": "a", "prompt": "b", "completion": "c"}, "prompt-completion", "w") == {
        "prompt": "b", "completion": "c"}


def test_under_auto_each_row_takes_the_layout_of_its_keys():
    """A key whose value is None is absent (tables fill a row's missing columns with None)."""
    assert canonical({"text": "a", "messages": None}, "auto", "w") == {"text": "a"}
    assert canonical({"text": None, "messages": CHAT}, "auto", "w") == {"messages": CHAT}
    assert canonical({"prompt": "p", "completion": "c", "id": 3}, "auto", "w") == {"prompt": "p", "completion": "c"}
    assert canonical({"instruction": "i", "output": "o", "text": None}, "auto", "w")["completion"] == "o"
    assert canonical({**sharegpt(CHAT), "text": None}, "auto", "w") == {"messages": CHAT}


def test_rows_mixing_layouts_in_one_file_train_as_they_do_read_whole(tmp_path, tokenizer):
    """A JSONL file mixing text, prompt-completion and messages rows, read through the table (every row every
    column), gives the examples of the same file read row by row."""
    rows = [{"text": "the fox"}, {"messages": CHAT}, {"prompt": "add 1 + 1 =", "completion": " 2"},
            {"messages": CHAT[1:3], "id": 7}, {"text": "the dog"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    source = open_source(str(path))
    detection = detect(source.dataset.column_names, source.description)
    assert detection.layout == "auto"
    got = tokenize([(source.where(i), canonical(row, detection.layout, source.where(i)))
                    for i, row in enumerate(source.dataset)], tokenizer)
    want = tokenize(read_rows(path), tokenizer)
    assert [e.where for e in got] == [e.where for e in want] == [f"{path}:{n}" for n in range(1, 6)]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.trained, b.trained)


def test_messages_keep_their_keys_but_not_the_ones_a_table_filled_with_none():
    row = {"messages": [{"role": "user", "content": "hi", "name": None},
                        {"role": "assistant", "content": "yo", "name": "bot"}]}
    assert canonical(row, "messages", "w") == {"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "yo", "name": "bot"}]}


@pytest.mark.parametrize("layout, row, message", [
    ("text", {"text": 3}, "layout text expects a 'text' string; found text (int)"),
    ("text", {"prompt": "p"}, "layout text expects a 'text' string; found prompt (str)"),
    ("prompt-completion", {"prompt": "p", "completion": None},
     "layout prompt-completion expects 'prompt' and 'completion' strings; found prompt (str)"),
    ("messages", {"messages": "hi"}, "layout messages expects a 'messages' list; found messages (str)"),
    ("alpaca", {"instruction": "i", "input": "x"},
     "layout alpaca expects 'instruction' and 'output' strings and an optional 'input' string; "
     "found instruction (str), input (str)"),
    ("alpaca", {"instruction": "i", "input": 3, "output": "o"},
     "layout alpaca expects 'instruction' and 'output' strings and an optional 'input' string; "
     "found instruction (str), input (int), output (str)"),
    ("sharegpt", {"conversations": "hi"}, "layout sharegpt expects a 'conversations' list; found conversations (str)"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "beep"}]},
     "conversations turn 2: expected 'from' (system, human, gpt, user or assistant) and a string 'value'; "
     "found {'from': 'robot', 'value': 'beep'}"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "hi"}], "system": 3},
     "layout sharegpt expects an optional 'system' string; found conversations (list), system (int)"),
    ("sharegpt", {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"}],
                  "system": "Be kind."},
     "layout sharegpt has a 'system' column and a system turn first in 'conversations': give the system prompt "
     "once"),
    ("alpaca", {"instruction": "i", "output": "o", "system": ["s"]},
     "layout alpaca expects an optional 'system' string; found instruction (str), output (str), system (list)"),
    ("sharegpt", {"conversations": [{"from": "human", "value": None}]},
     "conversations turn 1: expected 'from' (system, human, gpt, user or assistant) and a string 'value'; "
     "found {'from': 'human', 'value': None}"),
])
def test_a_row_that_does_not_fit_its_layout_is_one_line(layout, row, message):
    with pytest.raises(DataError) as info:
        canonical(row, layout, "d.jsonl:4")
    assert str(info.value) == f"d.jsonl:4: {message}"


def test_the_tokenizers_checks_of_a_chat_still_apply(tokenizer):
    row = canonical(sharegpt(CHAT[:2]), "sharegpt", "d.jsonl:1")
    with pytest.raises(DataError) as info:
        tokenize([("d.jsonl:1", row)], tokenizer)
    assert str(info.value) == "d.jsonl:1: 'messages' has no assistant turn to train on"


def test_the_readme_layout_tables_example_rows_are_their_layouts(tmp_path):
    """Each example row of README's layout table, in a JSONL file, is detected as the layout its line names."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme[readme.index("| layout | keys | trained | example row |"):]
    lines = [line for line in table[:table.index("\n\n")].splitlines()[2:]]
    assert [line.split("`")[1] for line in lines] == list(DATA_FORMATS[1:])
    for line in lines:
        layout, example = line.split("`")[1], line.rsplit("| `", 1)[1].rstrip("` |")
        source = open_source(str(write_jsonl(tmp_path / f"{layout}.jsonl", [json.loads(example)])))
        detection = detect(source.dataset.column_names, source.description, features=source.dataset.features)
        assert detection.layout == layout
        assert "not used" not in detection.report(1)
        canonical(source.dataset[0], layout, source.where(0))


def test_a_canonical_row_is_json():
    """What a layout gives is plain data (it may be cached or sent to other processes)."""
    for row, layout in [({"instruction": "i", "output": "o"}, "alpaca"), (sharegpt(CHAT), "sharegpt"),
                        ({"text": "t"}, "text")]:
        out = canonical(row, layout, "w")
        assert json.loads(json.dumps(out)) == out
