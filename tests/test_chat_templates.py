"""Which tokens a chat row trains under each family's real chat template (tests/data/chat_templates), on the
per-row reference path and the batched one alike. The rule is Llama's: an assistant turn trains the tokens the
rendering of the conversation through it adds to the rendering, with the generation prompt, of the conversation
before it; both renderings must be prefixes of the whole conversation's. A template that renders a conversation
otherwise is one error naming the row and the turn (the README, "Chat templates of other families")."""

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from demo.tiny import save_tokenizer
from finetune.data.encoding import BatchTokenizer
from finetune.data.layouts import canonical
from finetune.data.reference import tokenize
from finetune.data.rows import DataError

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# family template -> (its special tokens, bos, eos)
FAMILIES = {
    "qwen2.5-instruct": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>"),
    "qwen3": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>"),
    "mistral-large-instruct-2407": (["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "mistral-nemo-instruct-2407": (["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "gemma3-it": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
}
SYSTEM = {"role": "system", "content": "be brief"}
TWO_TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
QWEN_DEFAULT_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(out)
    return out


def family_tokenizer(base_dir, name):
    """demo/tiny.py's tokenizer with the family's special tokens, BOS/EOS and real chat template."""
    specials, bos, eos = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.bos_token, tokenizer.eos_token = bos, eos
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def both_paths(tokenizer, rows, layout="auto"):
    """The examples of the reference path, checked equal to the batched path's; a DataError of either is raised
    (the batched path's bad row is the reference path's)."""
    try:
        reference = tokenize([(f"d.jsonl:{i + 1}", canonical(row, layout, "")) for i, row in enumerate(rows)],
                             tokenizer)
    except DataError:
        assert BatchTokenizer(tokenizer, None, layout)(rows).bad_row is not None
        raise
    batch = BatchTokenizer(tokenizer, None, layout)(rows)
    assert batch.bad_row is None
    np.testing.assert_array_equal(batch.ids, np.concatenate([e.ids for e in reference]))
    np.testing.assert_array_equal(batch.trained, np.concatenate([e.trained for e in reference]))
    return reference


def spans(tokenizer, example) -> tuple[str, list[str]]:
    """The example's text and the texts of its runs of trained tokens."""
    runs, run = [], []
    for token, trained in zip(example.ids.tolist(), example.trained):
        if trained:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    return tokenizer.decode(example.ids.tolist()), [tokenizer.decode(r) for r in runs]


# (template, conversation) -> (the whole rendering, the trained texts), spelled out from each template's format
EXPECTED = {
    ("qwen2.5-instruct", "two turns"): (
        QWEN_DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\nsure<|im_end|>\n",
        ["hello<|im_end|>\n", "sure<|im_end|>\n"]),
    ("qwen2.5-instruct", "system, two turns"): (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\nsure<|im_end|>\n",
        ["hello<|im_end|>\n", "sure<|im_end|>\n"]),
    # the last assistant turn gets an empty think block, which is trained with the reply
    ("qwen3", "one turn"): (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>\n",
        ["<think>\n\n</think>\n\nhello<|im_end|>\n"]),
    ("qwen3", "system, one turn"): (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\nhello<|im_end|>\n",
        ["<think>\n\n</think>\n\nhello<|im_end|>\n"]),
    ("mistral-large-instruct-2407", "two turns"): (
        "<s>[INST] hi[/INST] hello</s>[INST] more[/INST] sure</s>", [" hello</s>", " sure</s>"]),
    ("mistral-nemo-instruct-2407", "two turns"): (
        "<s>[INST]hi[/INST]hello</s>[INST]more[/INST]sure</s>", ["hello</s>", "sure</s>"]),
    # the system message opens the first user turn; every turn ends <end_of_turn>, the reply's included
    ("gemma3-it", "system, two turns"): (
        "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nmore<end_of_turn>\n<start_of_turn>model\nsure<end_of_turn>\n",
        ["hello<end_of_turn>\n", "sure<end_of_turn>\n"]),
}
CONVERSATIONS = {"one turn": TWO_TURNS[:2], "two turns": TWO_TURNS, "system, one turn": [SYSTEM, *TWO_TURNS[:2]],
                 "system, two turns": [SYSTEM, *TWO_TURNS]}


@pytest.mark.parametrize("name, conversation", sorted(EXPECTED))
def test_each_assistant_turn_trains_what_the_template_renders_for_it(base_tokenizer_dir, name, conversation):
    tokenizer = family_tokenizer(base_tokenizer_dir, name)
    (example,) = both_paths(tokenizer, [{"messages": CONVERSATIONS[conversation]}])
    text, trained = spans(tokenizer, example)
    assert (text, trained) == EXPECTED[(name, conversation)]


# Templates that make the rule impossible: Qwen3 renders a finished assistant turn without the think block it gives
# the last one; Mistral's put the system message into the last user turn only, so it is in the generation prompt's
# rendering and not in a conversation that ends with a reply (which would drop it).
REFUSED = [
    ("qwen3", "two turns", "through assistant turn 1"),
    ("qwen3", "system, two turns", "through assistant turn 1"),
    ("mistral-large-instruct-2407", "system, one turn", "before assistant turn 1, with the generation prompt,"),
    ("mistral-nemo-instruct-2407", "system, two turns", "before assistant turn 1, with the generation prompt,"),
]


@pytest.mark.parametrize("name, conversation, turn", REFUSED)
def test_a_template_that_renders_a_turn_otherwise_is_one_error_naming_the_row(base_tokenizer_dir, name,
                                                                              conversation, turn):
    tokenizer = family_tokenizer(base_tokenizer_dir, name)
    rows = [{"messages": TWO_TURNS[:2]}, {"messages": CONVERSATIONS[conversation]}]
    with pytest.raises(DataError) as info:
        both_paths(tokenizer, rows)
    assert str(info.value).startswith(f"d.jsonl:2: the chat template renders the conversation {turn} "
                                      "differently from the whole conversation")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_preference_reply_trains_what_the_same_sft_row_trains_for_its_final_turn(base_tokenizer_dir, name):
    """A preference-chat pair's sides are the SFT rows of prompt + reply, with only the reply trained: under each
    template, what the single-turn SFT row trains (Qwen3's think block included)."""
    tokenizer = family_tokenizer(base_tokenizer_dir, name)
    prompt = [TWO_TURNS[0]]
    pair = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "bye"}]}
    chosen, rejected = both_paths(tokenizer, [pair], "preference-chat")
    (sft,) = both_paths(tokenizer, [{"messages": TWO_TURNS[:2]}])
    np.testing.assert_array_equal(chosen.ids, sft.ids)
    np.testing.assert_array_equal(chosen.trained, sft.trained)
    (chosen_text,) = spans(tokenizer, chosen)[1]
    assert spans(tokenizer, rejected)[1] == [chosen_text.replace("hello", "bye")]


def test_a_template_that_raises_on_a_row_is_one_error_naming_the_row(base_tokenizer_dir):
    """Gemma 3's template refuses roles that do not alternate user/assistant: the row is named, with its message."""
    tokenizer = family_tokenizer(base_tokenizer_dir, "gemma3-it")
    rows = [{"messages": TWO_TURNS[:2]}, {"messages": [TWO_TURNS[0], TWO_TURNS[2], TWO_TURNS[1]]}]
    with pytest.raises(DataError) as info:
        both_paths(tokenizer, rows)
    assert str(info.value).startswith("d.jsonl:2: ") and "roles must alternate" in str(info.value)
