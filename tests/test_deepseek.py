"""DeepSeek-V3 against transformers' own class (DeepseekV3ForCausalLM) on drawn configs: its multi-head latent attention
(the query bottleneck or none, latent ranks, query/key and value widths apart, YaRN with its attention factor and
softmax scale or plain RoPE, interleaved or rotate-half rotary pairs) and its mixtures of experts (dense first
layers, sigmoid routing with a selection bias over groups, renormalised or not, scaled, shared experts or none);
config.json read and written back; a grouping that cannot hold the experts refused in one line; training on the meshes
of the models with experts (and over two processes) as on one device, from a float32 and an FP8 base."""

import tempfile
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from converter import convert
from jaxmodel import ModelConfig, load_pretrained
from jaxmodel.config import ConfigError
from strategies import yarn_ropes
from test_moe_families import MOE_MESHES
from test_parity import f32_tolerance, hf_logits, jax_logits


@st.composite
def deepseek_configs(draw, max_layers: int = 2) -> dict:
    """A DeepSeek-V3 config: every latent-attention and routing switch drawn, dense layers first, then sparse."""
    heads = draw(st.sampled_from([1, 2, 4]))
    rope = draw(st.one_of(st.just({"rope_type": "default"}), yarn_ropes()))
    layers = draw(st.integers(1, max_layers))
    groups, per_group = draw(st.sampled_from([1, 2, 4])), draw(st.integers(2, 3))
    top_groups = draw(st.integers(1, groups))
    experts = {"n_routed_experts": groups * per_group, "n_group": groups, "topk_group": top_groups,
               "num_experts_per_tok": draw(st.integers(1, top_groups * per_group)),
               "moe_intermediate_size": draw(st.sampled_from([4, 10])), "n_shared_experts": draw(st.integers(1, 2)),
               "norm_topk_prob": draw(st.booleans()), "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5]))}
    return {**experts,
        "model_type": "deepseek_v3", "vocab_size": draw(st.integers(16, 100)),
        "hidden_size": heads * draw(st.sampled_from([4, 8, 12])), "intermediate_size": draw(st.integers(8, 48)),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": draw(st.sampled_from([None, 4, 12])), "kv_lora_rank": draw(st.sampled_from([4, 10])),
        "qk_nope_head_dim": draw(st.sampled_from([2, 6, 8])), "qk_rope_head_dim": draw(st.sampled_from([2, 4, 8])),
        "v_head_dim": draw(st.sampled_from([3, 8, 10])), "rope_interleave": draw(st.booleans()),
        "attention_bias": draw(st.booleans()), "first_k_dense_replace": draw(st.integers(0, layers)),
        "rope_parameters": {**rope, "rope_theta": draw(st.sampled_from([10000.0, 1e6]))},
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": draw(st.sampled_from([0.1, 0.2])),
        "tie_word_embeddings": draw(st.booleans()),
    }


def deepseek_model(config: dict, seed: int = 0) -> DeepseekV3ForCausalLM:
    """transformers' class, seeded, its routers' selection biases drawn too (they start at 0), its experts computed
    by the plain loop (its default CPU kernel refuses some small shapes)."""
    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in config.items() if k != "model_type"})).eval()
    hf.set_experts_implementation("eager")
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(hf.config.n_routed_experts))
    return hf


@settings(max_examples=20, deadline=None)
@given(config=deepseek_configs())
def test_configs_read_as_transformers_reads_them_and_write_back(config):
    ours = ModelConfig.from_hf(config)
    hf = DeepseekV3Config(**{k: v for k, v in config.items() if k != "model_type"})
    assert (ours.head_dim, ours.qk_head_dim, ours.v_head_dim, ours.q_lora_rank or None) == (
        hf.head_dim, hf.qk_head_dim, hf.v_head_dim, hf.q_lora_rank)
    with torch.device("meta"):
        sparse = tuple(hasattr(layer.mlp, "experts") for layer in DeepseekV3ForCausalLM(hf).model.layers)
    assert (ours.sparse_layers or (False,) * len(sparse)) == sparse
    assert ModelConfig.from_hf(hf.to_dict()) == ours
    written = ours.to_hf()
    assert written["architectures"] == ["DeepseekV3ForCausalLM"] and ModelConfig.from_hf(written) == ours


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(config=deepseek_configs(), seed=st.integers(0, 2**16), shape=st.tuples(st.integers(1, 3), st.integers(1, 40)))
def test_float32_logits_match_transformers(config, seed, shape):
    hf = deepseek_model(config, seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(Path(tmp) / "hf")
        convert(Path(tmp) / "hf", Path(tmp) / "jax", progress=False)
        model = load_pretrained(Path(tmp) / "jax")
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], shape)
    expected = hf_logits(hf, ids)
    assert np.abs(np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32))) - expected).max() <= \
        f32_tolerance(expected)


