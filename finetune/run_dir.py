"""Read a finetune-lora run directory: its config, and the LoRA parameters of one of its checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from finetune.checkpoints import RunCheckpoints
from finetune.config import TrainConfig
from finetune.step import TrainState, make_optimizer, split_model
from jaxmodel.config import LlamaConfig
from jaxmodel.errors import UserError
from jaxmodel.formats.io import read_json
from jaxmodel.formats.markers import RUN_CONFIG
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.model import LlamaForCausalLM


class RunError(ValueError, UserError):
    """A directory that is not a usable finetune-lora run; the message names the file and what is wrong."""


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


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[nnx.State, TrainConfig, int]:
    """(LoRA state on the default device, the run's TrainConfig, the step restored; default: newest)."""
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    checkpoints = RunCheckpoints(run_dir / "checkpoints", keep=config.keep_checkpoints)
    steps = sorted(checkpoints.manager.all_steps())
    if not steps:
        raise RunError(f"{run_dir}: no LoRA checkpoints (expected {run_dir / 'checkpoints'} from finetune-lora)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise RunError(f"{run_dir}: no checkpoint for step {step} (have: {', '.join(map(str, steps))})")
    llama = LlamaConfig.from_hf(config.model)
    lora = lora_template(llama, config.lora_config())
    tx, _ = make_optimizer(config)
    like = TrainState(jnp.int32(0), lora, tx.init(lora), jax.random.key(0))
    state, _ = checkpoints.restore(like, step)
    checkpoints.close()
    return state.lora, config, step


def lora_template(llama: LlamaConfig, lora_config: LoraConfig) -> nnx.State:
    """Zero LoRA parameters of the right shapes (and metadata), without building the base weights."""
    def build():
        model = LlamaForCausalLM(llama, rngs=nnx.Rngs(0))
        return apply_lora(model, lora_config, rngs=nnx.Rngs(0))

    _, lora, _ = split_model(nnx.eval_shape(build))
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), lora)
