"""A finetune-lora run's adapters as a PEFT adapter directory, or folded into a merged HF checkpoint."""

from __future__ import annotations

from pathlib import Path

from export.merge import merge_base_for, save_merged
from finetune.run.reading import load_run, read_run_config
from jaxmodel.formats.checkpoint import MANIFEST, checkpoint_quantization, read_manifest
from jaxmodel.formats.markers import ADAPTER, HF_CHECKPOINT
from jaxmodel.formats.output_dir import check_output_dir
from jaxmodel.formats.peft_adapter import save_peft_adapter
from jaxmodel.lora import LoraConfig


def check_export_targets(run_dir: str | Path, out: str | Path | None = None, merge: str | Path | None = None, *,
                         overwrite: bool = False,
                         merge_base: str | Path | None = None) -> tuple[Path | None, Path | None]:
    """Refuse, before any checkpoint is read, an `out` (adapter) or `merge` (HF checkpoint) directory that would
    replace the run, its base model, `merge_base`, the other output or anything but export-peft's own kind of
    output (that only with `overwrite`); with `merge`, also weights a merge cannot use (`merge_base_for`).
    Returns both outputs resolved (None where not given)."""
    config = read_run_config(run_dir)
    inputs = [("--run", run_dir), ("the run's base model", config.model)]
    if merge_base is not None:
        inputs.append(("--merge-base", merge_base))
    targets = []
    for option, path, writes, other in (("--out", out, ADAPTER, ("--merge", merge)),
                                        ("--merge", merge, HF_CHECKPOINT, ("--out", out))):
        targets.append(None if path is None else check_output_dir(
            path, option=option, writes=writes, overwrite=overwrite, inputs=inputs,
            separate=[other] if other[1] is not None else []))
    if merge is not None:
        merge_base_for(config.model, merge_base).close()
    return targets[0], targets[1]


def export_adapter(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "float32",
                   base_model: str | None = None, overwrite: bool = False) -> tuple[Path, int, LoraConfig]:
    """Write the LoRA adapters of `step` (default: newest) of a run as a PEFT adapter; returns (out, the step,
    the adapters' LoraConfig). An existing adapter at `out` is replaced only with `overwrite`. The adapter is
    the same whether the run's base was quantized or not; its model card records which."""
    target, _ = check_export_targets(run_dir, out, overwrite=overwrite)
    lora, config, step = load_run(run_dir, step)
    card = {"training steps": step, "learning rate": config.lr, "sequence length": config.seq_len,
            "base quantization in training": base_weights(config.model)}
    save_peft_adapter(target, lora, config.lora_config(), base_model=base_model or config.model, dtype=dtype,
                      card=card)
    return Path(out), step, config.lora_config()


def base_weights(converted_dir: str | Path) -> str:
    """How the run's converted base held its projections: "none", or the scheme and block."""
    quantization = checkpoint_quantization(read_manifest(converted_dir), Path(converted_dir) / MANIFEST)
    if quantization is None:
        return "none"
    return (f"{quantization.scheme}, blocks of {quantization.block} (QLoRA: convert-llama --quantize "
            f"{quantization.scheme} --quant-block {quantization.block})")


def export_merged(run_dir: str | Path, out: str | Path, *, step: int | None = None,
                  max_shard_size: int = 5 * 10**9, overwrite: bool = False,
                  merge_base: str | Path | None = None) -> tuple[Path, int]:
    """Write the run's base with the adapters of `step` folded in, as a HF checkpoint; returns (out, step).
    The base is the run's converted checkpoint or, for a quantized one, `merge_base`: its unquantized weights
    (a converted checkpoint or a HF checkpoint directory). An existing HF checkpoint at `out` is replaced only
    with `overwrite`."""
    _, target = check_export_targets(run_dir, merge=out, overwrite=overwrite, merge_base=merge_base)
    lora, config, step = load_run(run_dir, step)
    save_merged(target, merge_base_for(config.model, merge_base), lora, config.lora_config(),
                max_shard_size=max_shard_size)
    return Path(out), step
