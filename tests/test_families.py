"""Mistral, Qwen2, Qwen3 and Gemma 3 against transformers' own classes (MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration): config.json read and written back, logits on
drawn configs (float32, bf16), padding and sliding windows, greedy generation, loss and LoRA gradients on meshes
(blockwise attention and `cp` too), and the PEFT adapter and merged checkpoint a run exports."""

import dataclasses
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import AutoPeftModelForCausalLM, PeftModel
from strategies import batches, family_configs
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import run_model
from converter import convert
from demo.tiny import build_tiny_model
from jaxmodel import ModelConfig, generate, load_pretrained
from jaxmodel.config import ConfigError
from jaxmodel.families import FAMILIES
from jaxmodel.formats.hf_names import names_of
from jaxmodel.layers import LoRAParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.formats.peft_adapter import load_peft_adapter, save_peft_adapter
from test_parity import BF16_ERROR_RATIO, f32_tolerance, hf_logits, jax_logits

FAMILY_TYPES = ("mistral", "qwen2", "qwen3", "gemma3_text")
ARCHITECTURES = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}

# Each family's switches on, over demo/tiny.py's TINY_CONFIG (2 layers, GQA 4/2, head_dim 16): a window of 8 keys
# on every layer (Mistral) or on the second (Qwen, from max_window_layers 1), Qwen3 with attention biases, Gemma 3
# with a window on the first layer, each kind of layer with its own RoPE (the global one scaled) and a
# query_pre_attn_scalar that is not head_dim.
TINY_FAMILIES = {
    "mistral": {"model_type": "mistral", "sliding_window": 8},
    "qwen2": {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
              "attention_bias": True},
    "gemma3_text": {"model_type": "gemma3_text", "sliding_window": 8, "layer_types": ["sliding_attention",
                    "full_attention"], "query_pre_attn_scalar": 12, "tie_word_embeddings": True,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
}
DEFAULT_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def hf_model(config: dict, seed: int = 0, dtype: str = "float32"):
    """transformers' own class for `config["model_type"]`, seeded, with drawn norm weights, in `dtype` (RoPE
    frequencies kept float32, as `from_pretrained` keeps them)."""
    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    with torch.no_grad():  # norm weights other than transformers' ones, so that each one's place matters
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.5 * torch.randn_like(param))
    rotary = hf.model.rotary_emb  # Gemma 3 keeps one inv_freq per layer type
    inv_freqs = {name: buffer.clone() for name, buffer in rotary.named_buffers() if name.endswith("inv_freq")}
    hf = hf.to(getattr(torch, dtype)).eval()
    for name, buffer in inv_freqs.items():
        setattr(rotary, name, buffer)
    return hf


def converted(hf, **load):
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(Path(tmp) / "hf")
        convert(Path(tmp) / "hf", Path(tmp) / "jax", progress=False)
        return load_pretrained(Path(tmp) / "jax", **load)


# ----------------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
@settings(max_examples=20)
@given(data=st.data())
def test_configs_read_as_transformers_reads_them_and_write_back(model_type, data):
    raw = data.draw(family_configs(model_type))
    config = ModelConfig.from_hf(raw)
    hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    assert config.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    # transformers' per-layer windows: Mistral's one window, Qwen's layer_types with sliding_window
    if model_type == "mistral":
        windows = [hf.sliding_window or 0] * hf.num_hidden_layers
    else:
        windows = [hf.sliding_window if t == "sliding_attention" and hf.sliding_window else 0 for t in hf.layer_types]
    assert list(config.layer_windows()) == windows
    assert ModelConfig.from_hf(hf.to_dict()).layer_windows() == config.layer_windows()
    assert ModelConfig.from_hf(hf.to_dict()).rope == config.rope  # YaRN's fields as transformers keeps them
    if model_type == "gemma3_text":  # each kind of layer's RoPE, the scores' scale, the gate's activation
        assert hf.rope_parameters == {"full_attention": config.rope.to_hf(),
                                      "sliding_attention": config.local_rope.to_hf()}
        assert config.attention_scale == hf.query_pre_attn_scalar ** -0.5
        assert config.hidden_act == hf.hidden_activation and config.tie_word_embeddings == hf.tie_word_embeddings
    written = config.to_hf()
    assert written["architectures"] == [ARCHITECTURES[model_type]] and written["model_type"] == model_type
    assert ModelConfig.from_hf(written) == config


