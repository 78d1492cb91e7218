"""Read a finetune-lora run directory (`finetune.run.files`): its config (as started, and as changed by
resumes), and the LoRA parameters of one of its checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from finetune.run.checkpoints import CheckpointError, RunCheckpoints, describe_damaged
from finetune.config import TrainConfig
from finetune.run.errors import RunError
from finetune.run.files import BASE_SOURCE, CHECKPOINTS, RESUMES, RUN_CONFIG
from finetune.step.train_step import TrainState, make_optimizer, split_model
from jaxmodel.config import ModelConfig
from jaxmodel.formats.checkpoint import check_source
from jaxmodel.formats.io import read_json
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.model import CausalLM


def read_run_config(run_dir: str | Path) -> TrainConfig:
    """The TrainConfig a run was started with (its `run_config.json`)."""
    config_path = Path(run_dir) / RUN_CONFIG
    if not config_path.is_file():
        raise RunError(f"{run_dir}: not a finetune-lora run directory (no {RUN_CONFIG})")
    raw = read_json(config_path, RunError)
    if not isinstance(raw, dict):
        raise RunError(f"{config_path}: expected a JSON object of options")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise RunError(f"{config_path}: unknown option '{unknown[0]}' (written by another version of finetune-lora?)")
    return TrainConfig(**raw)


def run_model_config(run_dir: str | Path) -> ModelConfig:
    """The ModelConfig of the base a run trained (its converted checkpoint's config.json)."""
    return ModelConfig.from_hf(read_run_config(run_dir).model)


def read_base_source(run_dir: str | Path) -> dict | None:
    """The HF checkpoint the run's base was converted from (`base_source.json`), or None for a run without that
    record (started on an older conversion, or by an older finetune-lora)."""
    path = Path(run_dir) / BASE_SOURCE
    if not path.is_file():
        return None
    return check_source(read_json(path, RunError), str(path), RunError)


def read_resumes(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's resumes, oldest first: {"time", "from_step", "changes": {option: [old, new]}, ...}."""
    path = Path(run_dir) / RESUMES
    if not path.is_file():
        return []
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    resumes = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise RunError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        changes = entry.get("changes") if isinstance(entry, dict) else None
        if not isinstance(changes, dict) or not all(isinstance(v, list) and len(v) == 2 for v in changes.values()):
            raise RunError(f"{path}:{number}: expected an object with 'changes': {{option: [old, new]}}")
        unknown = sorted(set(changes) - known)
        if unknown:
            raise RunError(f"{path}:{number}: unknown option '{unknown[0]}' (written by another version of "
                           "finetune-lora?)")
        resumes.append(entry)
    return resumes


def current_run_config(run_dir: str | Path) -> TrainConfig:
    """The run's TrainConfig as its last invocation ran it: `run_config.json` with every resume's changes."""
    config = read_run_config(run_dir)
    for entry in read_resumes(run_dir):
        config = dataclasses.replace(config, **{name: new for name, (_, new) in entry["changes"].items()})
    return config


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the run's complete checkpoints (directories named by their step), without opening Orbax."""
    directory = Path(run_dir) / CHECKPOINTS
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def load_run(run_dir: str | Path, step: int | None = None,
             warn: Callable[[str], None] | None = None) -> tuple[nnx.State, TrainConfig, int]:
    """(LoRA state on the default device, the run's TrainConfig, the step restored).

    Default: the newest checkpoint that restores; damaged newer ones are named through `warn` (default: a
    `warning:` line on stderr). A `step` asked for must restore itself."""
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise RunError(f"{run_dir}: no LoRA checkpoints (expected {run_dir / CHECKPOINTS} from finetune-lora)")
    if step is not None and step not in steps:
        raise RunError(f"{run_dir}: no checkpoint for step {step} (have: {', '.join(map(str, steps))})")
    llama = ModelConfig.from_hf(config.model)
    lora = lora_template(llama, config.lora_config(llama))
    tx, _ = make_optimizer(config)
    like = TrainState(jnp.int32(0), lora, tx.init(lora), jax.random.key(0))
    checkpoints = RunCheckpoints(run_dir / CHECKPOINTS, keep=config.keep_checkpoints, read_only=True)
    try:
        if step is not None:
            state, _ = checkpoints.restore(like, step)
        else:
            state, _, step, damaged = checkpoints.restore_newest_intact(like)
            if damaged:
                (warn or _warn)(f"{run_dir / CHECKPOINTS}: {describe_damaged(damaged)}; using step {step}")
    except CheckpointError as e:
        raise RunError(str(e)) from None
    finally:
        checkpoints.close()
    return state.lora, config, step


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def lora_template(llama: ModelConfig, lora_config: LoraConfig) -> nnx.State:
    """Zero LoRA parameters of the right shapes (and metadata), without building the base weights."""
    def build():
        model = CausalLM(llama, rngs=nnx.Rngs(0))
        return apply_lora(model, lora_config, rngs=nnx.Rngs(0))

    _, lora, _ = split_model(nnx.eval_shape(build))
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), lora)
