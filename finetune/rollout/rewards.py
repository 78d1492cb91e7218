"""Reward functions for online RL, the ones users already wrote for TRL and the common built-ins.

`--reward path/to/rewards.py:function` loads `function` from that file; a built-in is named instead:
`equals:COLUMN` (1.0 when the completion's text, stripped, equals the row's COLUMN, else 0.0), `regex:PATTERN`
(1.0 when the completion matches PATTERN from its start, Python's `re.match` with DOTALL) and `last-number:COLUMN`
(1.0 when the last number in the completion equals the number in the row's COLUMN). Each is called as TRL's
`GRPOTrainer` calls a reward function: keyword arguments `prompts`, `completions` (texts, or for chat prompts a
list of one assistant message each), `completion_ids`, every other column of the dataset (one value a completion),
`trainer_state` (`global_step`, `max_steps`, `epoch`), `log_extra` and `log_metric`; it returns one float (or None:
not applicable) a completion. A function that raises or returns the wrong number stops the run with one line
naming it and the first dataset row it fails on (`file:line`, as the data's errors name rows).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from finetune.config import ConfigFileError
from jaxmodel.errors import UserError

BUILTINS = ("equals", "regex", "last-number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(RuntimeError, UserError):
    """A reward function that failed on a batch: its name, the row and what went wrong, in one line."""


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What a reward function sees of the run (TRL passes its `TrainerState`; these are the fields it has too)."""

    global_step: int
    max_steps: int
    epoch: float


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str  # as given: "path.py:function" or a built-in's spec
    function: Callable[..., Sequence[float | None]]

    @property
    def short_name(self) -> str:
        """The name its metrics go by: a file's function by its own name (as TRL names them), a built-in by its
        spec."""
        kind = self.name.partition(":")[0]
        return self.name if kind in BUILTINS else self.name.rpartition(":")[2]


def load_reward(spec: str) -> Reward:
    """The reward `spec` names (module docstring); a bad spec is a `ConfigFileError` naming it."""
    kind, sep, argument = spec.partition(":")
    if kind in BUILTINS and sep:
        return Reward(spec, _builtin(kind, argument, spec))
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ConfigFileError(f"--reward {spec!r}: expected path/to/file.py:function or one of "
                              f"{', '.join(b + ':...' for b in BUILTINS)}")
    file = Path(path)
    if not file.is_file():
        raise ConfigFileError(f"--reward {spec!r}: no file {file}")
    module_name = "finetune_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        sys.modules[module_name] = module  # dataclasses and pickling look their module up
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any error it raises is theirs to fix
        sys.modules.pop(module_name, None)
        raise ConfigFileError(f"--reward {spec!r}: {file} failed to load: {type(e).__name__}: {e}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigFileError(f"--reward {spec!r}: {file} defines no function {name!r}")
    return Reward(spec, function)


def score(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], state: TrainerState, rows: Sequence[str],
          log_extra: Callable[..., None] = lambda *a, **k: None,
          log_metric: Callable[..., None] = lambda *a, **k: None) -> np.ndarray:
    """Each reward function's rewards `[completions, functions]` float32 (NaN where it returned None) of the
    completions of the dataset rows `rows` names (one a completion, e.g. `prompts.jsonl:3`), called as TRL calls
    them."""
    out = np.zeros((len(completions), len(rewards)), np.float32)
    for i, reward in enumerate(rewards):
        # a column named as one of TRL's own arguments is shadowed by it, as in TRL
        kwargs = {**columns, "prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "trainer_state": state, "log_extra": log_extra, "log_metric": log_metric}
        try:
            values = reward.function(**kwargs)
            out[:, i] = _as_rewards(values, len(completions))
        except Exception as e:  # the user's function: found out which row it fails on, and say so
            row, problem = _first_failing_row(reward, kwargs, rows, e)
            raise RewardError(f"reward {reward.name}: {problem} ({row})") from None
    return out


def _as_rewards(values, n: int) -> np.ndarray:
    values = list(values)
    if len(values) != n:
        raise _CountError(f"returned {len(values)} rewards for {n} completions")
    return np.array([np.nan if v is None else float(v) for v in values], np.float32)


class _CountError(ValueError):
    pass


def _first_failing_row(reward: Reward, kwargs: dict[str, Any], rows: Sequence[str], error: Exception
                       ) -> tuple[str, str]:
    """(the dataset row of the first completion the function fails on alone, what went wrong): a wrong count is
    the batch's (its first row); otherwise each completion is scored by itself until one fails."""
    if isinstance(error, _CountError):
        return rows[0], str(error)
    for j, row in enumerate(rows):
        alone = {k: v[j:j + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
        try:
            _as_rewards(reward.function(**alone), 1)
        except Exception as e:
            return row, f"{type(e).__name__}: {e}"
    return rows[0], f"{type(error).__name__}: {error}"


def _text(completion) -> str:
    """A completion's text: itself, or the content of its assistant message (chat prompts)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _builtin(kind: str, argument: str, spec: str) -> Callable[..., list[float]]:
    if kind == "regex":
        try:
            pattern = re.compile(argument, re.DOTALL)
        except re.error as e:
            raise ConfigFileError(f"--reward {spec!r}: not a regular expression: {e}") from None
        return lambda completions, **_: [float(pattern.match(_text(c)) is not None) for c in completions]
    if not argument:
        raise ConfigFileError(f"--reward {spec!r}: name the dataset column to compare with ({kind}:COLUMN)")

    def column(kwargs: dict) -> list:
        if argument not in kwargs:
            raise KeyError(f"the dataset has no column {argument!r}")
        return kwargs[argument]

    if kind == "equals":
        return lambda completions, **kw: [float(_text(c).strip() == str(v).strip())
                                          for c, v in zip(completions, column(kw))]

    def last_number(completions, **kw):
        return [float(_same_number(_last_number(_text(c)), v)) for c, v in zip(completions, column(kw))]

    return last_number


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return None if not found else float(found[-1].replace(",", ""))


def _same_number(got: float | None, expected) -> bool:
    if got is None:
        return False
    want = expected if isinstance(expected, (int, float)) else _last_number(str(expected))
    return want is not None and math.isclose(got, float(want), rel_tol=0, abs_tol=1e-9)
