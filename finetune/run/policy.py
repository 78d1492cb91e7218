"""What a `--resume` may change: each option's policy (refused, allowed, not compared) and the comparison of a
stored run config with a new one."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from finetune.config import Allowed, NotCompared, Refused, TrainConfig, flag_of


def _declared(policy: type) -> dict[str, str]:
    """{option: why} for the options TrainConfig declares with this resume policy (finetune/config.py)."""
    return {f.name: f.metadata["resume"].why for f in dataclasses.fields(TrainConfig)
            if isinstance(f.metadata["resume"], policy)}


# Options a resume cannot change, and why: each either shapes what the checkpoints hold, decides which rows
# the data position counts, or defines the function being optimised (so the run would no longer be the one
# run_config.json describes, and export-peft reads the LoRA shape and base model from there).
IMMUTABLE = _declared(Refused)
# Options a resume may change (recorded in resumes.jsonl), and why they may.
MUTABLE = _declared(Allowed)
# Not compared: where the run is (the same directory, however spelled) and how this invocation treats it.
NOT_COMPARED = tuple(_declared(NotCompared))
# Compared as files: the same file under another spelling is no change.
PATHS = ("model", "data", "eval_data", "init_adapter")


def same_path(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if a is None or b is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def compare(stored: TrainConfig, new: TrainConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """({refused option: (old, new)}, {allowed option: (old, new)}) where `new` differs from `stored`."""
    refused, allowed = {}, {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in NOT_COMPARED:
            continue
        old, value = stored.value(f.name), new.value(f.name)  # an objective's default as the value it stands for
        if (same_path(old, value) if f.name in PATHS else old == value):
            continue
        (refused if f.name in IMMUTABLE else allowed)[f.name] = (old, value)
    return refused, allowed


def describe_changes(changes: dict[str, tuple]) -> str:
    """`--rank: 8 -> 16, --seq-len: 32 -> 64`."""
    return ", ".join(f"--{flag_of(name)}: {old} -> {new}" for name, (old, new) in changes.items())
