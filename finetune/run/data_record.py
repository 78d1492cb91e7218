"""RUN/run_data.json: the tokens a run trains and evaluates on (digest and counts of --data and --eval-data),
and the line that says what changed when a resume finds other tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.config import flag_of
from finetune.run.errors import RunDirError


def describe_data_changes(out: Path, recorded: dict[str, Any], data: dict[str, dict], changed: list[str]) -> str:
    """`--data X: its tokenized examples differ from those the run started with (N examples, T tokens then; ...
    now; what changed since): what to do` for the `changed` entries of `data` against those `recorded`."""
    when = ("the run started with" if recorded["step"] == 0
            else f"recorded when the run resumed from step {recorded['step']}")
    parts, files, tokenizer = [], False, False
    for name in changed:
        old, new = recorded[name], data[name]
        files_changed, tokenizer_changed = old.get("source") != new["source"], old.get("tokenizer") != new["tokenizer"]
        if files_changed or tokenizer_changed:
            why = " and ".join(["its files"] * files_changed + ["the tokenizer in --model"] * tokenizer_changed)
            why += " changed since"
        else:
            why = ("its files and the tokenizer are as they were: this version of finetune-lora tokenizes them "
                   "differently")
        files, tokenizer = files or files_changed, tokenizer or tokenizer_changed
        parts.append(f"--{flag_of(name)} {new['path']}: its tokenized examples differ from those {when} "
                     f"({_counts(old)} then; {_counts(new)} now; {why})")
    if files or tokenizer:
        fix = f"restore {' and '.join(['the data'] * files + ['the tokenizer'] * tokenizer)} the run used"
    else:
        fix = "resume with the version of finetune-lora the run started with"
    return (f"{'; '.join(parts)}: {fix}, or start a new run in another --out (export-peft --run {out} --out ADAPTER, "
            "then --init-adapter ADAPTER to start from this run's adapters)")


def _is_data_record(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("digest"), str) and isinstance(entry.get("path"), str)
            and all(isinstance(entry.get(k), int) for k in ("examples", "tokens")))


def _counts(entry: dict[str, Any]) -> str:
    return f"{entry['examples']:,} examples, {entry['tokens']:,} tokens"


def read_data_record(path: Path) -> dict[str, Any] | None:
    """RUN/run_data.json as recorded; None for a run without one (started by an older version)."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path}: cannot be read ({getattr(e, 'msg', None) or e}); restore it, or delete it "
                          "to resume without checking the data") from None
    if not (isinstance(recorded, dict) and isinstance(recorded.get("step"), int)
            and _is_data_record(recorded.get("data"))
            and ("eval_data" not in recorded or _is_data_record(recorded["eval_data"]))):
        raise RunDirError(f'{path}: expected {{"step", "data": {{"digest", "examples", "tokens", ...}}}}; restore '
                          "it, or delete it to resume without checking the data")
    return recorded
