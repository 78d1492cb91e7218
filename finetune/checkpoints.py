"""Run checkpoints with Orbax: LoRA parameters, optimizer state, step, data position and RNG, together.

Saves are asynchronous (training goes on while the bytes are written) and the newest `keep` are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from finetune.step import TrainState


class RunCheckpoints:
    def __init__(self, directory: Path, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
        self.manager = ocp.CheckpointManager(directory.absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, meta: dict[str, Any]) -> None:
        step = int(jax.device_get(state.step))
        tree = {"step": state.step, "lora": state.lora, "opt_state": state.opt_state,
                "rng": jax.random.key_data(state.rng)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, like: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """The state saved at `step` (default: newest), laid out with `like`'s shardings."""
        step = self.manager.latest_step() if step is None else step
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                {"step": like.step, "lora": like.lora, "opt_state": like.opt_state,
                                 "rng": jax.random.key_data(like.rng)})
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      meta=ocp.args.JsonRestore()))
        tree = restored["state"]
        state = TrainState(tree["step"], tree["lora"], tree["opt_state"], jax.random.wrap_key_data(tree["rng"]))
        return state, restored["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