def test_the_blockwise_path_equals_the_plain_one():
    """Latent attention's keys and values (values padded to the query width) through the blockwise path."""
    config = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8,
              "kv_lora_rank": 8, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5,
              "first_k_dense_replace": 1, "initializer_range": 0.2}
    hf = deepseek_model(config)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(Path(tmp) / "hf")
        convert(Path(tmp) / "hf", Path(tmp) / "jax", progress=False)
        plain = load_pretrained(Path(tmp) / "jax")
        blockwise = load_pretrained(Path(tmp) / "jax", attention="blockwise")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 24)), jnp.int32)
    expected = np.asarray(plain(ids))
    np.testing.assert_allclose(np.asarray(blockwise(ids)), expected, atol=f32_tolerance(expected))


def test_greedy_generation_through_the_kv_cache_equals_transformers(tmp_path):
    """Left-padded prompts, YaRN and a value head wider than the queries' (the queries and keys padded in the
    cache): transformers caches the latents, this port each head's keys and values."""
    from test_parity import left_padded_generations

    config = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None,
              "kv_lora_rank": 8, "qk_nope_head_dim": 2, "qk_rope_head_dim": 4, "v_head_dim": 8,
              "first_k_dense_replace": 2, "initializer_range": 0.3, "max_position_embeddings": 64,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                  "mscale_all_dim": 0.5, "original_max_position_embeddings": 8}}
    hf = deepseek_model(config, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "jax", progress=False)
    ours, theirs = left_padded_generations(hf, load_pretrained(tmp_path / "jax"), 32)
    assert len(set(ours[:, 9:].reshape(-1).tolist())) > 2  # not one repeated token
    np.testing.assert_array_equal(ours, theirs)


def test_a_grouping_that_cannot_hold_the_experts_is_refused_in_one_line():
    config = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "first_k_dense_replace": 3,
              "n_routed_experts": 6, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
              "moe_intermediate_size": 8}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf(config)
    assert str(info.value) == ("n_group=4 must split the 6 experts into groups of 2 or more, of which topk_group=2 "
                               "(1 to n_group) hold at least num_experts_per_tok=2")


def test_a_bf16_run_keeps_the_router_and_its_selection_bias_in_float32(tmp_path):
    """As transformers does (`_keep_in_fp32_modules_strict`): the bias loaded exactly, the logits a float32 product
    of the bf16 hidden states."""
    import jax

    config = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "first_k_dense_replace": 0,
              "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
              "moe_intermediate_size": 8, "kv_lora_rank": 4, "q_lora_rank": None, "qk_nope_head_dim": 2,
              "qk_rope_head_dim": 2, "v_head_dim": 2}
    hf = deepseek_model(config)
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "jax", progress=False)
    model = load_pretrained(tmp_path / "jax", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    gate = model.moe_layers.mlp.gate
    assert model.embed_tokens.weight[...].dtype == jnp.bfloat16
    assert gate.weight[...].dtype == gate.e_score_correction_bias[...].dtype == jnp.float32
    bias = hf.model.layers[0].mlp.gate.e_score_correction_bias.numpy()
    np.testing.assert_array_equal(np.asarray(gate.e_score_correction_bias[...])[0], bias)
    assert (bias.astype(jnp.bfloat16).astype(np.float32) != bias).any()  # bf16 would have moved it
    x = jax.random.normal(jax.random.key(0), (3, 16), jnp.bfloat16)
    one = jax.tree.map(lambda v: v[0], nnx.state(gate))
    logits = nnx.merge(nnx.graphdef(gate), one)(x)
    assert logits.dtype == jnp.float32
    # float32 to its summation order (a bf16 product would be ~1e-3 off)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(x, np.float32) @ np.asarray(gate.weight[...][0]).T,
                               rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [8, None])
