"""The measurements of bench/device_report.py, each on the devices JAX sees: matmul peak, the LoRA train step,
its memory against `--plan`, attention paths, collectives and logits parity with the CPU backend.

Every function measures one thing and returns plain numbers; device_report.py chooses the shapes, prints the
table and writes the JSON. The train step is the toolkit's own: `finetune.step.train_step.jit_steps` (what
`finetune-lora` runs and `--plan` compiles) on a random-weight `CausalLM` with LoRA adapters. Imported
with bench/ on sys.path (it times with bench/train.py's `step_times`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from train import step_times  # bench/train.py

from finetune.config import TrainConfig
from finetune.planning.plan import PlanReport, plan
from finetune.step.attention_choice import choose_attention
from finetune.step.checks import check_batch_split, check_rank, check_seq_len
from finetune.step.mesh import make_mesh
from finetune.step.train_step import (
    DTYPES,
    TrainState,
    jit_steps,
    make_optimizer,
    optimizer_shardings,
    split_model,
)
from finetune.step.flops import flops_per_token
from finetune.train.metrics import measure_peak_flops, peak_memory_gb, seconds_per_call
from jaxmodel.attention import attention
from jaxmodel.config import ModelConfig
from jaxmodel.lora import apply_lora
from jaxmodel.model import CausalLM
from jaxmodel.quantization import Quantization
from jaxmodel.sharding import DEFAULT_RULES, batch_sharding, named_sharding

GB = 1e9
PARITY_PRECISION = "highest"


def timings(run: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Wall time of each of `repeats` calls of `run()` (which must wait for its result) after `warmup` calls."""
    for _ in range(warmup):
        run()
    return step_times(run, repeats)


