"""Qwen3-MoE and Mixtral against transformers' own classes (Qwen3MoeForCausalLM, MixtralForCausalLM): config.json read
as transformers reads it (which layers are sparse, the experts, k, the renormalisation) and written back; the name
table's per-expert and fused names; checkpoints of either naming converted, a missing or doubled expert named; logits
on drawn configs with dense and sparse layers mixed (float32; bf16 on the rows whose routing agrees)."""

import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from strategies import moe_configs
from transformers import AutoConfig, AutoModelForCausalLM

from tiny_moe import MOE_MESH_TARGETS, TINY_MOE
from converter import ConversionError, convert
from jaxmodel import ModelConfig, load_pretrained
from jaxmodel.config import ConfigError
from jaxmodel.formats.hf_names import Location, names_of
from test_families import hf_model
from test_parity import BF16_ERROR_RATIO, f32_tolerance, hf_logits, jax_logits

MOE_TYPES = ("qwen3_moe", "mixtral")
SPARSE_BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock"}
SHAPE = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
         "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts_per_tok": 2, "initializer_range": 0.1}


def moe_model(config: dict, seed: int = 0, dtype: str = "float32"):
    """transformers' class for `config`, seeded, its experts computed by the plain loop (its default CPU kernel
    refuses some small shapes)."""
    hf = hf_model(config, seed, dtype)
    hf.set_experts_implementation("eager")
    return hf


def sparse_flags(hf_config) -> tuple[bool, ...]:
    """Which of transformers' decoder layers hold the experts, from the class it builds (on the meta device)."""
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    return tuple(type(layer.mlp).__name__ == SPARSE_BLOCKS[hf_config.model_type] for layer in hf.model.layers)


def convert_hf(hf, tmp: Path, fused: bool = False) -> Path:
    """`hf` saved as transformers saves it (per-expert hub names), or its state dict as it runs (`fused`: the
    experts' fused parameters), then converted."""
    source = tmp / "hf"
    hf.save_pretrained(source)
    if fused:
        (source / "model.safetensors").unlink()
        state = hf.state_dict()
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        save_file({k: v.contiguous() for k, v in state.items()}, source / "model.safetensors")
    convert(source, tmp / "jax", progress=False)
    return tmp / "jax"


# ----------------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize("model_type", MOE_TYPES)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_moe_configs_read_as_transformers_reads_them_and_write_back(model_type, data):
    raw = data.draw(moe_configs(model_type))
    config = ModelConfig.from_hf(raw)
    hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    flags = sparse_flags(hf)
    assert (config.sparse_layers or (False,) * config.num_hidden_layers) == flags
    assert config.num_experts == hf.num_local_experts and config.num_experts_per_tok == hf.num_experts_per_tok
    assert config.norm_topk_prob == getattr(hf, "norm_topk_prob", True)
    assert config.moe_intermediate_size == getattr(hf, "moe_intermediate_size", hf.intermediate_size)
    assert config.round_router_weights == (model_type == "qwen3_moe")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert config.head_dim == head_dim
    assert config.layer_windows() == (hf.sliding_window or 0,) * hf.num_hidden_layers
    written = config.to_hf()
    assert ModelConfig.from_hf(written) == config
    again = AutoConfig.for_model(model_type, **{k: v for k, v in written.items() if k != "model_type"})
    assert sparse_flags(again) == flags


def test_the_defaults_are_transformers():
    shape = {k: v for k, v in SHAPE.items() if k != "num_experts_per_tok"}
    qwen = ModelConfig.from_hf({"model_type": "qwen3_moe", **shape})
    hf = AutoConfig.for_model("qwen3_moe", **{**SHAPE, "num_experts_per_tok": 8})
    ours = (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob)
    assert ours == (hf.num_local_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob)
    assert ours == (128, 8, 768, False)
    assert qwen.head_dim == 8  # hidden / heads, not dense Qwen3's 128
    mixtral = ModelConfig.from_hf({"model_type": "mixtral", **shape})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.sliding_window) == (8, 2, None)
    assert mixtral.sparse_layers == (True,) * 3 and mixtral.moe_intermediate_size == 24


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mixtral", "router_jitter_noise": 0.1},
     "field 'router_jitter_noise' is 0.1: training with a perturbed router is not supported (set it to 0)"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5},
     "field 'num_experts_per_tok' (5) must not exceed the 4 experts"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 0},
     "field 'num_experts_per_tok' must be a positive integer, got 0"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": ["0"]}, "field 'mlp_only_layers' must list layer indices"),
    ({"model_type": "qwen3_moe", "moe_intermediate_size": -1}, "field 'moe_intermediate_size' must be a positive"),
])
def test_bad_expert_fields_are_named_in_one_line(change, message):
    with pytest.raises(ConfigError, match="^config: ") as info:
        ModelConfig.from_hf({**SHAPE, **change})
    assert message in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------
# names and conversion


