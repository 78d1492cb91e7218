"""Read a finetune-lora run directory: its config, and the LoRA parameters of one of its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from export.peft import AdapterError
from finetune.checkpoints import RunCheckpoints
from finetune.config import TrainConfig
from finetune.step import TrainState, make_optimizer, split_model
from finetune.train import RUN_CONFIG
from jaxmodel.config import LlamaConfig
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.model import LlamaForCausalLM


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[nnx.State, TrainConfig, int]:
    """(LoRA state on the default device, the run's TrainConfig, the step restored; default: newest)."""
    run_dir = Path(run_dir)
    config_path = run_dir / RUN_CONFIG
    if not config_path.is_file():
        raise AdapterError(f"{run_dir}: not a finetune-lora run directory (no {RUN_CONFIG})")
    config = TrainConfig(**json.loads(config_path.read_text()))
    checkpoints = RunCheckpoints(run_dir / "checkpoints", keep=config.keep_checkpoints)
    steps = sorted(checkpoints.manager.all_steps())
    if not steps:
        raise AdapterError(f"{run_dir}: no LoRA checkpoints (expected {run_dir / 'checkpoints'} from finetune-lora)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise AdapterError(f"{run_dir}: no checkpoint for step {step} (have: {', '.join(map(str, steps))})")
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
