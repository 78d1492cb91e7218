"""`finetune-lora --plan`: prove a run fits before renting the node.

Builds the model with LoRA from abstract shapes only (no weights), lays every parameter, optimizer moment
and batch onto the mesh exactly as a run does, lowers and compiles the same jit train step for the mesh's
devices (simulated CPU devices work), and reports the compiler's per-device memory, plus a margin measured
against real runs, against the part of `--hbm-gb` that JAX's allocator will let the run use.

A quantized base (`jaxmodel.quantization`) is planned as it would be trained: with the quantization a converted
`--model` records, or, from a config alone, the one `--quantize` names; its frozen weights are then the codes
and scales of the projections.
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

from finetune.config import ConfigFileError, TrainConfig
from finetune.step.memory import per_device_bytes, sharding_table
from finetune.step.mesh import make_mesh
from finetune.step.checks import (check_batch_split, check_experts_split, check_policy_mesh, check_rank,
                                  check_seq_len, layer_shapes)
from finetune.step.train_step import (DTYPES, FLOAT_BATCH_KEYS, TrainState, batch_keys, jit_steps, make_optimizer,
                                     optimizer_shardings, split_model)
from finetune.planning.allocator import FRACTION, UsableMemory, fraction_to_fit, usable_memory
from finetune.planning.devices import DeviceModel, default_device_model, load_device_model
from finetune.planning.hlo_cost import StepCost, step_cost
from finetune.planning.plan_json import plan_record
from finetune.planning.rollout import Phase, plan_rollout, prompt_tokens, rollout_lines
from finetune.planning.timing import Prediction, predict
from finetune.step.flops import flops_per_token
from jaxmodel.config import ModelConfig
from jaxmodel.formats.checkpoint import MANIFEST, checkpoint_quantization, read_manifest
from jaxmodel.layers import QuantizedParam
from jaxmodel.lora import apply_lora
from jaxmodel import scopes
from jaxmodel.model import CausalLM
from jaxmodel.moe import balanced_block_share, expert_axes
from jaxmodel.quantization import Quantization
from jaxmodel.sharding import DEFAULT_RULES, batch_sharding, batch_ways, variable_sharding

GB = 1e9
# Added to the compiler's temporaries: above the largest shortfall of the compiler's total against the measured
# memory of the same runs, 20% of the temporaries (bench/plan_accuracy.py, docs/benchmarks.md "Plan accuracy").
TEMPORARIES_MARGIN = 0.25


@dataclasses.dataclass
class PlanReport:
    mesh: dict[str, int]
    backend: str
    weights: float  # bytes per device
    lora_and_optimizer: float
    batch: float
    temp: float
    compile_seconds: float
    hbm: float  # bytes of one device
    usable: UsableMemory
    lines: list[str]
    frozen_parameters: int = 0  # of the unquantized model: a quantized projection counts its weight's values
    quantization: Quantization | None = None
    prediction: Prediction | None = None
    cost: StepCost | None = None  # the compiled step's counts the prediction is made of
    rollout: list[Phase] = dataclasses.field(default_factory=list)  # an online RL run's sampler and log-prob passes
    rollout_lines: list[str] = dataclasses.field(default_factory=list)  # shown after the training step's time

    @property
    def step_seconds(self) -> float:
        """A step's predicted time: the training step's, and an online RL run's share of its rollout (inf without a
        prediction)."""
        if self.prediction is None or any(phase.prediction is None for phase in self.rollout):
            return math.inf
        return self.prediction.step_seconds + sum(phase.seconds * phase.runs for phase in self.rollout)

    @property
    def margin(self) -> float:
        return self.temp * TEMPORARIES_MARGIN

    @property
    def compiler_total(self) -> float:
        return self.weights + self.lora_and_optimizer + self.batch + self.temp

    @property
    def total(self) -> float:
        return self.compiler_total + self.margin

    @property
    def capacity(self) -> float:
        """Bytes of one device the run may use."""
        return self.hbm * self.usable.fraction

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def record(self, config: TrainConfig) -> dict:
        """This plan of `config` as `--plan-json` writes it."""
        return plan_record(config, self)

    def verdict(self) -> str:
        """`fits in ...` or `DOES NOT FIT in ...`, with the room left or missing and the fraction that would fit."""
        room = f"{self.capacity / GB:.1f} GB per device ({self.total / self.capacity:.0%} used"
        if self.fits:
            return f"fits in {room}, {(self.capacity - self.total) / GB:.1f} GB to spare)"
        line = f"DOES NOT FIT in {room}, {(self.total - self.capacity) / GB:.1f} GB missing)"
        fraction = fraction_to_fit(self.total, self.hbm)
        if fraction is not None and fraction > self.usable.fraction:
            return f"{line}; fits at {FRACTION}={fraction:.2f}"
        return line

    def __str__(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        rows = [("frozen weights", self.weights), ("LoRA params + AdamW state", self.lora_and_optimizer),
                ("batch", self.batch), ("activations / temporaries", self.temp),
                (f"margin ({TEMPORARIES_MARGIN:.0%} of temporaries, measured)", self.margin), ("total", self.total)]
        out = self.lines + (self.prediction.lines() if self.prediction is not None else []) + self.rollout_lines
        out += [f"memory per device, mesh {mesh}, {self.backend} compiler (compiled in {self.compile_seconds:.0f} s):"]
        out += [f"  {name:<40} {value / GB:10.2f} GB" for name, value in rows]
        out[-1] += f"  (compiler's figure {self.compiler_total / GB:.2f} GB)"
        out.append(f"  usable: {self.hbm / GB:g} GB x {self.usable.fraction:g} = {self.capacity / GB:.1f} GB per device "
                   f"({self.usable.reason})")
        out.append(f"  {self.verdict()}")
        return "\n".join(out)


def param_dtype(config: TrainConfig):
    """The dtype the planned run stores its weights in: `--param-dtype`, or `keep`: the checkpoint's config's."""
    if config.param_dtype != "keep":
        return DTYPES[config.param_dtype]
    source = Path(config.model_config or config.model)
    raw = json.loads((source / "config.json" if source.is_dir() else source).read_text())
    return DTYPES.get(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16", jnp.bfloat16)


def plan_quantization(config: TrainConfig) -> tuple[Quantization | None, str]:
    """The quantization the planned base has, and where it comes from: a converted `--model` records its own
    (`--quantize`, if given, must agree); a config alone takes `--quantize`."""
    try:
        asked = None if config.quantize == "none" else Quantization(config.quantize, config.quant_block)
    except ValueError as e:
        raise ConfigFileError(f"--quant-block {config.quant_block}: {e}") from None
    if config.model_config or not (Path(config.model) / MANIFEST).is_file():
        return asked, "--quantize"
    stored = checkpoint_quantization(read_manifest(config.model), Path(config.model) / MANIFEST)
    if asked is not None and (stored is None or stored.scheme != asked.scheme):
        holds = "holds unquantized weights" if stored is None else \
            f"is quantized {stored.scheme} (block {stored.block})"
        raise ConfigFileError(f"--quantize {config.quantize}: {config.model} {holds}; a plan of a converted "
                              "checkpoint takes its quantization (leave --quantize out, or plan --model-config with "
                              "--quantize)")
    return stored, "from the checkpoint"


def frozen_parameter_count(base, quantization: Quantization | None) -> int:
    """Values of the frozen weights, a quantized projection counted by its weight's values, not its codes."""
    count = 0
    for path, var in nnx.to_flat_state(base):
        if not isinstance(var, QuantizedParam):
            count += math.prod(var.shape)
        elif quantization.two_dimensional and path[-1] == "codes":  # one code per value
            count += math.prod(var.shape)
        elif not quantization.two_dimensional and path[-1] == "scales":  # one scale per block of `block` values
            count += math.prod(var.shape) * quantization.block
    return count


