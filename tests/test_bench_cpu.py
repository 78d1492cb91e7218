"""The CPU line every bench/ table is printed under: the model, the cores and the matrix instructions that set the
matmul peaks (the same core count gives a float32 peak of ~210 GFLOP/s on a Zen 4 and ~360 on a Xeon with
AVX-512 and AMX, whose bf16 peak is then ~4.6x the float32 one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni
"""
XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx fma avx2 avx512f avx512ifma avx_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8
"""


def cli_runs():
    sys.path.insert(0, str(ROOT / "bench"))
    import cli_runs as module

    return module


def test_the_cpu_line_names_the_model_the_cores_and_the_matrix_instructions():
    describe = cli_runs().cpu_description
    assert describe(ZEN4, cores=2) == "AMD EPYC 9B14, 2 cores (avx512f, avx512_bf16)"
    assert describe(XEON, cores=2) == "Intel(R) Xeon(R) Processor, 2 cores (avx512f, avx512_bf16, amx_bf16)"
    assert describe("model name\t: Old\nflags\t\t: sse avx fma avx2\n", cores=4) == "Old, 4 cores (avx2)"
    assert describe("", cores=1) == "unknown CPU, 1 cores"


def test_the_cpu_line_of_this_machine_reads_proc_cpuinfo():
    line = cli_runs().cpu_description()
    assert ", " in line and " cores" in line


@pytest.mark.slow
def test_a_console_script_runs_through_its_entry_point_where_none_is_installed(monkeypatch, tmp_path):
    """bench/gpu_session.sh runs the tree uninstalled on a GPU machine: the benches reach the CLI through
    pyproject.toml's entry points there."""
    import subprocess

    module = cli_runs()
    monkeypatch.setattr(module, "BIN", tmp_path)  # no console script beside the interpreter
    command = module.console_script("convert-llama")
    assert command[:2] == [sys.executable, "-c"]
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.startswith("usage: convert-llama")
