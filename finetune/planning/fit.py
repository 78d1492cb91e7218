"""`finetune-lora --plan --fit`: the layouts, remat policies and accumulations that fit the devices, ranked by
predicted step time (finetune/planning/timing.py).

Meshes: every split of the devices the given mesh names into `dp x fsdp x cp x mp` (powers of two), with `mp` at
most the model's KV-head count (the rules split KV heads over `mp`) and within one host (8 devices where the plan
simulates them). `dp` alone keeps the base whole on every device (replicated); `fsdp` and `cp` split it along the
hidden dimension and gather each layer every pass; `mp` splits heads, MLP and vocabulary and gathers no weight.
On each mesh, remat `dots` (keeps matmul outputs: the fastest policy measured, bench/train.py), then `full` (a
second forward pass, least memory), then `full` with gradient accumulation 2, 4, ... (smaller micro-batches),
until one fits: a slower setting of the same mesh is not planned once a faster one fits.

Each plan is a full compile (about 20 s, twice for bf16, at 405B on a 2-core CPU), so meshes are planned in order
of a lower bound of their step time, and a mesh is pruned, without compiling, when
- its frozen weights alone (the base over `fsdp x cp x mp`) exceed a device's usable memory, or
- its lower bound is above the best predicted step time found so far. The bound: the larger of the model's FLOPs
  over all devices at the matmul rate, and the frozen weights gathered twice a step (forward and backward) over
  `fsdp x cp` at the bus bandwidth. Both parts are below anything the compiled step can do.
The report says what was pruned and why. `--fit-minutes` (default 20) stops planning new meshes after that long,
naming those left unplanned: on a 2-core CPU a long 405B sequence can leave most meshes above the compute bound
and each needs several compiles.

`--remat offload` is never tried: it has not been run on a GPU, and it keeps each layer's input in pinned host
memory (hundreds of GB a node for 405B at long sequences), which a plan of device memory does not check; the CPU
compiler even counts it as device memory. The report says so in one line, with the host memory it would take;
`--plan --remat offload` plans it when asked.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from finetune.config import ConfigFileError, TrainConfig, flag_of
from finetune.planning.allocator import usable_memory
from finetune.planning.devices import DeviceModel
from finetune.planning.plan import GB, PlanReport, param_dtype, plan, plan_device_model, plan_quantization
from finetune.planning.plan_json import plan_record
from finetune.step.checks import layer_shapes
from finetune.step.flops import flops_per_token
from finetune.step.mesh import parse_mesh
from finetune.step.train_step import DTYPES
from jaxmodel.lora import MLP_TARGETS, attention_targets
from jaxmodel.config import ModelConfig
from jaxmodel.sharding import MESH_AXES

# Options that describe the plan, not the run (declared with plan_only=True in finetune/config.py): left out
# of the command line --fit prints.
PLAN_ONLY = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["plan_only"])
# Devices of one host when the plan simulates them on a CPU (one node of 8 GPUs)
SIMULATED_HOST_DEVICES = 8
SHOWN = 5  # settings printed in the ranking


@dataclasses.dataclass
class FitReport:
    tried: list[tuple[TrainConfig, PlanReport | str]]  # each setting with its plan, or why it could not run
    pruned: list[tuple[str, str]]  # (mesh, why) of meshes never compiled
    notes: list[str] = dataclasses.field(default_factory=list)  # what the search left out, and why

    @property
    def ranked(self) -> list[tuple[TrainConfig, PlanReport]]:
        """The settings that fit, fastest predicted first."""
        fitting = [(c, r) for c, r in self.tried if isinstance(r, PlanReport) and r.fits]
        return sorted(fitting, key=lambda cr: _seconds(cr[1]))

    @property
    def chosen(self) -> TrainConfig | None:
        return self.ranked[0][0] if self.ranked else None

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    def record(self, config: TrainConfig) -> dict:
        """`--plan-json`: the chosen setting's plan, with every setting tried and every mesh pruned."""
        best = self.ranked[0] if self.ranked else None
        record = plan_record(best[0], best[1]) if best else {"memory": {"fits": False}, "predicted": None}
        record["fit"] = {
            "tried": [plan_record(c, r) if isinstance(r, PlanReport) else
                      {"mesh": parse_mesh(c.mesh, jax.device_count()), "remat": c.remat, "grad_accum": c.grad_accum,
                       "error": r} for c, r in self.tried],
            "pruned": [{"mesh": mesh, "why": why} for mesh, why in self.pruned],
            "command": command_line(best[0]) if best else None}
        return record

    def __str__(self) -> str:
        out = [f"{'mesh':<24} {'remat':<6} {'accum':>5} {'total GB':>9} {'step s':>9} {'tokens/s':>10}  verdict"]
        for config, result in self.tried:
            head = f"{config.mesh:<24} {config.remat:<6} {config.grad_accum:>5}"
            if isinstance(result, str):
                out.append(f"{head} {'-':>9} {'-':>9} {'-':>10}  not possible: {result}")
            else:
                p = result.prediction
                out.append(f"{head} {result.total / GB:>9.2f} {_seconds(result):>9.4g} "
                           f"{p.tokens_per_s if p else 0:>10,.0f}  {result.verdict()}")
        out += [f"{mesh}: pruned, {why}" for mesh, why in self.pruned]
        out += self.notes
        if not self.ranked:
            out.append("nothing tried fits: use more devices, a shorter --seq-len or a smaller --batch-size")
            return "\n".join(out)
        device = self.ranked[0][1].prediction.device if self.ranked[0][1].prediction else "?"
        out.append(f"fastest settings that fit, by predicted step time on {device}:")
        for i, (config, result) in enumerate(self.ranked[:SHOWN], 1):
            p = result.prediction
            out.append(f"  {i}. {config.mesh} remat {config.remat} accum {config.grad_accum}: {_seconds(result):.4g} s "
                       f"a step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, bound by {p.bound}; "
                       f"{result.total / GB:.1f} GB a device")
        out.append("fastest setting that fits:")
        out.append("  " + command_line(self.chosen))
        return "\n".join(out)


