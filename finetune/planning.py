"""`finetune-lora --plan`: prove a run fits before renting the node.

Builds the model with LoRA from abstract shapes only (no weights), lays every parameter, optimizer moment
and batch onto the mesh exactly as a run does, lowers and compiles the same jit train step for the mesh's
devices (simulated CPU devices work), and reports the compiler's per-device memory against `--hbm-gb`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from finetune.config import TrainConfig
from finetune.memory import per_device_bytes, sharding_table
from finetune.mesh import make_mesh
from finetune.setup import check_batch_split, check_seq_len
from finetune.step import BATCH_KEYS, DTYPES, TrainState, jit_steps, make_optimizer, optimizer_shardings, split_model
from jaxmodel.config import LlamaConfig
from jaxmodel.lora import apply_lora
from jaxmodel.model import LlamaForCausalLM
from jaxmodel.sharding import DEFAULT_RULES, batch_sharding, named_sharding

GB = 1e9


@dataclasses.dataclass
class PlanReport:
    mesh: dict[str, int]
    backend: str
    weights: float  # bytes per device
    lora_and_optimizer: float
    batch: float
    temp: float
    compile_seconds: float
    hbm: float
    lines: list[str]

    @property
    def total(self) -> float:
        return self.weights + self.lora_and_optimizer + self.batch + self.temp

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    def __str__(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        rows = [("frozen weights", self.weights), ("LoRA params + AdamW state", self.lora_and_optimizer),
                ("batch", self.batch), ("activations / temporaries", self.temp),
                ("total", self.total)]
        out = self.lines + [f"memory per device, mesh {mesh}, {self.backend} compiler "
                            f"(compiled in {self.compile_seconds:.0f} s):"]
        out += [f"  {name:<40} {value / GB:10.2f} GB" for name, value in rows]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        out.append(f"  {verdict} in {self.hbm / GB:.0f} GB per device ({self.total / self.hbm:.0%} used)")
        return "\n".join(out)


def _param_dtype(config: TrainConfig, raw: dict):
    if config.param_dtype != "keep":
        return DTYPES[config.param_dtype]
    return DTYPES.get(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16", jnp.bfloat16)


def _abstract_on(tree, mesh, rules):
    def lay(var):
        sharding = named_sharding(var.get_metadata()["axes"], var.shape, mesh, rules)
        var.set_value(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding))
        return var
    return jax.tree.map(lay, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def plan(config: TrainConfig) -> PlanReport:
    source = Path(config.model_config or config.model)
    llama = LlamaConfig.from_hf(source)  # a clear error for a missing or malformed config
    raw = json.loads((source / "config.json" if source.is_dir() else source).read_text())
    mesh = make_mesh(config.mesh)
    check_seq_len(config, llama, mesh)
    check_batch_split(config, mesh, DEFAULT_RULES)
    dtype, param_dtype = DTYPES[config.dtype], _param_dtype(config, raw)
    start = time.perf_counter()
    compiled, trees = _compile(config, llama, mesh, dtype, param_dtype)
    temp = float(compiled.memory_analysis().temp_size_in_bytes)
    lines = [f"model: {source} ({sum(math.prod(x.shape) for x in jax.tree.leaves(trees['base'])) / 1e9:.1f}B frozen "
             f"parameters, {sum(math.prod(x.shape) for x in jax.tree.leaves(trees['lora'])) / 1e6:.1f}M LoRA parameters)",
             f"batch {config.batch_size} x seq {config.seq_len}, grad accumulation {config.grad_accum}, "
             f"dtype {config.dtype}, remat {config.remat}, attention {config.attention_impl(mesh.shape['cp'])}, "
             f"loss chunk {config.loss_chunk or 'none'}, MLP chunk {config.mlp_chunk or 'none'}"]
    backend = jax.default_backend()
    if backend == "cpu" and jnp.dtype(dtype).itemsize < 4:
        # The CPU compiler turns 16-bit matmuls into float32 ones and hoists float32 copies of the weights,
        # so its temporaries for a bf16 step say little about an accelerator. Every temporary of the step
        # (activations, gathered layer weights) is in the compute dtype, so the same step compiled in
        # float32 and scaled by the dtype's size is the estimate used.
        f32, _ = _compile(config, llama, mesh, jnp.float32, jnp.float32)
        lines.append(f"CPU compiler's own temporaries for the {config.dtype} step: {temp / GB:.2f} GB (bf16 matmuls "
                     f"upcast to float32); estimate below: the float32 step's, scaled by {jnp.dtype(dtype).itemsize}/4")
        temp = float(f32.memory_analysis().temp_size_in_bytes) * jnp.dtype(dtype).itemsize / 4
    if config.show_sharding:
        lines = sharding_table(trees["base"], trees["lora"]) + lines
    return PlanReport(mesh=dict(mesh.shape), backend=backend, weights=per_device_bytes(trees["base"]),
                      lora_and_optimizer=per_device_bytes(trees["lora"]) + per_device_bytes(trees["opt_state"]),
                      batch=per_device_bytes(trees["batch"]), temp=temp,
                      compile_seconds=time.perf_counter() - start, hbm=config.hbm_gb * GB, lines=lines)


def _compile(config: TrainConfig, llama: LlamaConfig, mesh, dtype, param_dtype):
    """The run's jit train step, lowered and compiled from abstract, sharded inputs."""
    with jax.set_mesh(mesh):
        def build():
            model = LlamaForCausalLM(llama, dtype=dtype, param_dtype=param_dtype, remat=config.remat,
                                     attention=config.attention_impl(mesh.shape["cp"]), mlp_chunk=config.mlp_chunk,
                                     rules=DEFAULT_RULES, rngs=nnx.Rngs(0))
            return apply_lora(model, config.lora_config(), rngs=nnx.Rngs(0))

        graphdef, lora, base = split_model(nnx.eval_shape(build))
        lora, base = _abstract_on(lora, mesh, DEFAULT_RULES), _abstract_on(base, mesh, DEFAULT_RULES)
        tx, schedule = make_optimizer(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 jax.eval_shape(tx.init, lora), optimizer_shardings(tx, lora, replicated))
        key = jax.eval_shape(lambda: jax.random.key(0))
        state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), lora, opt_state,
                           jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated))
        shape = (config.batch_size, config.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                         sharding=batch_sharding(mesh, DEFAULT_RULES))
                 for k in BATCH_KEYS}
        train_step, _ = jit_steps(graphdef, config, tx, schedule, state, base, mesh, DEFAULT_RULES)
        compiled = train_step.lower(state, base, batch).compile()
    return compiled, {"base": base, "lora": lora, "opt_state": opt_state, "batch": batch}
