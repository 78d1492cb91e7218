"""Row layouts (`--data-format`): the shapes a data row may have, each mapped by `canonical` to one of the three
forms `finetune.data.reference.tokenize` takes: `{"text"}`, `{"prompt", "completion"}` or `{"messages"}`.

- text: `text` (every token trained);
- prompt-completion: `prompt`, `completion` (only the completion trained);
- messages: `messages`, OpenAI chat `[{"role", "content"}, ...]` (only assistant turns trained);
- alpaca: `instruction`, optional `input`, `output`, optional `system` -> prompt-completion, the prompt rendered
  with the Stanford Alpaca template (below), the output the completion. The template's opening sentence is its
  system prompt: a row's `system` takes its place. Rows render through this template, never the model's chat
  template (LLaMA-Factory renders them through the chat template): an Alpaca row's tokens do not depend on the
  tokenizer's template, and a base model without one trains on them;
- sharegpt: `conversations`, `[{"from", "value"}, ...]` with `from` system, human or gpt (user and assistant
  accepted too), optional `system` -> messages with roles system, user and assistant, the `system` column a
  system turn first (as LLaMA-Factory reads it; a row with both it and a system turn is an error): trains exactly
  as the same chat given as `messages`.

Preference layouts (`PREFERENCE_LAYOUTS`, for the preference objectives) hold a chosen and a rejected reply to
one prompt; `canonical` maps a row to a pair `{"chosen": row, "rejected": row}` of the canonical forms above,
each side tokenized as that SFT row is, a chat training only its final message (the reply):
- preference: `prompt`, `chosen`, `rejected` strings -> two prompt-completion rows;
- preference-chat: `prompt` a messages list, `chosen` and `rejected` the assistant reply (a list holding one
  assistant message, or a string) -> two messages rows, the prompt then the reply;
- preference-conversations: `chosen` and `rejected` whole conversations sharing their prompt turns: the prompt
  is their longest common prefix of messages, and what follows it on each side must be one assistant message;
- preference-sharegpt (LLaMA-Factory's ShareGPT pairs): `conversations` as sharegpt's, ending with a user turn,
  `chosen` and `rejected` one `{"from": "gpt", "value"}` message each, optional `system` -> two messages rows,
  each the sharegpt row of the conversation then that reply;
- preference-alpaca (LLaMA-Factory's Alpaca pairs): `instruction`, optional `input`, `chosen` and `rejected`
  strings, optional `system` -> two prompt-completion rows, each the alpaca row with that reply as its output.

The prompt layout (`PROMPT_LAYOUT`, for the online RL objectives) holds a prompt alone: `prompt`, a string or a
messages list (TRL's prompt-only layout) -> `{PROMPT_ONLY: prompt}`, tokenized as the prompt of a prompt-completion
row (BOS, then the text) or of a chat (its rendering with the generation prompt). Its other columns are read by the
reward functions, not the tokenizer.

Other keys are not read (`Detection.report` names the columns a layout leaves unread). A key whose value is None is absent: a table gives every row every column (and each
chat turn every field any turn has), None where the row has none.

`auto` takes the layout from the dataset's columns (`detect`; a `prompt` without a `completion` is the prompt
layout); where the columns hold several layouts (a JSONL file mixing text and messages rows), each row takes the one
of its keys, and a row with the keys of several
(an alpaca dump with a `text` column) is an error asking for --data-format, which settles it. Columns holding
`chosen` and `rejected` (and of the other layouts' keys only `prompt`) are a preference layout, which one decided
by the columns' types where the dataset has them (`detect`'s `features`); `chosen` and `rejected` with
`conversations` (each reply a message struct) are preference-sharegpt, and with `instruction` (and no `output`)
preference-alpaca. A preference dataset never mixes with the other layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from finetune.data.reference import PROMPT_ONLY
from finetune.data.rows import DataError

# Layout name -> the keys it reads, as shown to the user.
LAYOUTS = {
    "text": "text",
    "prompt-completion": "prompt, completion",
    "messages": "messages",
    "alpaca": "instruction, input (optional), output, system (optional)",
    "sharegpt": "conversations, system (optional)",
}
# Preference layout name -> the keys it reads, as shown to the user.
PREFERENCE_LAYOUTS = {
    "preference": "prompt, chosen, rejected",
    "preference-chat": "prompt (messages), chosen, rejected",
    "preference-conversations": "chosen, rejected (whole conversations)",
    "preference-sharegpt": "conversations, chosen, rejected (one message each), system (optional)",
    "preference-alpaca": "instruction, input (optional), chosen, rejected, system (optional)",
}
# The layout of the online RL objectives' prompts, and the columns of it the rewards are not given (TRL's: the reward
# functions' own arguments `completions` and `completion_ids` are the sampled ones).
PROMPT_LAYOUT = "prompt-only"
NOT_PASSED_TO_REWARDS = ("completion", "completion_ids")
AUTO = "auto"
# Every --data-format name.
DATA_FORMATS = (AUTO, *LAYOUTS, *PREFERENCE_LAYOUTS, PROMPT_LAYOUT)
# The two replies of a preference row, in the order their examples are stored (chosen first).
PAIR_KEYS = ("chosen", "rejected")
# The keys that make a row (or column set) one of each layout, and those the layout cannot do without.
_MARKS = {"text": ("text",), "prompt-completion": ("prompt", "completion"), "messages": ("messages",),
          "alpaca": ("instruction", "output"), "sharegpt": ("conversations",)}
# The columns each preference layout cannot do without.
_PAIR_NEEDS = {"preference": ("prompt", *PAIR_KEYS), "preference-chat": ("prompt", *PAIR_KEYS),
               "preference-conversations": PAIR_KEYS, "preference-sharegpt": ("conversations", *PAIR_KEYS),
               "preference-alpaca": ("instruction", *PAIR_KEYS)}
# The SFT key beside `chosen` and `rejected` that makes columns one of LLaMA-Factory's preference layouts.
_PAIR_MARKS = {"conversations": "preference-sharegpt", "instruction": "preference-alpaca"}
# Every key each layout reads.
_READS = {**_MARKS, **_PAIR_NEEDS, "alpaca": ("instruction", "input", "output", "system"),
          "sharegpt": ("conversations", "system"), "preference-sharegpt": ("conversations", *PAIR_KEYS, "system"),
          "preference-alpaca": ("instruction", "input", *PAIR_KEYS, "system"), PROMPT_LAYOUT: ("prompt",)}
_ACCEPTED = " | ".join(f"{name} ({keys})" for name, keys in LAYOUTS.items())

# The Stanford Alpaca prompts (github.com/tatsu-lab/stanford_alpaca, train.py), as most Alpaca fine-tunes use: an
# opening sentence (the system prompt, which a row's `system` replaces), then the instruction and input.
ALPACA_SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.")
ALPACA_SYSTEM_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.")
ALPACA_PROMPT = "{system}\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "{system}\n\n### Instruction:\n{instruction}\n\n### Response:\n"

# ShareGPT speaker -> chat role.
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


def is_preference(layout: str) -> bool:
    """Whether rows of `layout` are chosen/rejected pairs (two examples each) rather than SFT rows."""
    return layout in PREFERENCE_LAYOUTS


@dataclasses.dataclass(frozen=True)
class Detection:
    """The layout rows are read with: a name in LAYOUTS or PREFERENCE_LAYOUTS, or AUTO (each row takes the one of
    its keys, among `layouts`)."""

    layout: str
    layouts: tuple[str, ...]
    columns: tuple[str, ...]  # the dataset's columns

    def report(self, n_rows: int) -> str:
        """One line for the user, e.g. `1,000 rows, layout alpaca (instruction, input, output)`."""
        def reads(name):
            return ", ".join(key for key in _READS[name] if key in self.columns)

        read = {key for name in self.layouts for key in _READS[name]}
        unread = [column for column in self.columns if column not in read]
        if self.layout == PROMPT_LAYOUT:  # the rewards get the other columns but those TRL keeps from them
            passed = [c for c in unread if c not in NOT_PASSED_TO_REWARDS]
            dropped = [c for c in unread if c in NOT_PASSED_TO_REWARDS]
            return f"{n_rows:,} prompts, layout {self.layout} (prompt){_columns(passed, 'passed to the rewards')}" \
                   f"{_columns(dropped, 'not used')}"
        unused = _columns(unread, "not used")
        if self.layout != AUTO:
            unit = "pairs" if is_preference(self.layout) else "rows"
            return f"{n_rows:,} {unit}, layout {self.layout} ({reads(self.layout)}){unused}"
        named = [f"{name} ({reads(name)})" for name in self.layouts]
        return f"{n_rows:,} rows, layouts {', '.join(named[:-1])} and {named[-1]}, decided per row{unused}"


def _columns(names: list[str], fate: str) -> str:
    return f"; column{'s' * (len(names) > 1)} {', '.join(names)} {fate}" if names else ""


def detect(columns: Iterable[str], source: str, data_format: str = AUTO,
           features: Mapping[str, Any] | None = None) -> Detection:
    """The layout of a dataset with `columns` under `--data-format data_format`; DataError naming `source`
    when no layout fits the columns (or the named one's columns are missing). `features`: the columns' types
    (a `datasets.Features`), which tell the preference layouts apart; without them a preference dataset with a
    `prompt` is taken as `preference` (strings)."""
    columns = tuple(columns)
    if data_format != AUTO:
        if data_format in PREFERENCE_LAYOUTS:
            if not set(_PAIR_NEEDS[data_format]) <= set(columns):
                raise DataError(f"{source}: --data-format {data_format} needs the columns "
                                f"{', '.join(_PAIR_NEEDS[data_format])}; found columns {', '.join(columns)}")
            return Detection(data_format, (data_format,), columns)
        if data_format == PROMPT_LAYOUT:
            if "prompt" not in columns:
                raise DataError(f"{source}: --data-format {data_format} needs the column prompt; found columns "
                                f"{', '.join(columns)}")
            return Detection(data_format, (data_format,), columns)
        if data_format not in LAYOUTS:
            raise ValueError(f"unknown layout {data_format!r}")
        if not set(_MARKS[data_format]) <= set(columns):
            raise DataError(f"{source}: --data-format {data_format} needs the columns "
                            f"{', '.join(_MARKS[data_format])}; found columns {', '.join(columns)}")
        return Detection(data_format, (data_format,), columns)
    preference = _preference_layout(columns, source, features)
    if preference is not None:
        return Detection(preference, (preference,), columns)
    layouts = tuple(name for name, keys in _MARKS.items() if any(key in columns for key in keys))
    if layouts == ("prompt-completion",) and "completion" not in columns:  # prompts alone
        return Detection(PROMPT_LAYOUT, (PROMPT_LAYOUT,), columns)
    if not layouts:
        raise DataError(f"{source}: no layout matches the columns {', '.join(columns)}; expected one of {_ACCEPTED}")
    return Detection(layouts[0] if len(layouts) == 1 else AUTO, layouts, columns)


def detect_prompts(columns: Iterable[str], source: str, data_format: str, objective: str) -> Detection:
    """The layout of the prompts an online RL `objective` samples completions of: `PROMPT_LAYOUT` when `columns`
    hold a `prompt` (every other column goes to the rewards); DataError naming `source` otherwise, or when
    `data_format` names another layout."""
    columns = tuple(columns)
    if data_format not in (AUTO, PROMPT_LAYOUT):
        raise DataError(f"{source}: --data-format {data_format} does not go with --objective {objective}, which "
                        f"samples completions of prompts: use --data-format {PROMPT_LAYOUT} (or auto)")
    if "prompt" not in columns:
        raise DataError(f"{source}: --objective {objective} samples completions of prompts, and the rows have no "
                        f"'prompt' column (columns {', '.join(columns) or 'none'}): give each row a prompt, a string "
                        "or a messages list")
    return Detection(PROMPT_LAYOUT, (PROMPT_LAYOUT,), columns)


def _preference_layout(columns: tuple[str, ...], source: str, features: Mapping[str, Any] | None) -> str | None:
    """The preference layout of `columns`, None when they are not a preference dataset: they hold `chosen` or
    `rejected` and of the other layouts' keys at most `prompt` (which a preference layout reads) and one of
    `_PAIR_MARKS` (which make them LLaMA-Factory's layouts)."""
    pair = [key for key in PAIR_KEYS if key in columns]
    others = {key for keys in _MARKS.values() for key in keys if key in columns and key != "prompt"}
    if not pair or (others and (len(others) > 1 or not others <= set(_PAIR_MARKS))):
        return None
    if len(pair) == 1:
        missing = next(key for key in PAIR_KEYS if key not in columns)
        raise DataError(f"{source}: columns {', '.join(columns)}: a preference layout needs both a chosen and a "
                        f"rejected reply per row, and there is no '{missing}' column; add it (or, to fine-tune on "
                        "one reply per prompt, name the columns prompt and completion)")
    if others:
        return _PAIR_MARKS[others.pop()]
    if "prompt" not in columns:
        return "preference-conversations"
    kinds = {key: _kind((features or {}).get(key)) for key in ("prompt", *PAIR_KEYS)}
    if kinds["prompt"] == "list":
        return "preference-chat"
    if kinds["prompt"] == "string" and "list" in (kinds["chosen"], kinds["rejected"]):
        return "preference-conversations"  # whole conversations beside the prompt text (the prompt column unread)
    return "preference"


def _kind(feature: Any) -> str | None:
    """"string" or "list" for a column's type (a `datasets` feature), None when unknown."""
    if feature is None:
        return None
    if isinstance(feature, (list, tuple)) or type(feature).__name__ in ("List", "LargeList", "Sequence"):
        return "list"
    return "string" if getattr(feature, "dtype", None) in ("string", "large_string") else None


def canonical(row: Mapping[str, Any], layout: str, where: str) -> dict[str, Any]:
    """`row` as `{"text"}`, `{"prompt", "completion"}` or `{"messages"}` by `layout` (a name in LAYOUTS, or AUTO:
    the layout of the row's keys), or, for a name in PREFERENCE_LAYOUTS, as `{"chosen": row, "rejected": row}`
    of those; DataError naming `where` when it does not fit."""
    if layout == AUTO:
        layout = _row_layout(row, where)
    if layout == PROMPT_LAYOUT:
        prompt = row.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
            raise _mismatch(where, layout, "a 'prompt' string or messages list", row)
        return {PROMPT_ONLY: prompt if isinstance(prompt, str) else [_present(m) for m in prompt]}
    if is_preference(layout):
        return _pair(row, layout, where)
    if layout == "text":
        if not isinstance(row.get("text"), str):
            raise _mismatch(where, layout, "a 'text' string", row)
        return {"text": row["text"]}
    if layout == "prompt-completion":
        if not (isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str)):
            raise _mismatch(where, layout, "'prompt' and 'completion' strings", row)
        return {"prompt": row["prompt"], "completion": row["completion"]}
    if layout == "messages":
        if not isinstance(row.get("messages"), list):
            raise _mismatch(where, layout, "a 'messages' list", row)
        # the tokenizer checks roles and contents, and that there is an assistant turn
        return {"messages": [_present(m) if isinstance(m, dict) else m for m in row["messages"]]}
    if layout == "alpaca":
        instruction, given, output = row.get("instruction"), row.get("input"), row.get("output")
        if not (isinstance(instruction, str) and isinstance(output, str) and isinstance(given, (str, type(None)))):
            raise _mismatch(where, layout, "'instruction' and 'output' strings and an optional 'input' string", row)
        return {"prompt": _alpaca_prompt(row, layout, where), "completion": output}
    if layout == "sharegpt":
        if not isinstance(row.get("conversations"), list):
            raise _mismatch(where, layout, "a 'conversations' list", row)
        return {"messages": _sharegpt_messages(row, layout, where)}
    raise ValueError(f"unknown layout {layout!r}")


def _system(row: Mapping[str, Any], layout: str, where: str) -> str | None:
    """The row's `system` column: a string, or None when absent or empty."""
    system = row.get("system")
    if not isinstance(system, (str, type(None))):
        raise _mismatch(where, layout, "an optional 'system' string", row)
    return system or None


def _alpaca_prompt(row: Mapping[str, Any], layout: str, where: str) -> str:
    """The Stanford Alpaca prompt of a row whose `instruction` (and `input`, when present) are strings, the
    row's `system` in place of the template's opening sentence."""
    instruction, given, system = row["instruction"], row.get("input"), _system(row, layout, where)
    return (ALPACA_PROMPT.format(instruction=instruction, input=given, system=system or ALPACA_SYSTEM) if given
            else ALPACA_PROMPT_NO_INPUT.format(instruction=instruction, system=system or ALPACA_SYSTEM_NO_INPUT))


def _sharegpt_messages(row: Mapping[str, Any], layout: str, where: str) -> list[dict[str, str]]:
    """The messages of a row whose `conversations` is a list, its `system` column a system turn first."""
    turns = [_sharegpt_turn(turn, k, where) for k, turn in enumerate(row["conversations"], 1)]
    system = _system(row, layout, where)
    if system is None:
        return turns
    if turns and turns[0]["role"] == "system":
        raise DataError(f"{where}: layout {layout} has a 'system' column and a system turn first in 'conversations': "
                        "give the system prompt once")
    return [{"role": "system", "content": system}] + turns


def _pair(row: Mapping[str, Any], layout: str, where: str) -> dict[str, Any]:
    """A preference row as `{"chosen": row, "rejected": row}` of canonical SFT rows (see the module docstring)."""
    chosen, rejected = (row.get(key) for key in PAIR_KEYS)
    if layout == "preference":
        prompt = row.get("prompt")
        if not all(isinstance(value, str) for value in (prompt, chosen, rejected)):
            raise _pair_mismatch(where, layout, "'prompt', 'chosen' and 'rejected' strings", row,
                                 "for chat rows use --data-format preference-chat (a messages prompt) or "
                                 "preference-conversations (whole conversations)")
        return {key: {"prompt": prompt, "completion": reply} for key, reply in zip(PAIR_KEYS, (chosen, rejected))}
    if layout == "preference-chat":
        prompt = row.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(value, (str, list)) for value in (chosen, rejected))):
            raise _pair_mismatch(where, layout, "a 'prompt' messages list and 'chosen' and 'rejected' replies (a list "
                                 "holding one assistant message, or a string)", row,
                                 "each value must be a string or a messages list")
        prompt = [_present(m) if isinstance(m, dict) else m for m in prompt]
        return {key: {"messages": prompt + [_reply(reply, key, where)]}
                for key, reply in zip(PAIR_KEYS, (chosen, rejected))}
    if layout == "preference-conversations":
        if not all(isinstance(value, list) for value in (chosen, rejected)):
            raise _pair_mismatch(where, layout, "'chosen' and 'rejected' conversations (messages lists)", row,
                                 "each value must be a messages list")
        return _split_conversations(chosen, rejected, where)
    if layout == "preference-sharegpt":
        if not (isinstance(row.get("conversations"), list) and chosen is not None and rejected is not None):
            raise _pair_mismatch(where, layout, "a 'conversations' list and 'chosen' and 'rejected' replies (one "
                                 "message {from, value} each)", row, "each reply must be one message")
        prompt = _sharegpt_messages(row, layout, where)
        if not prompt or prompt[-1]["role"] != "user":
            role = prompt[-1]["role"] if prompt else None
            ends = f"ends with {'an' if role == 'assistant' else 'a'} {role} turn" if role else "has no user turn"
            raise DataError(f"{where}: layout {layout} expects 'conversations' to end with a user turn (the prompt "
                            f"the replies answer); it {ends}")
        return {key: {"messages": prompt + [_sharegpt_reply(reply, key, where)]}
                for key, reply in zip(PAIR_KEYS, (chosen, rejected))}
    if layout == "preference-alpaca":
        if not (all(isinstance(value, str) for value in (row.get("instruction"), chosen, rejected))
                and isinstance(row.get("input"), (str, type(None)))):
            raise _pair_mismatch(where, layout, "'instruction', 'chosen' and 'rejected' strings and optional 'input' "
                                 "and 'system' strings", row, "for replies given as messages use the layout "
                                 "preference-sharegpt (a 'conversations' prompt)")
        prompt = _alpaca_prompt(row, layout, where)
        return {key: {"prompt": prompt, "completion": reply} for key, reply in zip(PAIR_KEYS, (chosen, rejected))}
    raise ValueError(f"unknown layout {layout!r}")