def test_the_name_table_places_each_experts_tensor_and_each_layers_kind():
    qwen = names_of(ModelConfig.from_hf({"model_type": "qwen3_moe", **SHAPE, "num_experts": 4,
                                         "moe_intermediate_size": 8, "mlp_only_layers": [1]}))
    # layer 1 is dense: slice 0 of `layers`; layers 0 and 2 are slices 0 and 1 of `moe_layers`
    assert qwen.hf_to_jax("model.layers.1.mlp.up_proj.weight") == ("layers.mlp.up_proj.weight", 0)
    assert qwen.hf_to_jax("model.layers.2.self_attn.q_norm.weight") == ("moe_layers.self_attn.q_norm.weight", 1)
    assert qwen.hf_to_jax("model.layers.1.self_attn.q_norm.weight") == ("layers.self_attn.q_norm.weight", 0)
    assert qwen.hf_to_jax("model.layers.2.mlp.gate.weight") == ("moe_layers.mlp.gate.weight", 1)
    assert qwen.locate("model.layers.2.mlp.experts.3.up_proj.weight") == Location(
        "moe_layers.mlp.experts.gate_up_proj.weight", 1, 2, 3, 1, 2)
    assert qwen.locate("model.layers.0.mlp.experts.down_proj") == Location("moe_layers.mlp.experts.down_proj.weight",
                                                                           0, 0)
    assert qwen.hf_to_jax("model.layers.1.mlp.gate.weight") is None  # a dense layer has no router
    assert qwen.hf_to_jax("model.layers.0.mlp.up_proj.weight") is None  # nor a sparse one a dense MLP
    assert qwen.jax_to_hf("moe_layers.self_attn.o_proj.weight", 1) == "model.layers.2.self_attn.o_proj.weight"
    assert qwen.jax_to_hf("layers.mlp.down_proj.weight", 0) == "model.layers.1.mlp.down_proj.weight"
    rows = qwen.expert_tensors("moe_layers.mlp.experts.gate_up_proj.weight")
    assert [qwen.expert_name(r, 1, 3) for r in rows] == ["model.layers.2.mlp.experts.3.gate_proj.weight",
                                                         "model.layers.2.mlp.experts.3.up_proj.weight"]
    mixtral = names_of(ModelConfig.from_hf({"model_type": "mixtral", **SHAPE, "num_local_experts": 4}))
    assert mixtral.locate("model.layers.2.block_sparse_moe.experts.1.w3.weight") == Location(
        "moe_layers.mlp.experts.gate_up_proj.weight", 2, 2, 1, 1, 2)
    assert mixtral.locate("model.layers.0.block_sparse_moe.experts.0.w2.weight").path == \
        "moe_layers.mlp.experts.down_proj.weight"
    for name in ("model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"):
        assert mixtral.hf_to_jax(name) == ("moe_layers.mlp.gate.weight", 1)
    assert mixtral.jax_to_hf("moe_layers.mlp.gate.weight", 1) == "model.layers.1.block_sparse_moe.gate.weight"
    assert mixtral.hf_to_jax("model.layers.0.mlp.gate_proj.weight") is None


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    """A Qwen3-MoE checkpoint saved by transformers (4 experts, layer 1 dense) and its config."""
    config = {"model_type": "qwen3_moe", **SHAPE, "num_experts": 4, "moe_intermediate_size": 8,
              "mlp_only_layers": [1], "norm_topk_prob": True}
    hf = moe_model(config)
    out = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    hf.save_pretrained(out)
    return out


def _rewrite(source: Path, out: Path, change) -> Path:
    """A copy of checkpoint `source` with its tensors `change(tensors)`d."""
    from safetensors.torch import load_file

    out.mkdir()
    (out / "config.json").write_text((source / "config.json").read_text())
    tensors = change(load_file(source / "model.safetensors"))
    save_file({k: v.clone() for k, v in tensors.items()}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("change, message", [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.2.mlp.experts.3.up_proj.weight"},
     "missing tensor 'model.layers.2.mlp.experts.3.up_proj.weight', which config.json implies"),
    (lambda t: {k: v for k, v in t.items() if ".layers.0.mlp.experts." not in k},
     "missing tensor 'model.layers.0.mlp.experts.0.down_proj.weight', which config.json implies"),
    (lambda t: {**t, "model.layers.0.mlp.experts.4.up_proj.weight": t["model.layers.0.mlp.experts.0.up_proj.weight"]},
     "tensor 'model.layers.0.mlp.experts.4.up_proj.weight' is beyond the 4 experts config.json implies"),
    (lambda t: {**t, "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 16, 8)},
     "both hold part of 'moe_layers.mlp.experts.down_proj.weight' [0]"),
    (lambda t: {**t, "model.layers.1.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"]},
     "unexpected tensor 'model.layers.1.mlp.gate.weight'"),
    (lambda t: {**t, "model.layers.0.mlp.experts.1.gate_proj.weight": torch.zeros(8, 15)},
     "tensor 'model.layers.0.mlp.experts.1.gate_proj.weight' has shape [8, 15], config.json implies [8, 16]"),
])
def test_a_missing_doubled_or_misshapen_expert_is_named(tiny_qwen3_moe, tmp_path, change, message):
    source = _rewrite(tiny_qwen3_moe, tmp_path / "bad", change)
    with pytest.raises(ConversionError) as info:
        convert(source, tmp_path / "jax", progress=False)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "jax").exists()


def test_each_experts_tensor_lands_in_its_part_of_the_stacked_experts(tiny_qwen3_moe, tmp_path):
    from safetensors.torch import load_file

    convert(tiny_qwen3_moe, tmp_path / "jax", progress=False, verify=True)
    model = load_pretrained(tmp_path / "jax")
    tensors = load_file(tiny_qwen3_moe / "model.safetensors")
    gate_up = np.asarray(model.moe_layers.mlp.experts.gate_up_proj.weight[...])
    down = np.asarray(model.moe_layers.mlp.experts.down_proj.weight[...])
    for j, layer in enumerate((0, 2)):
        for e in range(4):
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            np.testing.assert_array_equal(gate_up[j, e, :8], tensors[prefix + "gate_proj.weight"].numpy())
            np.testing.assert_array_equal(gate_up[j, e, 8:], tensors[prefix + "up_proj.weight"].numpy())
            np.testing.assert_array_equal(down[j, e], tensors[prefix + "down_proj.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.up_proj.weight[0]),
                                  tensors["model.layers.1.mlp.up_proj.weight"].numpy())


def test_a_sparse_dense_sparse_model_equals_transformers_run_by_run(tiny_qwen3_moe, tmp_path):
    convert(tiny_qwen3_moe, tmp_path / "jax", progress=False)
    model = load_pretrained(tmp_path / "jax")
    assert model.config.layer_runs() == ((True, 0, 1), (False, 1, 1), (True, 2, 1))
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, experts_implementation="eager")
    ids = np.random.default_rng(0).integers(0, 32, (2, 9))
    expected = hf_logits(hf, ids)
    assert np.abs(np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32))) - expected).max() <= \
        f32_tolerance(expected)
    np.testing.assert_array_equal(np.asarray(model.routes(jnp.asarray(ids, jnp.int32))), hf_routes(hf, ids))


# ----------------------------------------------------------------------------------------------------
# the model against transformers


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MOE_TYPES)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_float32_logits_match_transformers(model_type, data):
    config = data.draw(moe_configs(model_type))
    seed, fused = data.draw(st.integers(0, 2**16)), data.draw(st.booleans())
    shape = data.draw(st.tuples(st.integers(1, 3), st.integers(1, 60)))
    hf = moe_model(config, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_pretrained(convert_hf(hf, Path(tmp), fused))
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], shape)
    expected = hf_logits(hf, ids)
    got = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - expected).max() <= f32_tolerance(expected)


