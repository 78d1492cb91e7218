"""export-peft warns, one line each, about adapters that vLLM would refuse or serve wrongly (what vLLM does with
them is checked by tests/test_serving.py in `tox -e serve`); the adapter is written all the same."""

import json

import pytest

from export.cli import main as export_main
from export.serving_limits import serving_warnings
from finetune.config import TrainConfig
from finetune.train.loop import run_training
from jaxmodel.config import ModelConfig
from jaxmodel.lora import LoraConfig

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
LLAMA = ModelConfig.from_hf({"model_type": "llama", **SHAPE})


@pytest.mark.parametrize("rank", [1, 8, 16])
def test_an_adapter_vllm_serves_by_default_gets_no_warning(rank):
    assert serving_warnings(LoraConfig(rank=rank, alpha=16, targets=DEFAULT_TARGETS), LLAMA) == []


@pytest.mark.parametrize("rank, option", [(17, 32), (32, 32), (33, 64), (100, 128), (300, 320), (512, 512)])
def test_a_rank_above_the_default_names_the_smallest_max_lora_rank_that_serves_it(rank, option):
    (warning,) = serving_warnings(LoraConfig(rank=rank, alpha=16, targets=DEFAULT_TARGETS), LLAMA)
    assert f"rank {rank}" in warning and f"--max-lora-rank {option}" in warning and "\n" not in warning


def test_a_rank_no_vllm_option_serves_points_to_the_merge():
    (warning,) = serving_warnings(LoraConfig(rank=513, alpha=16, targets=DEFAULT_TARGETS), LLAMA)
    assert "512" in warning and "--merge" in warning and "--max-lora-rank" not in warning.split("512")[-1]


def test_an_lm_head_target_is_named_with_the_merge():
    (warning,) = serving_warnings(LoraConfig(rank=8, alpha=16, targets=("q_proj", "lm_head")), LLAMA)
    assert "lm_head" in warning and "--merge" in warning and "\n" not in warning


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gemma3_text"])
def test_an_lm_head_target_on_a_family_vllm_refuses_it_for_points_to_the_merge(model_type):
    window = {} if model_type == "gemma3_text" else {"sliding_window": None}
    model = ModelConfig.from_hf({"model_type": model_type, **SHAPE, "num_key_value_heads": 2, "head_dim": 4, **window})
    (warning,) = serving_warnings(LoraConfig(rank=8, alpha=16, targets=("q_proj", "lm_head")), model)
    assert "refuses" in warning and "--merge" in warning
    assert serving_warnings(LoraConfig(rank=8, alpha=16, targets=DEFAULT_TARGETS), model) == []


def test_an_lm_head_target_on_a_multimodal_gemma3_says_to_train_without_it():
    """A multimodal base has no merged form (export.merge refuses it)."""
    text = {**SHAPE, "num_key_value_heads": 2, "head_dim": 4}
    model = ModelConfig.from_hf({"model_type": "gemma3", "text_config": text})
    (warning,) = serving_warnings(LoraConfig(rank=8, alpha=16, targets=("q_proj", "lm_head")), model)
    assert "Gemma3ForConditionalGeneration refuses" in warning and "train without lm_head" in warning
    assert "--merge" not in warning
    assert serving_warnings(LoraConfig(rank=8, alpha=16, targets=DEFAULT_TARGETS), model) == []


@pytest.mark.parametrize("raw, needle", [
    ({"model_type": "qwen2", **SHAPE, "head_dim": 8}, "head_dim 8 is not hidden_size / heads"),
    ({"model_type": "qwen3", **SHAPE, "head_dim": 4, "attention_bias": True}, "attention biases"),
    ({"model_type": "qwen3", **SHAPE, "head_dim": 4, "use_sliding_window": True, "sliding_window": 4,
      "max_window_layers": 1}, "some layers only"),
])
def test_bases_vllm_cannot_serve_are_named(raw, needle):
    (warning,) = serving_warnings(LoraConfig(rank=8, alpha=16, targets=DEFAULT_TARGETS), ModelConfig.from_hf(raw))
    assert needle in warning and "\n" not in warning
    qwen3_windows_everywhere = {**raw, "max_window_layers": 0} if "max_window_layers" in raw else None
    if qwen3_windows_everywhere:
        assert serving_warnings(LoraConfig(rank=8, alpha=16, targets=DEFAULT_TARGETS),
                                ModelConfig.from_hf(qwen3_windows_everywhere)) == []


@pytest.mark.parametrize("raw", [{"model_type": "qwen3_moe", **SHAPE, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 8},
                                 {"model_type": "mixtral", **SHAPE, "num_local_experts": 4}])
def test_an_adapter_on_a_mixture_of_experts_points_to_the_merge_for_vllms_cpu_build(raw):
    model = ModelConfig.from_hf(raw)
    (warning,) = serving_warnings(LoraConfig(rank=8, alpha=16, targets=("q_proj", "experts.down_proj")), model)
    assert f"CPU build serves no LoRA adapter on {model.family.architecture}" in warning and "--merge" in warning


@pytest.mark.slow
def test_export_peft_prints_the_warnings_and_writes_the_adapter(tmp_path, tiny_converted, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} " * 8}) + "\n" for i in range(8)))
    run = tmp_path / "run"
    run_training(TrainConfig(model=str(tiny_converted), data=str(data), out=str(run), steps=1, batch_size=8,
                             seq_len=32, rank=32, targets="q_proj,v_proj,lm_head", dtype="float32",
                             progress=False).validate())
    capsys.readouterr()
    assert export_main(["--run", str(run), "--out", str(tmp_path / "adapter")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("export-peft: warning: ")]
    assert len(warnings) == 2
    assert any("--max-lora-rank 32" in w for w in warnings) and any("lm_head" in w for w in warnings)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 32