def test_switches_of_each_family():
    shape = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 3,
             "num_attention_heads": 2, "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True}
    got = {t: ModelConfig.from_hf({"model_type": t, **shape}) for t in ("llama", *FAMILY_TYPES)}
    switches = {t: (c.qkv_bias, c.o_bias, c.mlp_bias, c.qk_norm, c.norm_unit_offset, c.sandwich_norms,
                    c.scale_embeddings, c.hidden_act) for t, c in got.items()}
    llama_like = (False, False, False, "silu")
    assert switches == {"llama": (True, True, True, False, *llama_like),
                        "mistral": (False, False, False, False, *llama_like),
                        "qwen2": (True, False, False, False, *llama_like),
                        "qwen3": (True, True, False, True, *llama_like),
                        "gemma3_text": (True, True, False, True, True, True, True, "gelu_pytorch_tanh")}
    # Gemma 3's defaults as transformers' Gemma3TextConfig: every sixth layer global, window 4096, head_dim 256
    gemma = got["gemma3_text"]
    assert gemma.layer_windows() == (4096,) * 3 and gemma.head_dim == 256 and gemma.attention_scale == 256 ** -0.5
    assert (gemma.rope.theta, gemma.local_rope.theta, gemma.tie_word_embeddings) == (1e6, 1e4, True)
    six = ModelConfig.from_hf({"model_type": "gemma3_text", **shape, "num_hidden_layers": 7})
    assert six.layer_windows() == (4096,) * 5 + (0, 4096)
    assert got["qwen3"].head_dim == 128  # transformers' Qwen3Config default
    # Qwen's configs carry a window that only use_sliding_window switches on
    qwen = {"model_type": "qwen2", **shape, "sliding_window": 4, "max_window_layers": 1}
    assert ModelConfig.from_hf(qwen).layer_windows() == (0, 0, 0)
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).layer_windows() == (0, 4, 4)
    # an absent sliding_window is transformers' default, 4096; null is none
    for model_type, switch in (("mistral", {}), ("qwen2", {"use_sliding_window": True, "max_window_layers": 0})):
        raw = {"model_type": model_type, **shape, **switch}
        hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
        assert hf.sliding_window == 4096 and ModelConfig.from_hf(raw).layer_windows() == (4096,) * 3
        assert ModelConfig.from_hf({**raw, "sliding_window": None}).layer_windows() == (0,) * 3


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma2"},
     "field 'model_type' is 'gemma2'; supported: llama, mistral, qwen2, qwen3, gemma3_text, gemma3"),
    ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0},
     "field 'final_logit_softcapping' is 30.0; Gemma 3 has none (null)"),
    ({"model_type": "gemma3_text", "sliding_window": None}, "field 'sliding_window' must be a positive integer"),
    ({"model_type": "gemma3_text", "hidden_activation": "relu"},
     "field 'hidden_activation' is 'relu'; supported: silu, gelu_pytorch_tanh"),
    ({"model_type": "gemma3_text", "rope_parameters": {"global": {"rope_theta": 1e6}}},
     "field 'rope_parameters' must map full_attention and sliding_attention to their RoPE"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "longrope", "rope_theta": 1.0}}},
     "field 'rope_parameters.full_attention.rope_type' is 'longrope'; supported: default, linear, llama3, yarn"),
    ({"model_type": "mistral", "sliding_window": 0}, "field 'sliding_window' must be a positive integer or null"),
    ({"model_type": "qwen2", "use_sliding_window": True, "layer_types": ["full_attention"]},
     "field 'layer_types' must list 2 of full_attention, sliding_attention"),
    ({"model_type": "qwen3", "use_sliding_window": "yes"}, "field 'use_sliding_window' must be bool"),
])
def test_bad_family_fields_are_named(change, message):
    raw = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4, **change}
    with pytest.raises(ConfigError, match="^config: ") as info:
        ModelConfig.from_hf(raw)
    assert message in str(info.value)


def test_flops_per_token_count_each_windowed_layer_at_its_window():
    from finetune.step.flops import flops_per_token

    shape = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
             "num_attention_heads": 2, "head_dim": 4}
    full = ModelConfig.from_hf({"model_type": "qwen3", **shape})
    windowed = ModelConfig.from_hf({"model_type": "qwen3", **shape, "use_sliding_window": True, "sliding_window": 100,
                                    "max_window_layers": 1})
    # three of four layers see 100 keys instead of 1000: 12 x (1000 - 100) x heads x head_dim FLOPs each fewer
    assert flops_per_token(full, 1000) - flops_per_token(windowed, 1000) == 3 * 12 * 900 * 2 * 4
    assert flops_per_token(full, 100) == flops_per_token(windowed, 100)


