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

from isolation import quick_compile_env

ROOT = Path(__file__).resolve().parent.parent


def report_run(*args: str) -> subprocess.CompletedProcess:
    """`python bench/device_report.py ARGS` from the repository root, with this session's XLA_FLAGS (compiling
    quickly: the figures' values are not under test)."""
    return subprocess.run([sys.executable, "bench/device_report.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=quick_compile_env(), check=False)


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


def test_a_report_cut_off_leaves_its_finished_sections_marked_unfinished(device_report, tmp_path, monkeypatch):
    """A session's time limit ends the report mid-way: the sections measured so far are in the JSON, marked."""
    path = tmp_path / "report.json"

    def cut_off(args, done):
        done({"step": {"seconds": 1.0}})
        raise SystemExit(124)  # as `timeout` ends it

    monkeypatch.setattr(device_report, "measure", cut_off)
    with pytest.raises(SystemExit):
        device_report.main(["--json", str(path)])
    assert json.loads(path.read_text()) == {"step": {"seconds": 1.0}, "unfinished": "cut off after this section"}


@pytest.mark.slow
def test_report_has_every_figure_and_they_are_positive(quick_report):
    report, stdout = quick_report
    assert "unfinished" not in report
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
    blocks = report["attention"]["blocks"]
    assert blocks["seq"] == 128 and all(seconds > 0 for seconds in blocks["seconds"].values())
    assert list(blocks["seconds"]) == ["128x128", "256x256", "512x512", "128x512", "512x128"]
    assert "| blockwise blocks, 128 positions | 128x128 " in stdout
    assert "| LoRA train step |" in stdout and "| logits parity |" in stdout  # the table
    table = report["memory_bandwidth"]["table"]
    assert [size for size, _ in table] == sorted(size for size, _ in table) and all(bw > 0 for _, bw in table)
    assert report["transcendentals_per_s"] > 0
    predicted = report["predicted_step"]
    assert predicted["seconds"] == pytest.approx(predicted["compute_seconds"] + predicted["memory_seconds"])
    assert "| LoRA train step: predicted |" in stdout


@pytest.mark.slow
def test_the_report_is_a_device_model_for_plan(quick_report, tmp_path):
    """`finetune-lora --plan --device-model report.json` reads the report's measured figures."""
    from finetune.planning.devices import load_device_model

    report, _ = quick_report
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    model = load_device_model(str(path))
    assert model.matmul_flops_per_s("bfloat16") == report["matmul_peak_flops"]["bfloat16"]
    assert model.memory_bytes_per_s(report["memory_bandwidth"]["table"][0][0]) == \
        report["memory_bandwidth"]["table"][0][1]
    if report["device_count"] > 1:
        table = report["collectives"]["table"]
        assert model.bus_bytes_per_s(table["2"][-1][0], 2) == table["2"][-1][1]
        assert model.collective_latency_s == report["collectives"]["latency_s"]


@pytest.mark.slow
def test_mfu_and_flops_per_token_are_the_toolkits(quick_report):
    from finetune.step.flops import flops_per_token
    from jaxmodel.config import ModelConfig

    report, _ = quick_report
    step, peak = report["step"], report["matmul_peak_flops"][report["step"]["dtype"]]
    llama = ModelConfig.from_hf(report["model"]["config"])
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
        groups = [2**k for k in range(1, report["device_count"].bit_length()) if 2**k <= report["device_count"]]
        assert list(collectives["table"]) == [str(g) for g in groups] and collectives["latency_s"] > 0
        assert all(len(rows) == 4 and all(bw > 0 for _, bw in rows) for rows in collectives["table"].values())
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


@pytest.fixture(scope="module")
def device_report():
    """bench/device_report.py as a module (bench/ on sys.path, as the script itself puts it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import device_report as module

    return module


class FakeDevice:
    def __init__(self, platform: str):
        self.platform = platform


def test_a_device_without_memory_stats_reports_no_measured_memory(device_report):
    """The process's RSS stands in for a CPU device's memory only: on an accelerator whose backend reports no
    memory_stats() the host's RSS says nothing about the device."""
    on_cpu = device_report.measured_memory(FakeDevice("cpu"), on_device=None, held=1000, rss_growth=500)
    assert on_cpu["measured_peak_bytes"] == 1500
    on_gpu = device_report.measured_memory(FakeDevice("gpu"), on_device=None, held=1000, rss_growth=500)
    assert on_gpu["measured_peak_bytes"] is None and "memory_stats" in on_gpu["measured_how"]
    stats = device_report.measured_memory(FakeDevice("gpu"), on_device=7e9, held=1000, rss_growth=500)
    assert stats["measured_peak_bytes"] == 7e9


def test_dense_attention_is_capped_on_an_accelerator_that_reports_no_memory_limit(device_report):
    from jaxmodel.config import ModelConfig

    llama = ModelConfig(**device_report.WIDE_MODEL, rms_norm_eps=1e-5)
    fits = device_report.dense_attention_fits
    assert fits(llama, 32768, None, "cpu")  # the CPU's shapes are fixed and small
    assert fits(llama, device_report.DENSE_SEQ_WITHOUT_LIMIT, None, "gpu")
    assert not fits(llama, 2 * device_report.DENSE_SEQ_WITHOUT_LIMIT, None, "gpu")
    assert fits(llama, 8192, 80e9, "gpu") and not fits(llama, 32768, 80e9, "gpu")  # half the device


@pytest.mark.slow
def test_on_an_nvidia_gpu_the_fused_kernels_are_timed_and_checked(device_report, quick_report):
    """The attention rows and checks as on a GPU (here: cuDNN absent, Pallas interpreted): each kernel timed or its
    error kept, each check's verdict, the table's share of the peak in attention FLOPs, the failures named."""
    args = device_report.build_parser().parse_args(["--quick"])
    shape = device_report.backend_shape(args, "cpu", None, 1)
    shape = device_report.dataclasses.replace(shape, attention_seqs=(128,))
    rows = device_report.attention_rows(shape, "bfloat16", None, "cuda")
    assert list(rows[0]) == ["seq", "xla", "blockwise", "cudnn", "pallas-triton", "pallas-flash"]
    assert rows[0]["cudnn"] == {"error": "RuntimeError: cuDNN is not detected."}
    assert rows[0]["pallas-triton"] > 0
    checks = device_report.attention_checks(device_report.llama_of(shape.model), "bfloat16", "cuda")
    packed_refused = "rows of one sequence each (padding as lengths): packed rows (--pack) need segments"
    assert checks == {"cudnn": {"packed": packed_refused, "one sequence a row": "RuntimeError: cuDNN is not detected.",
                                "packed, cp chunk, window": packed_refused},
                      "pallas-triton": {"packed": "agrees", "one sequence a row": "agrees",
                                        "packed, cp chunk, window": "no query offset (context parallelism's chunks)"},
                      "pallas-flash": {"packed": "agrees", "one sequence a row": "agrees",
                                       "packed, cp chunk, window": "agrees"}}
    report = json.loads(json.dumps(quick_report[0]))
    report["attention"] = {"dtype": "bfloat16", "batch": 1, "rows": rows, "checks": checks}
    report["matmul_peak_flops"]["bfloat16"] = 1e12
    lines = "\n".join(device_report.table(report))
    c = report["model"]["config"]
    flops = device_report.attention_flops(c["num_attention_heads"], c["head_dim"], 128)
    share = flops / rows[0]["pallas-triton"] / 1e12
    assert f"pallas-triton {rows[0]['pallas-triton'] * 1e3:,.1f} ms ({share:.0%})" in lines
    assert ("| attention check: pallas-flash | packed: agrees; one sequence a row: agrees; packed, cp chunk, window: "
            "agrees |") in lines
    assert device_report.failed_sections(report) == ["attention cudnn at 128 positions"]
    assert device_report.attention_flops(32, 128, 8192) == 3.5 * 2 * 32 * 128 * 8192**2  # the causal half


def accelerator_plan(device_report, tmp_path, bytes_limit: float, devices: int, *options: str):
    """(shape, plan) that the report would train at on `devices` accelerators of `bytes_limit` each."""
    args = device_report.build_parser().parse_args(["--dtype", "bfloat16", *options])
    shape = device_report.backend_shape(args, "gpu", bytes_limit, devices)
    shape = device_report.apply_options(shape, args, devices)
    shape, plan, _ = device_report.planned(shape, args, "bfloat16", bytes_limit, tmp_path)
    return shape, plan


@pytest.mark.parametrize("bytes_limit, devices", [(64e9, 1), (182e9, 8)])
@pytest.mark.slow
def test_an_accelerator_trains_the_8b_widths_sized_to_its_memory(device_report, tmp_path, bytes_limit, devices):
    """What runs first on a GPU node: the sizing from memory_stats()["bytes_limit"] (an H100 at JAX's default
    memory fraction; 8 MI300X at 0.95) and --plan's check of the shape it chose, from abstract shapes."""
    if devices > simulated_devices():
        pytest.skip(f"needs {devices} simulated devices")
    shape, plan = accelerator_plan(device_report, tmp_path, bytes_limit, devices)
    assert shape.model == device_report.WIDE_MODEL  # every layer: 8B's 16 GB of bf16 weights fit
    assert shape.seq == 2048 and shape.devices == devices and shape.batch % devices == 0
    assert 0 < plan.total <= bytes_limit


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
@pytest.mark.slow
def test_the_step_and_its_plan_take_the_attention_option(device_report, tmp_path, attention):
    """--attention reaches the planned run's config, which both --plan and the measured step are built from."""
    args = device_report.build_parser().parse_args(["--attention", attention, "--layers", "1", "--batch", "1"])
    shape = device_report.apply_options(device_report.backend_shape(args, "gpu", 64e9, 1), args, 1)
    _, _, config = device_report.planned(shape, args, "bfloat16", 64e9, tmp_path)
    assert config.attention_impl() == attention


def test_a_shape_whose_plan_does_not_fit_halves_its_rows_then_its_layers(device_report, tmp_path, monkeypatch):
    """Rows per device go first, then layers, until --plan fits; what the command line fixed is kept, and a
    shape that cannot fit is `DoesNotFit` (a UsageError: main() reports it in one line)."""
    bytes_limit, devices = 1e12, 8  # sized at 32 layers and 8 rows a device
    planned_shapes = []

    def fake_plan(config):  # a third of the device per row and layer: fits at rows x layers <= 3
        layers = json.loads(Path(config.model_config).read_text())["num_hidden_layers"]
        rows = config.batch_size // devices
        planned_shapes.append((rows, layers))
        return type("Plan", (), {"total": rows * layers * bytes_limit / 3, "compiler_total": 0.0})()

    monkeypatch.setattr(device_report.dm, "plan_of", fake_plan)
    shape, plan = accelerator_plan(device_report, tmp_path, bytes_limit, devices)
    assert planned_shapes == [(8, 32), (4, 32), (2, 32), (1, 32), (1, 16), (1, 8), (1, 4), (1, 2)]
    assert (shape.batch, shape.model["num_hidden_layers"]) == (8, 2) and plan.total <= bytes_limit

    planned_shapes.clear()
    shape, _ = accelerator_plan(device_report, tmp_path, bytes_limit, devices, "--batch", "16")
    assert planned_shapes == [(2, 32), (2, 16), (2, 8), (2, 4), (2, 2), (2, 1)]
    assert (shape.batch, shape.model["num_hidden_layers"]) == (16, 1)

    planned_shapes.clear()
    shape, plan = accelerator_plan(device_report, tmp_path, bytes_limit, devices, "--batch", "32", "--layers", "32")
    assert planned_shapes == [(4, 32)] and plan.total > bytes_limit  # measured as asked; the notes say so

    with pytest.raises(device_report.DoesNotFit, match="give a smaller --layers or --batch"):
        accelerator_plan(device_report, tmp_path, bytes_limit, devices, "--batch", "64")


@pytest.mark.slow
def test_a_train_step_out_of_device_memory_is_one_line(device_report, monkeypatch, capsys):
    """Options that ask for more than the device holds (dense attention at a length --plan says does not fit,
    say) end in one line naming the plan and what to shrink, not the backend's traceback."""
    def oom(*args):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 192.58GiB\nmore")

    monkeypatch.setattr(device_report, "measure_step", oom)
    assert device_report.main(["--quick", "--attention", "xla"]) != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("device_report.py: error: ")]
    assert errors == [errors[0]] and "Traceback" not in err, err  # (a mesh note of --plan may precede it)
    assert errors[0].startswith("device_report.py: error: the train step ran out of device memory (--plan: ")
    assert errors[0].endswith("give a smaller --layers, --batch or --seq")

    monkeypatch.setattr(device_report, "measure_step", lambda *args: 1 / 0)  # any other error is a defect: shown whole
    with pytest.raises(ZeroDivisionError):
        device_report.main(["--quick"])


@pytest.mark.slow
def test_a_failing_measurement_is_reported_and_the_others_kept(device_report, quick_report):
    """An accelerator's out-of-memory error in one section (attention at a length, collectives, parity) leaves
    that section's entry as the error, the table says so, the rest of the report stands and the exit status
    says the report is incomplete."""
    def oom():
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 137438953472 bytes.\nmore")

    failed = device_report.guarded(oom)
    assert failed == {"error": "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               "137438953472 bytes."}
    assert device_report.guarded(lambda: 1.5) == 1.5
    report = json.loads(json.dumps(quick_report[0]))
    report["parity"] = failed
    report["collectives"] = failed
    report["attention"]["rows"][1]["xla"] = failed
    report["attention"]["blocks"]["seconds"]["512x512"] = failed
    lines = "\n".join(device_report.table(report))
    assert lines.count("failed: RuntimeError: RESOURCE_EXHAUSTED") == 4, lines
    assert "| LoRA train step |" in lines
    assert device_report.failed_sections(report) == ["attention xla at 128 positions",
                                                     "blockwise 512x512 at 128 positions", "collectives", "parity"]
    assert device_report.failed_sections(quick_report[0]) == []


@pytest.mark.slow
def test_the_report_names_the_platform_and_the_parity_precision(quick_report):
    report, _ = quick_report
    assert report["jaxlib_version"] and "platform_version" in report
    assert report["parity"]["matmul_precision"] == "highest"


def test_collectives_are_timed_by_the_shared_sampler(device_report, monkeypatch):
    """An accelerator's all-reduce of a few MiB takes well under a millisecond: one call a sample would time its
    dispatch. The collectives take the median of finetune.train.metrics.seconds_per_call's samples, which issue
    short calls back to back."""
    import jax

    dm = device_report.dm
    sampled = []

    def fake_sampler(call, samples):
        call()  # the collective runs
        sampled.append(samples)
        return [0.004, 0.001, 0.002, 0.003, 0.005][:samples]

    monkeypatch.setattr(dm, "seconds_per_call", fake_sampler)
    col = dm.collective_bandwidth(jax.devices()[:1], 2**10, repeats=5)
    assert sampled == [5, 5]
    assert col["all_reduce_seconds"] == col["all_gather_seconds"] == 0.003  # the median of the samples


def test_the_gpu_session_script_parses_and_fits_its_time(device_report):
    """bench/gpu_session.sh: valid bash, every device_report, step_profile and other bench/ command line one its
    script's parser takes, and its budget of device time within 9 minutes, no measurement's limit past it."""
    import importlib

    from step_profile import build_parser as profile_parser

    script = ROOT / "bench" / "gpu_session.sh"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    calls = re.findall(r"^ *(measure|profile|bench) (\S+) (\d+)(.*)$", text, re.MULTILINE)
    assert calls[0][:2] == ("measure", "report") and len(calls) == 9
    assert {name for kind, name, _, _ in calls if kind == "bench"} == {"sampler", "grpo"}
    parsers = {"measure": device_report.build_parser(), "profile": profile_parser()}
    for kind, _, _, args in calls:
        if kind == "bench":
            script_name, *args = args.split()
            importlib.import_module(script_name.removesuffix(".py")).build_parser().parse_args(args)
        else:
            parsers[kind].parse_args(args.split())
    budget = int(re.search(r'^budget="\$\{GPU_SESSION_SECONDS:-(\d+)\}"$', text, re.MULTILINE).group(1))
    assert budget <= 9 * 60 and all(int(limit) <= budget for _, _, limit, _ in calls)