def hf_routes(hf, ids) -> np.ndarray:
    """transformers' experts of each token at each sparse layer, `[sparse layers, b, t, k]`, from its routers."""
    found = []
    hooks = [m.register_forward_hook(lambda _, __, out: found.append(out[2])) for name, m in hf.named_modules()
             if name.endswith("mlp.gate")]
    with torch.no_grad():
        hf(torch.tensor(ids))
    for hook in hooks:
        hook.remove()
    return np.stack([r.numpy().reshape(*ids.shape, -1) for r in found])


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MOE_TYPES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_bfloat16_logits_match_transformers_where_the_routing_agrees(model_type, data):
    config = data.draw(moe_configs(model_type, max_layers=2))
    seed = data.draw(st.integers(0, 2**16))
    hf = moe_model(config, seed, dtype="bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        model = load_pretrained(convert_hf(hf, Path(tmp)), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], (4, 16))
    theirs = hf_logits(hf, ids)
    exact_hf = hf.double()
    with torch.no_grad():
        exact = exact_hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32)))
    if model.moe_layers is not None:  # the rows where every token's experts are the float64 run's on both sides
        exact_routes = np.sort(hf_routes(exact_hf, ids), -1)
        ours = np.sort(np.asarray(jax.jit(model.routes)(jnp.asarray(ids, jnp.int32))), -1)
        exact_hf.to(torch.bfloat16)
        agree = (ours == exact_routes).all((0, 3)) & (np.sort(hf_routes(exact_hf, ids), -1) == exact_routes).all((0, 3))
        print(f"{model_type}: the experts of {agree.mean():.0%} of tokens agree")
        rows = agree.all(1)
        if not rows.any():
            return
        got, theirs, exact = got[rows], theirs[rows], exact[rows]
    floor = 1e-3 * max(1.0, np.abs(exact).max())
    assert np.abs(got - exact).max() <= BF16_ERROR_RATIO * np.abs(theirs - exact).max() + floor


# ----------------------------------------------------------------------------------------------------
# LoRA on the routed experts, against PEFT's target_parameters


def _random_adapters(model, seed: int = 0):
    """Every LoRA matrix of `model` drawn (B too, so that every adapter changes the output)."""
    from flax import nnx

    from jaxmodel.layers import LoRAParam

    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        var.set_value(jnp.asarray(0.3 * rng.standard_normal(var.shape), jnp.float32))


def _peft_model(source: Path, adapter: Path):
    from peft import PeftModel

    hf = AutoModelForCausalLM.from_pretrained(source, experts_implementation="eager")
    return PeftModel.from_pretrained(hf, adapter, is_trainable=True)


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixtral") / "hf"
    moe_model({"model_type": "mixtral", **SHAPE, "num_local_experts": 4}).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, targets, patterns", [
    # both: gate_up under base_layer; ranks and alphas of their own on two targets
    ("qwen3_moe", ("q_proj", "experts.gate_up_proj", "experts.down_proj"),
     dict(rank_pattern={"experts.gate_up_proj": 3}, alpha_pattern={"experts.down_proj": 5.0, "q_proj": 1.0})),
    ("mixtral", ("experts.down_proj", "gate"), {}),  # the router: transformers 5's mlp.gate, the hub's
                                                    # block_sparse_moe.gate
    ("mixtral", ("experts.gate_up_proj", "v_proj"), {}),
])
def test_an_experts_adapter_serves_in_peft_with_equal_logits_and_gradients(family, targets, patterns, tiny_qwen3_moe,
                                                                         tiny_mixtral, tmp_path):
    from flax import nnx

    from jaxmodel.layers import LoRAParam
    from jaxmodel.lora import LoraConfig, apply_lora
    from jaxmodel.formats.peft_adapter import save_peft_adapter

    source = tiny_qwen3_moe if family == "qwen3_moe" else tiny_mixtral
    convert(source, tmp_path / "jax", progress=False)
    lora_config = LoraConfig(rank=2, alpha=6.0, targets=targets, **patterns)
    model = apply_lora(load_pretrained(tmp_path / "jax"), lora_config, rngs=nnx.Rngs(0))
    _random_adapters(model)
    save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config, model_config=model.config,
                      base_model=str(source))
    peft, ours = assert_serves_in_peft(model, source, tmp_path / "adapter", tmp_path / "jax")
    if patterns:
        assert peft.base_model.model.model.layers[0].mlp.experts.base_layer.r["default"] == 3
    assert any(".experts." in k for k in ours)


def assert_serves_in_peft(model, source: Path, adapter: Path, jax_dir: Path, vocab: int = 32):
    """PEFT's model of HF checkpoint `source` with `adapter` (exported from `model`, converted at `jax_dir`) gives
    `model`'s logits and LoRA gradients, and `adapter` reads back bit for bit; returns (the PEFT model, our
    gradients by PEFT name)."""
    from flax import nnx

    from jaxmodel.formats.peft_adapter import peft_tensors
    from jaxmodel.layers import LoRAParam

    peft = _peft_model(source, adapter)
    ids = np.random.default_rng(1).integers(0, vocab, (2, 11))
    weights = np.random.default_rng(2).standard_normal((2, 11, vocab)).astype(np.float32)
    logits = peft(torch.tensor(ids)).logits
    (logits * torch.tensor(weights)).sum().backward()
    expected = logits.detach().numpy()
    theirs = {k.replace(".default", ""): p.grad.numpy() for k, p in peft.named_parameters() if p.requires_grad}
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora):
        out = nnx.merge(graphdef, lora, rest)(jnp.asarray(ids, jnp.int32))
        return jnp.sum(out * weights), out

    grads, got = jax.jit(jax.grad(loss, has_aux=True))(lora)
    assert np.abs(np.asarray(got) - expected).max() <= f32_tolerance(expected)
    ours = peft_tensors(grads, model.config)
    _assert_peft_grads(ours, theirs)
    _assert_reads_back(lora, jax_dir, adapter)
    return peft, ours