def test_qwen3_names_its_head_norms_and_the_others_share_llamas_table():
    qwen3 = names_of(ModelConfig.from_hf({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8,
                                         "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}))
    assert qwen3.hf_to_jax("model.layers.1.self_attn.k_norm.weight") == ("layers.self_attn.k_norm.weight", 1)
    assert qwen3.jax_to_hf("layers.self_attn.q_norm.weight", 0) == "model.layers.0.self_attn.q_norm.weight"
    assert FAMILIES["mistral"].modules == FAMILIES["qwen2"].modules == FAMILIES["llama"].modules
    llama = names_of(ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                                         "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}))
    assert llama.hf_to_jax("model.layers.1.self_attn.k_norm.weight") is None


# ----------------------------------------------------------------------------------------------------
# the model against transformers


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_float32_logits_match_transformers(model_type, data):
    config = data.draw(family_configs(model_type))
    shape, seed = data.draw(batches(max_seq=200)), data.draw(st.integers(0, 2**16))
    hf = hf_model(config, seed)
    model = converted(hf)
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], shape)
    expected = hf_logits(hf, ids)
    got = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - expected).max() <= f32_tolerance(expected)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_bfloat16_logits_match_transformers_within_documented_bound(model_type, data):
    config = data.draw(family_configs(model_type, max_layers=2))
    shape, seed = data.draw(batches(max_seq=160)), data.draw(st.integers(0, 2**16))
    hf = hf_model(config, seed, dtype="bfloat16")
    model = converted(hf)
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], shape)
    theirs = hf_logits(hf, ids)
    with torch.no_grad():
        exact = hf.double()(torch.tensor(ids)).logits.numpy()
    got = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32)))
    floor = 1e-3 * max(1.0, np.abs(exact).max())
    assert np.abs(got - exact).max() <= BF16_ERROR_RATIO * np.abs(theirs - exact).max() + floor


def tiny_family(model_type: str) -> dict:
    from demo.tiny import TINY_CONFIG

    return {**TINY_CONFIG, **DEFAULT_ROPE, **TINY_FAMILIES[model_type]}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_left_padding_and_windows_match_transformers(model_type, attention):
    """Rows left-padded by less and more than the window, on both attention paths (blockwise with blocks of 8
    keys, so that the window skips whole blocks)."""
    import jaxmodel.attention as attention_module

    config = tiny_family(model_type)
    hf = hf_model(config, seed=3)
    model = converted(hf, attention=attention)
    seq, lengths = 48, [48, 45, 30, 3]
    ids = np.random.default_rng(3).integers(0, config["vocab_size"], (len(lengths), seq))
    mask = np.array([[0] * (seq - n) + [1] * n for n in lengths])
    expected = hf_logits(hf, ids, mask)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "BLOCK_Q", 8)
        patch.setattr(attention_module, "BLOCK_KV", 8)
        got = np.asarray(model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(got[real] - expected[real]).max() <= f32_tolerance(expected[real])
    # the windows matter here: the same weights without them give other logits
    full = dataclasses.replace(model.config, sliding_window=None, sliding_layers=())
    model.config = full
    unwindowed = np.asarray(model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask)))
    assert np.abs(unwindowed[real] - expected[real]).max() > 100 * f32_tolerance(expected[real])


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_greedy_generation_equals_transformers(model_type):
    """Left-padded prompts whose generation runs past the window: the KV-cache path applies it as
    transformers' cache does."""
    config = tiny_family(model_type)
    hf = hf_model(config, seed=5)
    model = converted(hf)
    lengths, seq = [12, 7], 12
    ids = np.random.default_rng(5).integers(6, config["vocab_size"], (2, seq))
    mask = np.array([[0] * (seq - n) + [1] * n for n in lengths])
    ids = np.where(mask == 1, ids, config["pad_token_id"])
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=16,
                             do_sample=False, eos_token_id=None, pad_token_id=config["pad_token_id"]).numpy()
    ours = generate(model, ids, 16, attention_mask=mask, eos_token_id=(), pad_token_id=config["pad_token_id"])
    np.testing.assert_array_equal(ours, theirs)


