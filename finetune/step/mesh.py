"""The device mesh (dp, fsdp, cp, mp) and joining a multi-host run."""

from __future__ import annotations

import functools
import math
import os
import sys

import jax
from jax.sharding import AxisType, Mesh

from jaxmodel.errors import UsageError
from jaxmodel.sharding import MESH_AXES as AXES


# What picks the devices a process sees, named wherever a mesh and the visible devices disagree.
VISIBLE_DEVICES = "HIP_VISIBLE_DEVICES (ROCm) or CUDA_VISIBLE_DEVICES (CUDA)"


class MeshError(ValueError, UsageError):
    """A mesh spec that does not describe the available devices; the message says what was expected."""


def parse_mesh(spec: str, device_count: int) -> dict[str, int]:
    """`"dp=1,fsdp=-1,mp=2"` -> sizes for every axis, -1 resolved to the remaining devices. The mesh may name
    fewer devices than `device_count` (`make_mesh` decides whether that is allowed), never more."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES:
            raise MeshError(f"--mesh {spec!r}: unknown axis {name!r} (axes: {', '.join(AXES)})")
        if name in sizes:
            raise MeshError(f"--mesh {spec!r}: axis {name!r} given twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise MeshError(f"--mesh {spec!r}: size of {name!r} must be an integer, got {value!r}") from None
        if sizes[name] == 0 or sizes[name] < -1:
            raise MeshError(f"--mesh {spec!r}: size of {name!r} must be positive or -1, got {sizes[name]}")
    for name in AXES:
        sizes.setdefault(name, 1)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise MeshError(f"--mesh {spec!r}: only one axis may be -1")
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if device_count % known:
            raise MeshError(f"--mesh {spec!r}: {device_count} devices are not a multiple of {known}")
        sizes[free[0]] = device_count // known
    if math.prod(sizes.values()) > device_count:
        given = "x".join(str(sizes[a]) for a in AXES)
        raise MeshError(f"--mesh {spec!r}: {' x '.join(AXES)} = {given} = {math.prod(sizes.values())} devices, "
                        f"but {device_count} are available")
    return {name: sizes[name] for name in AXES}


def make_mesh(spec: str, devices=None) -> Mesh:
    """A mesh over the first devices it names of `devices` (default: all devices, of every process), axes in
    the order dp, fsdp, cp, mp.

    A mesh smaller than the devices is allowed in one process only: over several processes the first devices
    of the global list could leave a process without any. Axes are `Auto`: the compiler propagates
    shardings from the parameters and the constraints the model places on activations.
    """
    devices = jax.devices() if devices is None else devices
    sizes = parse_mesh(spec, len(devices))
    used = math.prod(sizes.values())
    if used < len(devices):
        if jax.process_count() > 1:
            raise MeshError(f"--mesh {spec!r} names {used} of the {len(devices)} devices of this "
                            f"{jax.process_count()}-process run; several processes must use every device: choose "
                            f"each process's devices with {VISIBLE_DEVICES}")
        _note_unused_devices(used, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                         devices=devices[:used])


@functools.cache  # once per process: --plan --fit plans many meshes over the same devices
def _note_unused_devices(used: int, visible: int) -> None:
    print(f"finetune-lora: note: the mesh uses {used} of the {visible} visible devices; {VISIBLE_DEVICES} chooses "
          "which are visible (JAX reserves memory on every visible GPU, used or not)", file=sys.stderr)


def initialize_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Join a multi-host run when one is described (flags or JAX_* environment); True if joined.

    On CPU the processes talk through gloo collectives.
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None and num_processes in (None, 1):
        return False
    if coordinator is None or num_processes is None or process_id is None:
        raise MeshError("a multi-host run needs --coordinator, --num-processes and --process-id (or JAX_* variables)")
    if not 0 <= process_id < num_processes:
        raise MeshError(f"--process-id {process_id} must be in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # used only by CPU devices
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True