def _seconds(report: PlanReport) -> float:
    return report.step_seconds


def meshes(config: TrainConfig, llama: ModelConfig, device_count: int, host_devices: int) -> list[dict[str, int]]:
    """Every dp x fsdp x cp x mp split (powers of two) of the devices the given mesh names, the given one first;
    mp at most the KV heads and the devices of one host; no cp for an online RL run (`checks.check_policy_mesh`)."""
    given = parse_mesh(config.mesh, device_count)
    used = math.prod(given.values())
    most_mp = min(llama.num_key_value_heads, host_devices, used)
    out = [given]
    for mp in _powers_of_two(most_mp):
        for cp in _powers_of_two(used // mp) if not config.policy else [1]:
            for fsdp in _powers_of_two(used // (mp * cp)):
                dp = used // (mp * cp * fsdp)
                mesh = {"dp": dp, "fsdp": fsdp, "cp": cp, "mp": mp}
                if dp * fsdp * cp * mp == used and mesh not in out:
                    out.append(mesh)
    return out


def settings(config: TrainConfig, mesh: dict[str, int]):
    """The remat / accumulation settings of one mesh, fastest first."""
    spec = ",".join(f"{axis}={mesh[axis]}" for axis in MESH_AXES)
    for remat in ("dots", "full"):  # never offload: see the module docstring
        yield dataclasses.replace(config, mesh=spec, remat=remat, grad_accum=1)
    for accum in _powers_of_two(config.rows_per_step)[1:]:
        if config.rows_per_step % accum == 0:
            yield dataclasses.replace(config, mesh=spec, remat="full", grad_accum=accum)


def frozen_bytes(config: TrainConfig, llama: ModelConfig) -> tuple[float, float]:
    """(all of the frozen base's matmul weights, what a layer gathers over fsdp x cp, on average over the layers),
    in bytes as the run stores them: quantized projections as their codes and float32 scales; the LM head and
    embedding in the parameter dtype. A dense layer gathers its attention and MLP projections; a sparse one its
    attention, router and shared experts, not its routed experts, which stay on fsdp's devices (jaxmodel/moe.py)."""
    shapes = layer_shapes(llama)
    quantization, _ = plan_quantization(config)
    dtype_bytes = jnp.dtype(param_dtype(config)).itemsize
    per_value = dtype_bytes if quantization is None else quantization.bytes_per_value
    attention = sum(math.prod(shapes[name]) for name in attention_targets(llama))
    dense_mlp = sum(math.prod(shapes[name]) for name in MLP_TARGETS)
    experts = 3 * llama.hidden_size * llama.moe_intermediate_size * llama.num_experts
    shared = 3 * llama.hidden_size * llama.moe_intermediate_size * llama.shared_experts  # quantized as an MLP
    router = llama.hidden_size * llama.num_experts * (4 if llama.router_groups else dtype_bytes)  # DeepSeek's float32
    sparse = llama.sparse_layers or (False,) * llama.num_hidden_layers
    stored = sum((attention + (shared + experts if s else dense_mlp)) * per_value + s * router for s in sparse)
    gathered = sum((attention + (shared if s else dense_mlp)) * per_value + s * router
                   for s in sparse) / llama.num_hidden_layers
    head = math.prod(shapes["lm_head"]) * (1 if llama.tie_word_embeddings else 2) * dtype_bytes  # and embedding
    return stored + head, gathered


def lower_bound(config: TrainConfig, llama: ModelConfig, mesh: dict[str, int], device: DeviceModel,
                layer_bytes: float) -> float:
    """Seconds no step of this mesh can beat (module docstring)."""
    devices = math.prod(mesh.values())
    tokens = config.step_rows * config.seq_len
    compute = flops_per_token(llama, config.seq_len, config.reference_forward) * tokens / devices / \
        device.matmul_flops_per_s(config.dtype)
    # each layer's projections gathered over fsdp x cp in the forward pass and again in the backward pass, each
    # device gathering its mp part
    gather = device.collective_seconds("all-gather", layer_bytes / mesh["mp"], mesh["fsdp"] * mesh["cp"])
    return max(compute, 2 * llama.num_hidden_layers * gather)


def fit(config: TrainConfig) -> FitReport:
    """Plan the settings of every mesh not pruned; rank those that fit by predicted step time."""
    llama = ModelConfig.from_hf(Path(config.model_config or config.model))
    device = plan_device_model(config)
    devices = jax.device_count()
    host = SIMULATED_HOST_DEVICES if jax.default_backend() == "cpu" else jax.local_device_count()
    capacity = config.hbm_gb * GB * usable_memory().fraction
    weights, layer_bytes = frozen_bytes(config, llama)
    notes = [offload_note(config, llama, parse_mesh(config.mesh, devices), jax.default_backend())]
    ordered = sorted(enumerate(meshes(config, llama, devices, host)),
                     key=lambda im: (lower_bound(config, llama, im[1], device, layer_bytes), im[0]))
    tried, pruned, best = [], [], math.inf
    deadline = time.monotonic() + config.fit_minutes * 60 if config.fit_minutes else math.inf
    for _, mesh in ordered:
        spec = ",".join(f"{axis}={mesh[axis]}" for axis in MESH_AXES)
        if time.monotonic() > deadline:
            pruned.append((spec, f"not planned: --fit-minutes {config.fit_minutes:g} reached"))
            continue
        held = weights / (mesh["fsdp"] * mesh["cp"] * mesh["mp"])
        if held > capacity:
            pruned.append((spec, f"its frozen weights alone take {held / GB:.1f} GB a device, more than the "
                                 f"{capacity / GB:.1f} GB usable"))
            continue
        bound = lower_bound(config, llama, mesh, device, layer_bytes)
        if bound >= best:
            pruned.append((spec, f"no step on it can beat {bound:.4g} s (the best so far: {best:.4g} s)"))
            continue
        for candidate in settings(config, mesh):
            try:
                report = plan(candidate)
            except ConfigFileError as e:  # e.g. the batch does not split over this mesh: no remat changes that
                tried.append((candidate, str(e)))
                break
            tried.append((candidate, report))
            if report.fits:
                best = min(best, _seconds(report))
                break
    return FitReport(tried, pruned, notes)


def offload_note(config: TrainConfig, llama: ModelConfig, mesh: dict[str, int], backend: str) -> str:
    """The report's line on `--remat offload`: why it was not tried, and the pinned host memory per device its
    saved layer inputs would take on the given mesh without accumulation (every layer's input, in the compute
    dtype, for the tokens of one device)."""
    tokens = config.step_rows * config.seq_len // (mesh["dp"] * mesh["fsdp"] * mesh["cp"])
    dtype_bytes = jnp.dtype(DTYPES[config.dtype]).itemsize
    host = llama.num_hidden_layers * tokens * llama.hidden_size * dtype_bytes
    return (f"--remat offload not tried: never measured on {backend}, and it keeps each layer's input in pinned host "
            f"memory: {host / GB:.1f} GB per device here ({llama.num_hidden_layers} layers x {tokens} tokens x hidden "
            f"{llama.hidden_size} x {dtype_bytes} bytes); plan it with --plan --remat offload")


def command_line(config: TrainConfig) -> str:
    """The `finetune-lora` command that runs `config`, with the allocator variables it was planned with."""
    env = usable_memory().settings(os.environ)
    words = [f"{name}={value}" for name, value in env.items()] + ["finetune-lora"]
    converted = "CONVERTED_DIR" if config.quantize == "none" else f"{config.quantize.upper()}_CONVERTED_DIR"
    placeholders = {"model": converted, "data": "DATA.jsonl", "out": "RUN_DIR"}
    for field in dataclasses.fields(TrainConfig):
        value = getattr(config, field.name)
        if field.name in PLAN_ONLY or (value == field.default and field.name not in placeholders):
            continue
        flag = f"--{flag_of(field.name)}"
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag_of(field.name)}")
        elif isinstance(value, tuple):  # a repeated flag
            words += [word for one in value for word in (flag, one)]
        else:
            words += [flag, str(value if value is not None else placeholders[field.name])]
    return shlex.join(words)


def _powers_of_two(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length()) if 2**i <= n]
