"""A finetune-lora run's adapters as a PEFT adapter directory, or folded into a merged HF checkpoint."""

from __future__ import annotations

from pathlib import Path

from export.merge import save_merged
from finetune.run_dir import load_run
from jaxmodel.formats.peft_adapter import save_peft_adapter
from jaxmodel.lora import LoraConfig


def export_adapter(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "float32",
                   base_model: str | None = None) -> tuple[Path, int, LoraConfig]:
    """Write the LoRA adapters of `step` (default: newest) of a run as a PEFT adapter; returns (out, the step,
    the adapters' LoraConfig)."""
    lora, config, step = load_run(run_dir, step)
    card = {"training steps": step, "learning rate": config.lr, "sequence length": config.seq_len}
    path = save_peft_adapter(out, lora, config.lora_config(), base_model=base_model or config.model, dtype=dtype,
                             card=card)
    return path, step, config.lora_config()


def export_merged(run_dir: str | Path, out: str | Path, *, step: int | None = None,
                  max_shard_size: int = 5 * 10**9) -> tuple[Path, int]:
    """Write the run's base with the adapters of `step` folded in, as a HF checkpoint; returns (out, step)."""
    lora, config, step = load_run(run_dir, step)
    return save_merged(out, config.model, lora, config.lora_config(), max_shard_size=max_shard_size), step
