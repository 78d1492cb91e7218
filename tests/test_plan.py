"""finetune-lora --plan: the train step compiled from abstract shapes, with a per-device memory report."""

import dataclasses
import json
import math
from pathlib import Path

import pytest

from finetune.cli import main
from finetune.config import TrainConfig
from finetune.planning.devices import DEVICE_MODELS
from finetune.planning import fit as fit_module
from finetune.planning.fit import fit, frozen_bytes, lower_bound, meshes, offload_note, settings
from finetune.planning.plan import plan
from finetune.step import mesh as mesh_module
from finetune.step.flops import flops_per_token
from jaxmodel.config import ModelConfig

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


@pytest.mark.slow
def test_a_grpo_plan_holds_its_samplers_kv_cache_and_predicts_its_rollout(small_config):
    """`--objective grpo` with two iterations and beta > 0: the training step on B x G rows of --seq-len, the sampler
    (its KV cache, layers x rows x KV heads x (prompt + completion) x head width x keys and values, among its
    temporaries; every decode step counted), the log-prob passes (old and reference); a step's time the training
    step's and half (one rollout in two steps) the rollout's."""
    from finetune.planning.fit import command_line

    def config(completion: int, grad_accum: int = 1) -> TrainConfig:
        return TrainConfig(plan=True, model_config=str(small_config), mesh="dp=1,fsdp=1,mp=1", batch_size=4,
                           seq_len=16 + completion, dtype="float32", objective="grpo", reward=("equals:a",),
                           num_generations=4, max_completion_length=completion, num_iterations=2, beta=0.1,
                           grad_accum=grad_accum).validate()

    report = plan(config(16))
    sampler, passes = report.rollout
    assert sampler.name.startswith("sampler (prefill and 15 decode steps)") and passes.name.startswith("log-prob")
    kv_cache = 2 * 16 * 2 * 32 * 16 * 2 * 4  # layers x rows x KV heads x slots x head width x (K, V) x float32
    assert sampler.temp >= kv_cache and report.temp == max(report.temp, sampler.temp, passes.temp)
    assert sampler.cost.unknown_trip_counts == [] and sampler.runs == passes.runs == 0.5
    assert report.step_seconds == pytest.approx(report.prediction.step_seconds + (sampler.seconds + passes.seconds) / 2)
    longer = plan(config(48)).rollout[0]  # three times the decode steps, over longer caches: more than twice the work
    assert longer.cost.flops > 2 * sampler.cost.flops and longer.temp > sampler.temp
    text = str(report)
    assert "rollout: 4 prompts x 4 completions, prompts of 16 tokens" in text and "a step with its share" in text
    assert "--reward equals:a" in command_line(config(16))
    # a step of 16 micro-batches holds a row at a time, the sampler every row: its temporaries are the verdict's
    accumulated = plan(config(16, grad_accum=16))
    assert accumulated.temp == accumulated.rollout[0].temp > accumulated.rollout[1].temp


