"""A CPU run's host memory: `finetune-lora` executes itself again with glibc's malloc in transparent huge pages,
so XLA:CPU's per-step temporaries fault in 2 MiB pages rather than 4 KiB ones; only on the CPU, only once, and
never over the user's own malloc settings."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from finetune import cli
from finetune.train import host_memory

ROOT = Path(__file__).parent.parent
CPU = {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}

# A jitted loop carrying 64 MB: XLA:CPU allocates its temporaries (above glibc's mmap threshold) at every call.
# Prints the fewest minor page faults of a call among 8 calls after 4 warm-up calls.
FAULTS = """
import resource
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, c: jnp.flip(c, 0) * 1.5 + c, x))
x = jnp.ones((4096, 4096), jnp.float32)
faults = []
for call in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[4:]))
"""


def _plain_environment() -> dict[str, str]:
    return {name: value for name, value in {**os.environ, **CPU}.items()
            if name not in ("GLIBC_TUNABLES", "LD_PRELOAD") and not name.startswith("MALLOC_")}


def _faults_per_call(environ: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", FAULTS], env=environ, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.slow
def test_huge_pages_cut_the_per_call_page_faults():
    plain = _plain_environment()
    huge = host_memory.hugepage_environment(plain)
    if huge is None:
        pytest.skip("no glibc or no transparent huge pages here")
    # 64 MB of temporaries and result: 16k pages of 4 KiB each, faulted at every call (here 32.8k faults a call;
    # 1.1k in huge pages: what is not in whole 2 MiB pages still faults by 4 KiB)
    plain_faults = _faults_per_call(plain)
    assert plain_faults > 10_000
    assert _faults_per_call(huge) < plain_faults / 10


@pytest.mark.slow
def test_the_restart_adds_the_tunable_once():
    """A real exec: the command comes back with the tunable set, and does not execute itself a second time."""
    plain = _plain_environment()
    if host_memory.hugepage_environment(plain) is None:
        pytest.skip("no glibc or no transparent huge pages here")
    code = ("import os; from finetune.train.host_memory import restart_with_hugepages; restart_with_hugepages(); "
            "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'))")
    out = subprocess.run([sys.executable, "-c", code], env={**plain, "GLIBC_TUNABLES": "glibc.pthread.rseq=1"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split()[1:] == [f"glibc.pthread.rseq=1:{host_memory.TUNABLE}"]
    assert host_memory.hugepage_environment({**plain, "GLIBC_TUNABLES": host_memory.TUNABLE}) is None


def test_cpu_is_decided_by_jax_platforms_first(monkeypatch):
    monkeypatch.setattr(host_memory, "_accelerator_plugins", lambda: ["xla_cuda12"])
    assert host_memory.computes_on_cpu({"JAX_PLATFORMS": "cpu"})
    assert not host_memory.computes_on_cpu({"JAX_PLATFORMS": "rocm,cpu"})
    assert not host_memory.computes_on_cpu({})  # an accelerator plugin is installed
    monkeypatch.setattr(host_memory, "_accelerator_plugins", lambda: [])
    assert host_memory.computes_on_cpu({})


def test_malloc_settings_of_the_user_are_left_alone(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: True)
    monkeypatch.setattr(host_memory, "transparent_hugepages", lambda: True)
    assert host_memory.hugepage_environment({"JAX_PLATFORMS": "cpu"}) == {
        "JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": host_memory.TUNABLE}
    for name, value in (("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096"), ("MALLOC_ARENA_MAX", "2"),
                        ("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")):
        assert host_memory.hugepage_environment({"JAX_PLATFORMS": "cpu", name: value}) is None, name
    assert host_memory.hugepage_environment({"JAX_PLATFORMS": "cuda"}) is None
    monkeypatch.setattr(host_memory, "transparent_hugepages", lambda: False)
    assert host_memory.hugepage_environment({"JAX_PLATFORMS": "cpu"}) is None


def test_the_command_restarts_under_huge_pages_before_running(monkeypatch):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["finetune-lora"] == "finetune.cli:console"
    execs = []

    class Executed(Exception):
        pass

    def execve(path, argv, environ):
        execs.append((path, argv, environ))
        raise Executed

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(host_memory, "hugepage_environment", lambda environ: {"GLIBC_TUNABLES": host_memory.TUNABLE})
    monkeypatch.setattr(cli, "main", lambda argv=None: 0)
    with pytest.raises(Executed):
        cli.console()
    assert execs == [(sys.executable, [sys.executable, *sys.orig_argv[1:]], {"GLIBC_TUNABLES": host_memory.TUNABLE})]
    monkeypatch.setattr(host_memory, "hugepage_environment", lambda environ: None)
    assert cli.console() == 0
    assert len(execs) == 1