def _assert_peft_grads(ours: dict, theirs: dict) -> None:
    """The same LoRA gradients by PEFT name, each within 1e-4 of the larger of 1 and PEFT's largest entry."""
    assert sorted(ours) == sorted(theirs)
    for name, grad in ours.items():
        assert np.abs(grad - theirs[name]).max() <= 1e-4 * max(1.0, np.abs(theirs[name]).max()), name


def _assert_reads_back(lora, jax_dir: Path, adapter: Path) -> None:
    """`adapter` read onto the converted model gives the LoRA state `lora` bit for bit."""
    from flax import nnx

    from jaxmodel.formats.peft_adapter import load_peft_adapter
    from jaxmodel.layers import LoRAParam

    back = load_peft_adapter(load_pretrained(jax_dir), adapter)
    for (path, mine), (_, read) in zip(nnx.to_flat_state(lora), nnx.to_flat_state(nnx.state(back, LoRAParam))):
        np.testing.assert_array_equal(np.asarray(read[...]), np.asarray(mine[...]), err_msg=str(path))


@pytest.mark.slow
def test_training_the_router_adds_transformers_load_balancing_loss_as_a_peft_run_does(tmp_path):
    """The router (`gate`, PEFT's `target_parameters` `mlp.gate.weight`) adapted: the step's loss is the
    cross-entropy plus `router_aux_loss_coef` times transformers' load-balancing loss (its `output_router_logits`
    run, padding left out), and the LoRA gradients PEFT's; exported and read back exactly. (Mixtral's class computes
    the same loss with the same function; its router's adapter serves in PEFT in the test above.)"""
    family = "qwen3_moe"
    from flax import nnx

    from finetune.step.train_step import loss_and_grads, split_model
    from jaxmodel.formats.peft_adapter import peft_tensors, save_peft_adapter
    from jaxmodel.layers import LoRAParam
    from jaxmodel.lora import LoraConfig, apply_lora

    experts = {"num_experts": 4, "mlp_only_layers": [1], "moe_intermediate_size": 8} if family == "qwen3_moe" else \
        {"num_local_experts": 4}
    source = tmp_path / "hf"
    moe_model({"model_type": family, **SHAPE, **experts, "router_aux_loss_coef": 0.5}).save_pretrained(source)
    convert(source, tmp_path / "jax", progress=False)
    lora_config = LoraConfig(rank=2, alpha=6.0, targets=("q_proj", "gate", "experts.down_proj"))
    model = apply_lora(load_pretrained(tmp_path / "jax"), lora_config, rngs=nnx.Rngs(0))
    _random_adapters(model)
    save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config, model_config=model.config,
                      base_model=str(source))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_parameters"] == [
        "mlp.experts.down_proj", "mlp.gate.weight"]

    ids = np.random.default_rng(1).integers(0, 32, (2, 11))
    lengths = np.array([11, 7])
    real = np.arange(11)[None] < lengths[:, None]
    hf = AutoModelForCausalLM.from_pretrained(source, experts_implementation="eager", output_router_logits=True)
    from peft import PeftModel

    peft = PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    out = peft(input_ids=torch.tensor(ids), attention_mask=torch.tensor(real.astype(np.int64)),
               labels=torch.tensor(np.where(real, ids, -100)))
    out.loss.backward()
    theirs = {k.replace(".default", ""): p.grad.numpy() for k, p in peft.named_parameters() if p.requires_grad}

    has_next = real & (np.arange(11)[None] + 1 < lengths[:, None])
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, axis=1), "loss_mask": has_next.astype(np.float32),
             "segment_ids": real.astype(np.int32), "positions": np.broadcast_to(np.arange(11), (2, 11))}
    batch = {k: jnp.asarray(v, jnp.float32 if k == "loss_mask" else jnp.int32) for k, v in batch.items()}
    graphdef, lora, base = split_model(model)
    loss, _, grads = jax.jit(lambda lora: loss_and_grads(graphdef, lora, base, batch))(lora)
    assert abs(float(loss) - out.loss.item()) <= 1e-5 * abs(out.loss.item())
    ours = peft_tensors(grads, model.config)
    assert any(".mlp.gate." in k for k in ours)
    _assert_peft_grads(ours, theirs)
    _assert_reads_back(lora, tmp_path / "jax", tmp_path / "adapter")

    # a row a micro-batch: the cross-entropy over both rows' targets, the load-balancing loss each pass's, averaged
    peft.zero_grad()
    coef, targets = hf.config.router_aux_loss_coef, has_next.sum()
    total = 0
    for row in range(2):
        one = peft(input_ids=torch.tensor(ids[row:row + 1, :lengths[row]]),
                   labels=torch.tensor(ids[row:row + 1, :lengths[row]]))
        total = total + (one.loss - coef * one.aux_loss) * (lengths[row] - 1) / targets + coef * one.aux_loss / 2
    total.backward()
    theirs = {k.replace(".default", ""): p.grad.numpy() for k, p in peft.named_parameters() if p.requires_grad}
    loss, _, grads = jax.jit(lambda lora: loss_and_grads(graphdef, lora, base, batch, grad_accum=2))(lora)
    assert abs(float(loss) - total.item()) <= 1e-5 * abs(total.item())
    _assert_peft_grads(peft_tensors(grads, model.config), theirs)


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_TYPES)
def test_a_transformers4_per_expert_adapter_reads_as_peft_converts_it_and_exports_fused(family, tiny_qwen3_moe,
                                                                                      tiny_mixtral, tmp_path):
    """A transformers-4 adapter of each expert's modules (Qwen3-MoE's gate_proj/up_proj/down_proj, Mixtral's
    w1/w3/w2) beside attention's: the JAX model's logits are PEFT's, which converts it to the fused experts (gate_up
    of rank 2r); its export in that layout (a rank_pattern) loads in PEFT with the same logits."""
    from flax import nnx
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.numpy import save_file

    from jaxmodel.formats.peft_adapter import load_peft_adapter, save_peft_adapter
    from jaxmodel.layers import LoRAParam

    source = tiny_qwen3_moe if family == "qwen3_moe" else tiny_mixtral
    convert(source, tmp_path / "jax", progress=False)
    shorts = ("gate_proj", "up_proj", "down_proj") if family == "qwen3_moe" else ("w1", "w3", "w2")
    module = "mlp.experts" if family == "qwen3_moe" else "block_sparse_moe.experts"
    config = AutoConfig.from_pretrained(source)
    rng, r = np.random.default_rng(3), 2
    sparse = [i for i, s in enumerate(sparse_flags(config)) if s]
    shapes = {shorts[0]: (config.hidden_size, config.moe_intermediate_size if family == "qwen3_moe" else
                          config.intermediate_size)}
    shapes[shorts[1]] = shapes[shorts[0]]
    shapes[shorts[2]] = shapes[shorts[0]][::-1]
    heads = config.num_attention_heads
    q = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    tensors = {}
    for i in range(config.num_hidden_layers):
        name = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[name + ".lora_A.weight"] = rng.standard_normal((r, config.hidden_size)).astype(np.float32)
        tensors[name + ".lora_B.weight"] = 0.3 * rng.standard_normal((q, r)).astype(np.float32)
        for e in range(4 if i in sparse else 0):
            for short, (n_in, n_out) in shapes.items():
                name = f"base_model.model.model.layers.{i}.{module}.{e}.{short}"
                tensors[name + ".lora_A.weight"] = rng.standard_normal((r, n_in)).astype(np.float32)
                tensors[name + ".lora_B.weight"] = 0.3 * rng.standard_normal((n_out, r)).astype(np.float32)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    PeftLoraConfig(r=r, lora_alpha=6, target_modules=["q_proj", *shorts], task_type="CAUSAL_LM",
                   base_model_name_or_path=str(source)).save_pretrained(adapter)

    ids = np.random.default_rng(1).integers(0, 32, (2, 11))
    with torch.no_grad():
        theirs = _peft_model(source, adapter)(torch.tensor(ids)).logits.numpy()
        plain = AutoModelForCausalLM.from_pretrained(source, experts_implementation="eager")(
            torch.tensor(ids)).logits.numpy()
    model = load_peft_adapter(load_pretrained(tmp_path / "jax"), adapter)
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    assert np.abs(theirs - plain).max() > 1e-2
    assert np.abs(ours - theirs).max() <= f32_tolerance(theirs)
    from jaxmodel.formats.peft_adapter import read_adapter

    lora_config = read_adapter(adapter, model.config)[0]
    assert (sorted(lora_config.targets), lora_config.rank_pattern, lora_config.alpha_pattern) == (
        ["experts.down_proj", "experts.gate_up_proj", "q_proj"], (("experts.gate_up_proj", 4),),
        (("experts.gate_up_proj", 12.0),))
    save_peft_adapter(tmp_path / "fused", nnx.state(model, LoRAParam), lora_config, model_config=model.config,
                      base_model=str(source))
    with torch.no_grad():
        again = _peft_model(source, tmp_path / "fused")(torch.tensor(ids)).logits.numpy()
    assert np.abs(again - theirs).max() <= f32_tolerance(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_TYPES)
