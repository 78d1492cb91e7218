"""What a directory is, from the marker files each tool writes, so any tool can recognise another's output
(e.g. to refuse to overwrite a run or a converted checkpoint)."""

from __future__ import annotations

from pathlib import Path

from jaxmodel.formats.checkpoint import MANIFEST
from jaxmodel.formats.hf_checkpoint import WEIGHT_FILES
from jaxmodel.formats.peft_adapter import ADAPTER_CONFIG

RUN_CONFIG = "run_config.json"  # written first into every finetune-lora run directory

HF_CHECKPOINT = "HF checkpoint"
CONVERTED_CHECKPOINT = "converted checkpoint"
RUN = "finetune-lora run"
ADAPTER = "PEFT adapter"


def directory_kind(path: str | Path) -> str | None:
    """Which of the toolkit's directory kinds `path` holds (one of the constants above), or None."""
    kinds = directory_kinds(path)
    return kinds[0] if kinds else None


def directory_kinds(path: str | Path) -> list[str]:
    """Every kind whose marker files `path` holds, in `directory_kind`'s order of precedence: more than one
    means a directory mixing outputs (e.g. a HF checkpoint with an adapter_config.json dropped into it)."""
    path = Path(path)
    if not path.is_dir():
        return []
    found = {CONVERTED_CHECKPOINT: (path / MANIFEST).is_file(), RUN: (path / RUN_CONFIG).is_file(),
             ADAPTER: (path / ADAPTER_CONFIG).is_file(),
             HF_CHECKPOINT: any((path / name).is_file() for name in WEIGHT_FILES)}
    return [kind for kind, present in found.items() if present]
