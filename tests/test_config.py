"""LlamaConfig.from_hf: both config dialects, defaults, and clear errors."""

import dataclasses
import json

import pytest
from hypothesis import given
from strategies import llama_configs
from transformers import LlamaConfig as HFLlamaConfig

from jaxmodel.config import ConfigError, LlamaConfig, RopeConfig

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}


def test_legacy_llama_31_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    config = LlamaConfig.from_hf(tmp_path)
    assert config.head_dim == 128 and config.num_key_value_heads == 8
    assert config.rope == RopeConfig("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (128001,)


def test_transformers5_dialect_equals_legacy():
    legacy = LlamaConfig.from_hf(LLAMA_31_8B)
    v5 = HFLlamaConfig(**{k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}).to_dict()
    assert "rope_parameters" in v5 and "rope_scaling" not in v5
    assert LlamaConfig.from_hf(v5) == legacy


@given(llama_configs())
def test_drawn_configs_round_trip_through_transformers(raw):
    config = LlamaConfig.from_hf(raw)
    hf = HFLlamaConfig(**raw)
    assert config.head_dim == hf.head_dim
    via_hf = LlamaConfig.from_hf(hf.to_dict())  # transformers fills in its default special-token ids
    assert dataclasses.replace(via_hf, bos_token_id=None, eos_token_id=None, pad_token_id=None) == config
    assert LlamaConfig.from_hf(config.to_hf()) == config


def test_defaults_for_optional_fields():
    config = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                                  "num_hidden_layers": 1, "num_attention_heads": 2})
    assert (config.num_key_value_heads, config.head_dim) == (2, 4)
    assert config.rope == RopeConfig("default", 10000.0)
    assert not config.tie_word_embeddings


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "field 'model_type' is 'mistral'"),
    ({"hidden_act": "gelu"}, "field 'hidden_act'"),
    ({"num_key_value_heads": 3}, "'num_key_value_heads' (3) must divide num_attention_heads (32)"),
    ({"vocab_size": None}, "field 'vocab_size' is missing"),
    ({"hidden_size": -4}, "'hidden_size' must be a positive integer"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be bool"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'rope_scaling.rope_type' is 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'rope_scaling.low_freq_factor' must be"),
])
def test_bad_fields_are_named(change, message):
    with pytest.raises(ConfigError) as info:
        LlamaConfig.from_hf({**LLAMA_31_8B, **change})
    assert message in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        LlamaConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        LlamaConfig.from_hf(tmp_path)
