"""A finetune-lora run's adapters as a PEFT adapter directory, or folded into a merged HF checkpoint."""

from __future__ import annotations

from pathlib import Path

from export.merge import save_merged
from finetune.run_dir import load_run, read_run_config
from jaxmodel.formats.markers import ADAPTER, HF_CHECKPOINT
from jaxmodel.formats.output_dir import check_output_dir
from jaxmodel.formats.peft_adapter import save_peft_adapter
from jaxmodel.lora import LoraConfig


def check_export_targets(run_dir: str | Path, out: str | Path | None = None, merge: str | Path | None = None, *,
                         overwrite: bool = False) -> tuple[Path | None, Path | None]:
    """Refuse, before any checkpoint is read, an `out` (adapter) or `merge` (HF checkpoint) directory that would
    replace the run, its base model, the other output or anything but export-peft's own kind of output (that
    only with `overwrite`); returns both resolved (None where not given)."""
    config = read_run_config(run_dir)
    inputs = [("--run", run_dir), ("the run's base model", config.model)]
    targets = []
    for option, path, writes, other in (("--out", out, ADAPTER, ("--merge", merge)),
                                        ("--merge", merge, HF_CHECKPOINT, ("--out", out))):
        targets.append(None if path is None else check_output_dir(
            path, option=option, writes=writes, overwrite=overwrite, inputs=inputs,
            separate=[other] if other[1] is not None else []))
    return targets[0], targets[1]


def export_adapter(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "float32",
                   base_model: str | None = None, overwrite: bool = False) -> tuple[Path, int, LoraConfig]:
    """Write the LoRA adapters of `step` (default: newest) of a run as a PEFT adapter; returns (out, the step,
    the adapters' LoraConfig). An existing adapter at `out` is replaced only with `overwrite`."""
    target, _ = check_export_targets(run_dir, out, overwrite=overwrite)
    lora, config, step = load_run(run_dir, step)
    card = {"training steps": step, "learning rate": config.lr, "sequence length": config.seq_len}
    save_peft_adapter(target, lora, config.lora_config(), base_model=base_model or config.model, dtype=dtype,
                      card=card)
    return Path(out), step, config.lora_config()


def export_merged(run_dir: str | Path, out: str | Path, *, step: int | None = None,
                  max_shard_size: int = 5 * 10**9, overwrite: bool = False) -> tuple[Path, int]:
    """Write the run's base with the adapters of `step` folded in, as a HF checkpoint; returns (out, step).
    An existing HF checkpoint at `out` is replaced only with `overwrite`."""
    _, target = check_export_targets(run_dir, merge=out, overwrite=overwrite)
    lora, config, step = load_run(run_dir, step)
    save_merged(target, config.model, lora, config.lora_config(), max_shard_size=max_shard_size)
    return Path(out), step
