"""finetune-lora --plan: the train step compiled from abstract shapes, with a per-device memory report."""

import json
from pathlib import Path


from finetune.cli import main
from finetune.config import TrainConfig
from finetune.planning import plan

LLAMA_405B = Path(__file__).parent / "data" / "llama-3.1-405b-config.json"  # meta-llama/Llama-3.1-405B's config.json


def test_llama_405b_on_eight_devices_compiles_and_fits():
    report = plan(TrainConfig(plan=True, model_config=str(LLAMA_405B), mesh="dp=1,fsdp=8,mp=1", batch_size=16,
                              seq_len=64).validate())
    assert report.mesh == {"dp": 1, "fsdp": 8, "mp": 1}
    assert 100e9 < report.weights < 103e9  # 811 GB of bf16 weights / 8
    assert report.lora_and_optimizer < 1e9  # 312M float32 LoRA params x (param + 2 moments) / 8
    assert 0 < report.temp < 60e9
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
