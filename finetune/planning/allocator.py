"""How much of each GPU's memory a JAX program may use, from the JAX client's allocator settings.

JAX's GPU client (CUDA and ROCm alike) reads these variables when it creates its devices: by default it
preallocates 75% of each device's memory and allocates every array and temporary inside that pool, so a
plan must be judged against `--hbm-gb` x that fraction, not the whole device.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping

from jaxmodel.errors import UsageError

FRACTION = "XLA_CLIENT_MEM_FRACTION"
FRACTION_DEPRECATED = "XLA_PYTHON_CLIENT_MEM_FRACTION"
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
ALLOCATORS = ("default", "platform", "bfc", "cuda_async", "vmm")
DEFAULT_FRACTION = 0.75  # JAX's preallocation when no fraction is set
# The largest fraction the plan suggests: the GPU runtime's own context, kernels and collective buffers live
# outside JAX's pool.
SUGGESTED_MAX = 0.95


class AllocatorSettingError(ValueError, UsageError):
    """An allocator variable the JAX client would refuse; the message names it."""


@dataclasses.dataclass(frozen=True)
class UsableMemory:
    fraction: float  # of each device's memory that the program may use
    reason: str  # which settings give that fraction

    def settings(self, env: Mapping[str, str] = os.environ) -> dict[str, str]:
        """The allocator variables set in `env` (to repeat them in front of a command line)."""
        names = (FRACTION, FRACTION_DEPRECATED, PREALLOCATE, ALLOCATOR)
        return {name: env[name] for name in names if env.get(name)}


def usable_memory(env: Mapping[str, str] = os.environ) -> UsableMemory:
    """The fraction of device memory JAX's allocator lets a program use, with the rule that gave it.

    From XLA's GPU client (`xla/pjrt/gpu/se_gpu_pjrt_client.cc`, `gpu_helpers.cc`), the same on ROCm:
    - `default` / `bfc` (the default) and `vmm`: at most `XLA_CLIENT_MEM_FRACTION` of the device's total
      memory (the deprecated `XLA_PYTHON_CLIENT_MEM_FRACTION` alike; both set is an error, as in jaxlib),
      0.75 when neither is set. `XLA_PYTHON_CLIENT_PREALLOCATE=false` grows the pool on demand up to the same
      limit: it changes when memory is taken, not how much may be.
    - `platform`: no pool; every array is allocated from the driver and freed (slow): all of the device.
    - `cuda_async` (CUDA only; the ROCm client refuses it): the fraction is what the pool keeps cached, not a
      limit: all of the device.
    """
    allocator = env.get(ALLOCATOR, "").lower() or "default"
    if allocator not in ALLOCATORS:
        raise AllocatorSettingError(f"{ALLOCATOR}={env[ALLOCATOR]!r}: expected one of {', '.join(ALLOCATORS)}")
    new, old = env.get(FRACTION, ""), env.get(FRACTION_DEPRECATED, "")
    if new and old:
        raise AllocatorSettingError(f"{FRACTION} and {FRACTION_DEPRECATED} are both set: keep only {FRACTION} "
                                    "(the other is its deprecated name)")
    name, text = (FRACTION, new) if new else (FRACTION_DEPRECATED, old)
    fraction = _parse_fraction(name, text) if text else None
    _parse_preallocate(env.get(PREALLOCATE, ""))
    if allocator == "platform":
        return UsableMemory(1.0, f"{ALLOCATOR}=platform: no pool, all of the device")
    if allocator == "cuda_async":
        return UsableMemory(1.0, f"{ALLOCATOR}=cuda_async: the fraction only sets the cached pool (CUDA only)")
    if fraction is None:
        return UsableMemory(DEFAULT_FRACTION, f"JAX's default preallocation; {FRACTION} not set")
    return UsableMemory(fraction, f"{name}={text}")


def fraction_to_fit(total: float, device_bytes: float) -> float | None:
    """The smallest `XLA_CLIENT_MEM_FRACTION` in steps of 0.05, at most 0.95, that holds `total`; None if none."""
    needed = math.ceil(round(total / device_bytes * 20, 6)) / 20
    return needed if needed <= SUGGESTED_MAX else None


def _parse_fraction(name: str, text: str) -> float:
    try:
        fraction = float(text)
    except ValueError:
        fraction = math.nan
    if not 0.0 < fraction <= 1.0:
        raise AllocatorSettingError(f"{name}={text!r}: expected a fraction of device memory in (0, 1], e.g. 0.95")
    return fraction


def _parse_preallocate(text: str) -> None:
    if text and text.lower() not in ("true", "false", "1", "0"):
        raise AllocatorSettingError(f"{PREALLOCATE}={text!r}: expected true or false")