def _sharegpt_reply(reply: Any, key: str, where: str) -> dict[str, str]:
    """The assistant message a preference-sharegpt reply (one {from, value} message) is."""
    if not isinstance(reply, dict):
        found = f"a list of {len(reply)} messages" if isinstance(reply, list) else type(reply).__name__
        raise DataError(f"{where}: layout preference-sharegpt expects '{key}' to be one message {{from, value}} (the "
                        f"reply); found {found}")
    if not (SHAREGPT_ROLES.get(reply.get("from")) == "assistant" and isinstance(reply.get("value"), str)):
        shown = {name: reply.get(name) for name in ("from", "value")}
        raise DataError(f"{where}: '{key}': expected 'from' gpt or assistant (the reply) and a string 'value'; "
                        f"found {shown}")
    return {"role": "assistant", "content": reply["value"]}


def _reply(reply: Any, key: str, where: str) -> dict[str, Any]:
    """The assistant message a preference-chat reply holds."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    if len(reply) == 1 and isinstance(reply[0], dict) and reply[0].get("role") == "assistant":
        return _present(reply[0])
    raise DataError(f"{where}: layout preference-chat expects '{key}' to be the assistant reply (a list holding one "
                    f"assistant message, or a string); found a list of {len(reply)} messages with roles "
                    f"{', '.join(str(m.get('role')) if isinstance(m, dict) else '?' for m in reply) or 'none'}; "
                    "for whole conversations use --data-format preference-conversations")


def _split_conversations(chosen: list, rejected: list, where: str) -> dict[str, Any]:
    """The two conversations as prompt (their longest common prefix of messages) + one reply each."""
    chosen = [_present(m) if isinstance(m, dict) else m for m in chosen]
    rejected = [_present(m) if isinstance(m, dict) else m for m in rejected]
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if not shared:
        raise DataError(f"{where}: layout preference-conversations expects 'chosen' and 'rejected' to share their "
                        "prompt turns (the same messages up to the reply); they differ from the first message")
    for key, conversation in zip(PAIR_KEYS, (chosen, rejected)):
        rest = conversation[shared:]
        if not (len(rest) == 1 and isinstance(rest[0], dict) and rest[0].get("role") == "assistant"):
            roles = ", ".join(str(m.get("role")) if isinstance(m, dict) else "?" for m in rest) or "nothing"
            raise DataError(f"{where}: layout preference-conversations expects each conversation to end with one "
                            f"assistant reply after the {shared} shared prompt messages; '{key}' has {roles} there")
    return {"chosen": {"messages": chosen}, "rejected": {"messages": rejected}}


def _row_layout(row: Mapping[str, Any], where: str) -> str:
    present = [name for name, keys in _MARKS.items() if any(row.get(key) is not None for key in keys)]
    if len(present) == 1:
        return present[0]
    if not present:
        raise DataError(f"{where}: no layout matches the keys {', '.join(row)}; expected one of {_ACCEPTED}")
    keys = [key for name in present for key in _MARKS[name] if row.get(key) is not None]
    raise DataError(f"{where}: keys {', '.join(keys)} match several layouts ({' | '.join(present)}); choose one "
                    "with --data-format")


def _sharegpt_turn(turn: Any, k: int, where: str) -> dict[str, str]:
    if not (isinstance(turn, dict) and turn.get("from") in SHAREGPT_ROLES and isinstance(turn.get("value"), str)):
        shown = {key: turn.get(key) for key in ("from", "value")} if isinstance(turn, dict) else turn
        raise DataError(f"{where}: conversations turn {k}: expected 'from' (system, human, gpt, user or assistant) "
                        f"and a string 'value'; found {shown}")
    return {"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}


def _present(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in mapping.items() if value is not None}


def _pair_mismatch(where: str, layout: str, expected: str, row: Mapping[str, Any], fix: str) -> DataError:
    """`_mismatch` of a preference row, with what to do about it: add a missing reply, else `fix`."""
    missing = [key for key in PAIR_KEYS if row.get(key) is None]
    if missing:
        fix = f"every pair needs a chosen and a rejected reply: add the {' and '.join(missing)} reply or drop the row"
    return DataError(f"{_mismatch(where, layout, expected, row)}; {fix}")


def _mismatch(where: str, layout: str, expected: str, row: Mapping[str, Any]) -> DataError:
    found = ", ".join(f"{key} ({type(value).__name__})" for key, value in row.items() if value is not None)
    return DataError(f"{where}: layout {layout} expects {expected}; found {found or 'no keys'}")
