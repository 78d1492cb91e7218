"""Row layouts (`--data-format`): the shapes a data row may have, each mapped by `canonical` to one of the three
forms `finetune.data.reference.tokenize` takes: `{"text"}`, `{"prompt", "completion"}` or `{"messages"}`.

- text: `text` (every token trained);
- prompt-completion: `prompt`, `completion` (only the completion trained);
- messages: `messages`, OpenAI chat `[{"role", "content"}, ...]` (only assistant turns trained);
- alpaca: `instruction`, optional `input`, `output` -> prompt-completion, the prompt rendered with the Stanford
  Alpaca template (below), the output the completion;
- sharegpt: `conversations`, `[{"from", "value"}, ...]` with `from` system, human or gpt (user and assistant
  accepted too) -> messages with roles system, user and assistant: trains exactly as the same chat given as
  `messages`.

Other keys are ignored. A key whose value is None is absent: a table gives every row every column (and each
chat turn every field any turn has), None where the row has none.

`auto` takes the layout from the dataset's columns (`detect`); where the columns hold several layouts (a JSONL
file mixing text and messages rows), each row takes the one of its keys, and a row with the keys of several
(an alpaca dump with a `text` column) is an error asking for --data-format, which settles it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from finetune.data.rows import DataError

# Layout name -> the keys it reads, as shown to the user.
LAYOUTS = {
    "text": "text",
    "prompt-completion": "prompt, completion",
    "messages": "messages",
    "alpaca": "instruction, input (optional), output",
    "sharegpt": "conversations",
}
AUTO = "auto"
# The keys that make a row (or column set) one of each layout, and those the layout cannot do without.
_MARKS = {"text": ("text",), "prompt-completion": ("prompt", "completion"), "messages": ("messages",),
          "alpaca": ("instruction", "output"), "sharegpt": ("conversations",)}
_READS = {**_MARKS, "alpaca": ("instruction", "input", "output")}
_ACCEPTED = " | ".join(f"{name} ({keys})" for name, keys in LAYOUTS.items())

# The Stanford Alpaca prompts (github.com/tatsu-lab/stanford_alpaca, train.py), as most Alpaca fine-tunes use.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

# ShareGPT speaker -> chat role.
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


@dataclasses.dataclass(frozen=True)
class Detection:
    """The layout rows are read with: a name in LAYOUTS, or AUTO (each row takes the one of its keys, among
    `layouts`)."""

    layout: str
    layouts: tuple[str, ...]
    columns: tuple[str, ...]  # the dataset's columns

    def report(self, n_rows: int) -> str:
        """One line for the user, e.g. `1,000 rows, layout alpaca (instruction, input, output)`."""
        def reads(name):
            return ", ".join(key for key in _READS[name] if key in self.columns)

        if self.layout != AUTO:
            return f"{n_rows:,} rows, layout {self.layout} ({reads(self.layout)})"
        named = [f"{name} ({reads(name)})" for name in self.layouts]
        return f"{n_rows:,} rows, layouts {', '.join(named[:-1])} and {named[-1]}, decided per row"


def detect(columns: Iterable[str], source: str, data_format: str = AUTO) -> Detection:
    """The layout of a dataset with `columns` under `--data-format data_format`; DataError naming `source`
    when no layout fits the columns (or the named one's columns are missing)."""
    columns = tuple(columns)
    if data_format != AUTO:
        if data_format not in LAYOUTS:
            raise ValueError(f"unknown layout {data_format!r}")
        if not set(_MARKS[data_format]) <= set(columns):
            raise DataError(f"{source}: --data-format {data_format} needs the columns "
                            f"{', '.join(_MARKS[data_format])}; found columns {', '.join(columns)}")
        return Detection(data_format, (data_format,), columns)
    layouts = tuple(name for name, keys in _MARKS.items() if any(key in columns for key in keys))
    if not layouts:
        raise DataError(f"{source}: no layout matches the columns {', '.join(columns)}; expected one of {_ACCEPTED}")
    return Detection(layouts[0] if len(layouts) == 1 else AUTO, layouts, columns)


def canonical(row: Mapping[str, Any], layout: str, where: str) -> dict[str, Any]:
    """`row` as `{"text"}`, `{"prompt", "completion"}` or `{"messages"}` by `layout` (a name in LAYOUTS, or AUTO:
    the layout of the row's keys); DataError naming `where` when it does not fit."""
    if layout == AUTO:
        layout = _row_layout(row, where)
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
        prompt = (ALPACA_PROMPT.format(instruction=instruction, input=given) if given
                  else ALPACA_PROMPT_NO_INPUT.format(instruction=instruction))
        return {"prompt": prompt, "completion": output}
    if layout == "sharegpt":
        if not isinstance(row.get("conversations"), list):
            raise _mismatch(where, layout, "a 'conversations' list", row)
        return {"messages": [_sharegpt_turn(turn, k, where) for k, turn in enumerate(row["conversations"], 1)]}
    raise ValueError(f"unknown layout {layout!r}")


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


def _mismatch(where: str, layout: str, expected: str, row: Mapping[str, Any]) -> DataError:
    found = ", ".join(f"{key} ({type(value).__name__})" for key, value in row.items() if value is not None)
    return DataError(f"{where}: layout {layout} expects {expected}; found {found or 'no keys'}")
