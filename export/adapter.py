"""A finetune-lora run's adapters as a PEFT adapter directory, or folded into a merged HF checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from export.merge import merge_base_for, save_merged
from finetune.run.reading import load_run, read_base_source, read_run_config, run_model_config
from jaxmodel.formats.checkpoint import MANIFEST, checkpoint_quantization, read_manifest, source_reference
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


def base_reference(run_dir: str | Path, base_model: str | None = None,
                   note: Callable[[str], None] | None = None) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) of a run's exports: `base_model` if given, else the HF checkpoint the
    run's base was converted from (RUN/base_source.json: a hub id and its commit, or the HF directory), else the
    converted checkpoint itself, which `note` (default: a line on stderr) says how to replace."""
    if base_model:
        return base_model, None
    source = read_base_source(run_dir)
    if source is not None:
        return source_reference(source)
    model = read_run_config(run_dir).model
    (note or _note)(f"the run's base {model} records no HF checkpoint it was converted from, so the export names "
                    "that converted directory as its base; set it with --base-model HUB_ID_OR_HF_DIR")
    return model, None


def _note(message: str) -> None:
    print(f"export-peft: note: {message}", file=sys.stderr)


def export_adapter(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "float32",
                   base_model: str | None = None, overwrite: bool = False,
                   note: Callable[[str], None] | None = None,
                   expert_layout: str = "fused") -> tuple[Path, int, LoraConfig]:
    """Write the LoRA adapters of `step` (default: newest) of a run as a PEFT adapter, the routed experts' in
    `expert_layout` (`jaxmodel.formats.peft_adapter.EXPERT_LAYOUTS`); returns (out, the step, the adapters'
    LoraConfig). An existing adapter at `out` is replaced only with `overwrite`. The adapter is the same whether
    the run's base was quantized or not; its model card records which. Its base is named as `base_reference` finds
    it."""
    target, _ = check_export_targets(run_dir, out, overwrite=overwrite)
    lora, config, step = load_run(run_dir, step)
    name, revision = base_reference(run_dir, base_model, note)
    card = {"training steps": step, "learning rate": config.value("lr"), "sequence length": config.seq_len,
            "base quantization in training": base_weights(config.model)}
    model_config = run_model_config(run_dir)
    if model_config.num_experts:
        card["experts' layout"] = expert_layout
    save_peft_adapter(target, lora, config.lora_config(model_config), model_config=model_config,
                      base_model=name, revision=revision, dtype=dtype, card=card, expert_layout=expert_layout)
    return Path(out), step, config.lora_config(model_config)


def base_weights(converted_dir: str | Path) -> str:
    """How the run's converted base held its projections: "none", or the scheme and block."""
    quantization = checkpoint_quantization(read_manifest(converted_dir), Path(converted_dir) / MANIFEST)
    if quantization is None:
        return "none"
    return (f"{quantization.scheme}, blocks of {quantization.block} (QLoRA: convert-llama --quantize "
            f"{quantization.scheme} --quant-block {quantization.block})")


def export_merged(run_dir: str | Path, out: str | Path, *, step: int | None = None,
                  max_shard_size: int = 5 * 10**9, overwrite: bool = False,
                  merge_base: str | Path | None = None, base_model: str | None = None,
                  note: Callable[[str], None] | None = None, dtype: str = "keep") -> tuple[Path, int]:
    """Write the run's base with the adapters of `step` folded in, as a HF checkpoint; returns (out, step).
    The base is the run's converted checkpoint or, for a quantized one, `merge_base`: its unquantized weights
    (a converted checkpoint or a HF checkpoint directory). An existing HF checkpoint at `out` is replaced only
    with `overwrite`. config.json's `_name_or_path` and a README.md card name the base (`base_reference`) and
    the run. `dtype` (`export.merge.MERGE_DTYPES`): keep each tensor's dtype (an FP8 base's FP8), or bfloat16."""
    _, target = check_export_targets(run_dir, merge=out, overwrite=overwrite, merge_base=merge_base)
    lora, config, step = load_run(run_dir, step)
    name, revision = base_reference(run_dir, base_model, note)
    lora_config = config.lora_config(run_model_config(run_dir))
    card = merged_card(name, revision, Path(run_dir).resolve(), step, lora_config)
    save_merged(target, merge_base_for(config.model, merge_base), lora, lora_config,
                max_shard_size=max_shard_size, name_or_path=name, card=card, dtype=dtype)
    return Path(out), step


def merged_card(base: str, revision: str | None, run_dir: Path, step: int, lora: LoraConfig) -> str:
    """The README.md of a merged checkpoint: its base, and the run and step whose adapters it holds."""
    at = f" at revision {revision}" if revision else ""
    return "\n".join([
        "---", f"base_model: {base}", "library_name: transformers", "tags:", "- llama-jax", "- lora", "- merged",
        "---", "", f"# {base} with LoRA adapters merged", "",
        f"The weights of {base}{at} with the LoRA adapters (r={lora.rank}, alpha={lora.alpha:g}, targets "
        f"{', '.join(sorted(lora.targets))}) of the finetune-lora run {run_dir}, step {step}, folded in by "
        "llama-jax's export-peft --merge.", "",
    ])