def test_the_per_expert_export_names_each_experts_modules_as_the_hub_does_and_serves_in_peft_alike(
        family, tiny_qwen3_moe, tiny_mixtral, tmp_path):
    """The per-expert layout (vLLM's MoE LoRA format on these classes): each expert's gate and up (Mixtral's w1, w3)
    with the fused adapter's A as both As and B's rows of each, down (w2) its own, the router under the
    checkpoint's name; PEFT loads it (gate and up at rank 2r) with the JAX model's logits, and so does this port."""
    from flax import nnx
    from safetensors.numpy import load_file

    from jaxmodel.formats.peft_adapter import load_peft_adapter, save_peft_adapter
    from jaxmodel.layers import LoRAParam
    from jaxmodel.lora import LoraConfig, apply_lora

    source = tiny_qwen3_moe if family == "qwen3_moe" else tiny_mixtral
    gate, up, down = ("gate_proj", "up_proj", "down_proj") if family == "qwen3_moe" else ("w1", "w3", "w2")
    moe = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    convert(source, tmp_path / "jax", progress=False)
    lora_config = LoraConfig(rank=2, alpha=6.0, targets=("q_proj", "experts.gate_up_proj", "experts.down_proj",
                                                         *(("gate",) if family == "mixtral" else ())))
    model = apply_lora(load_pretrained(tmp_path / "jax"), lora_config, rngs=nnx.Rngs(0))
    _random_adapters(model, seed=5)
    ids = np.random.default_rng(1).integers(0, 32, (2, 11))
    expected = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config, model_config=model.config,
                      base_model=str(source), expert_layout="per-expert")

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["target_modules"], config["target_parameters"]) == (
        sorted(["q_proj", gate, up, down, *(("gate",) if family == "mixtral" else ())]), None)
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    experts = model.moe_layers.mlp.experts
    a, b = (np.asarray(x[...]) for x in (experts.gate_up_proj.lora_a, experts.gate_up_proj.lora_b))
    f = b.shape[-2] // 2
    key = f"base_model.model.model.layers.0.{moe}.experts.3."
    for part, rows in ((gate, b[0, 3, :f]), (up, b[0, 3, f:])):
        np.testing.assert_array_equal(tensors[key + part + ".lora_A.weight"], a[0, 3])
        np.testing.assert_array_equal(tensors[key + part + ".lora_B.weight"], rows)
    assert not any(".experts.lora" in k or "base_layer" in k for k in tensors)
    if family == "mixtral":
        assert "base_model.model.model.layers.0.block_sparse_moe.gate.lora_A.weight" in tensors

    with torch.no_grad():
        theirs = _peft_model(source, tmp_path / "adapter")(torch.tensor(ids)).logits.numpy()
    assert np.abs(theirs - expected).max() <= f32_tolerance(expected)
    back = load_peft_adapter(load_pretrained(tmp_path / "jax"), tmp_path / "adapter")
    assert np.abs(np.asarray(back(jnp.asarray(ids, jnp.int32))) - expected).max() <= f32_tolerance(expected)


