"""finetune-lora --plan: the train step compiled from abstract shapes, with a per-device memory report."""

import json
from pathlib import Path

from finetune.cli import main
from finetune.config import TrainConfig
from finetune.planning import plan

LLAMA_405B = Path(__file__).parent / "data" / "llama-3.1-405b-config.json"  # meta-llama/Llama-3.1-405B's config.json


def gathered_layer_bytes(config: dict, dtype_bytes: int) -> int:
    """Bytes of one decoder layer's linear weights (norms are negligible)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_o = 2 * hidden * config["num_attention_heads"] * head_dim
    k_v = 2 * hidden * config["num_key_value_heads"] * head_dim
    return (q_o + k_v + 3 * hidden * inter) * dtype_bytes


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
    assert "405.9B frozen parameters" in text and "fits in 192 GB per device" in text


def test_cli_plan_on_a_small_model_reports_and_exits_by_verdict(tmp_path, capsys):
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = ["--plan", "--model-config", str(path), "--mesh", "dp=2,fsdp=4,mp=1", "--batch-size", "8", "--seq-len", "32",
            "--dtype", "float32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fits in 192 GB per device" in out and "frozen weights" in out
    assert main(args + ["--hbm-gb", "0.0001", "--show-sharding"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT in 0 GB" in out and "layers.self_attn.q_proj.lora_a" in out


def test_plan_without_a_config_is_an_error(capsys):
    assert main(["--plan", "--mesh", "dp=1,fsdp=8,mp=1"]) == 2
    assert "--plan needs --model-config" in capsys.readouterr().err


def test_plan_with_a_missing_config_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert main(["--plan", "--model-config", str(missing), "--mesh", "dp=1,fsdp=8,mp=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"finetune-lora: error: {missing}: not found (expected a HuggingFace Llama config.json)"]
