"""`finetune-lora --plan --fit`: the fastest `--remat`, `--grad-accum` and `--mesh` that fit the devices.

Settings are tried in order of expected step time, fastest first, and the first that fits ends the search:
on each mesh (the one given first, then every `fsdp x cp` split of the same devices, fewer `cp` first) remat
`dots` (keeps matmul outputs: the fastest policy measured, bench/train.py), then `full` (a second forward
pass, least memory), then `offload` (on backends whose plan can show it: not the CPU compiler, which counts
offloaded residuals as device memory), then `full` with gradient accumulation 2, 4, ... (smaller
micro-batches). Each setting is a full plan, compiled from abstract shapes.
"""

from __future__ import annotations

import dataclasses
import os
import shlex

import jax

from finetune.config import ConfigFileError, TrainConfig, flag_of
from finetune.step.mesh import parse_mesh
from finetune.planning.plan import GB, PlanReport, plan
from finetune.planning.allocator import usable_memory
from jaxmodel.sharding import MESH_AXES

# Options that describe the plan, not the run (declared with plan_only=True in finetune/config.py): left out
# of the command line --fit prints.
PLAN_ONLY = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["plan_only"])


@dataclasses.dataclass
class FitReport:
    tried: list[tuple[TrainConfig, PlanReport | str]]  # each setting with its plan, or why it could not run
    chosen: TrainConfig | None

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
        if self.chosen is None:
            out.append("nothing tried fits: use more devices, a shorter --seq-len or a smaller --batch-size")
        else:
            out.append("fastest setting that fits:")
            out.append("  " + command_line(self.chosen))
        return "\n".join(out)


def candidates(config: TrainConfig, device_count: int, backend: str):
    """The settings --fit tries, fastest first (see the module docstring)."""
    given = parse_mesh(config.mesh, device_count)
    splits = [{**dict.fromkeys(MESH_AXES, 1), "fsdp": device_count // cp, "cp": cp}
              for cp in _powers_of_two(device_count) if device_count % cp == 0]
    meshes = [given] + [m for m in splits if m != given]
    remats = ("dots", "full") + (("offload",) if backend != "cpu" else ())
    for mesh in meshes:
        spec = ",".join(f"{axis}={size}" for axis, size in mesh.items())
        for remat in remats:
            yield dataclasses.replace(config, mesh=spec, remat=remat, grad_accum=1)
        for accum in _powers_of_two(config.batch_size)[1:]:
            if config.batch_size % accum == 0:
                yield dataclasses.replace(config, mesh=spec, remat="full", grad_accum=accum)


def fit(config: TrainConfig) -> FitReport:
    """Plan each candidate setting until one fits."""
    tried, impossible = [], set()
    for candidate in candidates(config, jax.device_count(), jax.default_backend()):
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
            return FitReport(tried, candidate)
    return FitReport(tried, None)


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