def test_flops_per_token_count_the_active_experts_and_the_dense_layers():
    from finetune.step.flops import flops_per_token

    moe = ModelConfig.from_hf({"model_type": "qwen3_moe", **SHAPE, "num_experts": 4, "moe_intermediate_size": 8,
                               "mlp_only_layers": [1]})
    dense = ModelConfig.from_hf({"model_type": "qwen3", **{k: v for k, v in SHAPE.items() if "expert" not in k},
                                 "head_dim": 8})
    # two sparse layers: the router (16 x 4) and 2 experts' gate, up and down (3 x 16 x 8 each) instead of the
    # dense MLP (3 x 16 x 24); 4N a token
    assert flops_per_token(dense, 10) - flops_per_token(moe, 10) == 4 * 2 * (3 * 16 * 24 - 16 * 4 - 2 * 3 * 16 * 8)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_merge_folds_each_experts_adapter_into_a_checkpoint_of_the_familys_class(family, tiny_qwen3_moe,
                                                                                  tiny_mixtral, tmp_path):
    from flax import nnx

    from export.merge import save_merged
    from jaxmodel.layers import LoRAParam
    from jaxmodel.lora import LoraConfig, apply_lora

    source = tiny_qwen3_moe if family == "qwen3_moe" else tiny_mixtral
    convert(source, tmp_path / "jax", progress=False)
    lora_config = LoraConfig(rank=2, alpha=4.0, targets=("k_proj", "experts.gate_up_proj", "experts.down_proj",
                                                         *(("down_proj",) if family == "qwen3_moe" else ())),
                             rank_pattern={"experts.down_proj": 3}, alpha_pattern={"k_proj": 1.0})  # own scales
    model = apply_lora(load_pretrained(tmp_path / "jax"), lora_config, rngs=nnx.Rngs(0))
    _random_adapters(model, seed=4)
    ids = np.random.default_rng(3).integers(0, 32, (2, 10))
    expected = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32)))
    lora = nnx.state(model, LoRAParam)
    for base in (tmp_path / "jax", source):  # from the converted checkpoint (per-expert names) and from the HF one
        out = save_merged(tmp_path / f"merged-{base.name}", base, lora, lora_config)
        merged = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager")
        assert np.abs(hf_logits(merged, ids) - expected).max() <= f32_tolerance(expected), base


# ----------------------------------------------------------------------------------------------------
# training on meshes


@pytest.fixture(scope="module")
def moe_run_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE with a tokenizer (demo/tiny.py: 2 layers, hidden 64; 4 experts, 2 a token, layer 1 dense),
    converted, the packed rows of the mesh tests, and the loss and LoRA gradients of one plain device."""
    return mesh_run_checkpoint(tmp_path_factory.mktemp("moe-run"), TINY_MOE, MESH_TARGETS)


def mesh_run_checkpoint(root, config: dict, targets: str):
    """demo/tiny.py's model updated by `config`, converted, the packed rows of the mesh tests, and the loss and
    gradients of the LoRA `targets` on one plain device: (its directory, the data file, (loss, tokens, grads))."""
    from demo.tiny import build_tiny_model
    from test_context_parallel import grads_on, write_packed_data

    convert(build_tiny_model(root / "hf", config), root / "jax", progress=False)
    data = write_packed_data(root / "train.jsonl")
    reference = grads_on(root / "jax", data, root / "ref", "dp=1,fsdp=1,mp=1", jax.devices()[:1], attention="xla",
                         loss_chunk=0, mlp_chunk=0, targets=targets)
    return root / "jax", data, reference


MESH_TARGETS = MOE_MESH_TARGETS
# the meshes a model with experts trains on alike (with the options each runs): cp and fsdp, every axis, fsdp and mp
MOE_MESHES = [
    ("dp=1,fsdp=2,cp=4,mp=1", dict(attention="blockwise", loss_chunk=3)),
    ("dp=2,fsdp=1,cp=2,mp=2", dict(attention="xla")),
    ("dp=1,fsdp=4,mp=2", dict(attention="xla")),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", MOE_MESHES)
def test_same_loss_and_experts_lora_grads_on_a_mesh_as_one_plain_device(tmp_path, moe_run_checkpoint, mesh, options):
    from test_context_parallel import assert_same, grads_on

    jax_dir, data, reference = moe_run_checkpoint
    assert any(".experts.gate_up_proj.lora_a" in name for name in reference[2])
    assert_same(grads_on(jax_dir, data, tmp_path / "mesh", mesh, jax.devices(), targets=MESH_TARGETS, **options),
                reference)


@pytest.mark.slow
def test_a_run_from_a_peft_made_adapter_equals_the_same_run_in_torch_and_peft(moe_run_checkpoint, tmp_path):
    """finetune-lora --init-adapter of an adapter PEFT made on Qwen3MoeForCausalLM (attention and every expert's
    gate_up and down, random A and B): three AdamW steps on the same rows give torch + PEFT + torch's AdamW's losses
    and adapter, the objective in torch written out (the mean cross-entropy over the trained tokens)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.numpy import load_file

    from export.cli import main as export_main
    from finetune.config import TrainConfig
    from finetune.train.build import setup
    from finetune.train.loop import run_training

    jax_dir, data, _ = moe_run_checkpoint
    hf_dir = jax_dir.parent / "hf"
    torch.manual_seed(0)
    made = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, experts_implementation="eager"),
                          PeftLoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                         init_lora_weights=False, task_type="CAUSAL_LM"))
    made.save_pretrained(tmp_path / "peft")
    lr, steps = 1e-2, 3
    config = TrainConfig(model=str(jax_dir), data=str(data), out=str(tmp_path / "run"), steps=steps, batch_size=48,
                         mesh="dp=1,fsdp=1,mp=1",
                         seq_len=32, pack=False, dtype="float32", lr=lr, schedule="constant", clip_norm=0.0,
                         init_adapter=str(tmp_path / "peft"), progress=False).validate()
    rows = setup(config).train_rows  # every row in every step: the data order leaves the loss as it is
    assert len(rows) == 48
    run_training(config)
    assert export_main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "trained")]) == 0
    ours = load_file(tmp_path / "trained" / "adapter_model.safetensors")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, experts_implementation="eager"),
                                     tmp_path / "peft", is_trainable=True)
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    batch = {k: torch.tensor(v) for k, v in rows.take(np.arange(len(rows))).items()}
    theirs = []
    for _ in range(steps):
        logits = peft(input_ids=batch["input_ids"].long(), attention_mask=(batch["segment_ids"] > 0).long()).logits
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["targets"].long(), reduction="none")
        loss = (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(losses, theirs, rtol=1e-5)
    assert theirs[-1] < theirs[0]
    trained = {k: v.detach().numpy() for k, v in get_peft_model_state_dict(peft).items()}
    assert sorted(ours) == sorted(trained) and any(".experts.base_layer." in k for k in ours)
    start = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    for name, value in trained.items():
        assert np.abs(value - start[name]).max() > 1e-3, name  # every tensor moved
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_default_targets_on_a_model_with_experts_are_attention_and_the_experts():
    from finetune.config import MOE_DEFAULT_TARGETS, TrainConfig

    mixtral = ModelConfig.from_hf({"model_type": "mixtral", **SHAPE, "num_local_experts": 4})
    dense = ModelConfig.from_hf({"model_type": "mistral", **{k: v for k, v in SHAPE.items() if "expert" not in k}})
    config = TrainConfig(model="m", data="d")
    assert config.lora_config(mixtral).targets == MOE_DEFAULT_TARGETS
    assert config.lora_config(dense).targets == config.lora_config().targets == config.target_modules
    assert TrainConfig(model="m", data="d", targets="q_proj,experts.down_proj").lora_config(mixtral).targets == (
        "q_proj", "experts.down_proj")


def test_a_dense_layers_mlp_adapter_peft_cannot_attach_is_refused_in_one_line(tiny_qwen3_moe, tmp_path):
    from flax import nnx

    from jaxmodel.formats.peft_adapter import AdapterError, save_peft_adapter
    from jaxmodel.layers import LoRAParam
    from jaxmodel.lora import LoraConfig, apply_lora

    convert(tiny_qwen3_moe, tmp_path / "jax", progress=False)
    lora_config = LoraConfig(rank=2, targets=("q_proj", "down_proj", "experts.down_proj"))
    model = apply_lora(load_pretrained(tmp_path / "jax"), lora_config, rngs=nnx.Rngs(0))
    with pytest.raises(AdapterError) as info:
        save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config, model_config=model.config,
                          base_model=str(tiny_qwen3_moe))
    assert str(info.value) == ("LoRA targets down_proj: PEFT 0.21.2 attaches no adapter to them on Qwen3MoeForCausalLM "
                               "(it takes those names for the experts), so their adapters would be dropped when it "
                               "loads the adapter: export a merged checkpoint (--merge) instead, or train without them")
    assert not (tmp_path / "adapter").exists()