def _abstract_on(tree, mesh, rules):
    def lay(var):
        sharding = variable_sharding(var, mesh, rules)
        var.set_value(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sharding))
        return var
    return jax.tree.map(lay, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def plan_device_model(config: TrainConfig) -> DeviceModel:
    """The device model `--device-model` names, else the one of the accelerator the plan runs on (MI300X on a CPU)."""
    if config.device_model:
        return load_device_model(config.device_model)
    return default_device_model(jax.devices()[0].device_kind, jax.default_backend())


def expert_block_shares(config: TrainConfig, llama: ModelConfig, mesh, positions: int | None = None,
                        rows: int | None = None) -> dict[str, float]:
    """For `step_cost`: the share of the experts' grouped-matmul blocks that run when the routing is balanced
    (`jaxmodel.moe.balanced_block_share`), the work a grouped GEMM does, where the compiled loop's length is the
    worst routing's; {} for a model without experts. A pass of `rows` rows (default: a training micro-batch's) of
    `positions` positions each (default --seq-len; a sampler's decode step: 1)."""
    if not llama.num_experts:
        return {}
    rows = rows or config.step_rows // config.grad_accum
    tokens = rows // batch_ways(mesh, DEFAULT_RULES) * (positions or config.seq_len) // mesh.shape["cp"]
    mp = mesh.shape["mp"]
    tokens = tokens // mp if tokens % mp == 0 else tokens  # mp's devices share a device's tokens
    ways = math.prod(mesh.shape[a] for a in expert_axes(mesh, DEFAULT_RULES, llama.num_experts))
    return {scopes.EXPERT_BLOCK: balanced_block_share(tokens, llama.num_experts_per_tok, llama.num_experts, ways),
            scopes.EXPERT_DISPATCH: 1.0}


def plan(config: TrainConfig, cpu_bf16_figure: bool = True) -> PlanReport:
    """The plan of `config`'s run: its memory per device and its predicted time per step. On a CPU a 16-bit step
    is compiled twice, in float32 for its memory and traffic and as itself for its collectives;
    `cpu_bf16_figure=False` skips the second compile, and the plan then predicts no time."""
    usable = usable_memory()  # a bad allocator variable is an error before any compile
    device = plan_device_model(config)  # a bad --device-model too
    source = Path(config.model_config or config.model)
    llama = ModelConfig.from_hf(source)  # a clear error for a missing or malformed config
    mesh = make_mesh(config.mesh)
    check_seq_len(config, llama, mesh)
    check_experts_split(llama, mesh, DEFAULT_RULES)
    check_rank(config, llama)
    check_batch_split(config, mesh, DEFAULT_RULES)
    check_policy_mesh(config, mesh)
    if config.policy:
        prompt_tokens(config)  # a --seq-len that holds no prompt: before any compile
    quantization, quantization_source = plan_quantization(config)
    quantization = config.multiplied(quantization)
    if quantization is not None:
        for name, (in_features, out_features) in layer_shapes(llama).items():
            try:
                if name != "lm_head":  # never quantized
                    quantization.shapes((out_features, in_features))
            except ValueError as e:  # the block does not divide this projection's input dimension
                raise ConfigFileError(f"--quantize {quantization.scheme}: {e} of {name} ({source}); "
                                      "convert-llama --quant-block sets the block") from None
    dtype, stored = DTYPES[config.dtype], param_dtype(config)
    backend, itemsize = jax.default_backend(), jnp.dtype(dtype).itemsize
    cpu_16bit = backend == "cpu" and itemsize < 4
    start = time.perf_counter()
    compiled, trees = _compile(config, llama, mesh, dtype, stored, quantization,
                               lower=cpu_bf16_figure or not cpu_16bit)
    shares = expert_block_shares(config, llama, mesh)
    cost = step_cost(compiled.as_text(), mesh.size, cpu_16bit, shares) if compiled is not None else None
    frozen = frozen_parameter_count(trees["base"], quantization)
    lines = [f"model: {source} ({frozen / 1e9:.1f}B frozen parameters, "
             f"{sum(math.prod(x.shape) for x in jax.tree.leaves(trees['lora'])) / 1e6:.1f}M LoRA parameters)"]
    if quantization is not None:
        square = f" x {quantization.block}" if quantization.two_dimensional else ""
        lines.append(f"frozen projections {quantization.scheme} in blocks of {quantization.block}{square} "
                     f"({quantization_source}): codes and float32 scales, "
                     + ("dequantized layer by layer" if quantization.matmul is None else
                        f"multiplied in {quantization.matmul} (--fp8-matmul; its dots timed at --dtype's rate)"))
    lines += [f"batch {config.batch_size} x seq {config.seq_len}, grad accumulation {config.grad_accum}, "
              f"dtype {config.dtype}, remat {config.remat}, attention {_attention_line(config, mesh.shape['cp'])}, "
              f"loss chunk {config.loss_chunk or 'none'}, MLP chunk {config.mlp_chunk or 'none'}"]
    if config.preference:
        reference = config.reference_model()
        lines.append(f"objective {config.objective}: {config.batch_size} pairs in {2 * config.batch_size} rows a step "
                     f"(unpacked: the most rows packing ever needs), reference "
                     f"{'none' if reference is None else reference + _reference_where(config)}")
    if config.policy:
        lines.append(f"objective {config.objective}: {config.batch_size} prompts x {config.value('num_generations')} "
                     f"completions in {config.rows_per_step} rows of --seq-len {config.seq_len} (a prompt and its "
                     f"completion) a step; its rollout below")
    if cpu_16bit:
        # The CPU compiler turns 16-bit matmuls into float32 ones and hoists float32 copies of the weights,
        # so its temporaries for a bf16 step say little about an accelerator. Every temporary of the step
        # (activations, gathered layer weights) is in the compute dtype, so the same step compiled in
        # float32 and scaled by the dtype's size is the estimate used. (A quantized layer's gathered codes are
        # not in the compute dtype and count at half their size: a quarter of a byte per value, beside the
        # dequantized layer's two.)
        f32, _ = _compile(config, llama, mesh, jnp.float32, jnp.float32, quantization)
        temp = float(f32.memory_analysis().temp_size_in_bytes) * itemsize / 4
        if compiled is not None:
            lines.append(f"CPU compiler's own temporaries for the {config.dtype} step: "
                         f"{compiled.memory_analysis().temp_size_in_bytes / GB:.2f} GB (bf16 matmuls upcast to "
                         f"float32); estimate below: the float32 step's, scaled by {itemsize}/4")
            # its ops and their traffic likewise; the collectives stay the bf16 step's own (their dtypes are right)
            cost = dataclasses.replace(step_cost(f32.as_text(), mesh.size, shares=shares),
                                       collectives=cost.collectives)
    else:
        temp = float(compiled.memory_analysis().temp_size_in_bytes)
    rollout = []
    if config.policy:
        rollout_trees = (_trees(config, llama, mesh, jnp.float32, jnp.float32, quantization) if cpu_16bit
                         else _trees(config, llama, mesh, dtype, stored, quantization))
        rollout = plan_rollout(config, llama, mesh, rollout_trees, device if cost is not None else None,
                               itemsize / 4 if cpu_16bit else 1.0,
                               expert_block_shares(config, llama, mesh, positions=1, rows=config.rows_per_step),
                               shares)
        temps = [("training step", temp)] + [(phase.name.split(" (")[0], phase.temp) for phase in rollout]
        lines.append("temporaries a device by phase (the largest counts below): " +
                     ", ".join(f"{name} {value / GB:.2f} GB" for name, value in temps))
        temp = max(value for _, value in temps)
    prediction = None
    if cost is not None:
        tokens = config.step_rows * config.seq_len
        prediction = predict(cost, device, config.dtype, tokens,
                             flops_per_token(llama, config.seq_len, config.reference_forward) * tokens, mesh.size,
                             bytes_scale=itemsize / 4 if cpu_16bit else 1.0)
    after = rollout_lines(config, rollout, prediction.step_seconds if prediction is not None else None) \
        if rollout else []
    if config.show_sharding:
        lines = sharding_table(trees["base"], trees["lora"]) + lines
    return PlanReport(mesh=dict(mesh.shape), backend=backend, weights=per_device_bytes(trees["base"]),
                      lora_and_optimizer=per_device_bytes(trees["lora"]) + per_device_bytes(trees["opt_state"]),
                      batch=per_device_bytes(trees["batch"]), temp=temp,
                      compile_seconds=time.perf_counter() - start, hbm=config.hbm_gb * GB, usable=usable,
                      lines=lines, frozen_parameters=frozen, quantization=quantization, prediction=prediction,
                      cost=cost, rollout=rollout, rollout_lines=after)


def _reference_where(config: TrainConfig) -> str:
    if config.precompute_reference:
        return " (precomputed before training: no forward in the step)"
    return " (in the step, under stop_gradient)"


def _trees(config: TrainConfig, llama: ModelConfig, mesh, dtype, param_dtype,
           quantization: Quantization | None = None):
    """(graphdef, LoRA state, frozen base) of the planned model, its arrays abstract and laid out on `mesh`."""
    with jax.set_mesh(mesh):
        def build():
            model = CausalLM(llama, dtype=dtype, param_dtype=param_dtype, remat=config.remat,
                             attention=config.attention_impl(mesh.shape["cp"]), mlp_chunk=config.mlp_chunk,
                             rules=DEFAULT_RULES, quantization=quantization, rngs=nnx.Rngs(0))
            return apply_lora(model, config.lora_config(llama), rngs=nnx.Rngs(0))

        graphdef, lora, base = split_model(nnx.eval_shape(build))
        return graphdef, _abstract_on(lora, mesh, DEFAULT_RULES), _abstract_on(base, mesh, DEFAULT_RULES)


def _compile(config: TrainConfig, llama: ModelConfig, mesh, dtype, param_dtype,
             quantization: Quantization | None = None, lower: bool = True):
    """The run's jit train step, lowered and compiled from abstract, sharded inputs (None unless `lower`), and
    those inputs."""
    graphdef, lora, base = _trees(config, llama, mesh, dtype, param_dtype, quantization)
    with jax.set_mesh(mesh):
        tx, schedule = make_optimizer(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 jax.eval_shape(tx.init, lora), optimizer_shardings(tx, lora, replicated))
        key = jax.eval_shape(lambda: jax.random.key(0))
        state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), lora, opt_state,
                           jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated))
        # A preference step is planned at its most rows: two a pair (packing never needs more).
        shape = (config.step_rows, config.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k in FLOAT_BATCH_KEYS else jnp.int32,
                                         sharding=batch_sharding(mesh, DEFAULT_RULES))
                 for k in batch_keys(config)}
        # The init reference is a second LoRA state of the adapter's shape, frozen, unless precomputed.
        in_step_init = config.reference_forward and config.reference_model() == "init"
        frozen = (base, lora if in_step_init else None) if config.preference else base
        compiled = None
        if lower:
            train_step, _ = jit_steps(graphdef, config, tx, schedule, state, frozen, mesh, DEFAULT_RULES)
            compiled = train_step.lower(state, frozen, batch).compile()
    return compiled, {"base": base, "lora": lora, "opt_state": opt_state, "batch": batch}


def _attention_line(config: TrainConfig, cp: int) -> str:
    impl = config.attention_impl(cp)
    if config.attention in ("xla", "blockwise", impl):
        return impl
    if config.attention == "auto":
        return f"{impl} (auto: on an NVIDIA GPU a fused kernel may serve the run instead)"
    return f"{impl} (standing in for {config.attention}, which a CPU cannot compile: both hold O(seq) a row)"