def median_seconds(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    return statistics.median(timings(run, repeats, warmup))


# ---- matmul peak -------------------------------------------------------------------------------------------

def matmul_peaks(size: int, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of one device on a square `size` matmul in float32 and bfloat16: finetune-lora's own MFU
    denominator (`measure_peak_flops`: `x @ x` on operands in the dtype, accumulated and returned in float32,
    the form of every backend's fast bf16 path)."""
    return {name: measure_peak_flops(DTYPES[name], size, repeats) for name in ("float32", "bfloat16")}


# ---- memory bandwidth --------------------------------------------------------------------------------------

MEMORY_SIZES = tuple(2**k for k in range(16, 29, 2))  # 64 KiB ... 256 MiB read and written


def memory_bandwidth_table(sizes: tuple[int, ...] = MEMORY_SIZES, repeats: int = 3) -> list[list[float]]:
    """[[bytes, bytes/s], ...]: the bandwidth of an elementwise op reading and writing `bytes` in all (a float32
    array of half that, `b * 1.0001 + 1e-7`), inside a compiled loop that runs it many times: an op of a compiled
    step pays no dispatch and no fresh output memory, which a call per op would add. Best of `repeats` samples."""
    table = []
    for size in sizes:
        rows = max(1, size // 2 // 4 // 256)
        runs = max(4, min(256, 2**27 // size))
        x = jnp.ones((rows, 256), jnp.float32)
        loop = jax.jit(lambda a, runs=runs: jax.lax.fori_loop(0, runs, lambda i, b: b * 1.0001 + 1e-7, a))
        jax.block_until_ready(loop(x))  # compiles
        seconds = min(seconds_per_call(lambda: loop(x), repeats)) / runs
        table.append([float(2 * x.size * 4), 2 * x.size * 4 / seconds])
    return table


def transcendentals_per_s(size: int = 2**20, repeats: int = 3) -> float:
    """Elements of `exp` a second, inside a compiled loop over a float32 array of `size` bytes (small enough for a
    cache: the rate of the units that compute them, not of memory). Best of `repeats` samples."""
    runs = 64
    x = jnp.ones((size // 4 // 256, 256), jnp.float32)
    loop = jax.jit(lambda a: jax.lax.fori_loop(0, runs, lambda i, b: jnp.exp(b * -1e-3), a))
    jax.block_until_ready(loop(x))  # compiles
    return x.size * runs / min(seconds_per_call(lambda: loop(x), repeats))


# ---- the LoRA train step -----------------------------------------------------------------------------------

def mesh_spec(devices: int) -> str:
    """finetune-lora's default mesh (every device on fsdp) over `devices`."""
    return f"dp=1,fsdp={devices},cp=1,mp=1"


def write_model_config(llama: ModelConfig, directory: Path, dtype: str) -> Path:
    """config.json of `llama` (weights stored in `dtype`) for `--plan --model-config`."""
    path = directory / "config.json"
    path.write_text(json.dumps({**llama.to_hf(), "torch_dtype": dtype}))
    return path


def train_config(model_config: Path, devices: int, batch: int, seq: int, dtype: str, hbm_bytes: float,
                 attention: str = TrainConfig.attention) -> TrainConfig:
    """The run being measured: finetune-lora's defaults (LoRA, remat, attention, chunks, AdamW) at this shape."""
    return TrainConfig(model_config=str(model_config), mesh=mesh_spec(devices), batch_size=batch, seq_len=seq,
                       dtype=dtype, param_dtype=dtype, attention=attention, hbm_gb=hbm_bytes / GB, steps=10**6,
                       schedule="constant")


def plan_of(config: TrainConfig) -> PlanReport:
    """`finetune-lora --plan` for `config`."""
    return plan(config)


def _on_mesh(tree, mesh):
    """Shardings of every variable of `tree` from its logical axes: the layout a run gives it."""
    return jax.tree.map(lambda var: named_sharding(var.get_metadata()["axes"], var.shape, mesh, DEFAULT_RULES),
                        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass
class Step:
    """A compiled train step with its state and a fixed batch; `run()` does one step and waits for it."""
    compiled: Callable
    state: TrainState
    base: object
    batch: dict
    attention: str
    compile_seconds: float

    def held_bytes(self, device) -> int:
        """Bytes of the state, frozen weights and batch on `device`: what the step holds between steps."""
        return held_bytes((self.state, self.base, self.batch), device)

    def run(self) -> float:
        """One step; waits for it."""
        self.state, metrics = self.compiled(self.state, self.base, self.batch)
        return float(metrics["loss"])  # waits for the step


def build_step(llama: ModelConfig, config: TrainConfig, devices: list) -> Step:
    """The run's jit step (`jit_steps`) on a mesh over `devices`, with random weights created on their shards
    (a jitted constructor with the run's output shardings: no device ever holds the whole model)."""
    mesh = make_mesh(config.mesh, devices)
    check_seq_len(config, llama, mesh)
    check_rank(config, llama)
    check_batch_split(config, mesh, DEFAULT_RULES)
    dtype = DTYPES[config.dtype]
    impl = choose_attention(config, llama, mesh.shape["cp"]).impl

    # a quantized base as --plan --quantize plans one (random codes), multiplied as --fp8-matmul says
    quantization = config.multiplied(None if config.quantize == "none" else Quantization(config.quantize,
                                                                                          config.quant_block))

    def build():
        model = CausalLM(llama, dtype=dtype, param_dtype=DTYPES[config.param_dtype], remat=config.remat,
                         attention=impl, mlp_chunk=config.mlp_chunk, rules=DEFAULT_RULES, quantization=quantization,
                         rngs=nnx.Rngs(0))
        return apply_lora(model, config.lora_config(), rngs=nnx.Rngs(1))

    with jax.set_mesh(mesh):
        graphdef, lora, base = split_model(nnx.eval_shape(build))
        lora, base = jax.jit(lambda: split_model(build())[1:],
                             out_shardings=(_on_mesh(lora, mesh), _on_mesh(base, mesh)))()
        tx, schedule = make_optimizer(config)
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_state = jax.jit(tx.init, out_shardings=optimizer_shardings(tx, lora, replicated))(lora)
        state = TrainState(jax.device_put(jnp.int32(0), replicated), lora, opt_state,
                           jax.device_put(jax.random.key(0), replicated))
        train_step, _ = jit_steps(graphdef, config, tx, schedule, state, base, mesh, DEFAULT_RULES)
        batch = jax.device_put(random_batch(config.batch_size, config.seq_len, llama.vocab_size),
                               batch_sharding(mesh, DEFAULT_RULES))
        start = time.perf_counter()
        compiled = train_step.lower(state, base, batch).compile()
    return Step(compiled, state, base, batch, impl, time.perf_counter() - start)


def random_batch(batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """One packed-row batch of random tokens, every position a target (what `finetune.train.batches` makes)."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": np.ones((batch, seq), np.float32),
            "segment_ids": np.ones((batch, seq), np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()}


def step_figures(llama: ModelConfig, config: TrainConfig, times: list[float], peak: float, devices: int) -> dict:
    """tokens/s of the median step and its MFU against `devices` x one device's matmul peak in its dtype."""
    tokens_per_s = config.batch_size * config.seq_len / statistics.median(times)
    flops = flops_per_token(llama, config.seq_len)
    return {"dtype": config.dtype, "tokens_per_s": tokens_per_s, "flops_per_token": flops,
            "mfu": tokens_per_s * flops / (peak * devices), "devices": devices, "mesh": config.mesh,
            "batch": config.batch_size, "seq": config.seq_len, "remat": config.remat,
            "median_step_seconds": statistics.median(times), "timed_steps": len(times)}


# ---- memory ------------------------------------------------------------------------------------------------

def _status_bytes(field: str) -> int | None:
    """A `VmRSS` / `VmHWM` line of /proc/self/status in bytes, or None where there is none (not Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def current_rss() -> int | None:
    return _status_bytes("VmRSS")


def peak_rss() -> int | None:
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Set the process's peak RSS (VmHWM) to its current RSS (Linux: `5` into clear_refs), so that a later peak
    leaves out what came before (the compiler's working memory); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def held_bytes(tree, device) -> int:
    """Bytes of the arrays of `tree` that lie on `device` (its shards of each)."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
               if shard.device == device)


def device_peak_bytes(devices: list) -> float | None:
    """The most any of `devices` held at once since the process started (`memory_stats`), or None (CPU)."""
    peak = peak_memory_gb(devices)
    return None if peak is None else peak * GB


# ---- attention ---------------------------------------------------------------------------------------------

def attention_seconds(llama: ModelConfig, dtype, seq: int, impl: str, repeats: int = 3,
                      block: tuple[int, int] | None = None) -> float:
    """Median seconds of the forward + backward of one attention call (batch 1, the model's heads, one packed
    row of `seq` positions) on the default device, by `impl` (`jaxmodel.attention.ATTENTION_IMPLS`); `block`:
    the blockwise path's (block_q, block_kv) instead of its defaults."""
    blocks = {} if block is None else {"block_q": block[0], "block_kv": block[1]}
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, seq, llama.num_attention_heads, llama.head_dim), dtype)
    k, v = (jax.random.normal(key, (1, seq, llama.num_key_value_heads, llama.head_dim), dtype) for key in keys[1:])
    segments = jnp.ones((1, seq), jnp.int32)

    def loss(q, k, v):
        out = attention(q, k, v, q_segment_ids=segments, kv_segment_ids=segments, impl=impl, **blocks)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return median_seconds(lambda: jax.block_until_ready(grad(q, k, v)), repeats)


def dense_scores_bytes(llama: ModelConfig, seq: int) -> float:
    """Bytes of the dense path's float32 scores, probabilities and their gradient for one row of `seq`."""
    return 3 * 4.0 * llama.num_attention_heads * seq * seq


# ---- collectives -------------------------------------------------------------------------------------------

def collective_bandwidth(devices: list, bytes_per_device: int, repeats: int = 5) -> dict:
    """All-reduce (psum) and all-gather of a float32 array over a 1-D mesh of `devices`, each device holding
    `bytes_per_device`; bus bandwidth as nccl-tests counts it: all-reduce S/t x 2(n-1)/n with S the bytes
    reduced per device, all-gather nS/t x (n-1)/n with nS the bytes gathered on each device. Median of `repeats`
    samples (`seconds_per_call`: a call of under a millisecond is timed several back to back; on a CPU, one at a
    time)."""
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    spec = PartitionSpec("x")
    per = bytes_per_device // 4
    x = jax.jit(lambda: jnp.ones((n, per), jnp.float32), out_shardings=NamedSharding(mesh, spec))()  # on its shards
    reduce = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=spec, out_specs=spec))
    gather = jax.jit(jax.shard_map(lambda b: jax.lax.all_gather(b, "x", tiled=True), mesh=mesh, in_specs=spec,
                                   out_specs=spec))
    size = per * 4
    # XLA's CPU runtime can deadlock with several collective calls in flight over overlapping device groups (one
    # device's part never starts: "only 7 of 8 arrived"); there each call is waited for before the next is issued.
    wait = jax.block_until_ready if devices[0].platform == "cpu" else (lambda result: result)
    reduce_call, gather_call = (lambda: wait(reduce(x))), (lambda: wait(gather(x)))
    jax.block_until_ready((reduce_call(), gather_call()))  # compiles
    reduce_s = statistics.median(seconds_per_call(reduce_call, repeats))
    gather_s = statistics.median(seconds_per_call(gather_call, repeats))
    return {"devices": n, "bytes_per_device": size, "all_reduce_seconds": reduce_s,
            "all_reduce_bus_bytes_per_s": size / reduce_s * 2 * (n - 1) / n, "all_gather_seconds": gather_s,
            "all_gather_bus_bytes_per_s": n * size / gather_s * (n - 1) / n}


def collective_table(devices: list, sizes: tuple[int, ...], repeats: int = 3) -> dict:
    """The device model's collective figures (finetune/planning/devices.py): all-reduce bus bandwidth over the first
    2, 4, ... of `devices` at each of `sizes` bytes per device, `{"table": {GROUP: [[bytes, busbw], ...]}}`, and
    `latency_s`: the time of a 4 KiB all-reduce over all of them."""
    table = {}
    group = 2
    while group <= len(devices):
        table[str(group)] = [[float(size), collective_bandwidth(devices[:group], size, repeats)[
            "all_reduce_bus_bytes_per_s"]] for size in sizes]
        group *= 2
    latency = collective_bandwidth(devices, 4096, repeats)["all_reduce_seconds"]
    return {"table": table, "latency_s": latency}


# ---- parity ------------------------------------------------------------------------------------------------

def logits_parity(llama: ModelConfig, seq: int) -> dict:
    """The same float32 random weights and tokens run on the default device and on the CPU backend: max |logit
    difference| / max |logit|, every matmul at "highest" precision on both (the default one is TF32 on NVIDIA
    GPUs and one bf16 pass on TPUs, whose rounding would hide a real difference); "skipped" without a CPU
    backend."""
    try:
        cpu, device = jax.devices("cpu")[0], jax.devices()[0]
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU backend out
        return {"skipped": "no CPU backend (JAX_PLATFORMS)"}
    with jax.default_device(cpu):  # weights drawn once, on the CPU, then copied
        graphdef, weights = nnx.split(CausalLM(llama, rngs=nnx.Rngs(2)))
    ids = np.random.default_rng(1).integers(0, llama.vocab_size, (1, seq)).astype(np.int32)
    forward = jax.jit(lambda w, ids: nnx.merge(graphdef, w)(ids))
    with jax.default_matmul_precision(PARITY_PRECISION):
        on = {where: np.asarray(forward(jax.device_put(weights, where), jax.device_put(ids, where)))
              for where in (cpu, device)}
    difference = float(np.max(np.abs(on[device] - on[cpu])))
    return {"compared": f"{device.platform}:{device.id} vs cpu:{cpu.id}", "max_abs_difference": difference,
            "max_abs_logit": float(np.max(np.abs(on[cpu]))),
            "relative_difference": difference / float(np.max(np.abs(on[cpu]))), "matmul_precision": PARITY_PRECISION,
            "layers": llama.num_hidden_layers, "seq": seq}