def test_a_per_expert_export_of_an_adapter_with_ranks_of_its_own_is_refused_in_one_line(tmp_path):
    from jaxmodel.formats.peft_adapter import AdapterError, save_peft_adapter
    from jaxmodel.lora import LoraConfig

    config = ModelConfig.from_hf({"model_type": "mixtral", **SHAPE, "num_local_experts": 4})
    lora_config = LoraConfig(rank=2, targets=("q_proj", "experts.down_proj"), rank_pattern={"q_proj": 4})
    with pytest.raises(AdapterError) as info:
        save_peft_adapter(tmp_path / "adapter", None, lora_config, model_config=config, base_model="base",
                          expert_layout="per-expert")
    assert str(info.value) == ("--expert-layout per-expert: the adapter has ranks or alphas of its own on some "
                               "targets (rank_pattern/alpha_pattern), which PEFT's reading of per-expert adapters "
                               "replaces on the experts; export the fused layout")
    assert not (tmp_path / "adapter").exists()


@pytest.mark.slow
def test_a_run_says_at_its_start_which_adapters_peft_cannot_serve(moe_run_checkpoint, tmp_path, capsys):
    from flax import nnx

    from finetune.config import TrainConfig
    from finetune.train.build import setup

    jax_dir, data, _ = moe_run_checkpoint
    for targets, noted in (("q_proj,down_proj,experts.down_proj", True), (None, False)):
        options = {} if targets is None else {"targets": targets}
        config = TrainConfig(model=str(jax_dir), data=str(data), out=str(tmp_path / str(noted)), steps=1, batch_size=8,
                             seq_len=32, dtype="float32", progress=False, **options).validate()
        run = setup(config, devices=jax.devices()[:1])
        err = capsys.readouterr().err
        assert ("finetune-lora: note: LoRA targets down_proj: PEFT 0.21.2 attaches no adapter" in err) == noted
        adapted = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(run.state.lora)}
        assert any("experts.gate_up_proj.lora_a" in p for p in adapted) == (targets is None)
        # the adapter's line, against a count from the config: r x (in + out) a projection, the experts' E times
        c, r = run.llama, config.rank
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        attention = r * (c.hidden_size + q) + (0 if noted else r * (2 * (c.hidden_size + kv) + q + c.hidden_size))
        experts = c.num_experts * r * ((c.moe_intermediate_size + c.hidden_size) +
                                       (0 if noted else c.hidden_size + 2 * c.moe_intermediate_size))
        dense_down = r * (c.intermediate_size + c.hidden_size) if noted else 0  # layer 1 is dense, layer 0 sparse
        total = c.num_hidden_layers * attention + experts + dense_down
        held = 12 * total / 1e6  # float32 parameters and AdamW's two moments, all on the one device
        assert f"finetune-lora: adapter: {total:,} trainable parameters ({experts:,} of them on the routed experts); " \
               f"{held:,.1f} MB a device with their optimizer state" in err.splitlines()



@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_a_quantized_conversion_quantizes_each_expert_as_the_in_memory_model_does(tiny_qwen3_moe, tmp_path, scheme):
    """Every expert's part quantized as it streams (its codes and scales at its offset), the router unquantized."""
    from flax import nnx

    from jaxmodel.model import quantize_model
    from jaxmodel.quantization import Quantization

    convert(tiny_qwen3_moe, tmp_path / "jax", progress=False)
    convert(tiny_qwen3_moe, tmp_path / "q", quantize=scheme, quant_block=4, progress=False, verify=True)
    loaded = load_pretrained(tmp_path / "q")
    expected = quantize_model(load_pretrained(tmp_path / "jax"), Quantization(scheme, 4))
    got, want = ({".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
                 for m in (loaded, expected))
    assert set(got) == set(want)
    assert {"moe_layers.mlp.experts.gate_up_proj.codes", "moe_layers.mlp.experts.down_proj.scales",
            "moe_layers.mlp.gate.weight"} <= set(got) and "moe_layers.mlp.experts.down_proj.weight" not in got
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 32, (2, 12)), jnp.int32)
    plain = np.asarray(jax_logits(load_pretrained(tmp_path / "jax"), ids))
    quantized = np.asarray(jax_logits(loaded, ids))
    np.testing.assert_array_equal(quantized, np.asarray(jax_logits(expected, ids)))
    assert np.abs(quantized - plain).max() > 0