def test_the_default_adapter_serves_in_peft_with_equal_logits_and_gradients(q_lora_rank, tmp_path):
    """The default targets on DeepSeek-V3: latent attention's projections (q_proj without a query bottleneck) and
    the routed experts, as PEFT names them on DeepseekV3ForCausalLM; the exported adapter read back bit for bit."""
    from finetune.config import TrainConfig
    from jaxmodel.formats.peft_adapter import save_peft_adapter
    from jaxmodel.layers import LoRAParam
    from jaxmodel.lora import apply_lora
    from test_moe_families import _random_adapters, assert_serves_in_peft

    config = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "first_k_dense_replace": 1,
              "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
              "moe_intermediate_size": 8, "kv_lora_rank": 6, "q_lora_rank": q_lora_rank, "qk_nope_head_dim": 4,
              "qk_rope_head_dim": 2, "v_head_dim": 4, "initializer_range": 0.2}
    deepseek_model(config).save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "jax", progress=False)
    base = load_pretrained(tmp_path / "jax")
    lora_config = TrainConfig(model="m", data="d", rank=2, alpha=6.0).lora_config(base.config)
    queries = ("q_a_proj", "q_b_proj") if q_lora_rank else ("q_proj",)
    assert lora_config.targets == (*queries, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts.gate_up_proj",
                                   "experts.down_proj")
    model = apply_lora(base, lora_config, rngs=nnx.Rngs(0))
    _random_adapters(model)
    save_peft_adapter(tmp_path / "adapter", nnx.state(model, LoRAParam), lora_config, model_config=model.config,
                      base_model=str(tmp_path / "hf"))
    _, ours = assert_serves_in_peft(model, tmp_path / "hf", tmp_path / "adapter", tmp_path / "jax")
    assert any("kv_b_proj" in k for k in ours) and any(".experts." in k for k in ours)


def test_the_shared_experts_and_dense_mlps_adapters_peft_cannot_attach_are_named():
    """PEFT 0.21.2 takes gate_proj/up_proj/down_proj on DeepseekV3ForCausalLM for the routed experts: an adapter on
    the shared experts or a dense layer's MLP is refused for PEFT export (export-peft names them in one line)."""
    from jaxmodel.formats.peft_adapter import unservable_targets
    from jaxmodel.lora import LoraConfig

    config = ModelConfig.from_hf({"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16,
                                  "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
                                  "num_key_value_heads": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
                                  "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 8})
    lora = LoraConfig(targets=("q_a_proj", "kv_b_proj", "up_proj", "down_proj", "experts.down_proj"))
    assert unservable_targets(lora, config) == ["down_proj", "up_proj"]


DEEPSEEK_V3 = Path(__file__).parent / "data" / "deepseek-v3-config.json"  # the published config.json


def test_flops_per_token_count_latent_attention_the_active_and_shared_experts_and_the_dense_layers():
    """4N + 6·L·T·heads·(qk + v): N the weights a token goes through, counted from transformers' own modules."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.step.flops import flops_per_token

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEEPSEEK_V3))
    config = ModelConfig.from_hf(DEEPSEEK_V3)
    n = hf.lm_head.weight.numel()
    for layer in hf.model.layers:
        n += sum(p.numel() for name, p in layer.self_attn.named_parameters() if "norm" not in name)
        if hasattr(layer.mlp, "experts"):
            per_expert = layer.mlp.experts.gate_up_proj[0].numel() + layer.mlp.experts.down_proj[0].numel()
            n += layer.mlp.gate.weight.numel() + 8 * per_expert + sum(
                p.numel() for p in layer.mlp.shared_experts.parameters())
        else:
            n += sum(p.numel() for p in layer.mlp.parameters())
    attention = 61 * 2048 * 128 * (192 + 128)
    assert flops_per_token(config, 2048) == 4 * n + 6 * attention
    assert round(n / 1e9) == 37  # DeepSeek-V3's 37B activated parameters


def test_fits_count_of_deepseeks_weights_is_transformers_and_its_gathers_leave_the_routed_experts_out():
    """--fit's frozen bytes: bf16 weights, the float32 routers; a layer gathers its attention, router and shared
    experts (or its dense MLP), not its routed experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune import TrainConfig
    from finetune.planning.fit import frozen_bytes

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEEPSEEK_V3))
    config = ModelConfig.from_hf(DEEPSEEK_V3)
    stored, gathered = frozen_bytes(TrainConfig(plan=True, model_config=str(DEEPSEEK_V3)), config)
    routers = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("mlp.gate.weight"))
    matmul = sum(p.numel() for n, p in hf.named_parameters() if "norm" not in n)
    assert stored == 2 * (matmul - routers) + 4 * routers
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    embeddings = 2 * 2 * 129280 * 7168
    assert gathered == pytest.approx((stored - embeddings - 2 * routed) / 61)


