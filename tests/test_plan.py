"""finetune-lora --plan: the train step compiled from abstract shapes, with a per-device memory report."""

import json
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.config import TrainConfig
from finetune.planning.fit import candidates, offload_note
from finetune.planning.plan import plan
from finetune.step import mesh as mesh_module
from jaxmodel.config import LlamaConfig

LLAMA_405B = Path(__file__).parent / "data" / "llama-3.1-405b-config.json"  # meta-llama/Llama-3.1-405B's config.json


def gathered_layer_bytes(config: dict, dtype_bytes: int) -> int:
    """Bytes of one decoder layer's linear weights (norms are negligible)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_o = 2 * hidden * config["num_attention_heads"] * head_dim
    k_v = 2 * hidden * config["num_key_value_heads"] * head_dim
    return (q_o + k_v + 3 * hidden * inter) * dtype_bytes


@pytest.mark.slow
def test_llama_405b_on_eight_devices_compiles_and_fits():
    report = plan(TrainConfig(plan=True, model_config=str(LLAMA_405B), mesh="dp=1,fsdp=8,mp=1", batch_size=16,
                              seq_len=64).validate())
    assert {axis: size for axis, size in report.mesh.items() if size > 1} == {"fsdp": 8}
    assert 100e9 < report.weights < 103e9  # 811 GB of bf16 weights / 8
    assert report.lora_and_optimizer < 1e9  # 312M float32 LoRA params x (param + 2 moments) / 8
    # One layer's weights, gathered whole for its matmuls: q/o 16384 x 16384 each, k/v 1024 x 16384 each,
    # gate/up/down 53248 x 16384 each = 3.19e9 bf16 parameters = 6.38 GB. The step holds a gathered layer in
    # the forward scan and another in the backward scan (more while the next layer's gather overlaps), plus
    # the `dots` policy's saved matmul outputs: 174,080 values per token per layer (q, k, v, attention
    # output, o, gate, up, down) x 128 tokens per device x 126 layers x 2 bytes = 5.6 GB = 0.9 layers.
    # Bound: more than one gathered layer, less than four (measured 22.86 GB = 3.6 layers). The float32
    # step's temporaries without the bf16 scaling would be 45.7 GB = 7.2 layers, the CPU compiler's raw bf16
    # figure 248 GB.
    layer_bytes = gathered_layer_bytes(json.loads(LLAMA_405B.read_text()), dtype_bytes=2)
    assert 6.37e9 < layer_bytes < 6.38e9
    assert layer_bytes < report.temp < 4 * layer_bytes
    assert report.fits
    text = str(report)
    assert "405.9B frozen parameters" in text and "fits in 144.0 GB per device" in text  # 192 GB x 0.75


SMALL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}


@pytest.fixture
def small_config(tmp_path, default_allocator):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    return path


@pytest.mark.slow
def test_cli_plan_on_a_small_model_reports_and_exits_by_verdict(small_config, capsys):
    args = ["--plan", "--model-config", str(small_config), "--mesh", "dp=2,fsdp=4,mp=1", "--batch-size", "8",
            "--seq-len", "32", "--dtype", "float32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fits in 144.0 GB per device" in out and "frozen weights" in out
    assert main(args + ["--hbm-gb", "0.0001", "--show-sharding"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT in 0.0 GB" in out and "layers.self_attn.q_proj.lora_a" in out


@pytest.mark.slow
def test_cli_plan_on_fewer_devices_than_jax_has_plans_the_first_ones(small_config, capsys):
    """JAX has 8 devices already (a GPU node, or these tests): a 2-device mesh plans on the first 2."""
    mesh_module._note_unused_devices.cache_clear()  # printed once per process
    assert main(["--plan", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=2,mp=1", "--batch-size", "2",
                 "--seq-len", "32", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert "memory per device, mesh dp=1,fsdp=2,cp=1,mp=1, cpu compiler" in captured.out
    assert captured.err.splitlines() == [
        ("finetune-lora: note: the mesh uses 2 of the 8 visible devices; HIP_VISIBLE_DEVICES (ROCm) or "
         "CUDA_VISIBLE_DEVICES (CUDA) chooses which are visible (JAX reserves memory on every visible GPU, used or not)")]


@pytest.mark.slow
def test_cli_verdict_follows_the_memory_fraction_variable(small_config, capsys, monkeypatch):
    config = TrainConfig(plan=True, model_config=str(small_config), mesh="dp=1,fsdp=8,mp=1", batch_size=8,
                         seq_len=64, dtype="float32").validate()
    total = plan(config, cpu_bf16_figure=False).total
    # A device on which the plan needs 85%: more than JAX's default 75%, less than 95%.
    args = ["--plan", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=8,mp=1", "--batch-size", "8",
            "--seq-len", "64", "--dtype", "float32", "--hbm-gb", str(total / 0.85 / 1e9)]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "(JAX's default preallocation; XLA_CLIENT_MEM_FRACTION not set)" in out
    assert "DOES NOT FIT" in out and out.rstrip().endswith("fits at XLA_CLIENT_MEM_FRACTION=0.85")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.95")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "x 0.95 =" in out and "(XLA_CLIENT_MEM_FRACTION=0.95)" in out and "(89% used" in out


@pytest.mark.slow
def test_a_dpo_plan_holds_two_rows_a_pair(small_config):
    """`--objective dpo` with b pairs runs the policy forward and backward on 2b rows (chosen and rejected) plus
    a reference forward under stop_gradient that keeps no activations: its temporaries are at least SFT's on
    2b sequences of the same length, and more than SFT's on b. (Measured, float32, 8 pairs x 64 on fsdp=8:
    DPO 2.62 MB, SFT 16 x 64 2.43 MB, SFT 8 x 64 1.33 MB.)"""
    def temp(objective: str, batch_size: int) -> float:
        config = TrainConfig(plan=True, model_config=str(small_config), mesh="dp=1,fsdp=8,mp=1",
                             batch_size=batch_size, seq_len=64, dtype="float32", objective=objective).validate()
        return plan(config, cpu_bf16_figure=False).temp

    dpo, sft_rows, sft_pairs = temp("dpo", 8), temp("sft", 16), temp("sft", 8)
    assert dpo >= sft_rows > sft_pairs


def test_cli_bad_allocator_variable_is_one_line_before_compiling(small_config, capsys, monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
    assert main(["--plan", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=8,mp=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "finetune-lora: error: XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set: keep only "
        "XLA_CLIENT_MEM_FRACTION (the other is its deprecated name)"]


def test_fit_tries_settings_fastest_first():
    config = TrainConfig(plan=True, model_config="c.json", mesh="dp=1,fsdp=-1,mp=1", batch_size=4, seq_len=64,
                         remat="none", grad_accum=2)
    tried = [(c.mesh, c.remat, c.grad_accum) for c in candidates(config, 4)]
    assert tried == [
        ("dp=1,fsdp=4,cp=1,mp=1", "dots", 1), ("dp=1,fsdp=4,cp=1,mp=1", "full", 1),
        ("dp=1,fsdp=4,cp=1,mp=1", "full", 2), ("dp=1,fsdp=4,cp=1,mp=1", "full", 4),
        ("dp=1,fsdp=2,cp=2,mp=1", "dots", 1), ("dp=1,fsdp=2,cp=2,mp=1", "full", 1),
        ("dp=1,fsdp=2,cp=2,mp=1", "full", 2), ("dp=1,fsdp=2,cp=2,mp=1", "full", 4),
        ("dp=1,fsdp=1,cp=4,mp=1", "dots", 1), ("dp=1,fsdp=1,cp=4,mp=1", "full", 1),
        ("dp=1,fsdp=1,cp=4,mp=1", "full", 2), ("dp=1,fsdp=1,cp=4,mp=1", "full", 4)]


def test_fit_searches_only_the_devices_the_mesh_names():
    config = TrainConfig(plan=True, model_config="c.json", mesh="dp=1,fsdp=2,mp=1", batch_size=2, seq_len=64)
    assert [(c.mesh, c.remat, c.grad_accum) for c in candidates(config, 8)] == [
        ("dp=1,fsdp=2,cp=1,mp=1", "dots", 1), ("dp=1,fsdp=2,cp=1,mp=1", "full", 1),
        ("dp=1,fsdp=2,cp=1,mp=1", "full", 2),
        ("dp=1,fsdp=1,cp=2,mp=1", "dots", 1), ("dp=1,fsdp=1,cp=2,mp=1", "full", 1),
        ("dp=1,fsdp=1,cp=2,mp=1", "full", 2)]


def test_fit_leaves_offload_out_and_says_what_it_would_need():
    """Never run on a GPU, and its saved layer inputs need pinned host memory: 405B at 128k on cp=8 keeps
    126 layers x 16384 tokens x 16384 x 2 bytes = 67.6 GB per device (541 GB a node)."""
    config = TrainConfig(plan=True, model_config=str(LLAMA_405B), mesh="dp=1,fsdp=1,cp=8,mp=1", batch_size=1,
                         seq_len=131072)
    assert all(c.remat != "offload" for c in candidates(config, 8))
    note = offload_note(config, LlamaConfig.from_hf(LLAMA_405B), {"dp": 1, "fsdp": 1, "cp": 8, "mp": 1}, "gpu")
    assert note == ("--remat offload not tried: never measured on gpu, and it keeps each layer's input in pinned "
                    "host memory: 67.6 GB per device here (126 layers x 16384 tokens x hidden 16384 x 2 bytes); "
                    "plan it with --plan --remat offload")


@pytest.mark.slow
def test_cli_fit_prints_each_tried_setting_and_the_first_that_fits(small_config, capsys):
    base = dict(plan=True, model_config=str(small_config), mesh="dp=1,fsdp=8,mp=1", batch_size=8, seq_len=256,
                dtype="float32")
    dots = plan(TrainConfig(**base, remat="dots").validate(), cpu_bf16_figure=False).total
    full = plan(TrainConfig(**base, remat="full").validate(), cpu_bf16_figure=False).total
    assert full < dots
    hbm_gb = (full + dots) / 2 / 0.75 / 1e9  # full fits at JAX's default fraction, dots does not
    args = ["--plan", "--fit", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=8,mp=1", "--batch-size", "8",
            "--seq-len", "256", "--dtype", "float32", "--hbm-gb", str(hbm_gb)]
    assert main(args) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[:3] == ["dp=1,fsdp=8,cp=1,mp=1", "dots", "1"] and "DOES NOT FIT" in rows[1]
    assert rows[2].split()[:3] == ["dp=1,fsdp=8,cp=1,mp=1", "full", "1"] and "fits in" in rows[2]
    assert rows[3].startswith("--remat offload not tried: never measured on cpu")
    assert "(2 layers x 256 tokens x hidden 64 x 4 bytes)" in rows[3]
    assert rows[4:] == ["fastest setting that fits:",
                        "  finetune-lora --model CONVERTED_DIR --data DATA.jsonl --out RUN_DIR "
                        "--mesh dp=1,fsdp=8,cp=1,mp=1 --seq-len 256 --dtype float32 --remat full"]



@pytest.mark.slow
def test_cli_fit_when_nothing_fits_lists_every_setting_and_exits_1(small_config, capsys):
    # One sequence on 8 devices: only the cp=8 mesh can hold it; the other splits are not possible.
    args = ["--plan", "--fit", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=1,cp=8,mp=1",
            "--batch-size", "1", "--seq-len", "256", "--dtype", "float32", "--hbm-gb", "0.0001"]
    assert main(args) == 1
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[:2] for row in rows[1:3]] == [["dp=1,fsdp=1,cp=8,mp=1", "dots"], ["dp=1,fsdp=1,cp=8,mp=1", "full"]]
    assert all("DOES NOT FIT" in row for row in rows[1:3])
    assert [row.split()[0] for row in rows[3:6]] == ["dp=1,fsdp=8,cp=1,mp=1", "dp=1,fsdp=4,cp=2,mp=1",
                                                     "dp=1,fsdp=2,cp=4,mp=1"]
    assert all("not possible: --batch-size 1 / --grad-accum 1 must be a multiple of" in row for row in rows[3:6])
    assert rows[6].startswith("--remat offload not tried")
    assert rows[7:] == ["nothing tried fits: use more devices, a shorter --seq-len or a smaller --batch-size"]


def test_fit_without_plan_is_a_usage_error(capsys):
    assert main(["--fit", "--model", "m", "--data", "d", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip() == "finetune-lora: error: --fit goes with --plan"


def test_plan_without_a_config_is_an_error(capsys):
    assert main(["--plan", "--mesh", "dp=1,fsdp=8,mp=1"]) == 2
    assert "--plan needs --model-config" in capsys.readouterr().err


def test_plan_with_a_missing_config_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert main(["--plan", "--model-config", str(missing), "--mesh", "dp=1,fsdp=8,mp=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"finetune-lora: error: {missing}: not found (expected a HuggingFace Llama config.json)"]


def test_plan_refuses_a_rank_larger_than_the_layers_before_compiling(small_config, capsys):
    assert main(["--plan", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=8,mp=1", "--rank", "64"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "finetune-lora: error: --rank 64 is larger than the smallest adapted layer: k_proj (64 -> 32) allows a rank "
        "of at most 32"]