@pytest.mark.slow
def test_greedy_generation_through_the_kv_cache_equals_transformers(tiny_qwen3_moe, tmp_path):
    """Left-padded prompts on the sparse-dense-sparse model: the cache is written and read run by run."""
    from test_parity import left_padded_generations

    convert(tiny_qwen3_moe, tmp_path / "jax", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, experts_implementation="eager")
    np.testing.assert_array_equal(*left_padded_generations(hf, load_pretrained(tmp_path / "jax"), 32))


@pytest.mark.slow
@pytest.mark.slow
def test_two_processes_holding_the_experts_across_them_match_one_device(two_process_grads, moe_run_checkpoint):
    """fsdp=4 over 2 processes of 4 devices (mp=2 inside each): each expert on one device, the rows dispatched to
    it from the other process's devices and back over loopback."""
    assert_the_two_process_case_matches(two_process_grads, "moe", moe_run_checkpoint)


def assert_the_two_process_case_matches(two_process_grads, case: str, run_checkpoint):
    """tests/multihost_worker.py's `case`, computed on the same data and model as `run_checkpoint` (a converted
    checkpoint, its data file and the one-device loss and gradients), gives the one device's loss and gradients."""
    from test_context_parallel import assert_same

    jax_dir, data, reference = run_checkpoint
    assert (two_process_grads / "packed.jsonl").read_bytes() == data.read_bytes()
    files = sorted(p.relative_to(jax_dir) for p in jax_dir.rglob("*")
                   if p.is_file() and p.name != "jax_checkpoint.json")
    assert any(name.parts[0] == "params" for name in files)
    for name in files:  # the same model
        assert (two_process_grads / case / name).read_bytes() == (jax_dir / name).read_bytes(), name
    got = np.load(two_process_grads / f"{case}.npz")
    assert_same((float(got["loss"]), float(got["tokens"]), {k: got[k] for k in got.files if k not in ("loss",
                                                                                                     "tokens")}),
                reference)


def test_an_nf4_base_with_quantized_experts_trains_alike_on_a_mesh_and_one_device(moe_run_checkpoint, tmp_path):
    from test_context_parallel import assert_same, grads_on

    jax_dir, data, _ = moe_run_checkpoint
    convert(jax_dir.parent / "hf", tmp_path / "nf4", quantize="nf4", quant_block=16, progress=False)
    one = grads_on(tmp_path / "nf4", data, tmp_path / "one", "dp=1,fsdp=1,mp=1", jax.devices()[:1], attention="xla",
                   targets=MESH_TARGETS)
    assert all(np.isfinite(g).all() for g in one[2].values())
    assert_same(grads_on(tmp_path / "nf4", data, tmp_path / "mesh", "dp=1,fsdp=4,mp=2", jax.devices(),
                         attention="xla", targets=MESH_TARGETS), one)


def test_a_mesh_whose_fsdp_does_not_divide_the_experts_is_refused_in_one_line(tmp_path, capsys):
    from finetune.cli import main

    config = {"model_type": "mixtral", **SHAPE, "num_local_experts": 6, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["--plan", "--model-config", str(tmp_path / "config.json"), "--mesh", "dp=2,fsdp=4,mp=1",
                 "--batch-size", "8", "--seq-len", "16"]) != 0
    err = capsys.readouterr().err.strip()
    assert err == ("finetune-lora: error: --mesh fsdp=4 does not divide the model's 6 experts (num_experts): fsdp's "
                   "devices each hold an equal share of every sparse layer's experts; choose a mesh whose split "
                   "divides them (dp, cp or mp for the other devices)")


@pytest.mark.slow
def test_a_steps_collectives_do_not_grow_with_the_blocks_of_routed_rows(tmp_path, default_allocator):
    """Each device sorts and multiplies the rows routed to its own experts (fsdp's devices own them), their
    adapters' gradients summed once a layer over the devices that share the experts (dp's): four times the tokens
    (four times the blocks) run the same collectives."""
    from finetune import TrainConfig
    from finetune.planning.plan import plan

    config = {"model_type": "qwen3_moe", **SHAPE, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts": 8, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    counts = []
    for seq in (32, 128):
        report = plan(TrainConfig(plan=True, model_config=str(tmp_path / "config.json"), mesh="dp=2,fsdp=4,mp=1",
                                  batch_size=8, seq_len=seq, targets="q_proj,experts.gate_up_proj,experts.down_proj",
                                  dtype="float32").validate())  # one compile a plan (a 16-bit one compiles twice)
        counts.append({kind: total["count"] for kind, total in report.cost.collective_totals().items()})
    assert counts[0] == counts[1] and counts[0]["all-gather"] > 0


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "mixtral-8x22b"])
def test_fits_count_of_a_models_weights_is_the_plans_and_its_gathers_leave_the_experts_out(name):
    """--fit prunes a mesh by the frozen weights a device holds and bounds its time by the weights each layer
    gathers: every expert counted among the first (as the plan's model holds them), none among the second."""
    from finetune import TrainConfig
    from finetune.planning.fit import frozen_bytes

    path = Path(__file__).parent.parent / "bench" / "configs" / f"{name}-config.json"
    llama = ModelConfig.from_hf(path)
    stored, gathered = frozen_bytes(TrainConfig(plan=True, model_config=str(path)), llama)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    matmul = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    assert stored == 2 * matmul
    e, f, d = llama.num_experts, llama.moe_intermediate_size, llama.hidden_size
    assert gathered == pytest.approx((stored - 2 * 2 * llama.vocab_size * d) / llama.num_hidden_layers
                                     - 2 * 3 * e * f * d)