# ----------------------------------------------------------------------------------------------------
# training and export


@pytest.fixture(scope="module", params=FAMILY_TYPES)
def family_checkpoint(request, tmp_path_factory):
    """(model_type, HF directory with tokenizer, converted directory) of the family's tiny model."""
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = build_tiny_model(root / "hf", {**DEFAULT_ROPE, **TINY_FAMILIES[request.param]})
    convert(hf_dir, root / "jax", progress=False)
    return request.param, hf_dir, root / "jax"


@pytest.fixture(scope="module")
def plain_device_grads(tmp_path_factory):
    """model_type -> (data file, loss, tokens and LoRA gradients on one device with plain attention and full
    logits), computed once a family."""
    from test_context_parallel import grads_on, write_packed_data

    found = {}

    def get(model_type, jax_dir):
        if model_type not in found:
            root = tmp_path_factory.mktemp(f"{model_type}-ref")
            data = write_packed_data(root / "train.jsonl")
            found[model_type] = data, grads_on(jax_dir, data, root / "ref", "dp=1,fsdp=1,mp=1", jax.devices()[:1],
                                               attention="xla", loss_chunk=0, mlp_chunk=0)
        return found[model_type]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", [
    ("dp=1,fsdp=1,mp=1", dict(attention="blockwise", loss_chunk=5)),
    ("dp=1,fsdp=2,cp=4,mp=1", dict(attention="blockwise", loss_chunk=3)),
    ("dp=2,fsdp=1,cp=2,mp=2", dict(attention="xla")),
    ("dp=1,fsdp=4,mp=2", dict(attention="xla")),
])
def test_same_loss_and_lora_grads_on_a_mesh_as_one_plain_device(tmp_path, family_checkpoint, plain_device_grads, mesh,
                                                              options):
    """Rows of 32 packed tokens against windows of 8: the windows, blockwise attention, `cp` and `mp` together."""
    from test_context_parallel import assert_same, grads_on

    model_type, _, jax_dir = family_checkpoint
    data, reference = plain_device_grads(model_type, jax_dir)
    devices = jax.devices()[:1] if mesh == "dp=1,fsdp=1,mp=1" else jax.devices()
    assert_same(grads_on(jax_dir, data, tmp_path / "mesh", mesh, devices, **options), reference)


def adapted(jax_dir, lora_config: LoraConfig):
    """The converted model with non-zero adapters (B drawn), so that they move the output."""
    model = load_pretrained(jax_dir)
    apply_lora(model, lora_config, rngs=nnx.Rngs(1))
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        if path[-1] == "lora_b":
            var.set_value(0.05 * jax.random.normal(jax.random.key(len(path)), var[...].shape))
    return model


@pytest.mark.slow
def test_exported_adapter_serves_in_peft_with_identical_outputs_and_reads_back(tmp_path, family_checkpoint):
    model_type, hf_dir, jax_dir = family_checkpoint
    lora_config = LoraConfig(rank=4, alpha=8.0)
    model = adapted(jax_dir, lora_config)
    adapter = save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config,
                                model_config=model.config, base_model=str(hf_dir))
    ids = np.random.default_rng(0).integers(0, 512, (2, 40))
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(base).__name__ == ARCHITECTURES[model_type]
    with torch.no_grad():
        plain = base(torch.tensor(ids)).logits.numpy()
        theirs = PeftModel.from_pretrained(base, adapter).eval()(torch.tensor(ids)).logits.numpy()
        auto = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()
        by_auto = auto(torch.tensor(ids)).logits.numpy()
    assert np.abs(theirs - plain).max() > 1e-3
    assert np.abs(ours - theirs).max() <= f32_tolerance(theirs)
    assert np.abs(by_auto - theirs).max() <= f32_tolerance(theirs)
    read_back = load_peft_adapter(load_pretrained(jax_dir), adapter)
    np.testing.assert_array_equal(np.asarray(read_back(jnp.asarray(ids, jnp.int32))), ours)


