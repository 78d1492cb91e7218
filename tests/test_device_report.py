"""bench/device_report.py run as a subprocess in its reduced form (--quick, a tiny model) on the simulated CPU
devices tests/conftest.py sets up: the JSON holds every figure, and the figures agree with each other and with
the toolkit's own FLOP count; bad input is one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def report_run(*args: str) -> subprocess.CompletedProcess:
    """`python bench/device_report.py ARGS` from the repository root, with this session's XLA_FLAGS."""
    return subprocess.run([sys.executable, "bench/device_report.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=os.environ.copy(), check=False)


def simulated_devices() -> int:
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 1


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """The report of a --quick run whose train step uses two devices (a mesh, fsdp=2), and its stdout."""
    path = tmp_path_factory.mktemp("report") / "report.json"
    run = report_run("--quick", "--step-devices", "2", "--json", str(path))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(path.read_text()), run.stdout


@pytest.mark.slow
def test_report_has_every_figure_and_they_are_positive(quick_report):
    report, stdout = quick_report
    assert report["backend"] == "cpu" and report["device_count"] == simulated_devices()
    peaks = report["matmul_peak_flops"]
    assert set(peaks) == {"float32", "bfloat16"} and all(v > 0 for v in peaks.values())
    step = report["step"]
    assert step["dtype"] == "bfloat16" and step["devices"] == 2 and step["mesh"] == "dp=1,fsdp=2,cp=1,mp=1"
    assert step["tokens_per_s"] > 0 and step["flops_per_token"] > 0 and step["mfu"] > 0
    memory = report["memory"]
    assert memory["plan_peak_bytes"] > 0 and memory["measured_peak_bytes"] > 0
    assert memory["plan_peak_bytes"] >= memory["plan_compiler_bytes"] > 0
    rows = report["attention"]["rows"]
    assert len(rows) == 2 and all(row["xla"] > 0 and row["blockwise"] > 0 for row in rows)
    assert "| LoRA train step |" in stdout and "| logits parity |" in stdout  # the table


@pytest.mark.slow
def test_mfu_and_flops_per_token_are_the_toolkits(quick_report):
    from finetune.train.metrics import flops_per_token
    from jaxmodel.config import LlamaConfig

    report, _ = quick_report
    step, peak = report["step"], report["matmul_peak_flops"][report["step"]["dtype"]]
    llama = LlamaConfig.from_hf(report["model"]["config"])
    assert llama.num_hidden_layers == step["layers"]
    assert step["flops_per_token"] == flops_per_token(llama, step["seq"])
    assert step["mfu"] == pytest.approx(step["tokens_per_s"] * step["flops_per_token"] / (peak * step["devices"]))


@pytest.mark.slow
def test_collectives_and_parity(quick_report):
    report, _ = quick_report
    collectives = report["collectives"]
    if report["device_count"] == 1:
        assert collectives == {"skipped": "one device"}
    else:
        assert collectives["devices"] == report["device_count"]
        assert collectives["all_reduce_bus_bytes_per_s"] > 0 and collectives["all_gather_bus_bytes_per_s"] > 0
    # CPU against CPU: the same program on the same backend
    assert report["parity"]["relative_difference"] <= 1e-6
    assert report["parity"]["max_abs_logit"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("args, named", [
    (["--dtype", "float16"], "--dtype"),
    (["--json", "/nonexistent-dir/report.json"], "--json /nonexistent-dir/report.json"),
    (["--json", "."], "--json ."),
])
def test_bad_input_is_one_line(args, named):
    run = report_run("--quick", *args)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("device_report.py: error: ") and named in lines[0], run.stderr
    assert "Traceback" not in run.stderr and not run.stdout