# ----------------------------------------------------------------------------------------------------
# training on meshes


@pytest.fixture(scope="module")
def deepseek_run_checkpoint(tmp_path_factory):
    """tests/tiny_moe.py's tiny DeepSeek-V3 with a tokenizer, converted, the packed rows of the mesh tests, and the
    loss and LoRA gradients of one plain device."""
    from test_moe_families import mesh_run_checkpoint
    from tiny_moe import DEEPSEEK_MESH_TARGETS, TINY_DEEPSEEK

    return mesh_run_checkpoint(tmp_path_factory.mktemp("deepseek-run"), TINY_DEEPSEEK, DEEPSEEK_MESH_TARGETS)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, options", MOE_MESHES)
def test_same_loss_and_lora_grads_on_a_mesh_as_one_plain_device(tmp_path, deepseek_run_checkpoint, mesh, options):
    """Latent attention split over cp and mp, the routed experts over fsdp, the shared expert and dense layer's MLP
    over mp: every adapter's gradient and the loss as on one device."""
    import jax
    from test_context_parallel import assert_same, grads_on
    from tiny_moe import DEEPSEEK_MESH_TARGETS

    jax_dir, data, reference = deepseek_run_checkpoint
    for name in ("q_a_proj", "kv_b_proj", "o_proj", "shared_experts.down_proj", "layers.mlp.gate_proj",
                 "experts.gate_up_proj", "experts.down_proj"):
        assert any(name in key for key in reference[2]), name
    assert_same(grads_on(jax_dir, data, tmp_path / "mesh", mesh, jax.devices(), targets=DEEPSEEK_MESH_TARGETS,
                         **options), reference)


@pytest.mark.slow
@pytest.mark.parametrize("fp8_matmul", ["off", "e4m3fnuz"])
def test_an_fp8_base_split_over_a_mesh_trains_as_on_one_device(deepseek_run_checkpoint, tmp_path, fp8_matmul):
    """Codes and block scales of every latent projection and expert cut at whole blocks over fsdp and mp; dequantized,
    or multiplied in FP8 (`--fp8-matmul`: the experts' blocks of rows inside the dispatch's shard_map too)."""
    import jax
    from test_context_parallel import assert_same, grads_on
    from tiny_moe import DEEPSEEK_MESH_TARGETS

    jax_dir, data, _ = deepseek_run_checkpoint
    convert(jax_dir.parent / "hf", tmp_path / "fp8", quantize="fp8", quant_block=16, progress=False)
    one = grads_on(tmp_path / "fp8", data, tmp_path / "one", "dp=1,fsdp=1,mp=1", jax.devices()[:1], attention="xla",
                   targets=DEEPSEEK_MESH_TARGETS, fp8_matmul=fp8_matmul)
    if fp8_matmul != "off":  # the run did multiply in FP8
        assert one[0] != grads_on(tmp_path / "fp8", data, tmp_path / "plain", "dp=1,fsdp=1,mp=1", jax.devices()[:1],
                                  attention="xla", targets=DEEPSEEK_MESH_TARGETS)[0]
    # In FP8 an activation that float32 sums in another order move across a rounding boundary takes the next code,
    # 2^-4 of it away: a few gradient values moved by up to 3.3e-5 of their largest (fp8_matmul.py's docstring).
    assert_same(grads_on(tmp_path / "fp8", data, tmp_path / "mesh", "dp=1,fsdp=4,mp=2", jax.devices(),
                         attention="xla", targets=DEEPSEEK_MESH_TARGETS, fp8_matmul=fp8_matmul), one,
                tolerance=1e-5 if fp8_matmul == "off" else 1e-4)


@pytest.mark.slow
def test_two_processes_holding_the_experts_across_them_match_one_device(two_process_grads, deepseek_run_checkpoint):
    """fsdp=4 over 2 processes of 4 devices (mp=2 inside each): two routed experts a device, the rows dispatched to
    them from the other process's devices and back over loopback."""
    from test_moe_families import assert_the_two_process_case_matches

    assert_the_two_process_case_matches(two_process_grads, "deepseek", deepseek_run_checkpoint)