@pytest.mark.slow
def test_a_run_merges_into_a_checkpoint_of_the_familys_class(tmp_path, family_checkpoint):
    from export.cli import main as export_main
    from finetune import TrainConfig, run_training
    from test_context_parallel import write_packed_data

    model_type, _, jax_dir = family_checkpoint
    run = tmp_path / "run"
    run_training(TrainConfig(model=str(jax_dir), data=str(write_packed_data(tmp_path / "train.jsonl")), out=str(run),
                             steps=2, batch_size=8, seq_len=32, dtype="float32", lr=1e-2,
                             progress=False).validate())
    assert export_main(["--run", str(run), "--merge", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert type(merged).__name__ == ARCHITECTURES[model_type]
    ids = np.random.default_rng(1).integers(0, 512, (2, 40))
    with torch.no_grad():
        theirs = merged(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(run_model(run, jax_dir)(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - np.asarray(load_pretrained(jax_dir)(jnp.asarray(ids, jnp.int32)))).max() > 1e-3
    assert np.abs(ours - theirs).max() <= f32_tolerance(theirs)


@pytest.mark.slow
def test_an_nf4_qwen3_base_is_the_in_memory_quantized_model_and_trains(tmp_path):
    """Qwen3's biases and head norms stay unquantized beside NF4 projections; a run on that base exports an
    adapter PEFT loads onto the HF model."""
    from export.cli import main as export_main
    from finetune import TrainConfig, run_training
    from jaxmodel.model import quantize_model
    from jaxmodel.quantization import Quantization
    from test_context_parallel import write_packed_data

    hf_dir = build_tiny_model(tmp_path / "hf", {**DEFAULT_ROPE, **TINY_FAMILIES["qwen3"]})
    convert(hf_dir, tmp_path / "jax", progress=False)
    convert(hf_dir, tmp_path / "nf4", quantize="nf4", quant_block=8, progress=False)
    loaded = load_pretrained(tmp_path / "nf4")
    expected = quantize_model(load_pretrained(tmp_path / "jax"), Quantization("nf4", 8))
    got, want = (nnx.to_flat_state(nnx.state(m, nnx.Param)) for m in (loaded, expected))
    got = {".".join(map(str, k)): np.asarray(v[...]) for k, v in got}
    want = {".".join(map(str, k)): np.asarray(v[...]) for k, v in want}
    assert set(got) == set(want) and "layers.self_attn.q_norm.weight" in got and "layers.self_attn.o_proj.bias" in got
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 512, (2, 24)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(expected(ids)))
    run = tmp_path / "run"
    run_training(TrainConfig(model=str(tmp_path / "nf4"), data=str(write_packed_data(tmp_path / "train.jsonl")),
                             out=str(run), steps=1, batch_size=8, seq_len=32, dtype="float32",
                             progress=False).validate())
    assert export_main(["--run", str(run), "--out", str(tmp_path / "adapter"), "--base-model", str(hf_dir)]) == 0
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert len([n for n, _ in peft.named_parameters() if "lora_A" in n]) == 2 * 7  # 2 layers x 7 projections


# ----------------------------------------------------------------------------------------------------
# Gemma 3's multimodal class (4B and up): the decoder under text_config, beside a vision tower

# Gemma 3 27B's config.json as published, less its vision_config: its text_config leaves out what transformers'
# Gemma3TextConfig defaults (vocab_size among them).
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
}
TINY_VISION = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
               "num_attention_heads": 2, "image_size": 28, "patch_size": 14}


def test_a_multimodal_config_is_read_from_its_text_config_as_transformers_reads_it():
    from transformers import Gemma3Config

    config = ModelConfig.from_hf(GEMMA3_27B)
    hf = Gemma3Config(**{k: v for k, v in GEMMA3_27B.items() if k != "model_type"}).text_config
    assert (config.model_type, config.family.architecture) == ("gemma3", "Gemma3ForConditionalGeneration")
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (262_208, 5376, 62)
    assert config.vocab_size == hf.vocab_size and config.head_dim == hf.head_dim
    windows = [hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types]
    assert list(config.layer_windows()) == windows and windows.count(0) == 10
    assert hf.rope_parameters == {"full_attention": config.rope.to_hf(),
                                  "sliding_attention": config.local_rope.to_hf()}
    assert config.rope == dataclasses.replace(config.rope, type="linear", factor=8.0, theta=1e6)
    assert config.attention_scale == 168 ** -0.5 and config.eos_token_ids == (1, 106)
    assert ModelConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ConfigError, match=r"^config: text_config: field 'sliding_window' must be a positive integer"):
        ModelConfig.from_hf({**GEMMA3_27B, "text_config": {**GEMMA3_27B["text_config"], "sliding_window": 0}})
    names = names_of(config)
    assert names.hf_to_jax("language_model.model.layers.3.self_attn.q_proj.weight") == (
        "layers.self_attn.q_proj.weight", 3)
    assert names.runtime_module("layers.self_attn.q_proj", 3) == "model.language_model.layers.3.self_attn.q_proj"
    assert names.is_other("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight")
    assert not names.is_other("language_model.model.norm.weight")


