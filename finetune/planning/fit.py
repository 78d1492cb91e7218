"""`finetune-lora --plan --fit`: the fastest `--remat`, `--grad-accum` and `--mesh` that fit the devices.

Settings are tried in order of expected step time, fastest first, and the first that fits ends the search:
on each mesh (the one given first, then every `fsdp x cp` split of the same devices, fewer `cp` first) remat
`dots` (keeps matmul outputs: the fastest policy measured, bench/train.py), then `full` (a second forward
pass, least memory), then `full` with gradient accumulation 2, 4, ... (smaller micro-batches). Each setting
is a full plan, compiled from abstract shapes; the settings are tried on the devices the given mesh names.

`--remat offload` is never tried: it has not been run on a GPU, and it keeps each layer's input in pinned
host memory (hundreds of GB a node for 405B at long sequences), which a plan of device memory does not
check; the CPU compiler even counts it as device memory. The report says so in one line, with the host
memory it would take; `--plan --remat offload` plans it when asked.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp

from finetune.config import ConfigFileError, TrainConfig, flag_of
from finetune.step.mesh import parse_mesh
from finetune.planning.plan import GB, PlanReport, plan
from finetune.planning.allocator import usable_memory
from finetune.step.train_step import DTYPES
from jaxmodel.config import LlamaConfig
from jaxmodel.sharding import MESH_AXES

# Options that describe the plan, not the run (declared with plan_only=True in finetune/config.py): left out
# of the command line --fit prints.
PLAN_ONLY = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["plan_only"])


@dataclasses.dataclass
class FitReport:
    tried: list[tuple[TrainConfig, PlanReport | str]]  # each setting with its plan, or why it could not run
    chosen: TrainConfig | None
    notes: list[str] = dataclasses.field(default_factory=list)  # what the search left out, and why

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    def __str__(self) -> str:
        out = [f"{'mesh':<28} {'remat':<8} {'grad accum':>10} {'total GB':>10}  verdict"]
        for config, result in self.tried:
            head = f"{config.mesh:<28} {config.remat:<8} {config.grad_accum:>10}"
            if isinstance(result, str):
                out.append(f"{head} {'-':>10}  not possible: {result}")
            else:
                out.append(f"{head} {result.total / GB:>10.2f}  {result.verdict()}")
        out += self.notes
        if self.chosen is None:
            out.append("nothing tried fits: use more devices, a shorter --seq-len or a smaller --batch-size")
        else:
            out.append("fastest setting that fits:")
            out.append("  " + command_line(self.chosen))
        return "\n".join(out)


def candidates(config: TrainConfig, device_count: int):
    """The settings --fit tries, fastest first (see the module docstring), on the devices the mesh names."""
    given = parse_mesh(config.mesh, device_count)
    used = math.prod(given.values())
    splits = [{**dict.fromkeys(MESH_AXES, 1), "fsdp": used // cp, "cp": cp}
              for cp in _powers_of_two(used) if used % cp == 0]
    meshes = [given] + [m for m in splits if m != given]
    for mesh in meshes:
        spec = ",".join(f"{axis}={size}" for axis, size in mesh.items())
        for remat in ("dots", "full"):  # never offload: see the module docstring
            yield dataclasses.replace(config, mesh=spec, remat=remat, grad_accum=1)
        for accum in _powers_of_two(config.batch_size)[1:]:
            if config.batch_size % accum == 0:
                yield dataclasses.replace(config, mesh=spec, remat="full", grad_accum=accum)


def fit(config: TrainConfig) -> FitReport:
    """Plan each candidate setting until one fits."""
    tried, impossible = [], set()
    notes = [offload_note(config, LlamaConfig.from_hf(Path(config.model_config or config.model)),
                          parse_mesh(config.mesh, jax.device_count()), jax.default_backend())]
    for candidate in candidates(config, jax.device_count()):
        shape = (candidate.mesh, candidate.grad_accum)
        if shape in impossible:
            continue
        try:
            report = plan(candidate, cpu_bf16_figure=False)
        except ConfigFileError as e:  # e.g. the batch does not split over this mesh: no remat changes that
            impossible.add(shape)
            tried.append((candidate, str(e)))
            continue
        tried.append((candidate, report))
        if report.fits:
            return FitReport(tried, candidate, notes)
    return FitReport(tried, None, notes)


def offload_note(config: TrainConfig, llama: LlamaConfig, mesh: dict[str, int], backend: str) -> str:
    """The report's line on `--remat offload`: why it was not tried, and the pinned host memory per device its
    saved layer inputs would take on the given mesh without accumulation (every layer's input, in the compute
    dtype, for the tokens of one device)."""
    tokens = config.batch_size * config.seq_len // (mesh["dp"] * mesh["fsdp"] * mesh["cp"])
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
        else:
            words += [flag, str(value if value is not None else placeholders[field.name])]
    return shlex.join(words)


def _powers_of_two(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length()) if 2**i <= n]