def test_cli_bad_allocator_variable_is_one_line_before_compiling(small_config, capsys, monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
    assert main(["--plan", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=8,mp=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "finetune-lora: error: XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set: keep only "
        "XLA_CLIENT_MEM_FRACTION (the other is its deprecated name)"]


def test_fit_tries_every_split_of_the_named_devices_with_mp_within_the_kv_heads():
    llama = ModelConfig.from_hf({**SMALL, "num_key_value_heads": 2})
    config = TrainConfig(plan=True, model_config="c.json", mesh="dp=1,fsdp=-1,mp=1", batch_size=4, seq_len=64)
    found = [",".join(f"{a}={m[a]}" for a in ("dp", "fsdp", "cp", "mp")) for m in meshes(config, llama, 4, 8)]
    assert found[0] == "dp=1,fsdp=4,cp=1,mp=1"  # the given mesh first
    assert sorted(found) == sorted(["dp=1,fsdp=4,cp=1,mp=1", "dp=4,fsdp=1,cp=1,mp=1", "dp=2,fsdp=2,cp=1,mp=1",
                                    "dp=2,fsdp=1,cp=2,mp=1", "dp=1,fsdp=2,cp=2,mp=1", "dp=1,fsdp=1,cp=4,mp=1",
                                    "dp=2,fsdp=1,cp=1,mp=2", "dp=1,fsdp=2,cp=1,mp=2", "dp=1,fsdp=1,cp=2,mp=2"])
    # the devices the mesh names, not all of them; mp within one host
    two = meshes(dataclasses.replace(config, mesh="dp=1,fsdp=2,mp=1"), llama, 8, 8)
    assert len(two) == 4 and all(math.prod(m.values()) == 2 for m in two)
    assert max(m["mp"] for m in meshes(config, ModelConfig.from_hf({**SMALL, "num_key_value_heads": 4}), 8, 2)) == 2


def test_fit_tries_no_cp_mesh_for_an_online_rl_run(tmp_path, capsys):
    """The sampler holds whole sequences: a grpo run refuses cp, and --fit does not plan it."""
    llama = ModelConfig.from_hf(LLAMA_405B)
    config = TrainConfig(plan=True, model_config=str(LLAMA_405B), objective="grpo", reward=("equals:a",))
    assert {m["cp"] for m in meshes(config, llama, 8, 8)} == {1}
    assert main(["--plan", "--model-config", str(LLAMA_405B), "--objective", "grpo", "--reward", "equals:a",
                 "--mesh", "dp=1,fsdp=4,cp=2,mp=1", "--seq-len", "1024"]) == 2
    assert capsys.readouterr().err.strip() == ("finetune-lora: error: --objective grpo runs on meshes without cp (its "
                                               "sampler holds whole sequences); got --mesh dp=1,fsdp=4,cp=2,mp=1")


def test_fit_tries_each_meshs_settings_fastest_first():
    config = TrainConfig(plan=True, model_config="c.json", mesh="dp=1,fsdp=-1,mp=1", batch_size=4, seq_len=64,
                         remat="none", grad_accum=2)
    tried = [(c.mesh, c.remat, c.grad_accum) for c in settings(config, {"dp": 1, "fsdp": 2, "cp": 2, "mp": 1})]
    assert tried == [("dp=1,fsdp=2,cp=2,mp=1", "dots", 1), ("dp=1,fsdp=2,cp=2,mp=1", "full", 1),
                     ("dp=1,fsdp=2,cp=2,mp=1", "full", 2), ("dp=1,fsdp=2,cp=2,mp=1", "full", 4)]


def test_the_lower_bound_of_fsdp_is_its_weight_gathers():
    """405B on 8 MI300X at the reference shape: gathering every layer twice a step over fsdp=8 takes 4.4 s at
    RCCL's bus bandwidth, whatever the batch; mp=8 gathers nothing, so its bound is its compute (0.29 s)."""
    llama = ModelConfig.from_hf(LLAMA_405B)
    config = TrainConfig(plan=True, model_config=str(LLAMA_405B), batch_size=16, seq_len=64)
    weights, layer = frozen_bytes(config, llama)
    assert weights == pytest.approx(811.7e9, rel=1e-3) and layer * 126 == pytest.approx(weights - 2 * 4.2e9, rel=1e-2)
    device = DEVICE_MODELS["mi300x"]
    fsdp = lower_bound(config, llama, {"dp": 1, "fsdp": 8, "cp": 1, "mp": 1}, device, layer)
    mp = lower_bound(config, llama, {"dp": 1, "fsdp": 1, "cp": 1, "mp": 8}, device, layer)
    assert fsdp == pytest.approx(2 * 126 * layer * 7 / 8 / 314.7e9, rel=0.01)
    compute = flops_per_token(llama, 64) * 16 * 64 / 8 / device.matmul_flops_per_s("bfloat16")
    assert mp == pytest.approx(compute) and 4.3 < fsdp < 4.6 and mp < 0.3


def test_fit_leaves_offload_out_and_says_what_it_would_need():
    """Never run on a GPU, and its saved layer inputs need pinned host memory: 405B at 128k on cp=8 keeps
    126 layers x 16384 tokens x 16384 x 2 bytes = 67.6 GB per device (541 GB a node)."""
    config = TrainConfig(plan=True, model_config=str(LLAMA_405B), mesh="dp=1,fsdp=1,cp=8,mp=1", batch_size=1,
                         seq_len=131072)
    assert all(c.remat != "offload" for c in settings(config, {"dp": 1, "fsdp": 1, "cp": 8, "mp": 1}))
    note = offload_note(config, ModelConfig.from_hf(LLAMA_405B), {"dp": 1, "fsdp": 1, "cp": 8, "mp": 1}, "gpu")
    assert note == ("--remat offload not tried: never measured on gpu, and it keeps each layer's input in pinned "
                    "host memory: 67.6 GB per device here (126 layers x 16384 tokens x hidden 16384 x 2 bytes); "
                    "plan it with --plan --remat offload")


def fit_rows(out: str) -> dict[tuple[str, str], str]:
    """(mesh, remat) -> its row of a --fit table."""
    rows = {}
    for row in out.splitlines()[1:]:
        words = row.split()
        if len(words) > 2 and words[0].startswith("dp=") and words[1] in ("dots", "full"):
            rows[words[0], words[1]] = row
    return rows


@pytest.mark.slow
def test_fit_takes_a_meshs_first_setting_that_fits(small_config, capsys, monkeypatch):
    base = dict(plan=True, model_config=str(small_config), mesh="dp=1,fsdp=2,mp=1", batch_size=2, seq_len=256,
                dtype="float32")
    dots = plan(TrainConfig(**base, remat="dots").validate()).total
    full = plan(TrainConfig(**base, remat="full").validate()).total
    assert full < dots
    monkeypatch.setattr(fit_module, "meshes", lambda config, *_: [{"dp": 1, "fsdp": 2, "cp": 1, "mp": 1}])
    hbm_gb = (full + dots) / 2 / 0.75 / 1e9  # full fits at JAX's default fraction, dots does not
    args = ["--plan", "--fit", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=2,mp=1", "--batch-size", "2",
            "--seq-len", "256", "--dtype", "float32", "--hbm-gb", str(hbm_gb)]
    assert main(args) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[:3] == ["dp=1,fsdp=2,cp=1,mp=1", "dots", "1"] and "DOES NOT FIT" in rows[1]
    assert rows[2].split()[:3] == ["dp=1,fsdp=2,cp=1,mp=1", "full", "1"] and "fits in" in rows[2]
    assert rows[3].startswith("--remat offload not tried: never measured on cpu")
    assert "(2 layers x 256 tokens x hidden 64 x 4 bytes)" in rows[3]
    assert rows[4] == "fastest settings that fit, by predicted step time on mi300x:"
    assert rows[5].startswith("  1. dp=1,fsdp=2,cp=1,mp=1 remat full accum 1: ")
    assert rows[6:] == ["fastest setting that fits:",
                        "  finetune-lora --model CONVERTED_DIR --data DATA.jsonl --out RUN_DIR "
                        "--mesh dp=1,fsdp=2,cp=1,mp=1 --batch-size 2 --seq-len 256 --dtype float32 --remat full"]


@pytest.mark.slow
def test_cli_fit_ranks_the_settings_that_fit_by_predicted_time(small_config, capsys, tmp_path, default_allocator):
    args = ["--plan", "--fit", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=2,mp=1", "--batch-size", "2",
            "--seq-len", "256", "--dtype", "float32", "--plan-json", str(tmp_path / "p.json")]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    ranking = lines[lines.index("fastest settings that fit, by predicted step time on mi300x:") + 1:-2]
    times = [float(line.split(": ")[1].split(" s a step")[0]) for line in ranking]
    assert len(ranking) == 4 and times == sorted(times)  # dp=2, fsdp=2, cp=2, mp=2: every split of 2 devices
    best = ranking[0].split()[1]
    assert lines[-2] == "fastest setting that fits:" and f"--mesh {best} " in lines[-1] + " "
    record = json.loads((tmp_path / "p.json").read_text())
    assert ",".join(f"{a}={s}" for a, s in record["mesh"].items()) == best and record["memory"]["fits"]
    assert record["predicted"]["step_seconds"] == pytest.approx(times[0], rel=1e-3)
    assert len(record["fit"]["tried"]) == 4 and record["fit"]["command"] == lines[-1].strip()


def test_cli_fit_when_nothing_fits_names_every_mesh_and_exits_1(small_config, capsys):
    """A device smaller than any mesh's share of the weights: every mesh pruned before any compile."""
    args = ["--plan", "--fit", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=1,cp=8,mp=1",
            "--batch-size", "1", "--seq-len", "256", "--dtype", "float32", "--hbm-gb", "0.00001"]
    assert main(args) == 1
    rows = capsys.readouterr().out.splitlines()
    pruned = [row for row in rows if ": pruned, its frozen weights alone take" in row]
    assert len(pruned) == len(meshes(TrainConfig(plan=True, model_config="c", mesh="dp=1,fsdp=1,cp=8,mp=1"),
                                     ModelConfig.from_hf(SMALL), 8, 8)) == 16  # mp at most the 2 KV heads
    assert rows[-2].startswith("--remat offload not tried")
    assert rows[-1] == "nothing tried fits: use more devices, a shorter --seq-len or a smaller --batch-size"


def test_fit_plans_no_mesh_after_its_minutes(small_config, capsys):
    args = ["--plan", "--fit", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=2,mp=1", "--batch-size", "2",
            "--seq-len", "64", "--dtype", "float32", "--fit-minutes", "1e-9"]
    assert main(args) == 1
    rows = capsys.readouterr().out.splitlines()
    assert len([row for row in rows if row.endswith(": pruned, not planned: --fit-minutes 1e-09 reached")]) == 4


def fit_ranking(config_path, hbm_gb: float, batch: int, seq: int) -> tuple[list[str], list[str]]:
    """(the meshes --fit ranks, fastest first; the meshes it pruned) on 2 of the devices."""
    report = fit(TrainConfig(plan=True, model_config=str(config_path), mesh="dp=1,fsdp=2,mp=1", batch_size=batch,
                             seq_len=seq, dtype="float32", hbm_gb=hbm_gb).validate())
    return [config.mesh for config, _ in report.ranked], [mesh for mesh, _ in report.pruned]


@pytest.mark.slow
def test_fit_puts_a_layout_that_moves_no_weight_first_when_weights_dominate(tmp_path, default_allocator):
    """32 tokens a step through 2 layers of 4.2M parameters: gathering the weights (fsdp, cp) moves 67 MB a step,
    reducing the activations (mp) about 1 MB, the LoRA gradients (a replicated base, dp) 0.5 MB."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, "hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
                                "num_key_value_heads": 8}))
    ranked, pruned = fit_ranking(path, 192, batch=2, seq=16)
    assert ranked[0] in ("dp=2,fsdp=1,cp=1,mp=1", "dp=1,fsdp=1,cp=1,mp=2")
    for gathering in ("dp=1,fsdp=2,cp=1,mp=1", "dp=1,fsdp=1,cp=2,mp=1"):  # pruned by their bound, or ranked later
        assert gathering in pruned or ranked.index(gathering) > ranked.index("dp=1,fsdp=1,cp=1,mp=2")


@pytest.mark.slow
def test_fit_ranks_fsdp_above_mp_when_activations_dominate(tmp_path, default_allocator, monkeypatch):
    """2,048 tokens a step through 2 layers of 0.26M parameters: mp reduces the activations (1 MB a reduction,
    several a layer), fsdp gathers each layer's 1 MB twice, at half the bus bytes of an all-reduce. (A replicated
    base would beat both wherever it fits, moving only the LoRA gradients: left out here.)"""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, "hidden_size": 128, "intermediate_size": 512, "num_key_value_heads": 4}))
    splits = [{"dp": 1, "fsdp": 2, "cp": 1, "mp": 1}, {"dp": 1, "fsdp": 1, "cp": 1, "mp": 2}]
    monkeypatch.setattr(fit_module, "meshes", lambda *_: splits)
    ranked, pruned = fit_ranking(path, 192, batch=2, seq=1024)
    assert ranked[0] == "dp=1,fsdp=2,cp=1,mp=1"
    assert "dp=1,fsdp=1,cp=1,mp=2" in pruned or ranked == ["dp=1,fsdp=2,cp=1,mp=1", "dp=1,fsdp=1,cp=1,mp=2"]


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
    assert err == [f"finetune-lora: error: {missing}: not found (expected a HuggingFace config.json)"]


def test_plan_refuses_a_rank_larger_than_the_layers_before_compiling(small_config, capsys):
    assert main(["--plan", "--model-config", str(small_config), "--mesh", "dp=1,fsdp=8,mp=1", "--rank", "64"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "finetune-lora: error: --rank 64 is larger than the smallest adapted layer: k_proj (64 -> 32) allows a rank "
        "of at most 32"]
