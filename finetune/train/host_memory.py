"""Host memory of a run that computes on the CPU: the step's temporaries in transparent huge pages.

Why: XLA:CPU allocates each execution's temporaries with malloc, one block of hundreds of MB to GB
(bench/train.py's model: 555 MB a step; SmolLM2-135M's shape at 8 x 256 tokens: 2.6 GB). glibc serves blocks that
large with mmap and unmaps them when they are freed, so every step faults its whole temporary buffer in again,
one fault per 4 KiB page, each page zeroed by the kernel: 142k faults a step for the first model, 636k for
the second (2-core AMD EPYC). glibc's tunable `glibc.malloc.hugetlb=1` makes malloc ask the kernel for
transparent huge pages for such blocks (madvise), 2 MiB a fault: 500 times fewer faults, and fewer TLB misses
in the step's matmuls. The memory still goes back to the kernel after each step, so the process holds no more
than before. (Keeping freed memory in the heap instead, with mallopt, removes the faults and the kernel's
zeroing too, but the heap fragments: resident memory grew 1.7x on the first model.)

glibc reads tunables only when a process starts, so `finetune-lora` executes itself again with the tunable
added, first thing, when JAX will compute on the CPU (`JAX_PLATFORMS` names cpu first, or it is unset and no
accelerator plugin is installed), the C library is glibc, the kernel's transparent huge pages are not `never`,
and the environment does not set malloc up already (GLIBC_TUNABLES with a `glibc.malloc.` setting, a
`MALLOC_*` variable, an allocator in LD_PRELOAD): the added tunable is such a setting, so this happens at most
once. On an accelerator the step's temporaries are device memory, and the host's malloc is left as it is.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil
import platform
import sys
from pathlib import Path
from typing import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def hugepage_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """`environ` with glibc's malloc told to use transparent huge pages, or None where that is not wanted or
    would do nothing (the module's docstring)."""
    if not (computes_on_cpu(environ) and _glibc() and transparent_hugepages()) or malloc_chosen_by_user(environ):
        return None
    tunables = environ.get("GLIBC_TUNABLES")
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def restart_with_hugepages() -> None:
    """Execute this process's command again under `hugepage_environment`, when it gives one; otherwise, or if
    the exec fails, return. Call before anything else: nothing after the call survives the exec."""
    environ = hugepage_environment(os.environ)
    if environ is None:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError:
        return


def computes_on_cpu(environ: Mapping[str, str]) -> bool:
    """Whether JAX's default backend will be the CPU, decided without creating any backend."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not _accelerator_plugins()


def malloc_chosen_by_user(environ: Mapping[str, str]) -> bool:
    """Whether `environ` sets glibc's malloc up or preloads another allocator: then it is left as it is."""
    return ("glibc.malloc." in environ.get("GLIBC_TUNABLES", "") or any(name.startswith("MALLOC_") for name in environ)
            or "malloc" in environ.get("LD_PRELOAD", ""))


def transparent_hugepages() -> bool:
    """Whether the kernel gives transparent huge pages to a process that asks (`always` or `madvise`)."""
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _accelerator_plugins() -> list[str]:
    """The accelerator backends JAX would find: its `jax_plugins` (CUDA, ROCm, ...) and libtpu."""
    found = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        found += [name for _, name, _ in pkgutil.iter_modules(spec.submodule_search_locations)]
    if importlib.util.find_spec("libtpu") is not None:
        found.append("libtpu")
    return found