def build_multimodal_gemma3(out: Path, seed: int = 0) -> Path:
    """transformers' Gemma3ForConditionalGeneration over the tiny Gemma 3 decoder, with a one-layer vision tower
    and drawn norm weights, saved as save_pretrained writes it (tensors under language_model. and vision_tower.)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {k: v for k, v in tiny_family("gemma3_text").items() if k not in ("model_type", "initializer_range")}
    config = Gemma3Config(text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4,
                          boi_token_index=509, eoi_token_index=510, image_token_index=511)
    torch.manual_seed(seed)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.copy_(0.5 * torch.randn_like(param))
    hf.save_pretrained(out)
    return out


@pytest.mark.slow
def test_a_multimodal_gemma3_converts_its_decoder_and_its_adapter_serves_in_peft(tmp_path):
    """The converted decoder equals Gemma3ForConditionalGeneration on text; the exported adapter, keyed by the
    class's module names and kept off the vision tower, gives PEFT the same logits; a merge is refused."""
    from safetensors import safe_open

    from export.merge import MergeBase, MergeBaseError

    hf_dir = build_multimodal_gemma3(tmp_path / "hf")
    with safe_open(str(hf_dir / "model.safetensors"), "np") as f:
        assert any(k.startswith("vision_tower.") for k in f.keys())  # left out by the conversion
    convert(hf_dir, tmp_path / "jax", progress=False)
    lora_config = LoraConfig(rank=4, alpha=8.0)
    model = adapted(tmp_path / "jax", lora_config)
    assert model.config.model_type == "gemma3"
    adapter = save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config,
                                model_config=model.config, base_model=str(hf_dir))
    ids = np.random.default_rng(0).integers(0, 500, (2, 40))
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(base).__name__ == "Gemma3ForConditionalGeneration"
    with torch.no_grad():
        plain = base(torch.tensor(ids)).logits.numpy()
        peft = PeftModel.from_pretrained(base, adapter).eval()
        theirs = peft(torch.tensor(ids)).logits.numpy()
        by_auto = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()(
            torch.tensor(ids)).logits.numpy()
    base_jax = np.asarray(load_pretrained(tmp_path / "jax")(jnp.asarray(ids, jnp.int32)))
    assert np.abs(base_jax - plain).max() <= f32_tolerance(plain)
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    assert np.abs(theirs - plain).max() > 1e-3
    assert np.abs(ours - theirs).max() <= f32_tolerance(theirs)
    assert np.abs(by_auto - theirs).max() <= f32_tolerance(theirs)
    read_back = load_peft_adapter(load_pretrained(tmp_path / "jax"), adapter)
    np.testing.assert_array_equal(np.asarray(read_back(jnp.asarray(ids, jnp.int32))), ours)
    adapted_modules = [n for n, _ in peft.named_modules() if n.endswith(".lora_A")]
    assert len(adapted_modules) == 2 * 7 and all(".language_model." in n for n in adapted_modules)
    with pytest.raises(MergeBaseError, match="weights outside its decoder"):
        MergeBase(tmp_path / "jax")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-72b", "gemma-3-27b",  # biases; a multimodal file, sandwich and q/k norms
                                  "qwen3-30b-a3b", "mixtral-8x22b"])  # experts (router, fused gate_up and down)
def test_a_published_config_plans_transformers_parameter_count(name, tmp_path, default_allocator):
    """`--plan --model-config` on the published configs the docs plan (bench/configs): the frozen parameters it
    counts are those of transformers' own causal-LM class built from the same file (a multimodal config's text
    model), and the step compiles on 8 devices."""
    from finetune import TrainConfig
    from finetune.planning.plan import plan

    path = Path(__file__).parent.parent / "bench" / "configs" / f"{name}-config.json"
    (tmp_path / "config.json").write_text(path.read_text())
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(getattr(config, "text_config", config))
    report = plan(TrainConfig(plan=True, model_config=str(path), mesh="dp=1,fsdp=8,mp=1", batch_size=8,
                              seq_len=128, remat="full").validate())
    assert report.frozen_parameters == sum(p.numel() for p in model.parameters())
