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
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / MANIFEST).is_file():
        return CONVERTED_CHECKPOINT
    if (path / RUN_CONFIG).is_file():
        return RUN
    if (path / ADAPTER_CONFIG).is_file():
        return ADAPTER
    if any((path / name).is_file() for name in WEIGHT_FILES):
        return HF_CHECKPOINT
    return None
