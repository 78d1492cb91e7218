"""Mixture-of-experts parts (jaxmodel/moe.py): the router's choice as transformers makes it, the grouped matmuls
each row times its own expert's weight, the experts' MLPs equal to transformers' sparse blocks (Qwen3-MoE,
Mixtral) and to a float64 computation, the "blocks" path's gradients the dense reference's, and its work the
routed rows, not every expert's."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmodel.moe import (GROUPED_MATMULS, combine, group_rows, grouped_matmul, grouped_sigmoid_route, padded_rows,
                          reference_experts, route, routed_experts)


def _routing(rng, t, e, k):
    """`k` distinct experts of `e` for each of `t` tokens, and weights summing to 1."""
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32) + 0.1
    return weights / weights.sum(-1, keepdims=True), experts


def _transformers_block(family, normalize=False):
    """transformers' sparse block (eager experts, top-3 of 6) with random weights, and the ModelConfig of ours."""
    import transformers

    from jaxmodel import ModelConfig

    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        config = transformers.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=12, num_experts=6,
                                             num_experts_per_tok=3, norm_topk_prob=normalize)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        config = transformers.MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=6,
                                            num_experts_per_tok=3)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Block(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=3,
                       moe_intermediate_size=12, norm_topk_prob=normalize or family == "mixtral",
                       round_router_weights=family == "qwen3_moe")
    return block, ours


@pytest.mark.parametrize("normalize", [False, True])
def test_route_is_transformers_router(normalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=normalize)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=1.0)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, expected_weights, expected_experts = router(x)
    weights, experts = route(jnp.asarray(logits.numpy()), 3, normalize)
    np.testing.assert_array_equal(np.asarray(experts), expected_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), expected_weights.numpy(), rtol=1e-6)
    assert np.allclose(np.asarray(weights).sum(-1), 1.0) == normalize


@settings(max_examples=20, deadline=None)
@given(groups=st.sampled_from([1, 2, 4]), per_group=st.integers(2, 4), data=st.data(), normalize=st.booleans(),
       scale=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2**16))
def test_grouped_sigmoid_route_is_deepseek_v3s_router(groups, per_group, data, normalize, scale, seed):
    """Sigmoid scores, a selection bias that moves which experts are chosen (not their weights), the best
    `top_groups` groups by the sum of their two best biased scores, the top-k within them, renormalised and scaled:
    transformers' `DeepseekV3TopkRouter` (the experts as sets: it does not sort them)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    top_groups = data.draw(st.integers(1, groups))
    k = data.draw(st.integers(1, top_groups * per_group))
    e = groups * per_group
    config = DeepseekV3Config(hidden_size=16, n_routed_experts=e, num_experts_per_tok=k, n_group=groups,
                              topk_group=top_groups, norm_topk_prob=normalize, routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, 16, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(e, generator=generator))
        logits, expected_weights, expected_experts = router(torch.randn(20, 16, generator=generator))
    weights, experts = grouped_sigmoid_route(jnp.asarray(logits.numpy()), jnp.asarray(
        router.e_score_correction_bias.numpy()), k, groups, top_groups, normalize, scale)
    weights, experts = np.asarray(weights), np.asarray(experts)
    order, expected_order = np.argsort(experts, axis=1), np.argsort(expected_experts.numpy(), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(experts, order, 1),
                                  np.take_along_axis(expected_experts.numpy(), expected_order, 1))
    np.testing.assert_allclose(np.take_along_axis(weights, order, 1),
                               np.take_along_axis(expected_weights.numpy(), expected_order, 1), rtol=1e-6)


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 12), e=st.integers(1, 9), k=st.integers(1, 4), block=st.sampled_from([1, 3, 8]),
       one_expert=st.booleans(), seed=st.integers(0, 2**16))
def test_each_grouped_matmul_is_each_row_times_its_experts_weight(t, e, k, block, one_expert, seed):
    """Every way, routings with experts left empty and with all rows on one expert (the most padding a block)."""
    rng = np.random.default_rng(seed)
    k = min(k, e)
    _, experts = _routing(rng, t, e, k)
    if one_expert:
        experts[:, 0] = e - 1
        experts[:, 1:] = np.arange(k - 1)  # distinct from e - 1 when k <= e
    rows = group_rows(jnp.asarray(experts), e)
    assert np.all(np.diff(np.asarray(rows.expert_a)) >= 0)
    assert np.asarray(rows.group_sizes).tolist() == np.bincount(experts.reshape(-1), minlength=e).tolist()
    x = rng.standard_normal((t * k, 5)).astype(np.float32)
    w = rng.standard_normal((e, 7, 5)).astype(np.float32)
    expected = np.einsum("ai,aoi->ao", x.astype(np.float64), w[np.asarray(rows.expert_a)].astype(np.float64))
    for impl in GROUPED_MATMULS:
        got = jax.jit(grouped_matmul, static_argnums=(3, 4))(jnp.asarray(x), jnp.asarray(w), rows, impl, block)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=impl)


def test_the_padded_length_holds_the_worst_routing():
    """One row on each of e experts pads every expert to a whole block: the static length has room for it."""
    e, block = 5, 4
    rows = group_rows(jnp.arange(e, dtype=jnp.int32)[:, None], e)
    x = jnp.ones((e, 3))
    w = jnp.arange(e * 2 * 3, dtype=jnp.float32).reshape(e, 2, 3)
    assert padded_rows(e, e, block) == e * block and padded_rows(3, 8, 4) == 12
    np.testing.assert_array_equal(grouped_matmul(x, w, rows, "blocks", block), w.sum(-1))


@pytest.mark.parametrize("rows, experts, block", [
    (32768, 32, 256),  # DeepSeek-V3 at 16 x 2048 on fsdp=8: a pass's room (2 x 2048 tokens x 8) over 32 experts
    (1536, 3, 128), (1535, 3, 64), (2**20, 1, 256), (96, 4, 64), (5, 8, 64)])
def test_a_block_is_a_quarter_of_an_experts_average_rows_as_a_power_of_two_within_bounds(rows, experts, block):
    """block_rows, and the "blocks" loop's length by default: the rows' padded length in blocks of that many."""
    from jaxprs import count_eqns

    from jaxmodel.moe import block_rows

    assert block_rows(rows, experts) == block
    if rows <= 2048:
        x, w = jnp.ones((rows, 2)), jnp.ones((experts, 3, 2))
        grouped = group_rows(jnp.arange(rows, dtype=jnp.int32)[:, None] % experts, experts)
        n = padded_rows(rows, experts, block) // block
        jaxpr = jax.make_jaxpr(grouped_matmul)(x, w, grouped).jaxpr
        assert count_eqns(jaxpr, lambda e: e.primitive.name == "scan" and e.params["length"] == n) == 1


def test_combine_weights_each_tokens_rows_and_sums_them():
    weights, experts = np.array([[0.75, 0.25], [0.5, 0.5]], np.float32), np.array([[2, 0], [0, 1]], np.int32)
    rows = group_rows(jnp.asarray(experts), 3)
    assert np.asarray(rows.expert_a).tolist() == [0, 0, 1, 2] and np.asarray(rows.token_a).tolist() == [0, 1, 1, 0]
    y = jnp.asarray([[1.0], [2.0], [3.0], [4.0]])  # sorted rows: (token 0, e0), (1, e0), (1, e1), (0, e2)
    np.testing.assert_allclose(np.asarray(combine(y, rows, jnp.asarray(weights))), [[0.75 * 4 + 0.25 * 1],
                                                                                     [0.5 * 2 + 0.5 * 3]])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routed_experts_equal_transformers_sparse_block_and_float64(family):
    """The block's output on random float32 weights: router, the k experts' MLPs, the weighted sum (transformers'
    eager experts; top-3 of 6, Qwen3-MoE without renormalising)."""
    block, _ = _transformers_block(family)
    x = torch.randn(2, 10, 16)
    with torch.no_grad():
        expected = block(x).numpy().reshape(20, 16)
    router, gate_up, down = (p.detach().numpy() for p in (block.gate.weight, block.experts.gate_up_proj,
                                                          block.experts.down_proj))
    x_td = x.numpy().reshape(20, 16)
    weights, experts = route(jnp.asarray(x_td @ router.T), 3, family == "mixtral")
    exact = reference_experts(x_td, np.asarray(weights), np.asarray(experts), gate_up, down)
    scale = np.abs(exact).max()
    assert np.abs(expected - exact).max() <= 1e-5 * scale
    for impl in GROUPED_MATMULS:
        got = jax.jit(routed_experts, static_argnums=(5, 6, 7))(jnp.asarray(x_td), weights, experts,
                                                                jnp.asarray(gate_up), jnp.asarray(down), "silu",
                                                                impl, 4)
        assert np.abs(np.asarray(got) - exact).max() <= 1e-5 * scale, impl


def test_the_blocks_gradients_are_the_dense_references():
    """Of the tokens, the router's weights and both experts' weights: what a LoRA on the experts and the layers
    below it are trained by."""
    rng = np.random.default_rng(1)
    t, e, k, d, f = 11, 5, 2, 6, 4
    weights, experts = _routing(rng, t, e, k)
    args = [jnp.asarray(a) for a in (rng.standard_normal((t, d)), weights, experts, rng.standard_normal((e, 2 * f, d)),
                                     rng.standard_normal((e, d, f)))]
    args = [a.astype(jnp.float32) if a.dtype == jnp.float64 else a for a in args]
    cotangent = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)

    def grads(impl):
        loss = lambda x, w, gu, dn: jnp.sum(routed_experts(x, w, args[2], gu, dn, "silu", impl, 3) * cotangent)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(args[0], args[1], args[3], args[4])

    for got, want in zip(grads("blocks"), grads("dense")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_blocks_work_is_the_routed_rows_and_the_dense_work_every_experts():
    """The compiled matmuls' FLOPs, each loop's body counted as often as it runs (the plan's count,
    finetune/planning/hlo_cost.py): the blocks path's within its padded rows, the dense one's e x."""
    from finetune.planning.hlo_cost import step_cost

    t, e, k, block, i, o = 64, 16, 2, 8, 32, 48
    experts = jnp.asarray(_routing(np.random.default_rng(2), t, e, k)[1])
    rows = group_rows(experts, e)
    x, w = jnp.ones((t * k, i)), jnp.ones((e, o, i))

    def flops(impl):
        compiled = jax.jit(grouped_matmul, static_argnums=(3, 4)).lower(x, w, rows, impl, block).compile()
        return step_cost(compiled.as_text(), devices=1).flops

    routed = 2 * t * k * i * o
    assert routed <= flops("blocks") <= 2 * padded_rows(t * k, e, block) * i * o * 1.05
    assert flops("dense") >= e * routed


@pytest.mark.parametrize("family, normalize", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
@pytest.mark.parametrize("grouped", ["blocks", "ragged"])
def test_the_sparse_block_module_equals_transformers(family, normalize, grouped):
    from flax import nnx

    from jaxmodel.moe import SparseMoeBlock

    block, config = _transformers_block(family, normalize)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x).numpy()
    ours = SparseMoeBlock(config, layers=None, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                          grouped=grouped, block=4)
    ours.gate.weight.set_value(jnp.asarray(block.gate.weight.detach().numpy()))
    ours.experts.gate_up_proj.weight.set_value(jnp.asarray(block.experts.gate_up_proj.detach().numpy()))
    ours.experts.down_proj.weight.set_value(jnp.asarray(block.experts.down_proj.detach().numpy()))
    got = np.asarray(nnx.jit(lambda m, x: m(x)[0])(ours, jnp.asarray(x.numpy())))
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("fields, message", [
    (dict(num_experts_per_tok=7), "num_experts_per_tok=7 must be between 1 and num_experts=6"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0 must be between 1 and num_experts=6"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0 must be a positive integer"),
])
def test_an_impossible_expert_config_is_refused_naming_its_field(fields, message):
    from jaxmodel import ModelConfig
    from jaxmodel.config import ConfigError

    values = dict(vocab_size=8, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12)
    with pytest.raises(ConfigError, match=f"^{message}$"):
        ModelConfig(**{**values, **fields})


@pytest.mark.parametrize("grouped", GROUPED_MATMULS)
def test_an_experts_lora_adds_its_own_experts_low_rank_delta_on_each_row(grouped):
    from flax import nnx

    from jaxmodel.layers import LoRAParam
    from jaxmodel.moe import GroupedLinear

    rng = np.random.default_rng(3)
    t, e, k, i, o, r, scale = 12, 5, 2, 6, 7, 3, 1.5
    weights, experts = _routing(rng, t, e, k)
    rows = group_rows(jnp.asarray(experts), e)
    x = rng.standard_normal((t * k, i)).astype(np.float32)
    linear = GroupedLinear(e, i, o, axes=("mlp", "embed"), layers=None, dtype=jnp.float32, param_dtype=jnp.float32,
                           rngs=nnx.Rngs(0), grouped=grouped, block=4)
    w, a, b = rng.standard_normal((e, o, i)), rng.standard_normal((e, r, i)), rng.standard_normal((e, o, r))
    linear.weight.set_value(jnp.asarray(w, jnp.float32))
    linear.lora_a, linear.lora_b = LoRAParam(jnp.asarray(a, jnp.float32)), LoRAParam(jnp.asarray(b, jnp.float32))
    linear.lora_scale = scale
    got = np.asarray(linear(jnp.asarray(x), rows))
    expert_a = np.asarray(rows.expert_a)
    expected = np.stack([x[j] @ (w[ex] + scale * b[ex] @ a[ex]).T for j, ex in enumerate(expert_a)])
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("base", [True, False])
def test_an_experts_lora_trains_alike_in_the_blocks_one_pass_and_the_dense_reference(base):
    """The blocks path takes the weight's and the adapter's products in one pass over the rows (`base` False: the
    adapter alone, beside an FP8 base's own pass); its gradients of the rows and of each expert's A and B, several
    blocks an expert, are those of the dense path's three separate products."""
    from jaxmodel.moe import ExpertAdapter

    rng = np.random.default_rng(4)
    t, e, k, i, o, r, scale = 40, 3, 2, 6, 7, 2, 1.5
    rows = group_rows(jnp.asarray(_routing(rng, t, e, k)[1]), e)
    x, w, a, b = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                  for shape in ((t * k, i), (e, o, i), (e, r, i), (e, o, r)))
    cotangent = jnp.asarray(rng.standard_normal((t * k, o)), jnp.float32)

    def grads(impl):
        def loss(x, a, b):
            y = grouped_matmul(x, w if base else None, rows, impl, 4, ExpertAdapter(a, b, scale))
            return jnp.sum(y * cotangent)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, a, b)

    assert np.asarray(rows.group_sizes).min() > 2 * 4  # each expert's rows in several blocks
    for got, want in zip(grads("blocks"), grads("dense")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_a_quantized_experts_adapter_trains_alike_in_the_blocks_one_pass_and_the_dense_reference(scheme):
    """An NF4 or int8 base's experts with an adapter (the adapter inside the dequantized matmul's remat): each row
    is its expert's dequantized weight plus its low-rank delta, and the blocks path's gradients of the rows, A and B
    are the dense path's."""
    from flax import nnx

    from jaxmodel.layers import LoRAParam
    from jaxmodel.moe import GroupedLinear
    from jaxmodel.quantization import Quantization, dequantize, quantize

    rng = np.random.default_rng(5)
    t, e, k, i, o, r = 40, 3, 2, 8, 6, 2
    rows = group_rows(jnp.asarray(_routing(rng, t, e, k)[1]), e)
    quantization = Quantization(scheme, 4)
    layer = GroupedLinear(e, i, o, axes=("mlp", "embed"), layers=None, dtype=jnp.float32, param_dtype=jnp.float32,
                          rngs=nnx.Rngs(0), block=4, quantization=quantization)
    codes, scales = quantize(rng.standard_normal((e, o, i)), quantization)
    layer.codes.set_value(jnp.asarray(codes))
    layer.scales.set_value(jnp.asarray(scales))
    layer.lora_a = LoRAParam(jnp.asarray(rng.standard_normal((e, r, i)), jnp.float32))
    layer.lora_b = LoRAParam(jnp.asarray(rng.standard_normal((e, o, r)), jnp.float32))
    layer.lora_scale = 1.5
    x = jnp.asarray(rng.standard_normal((t * k, i)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((t * k, o)), jnp.float32)

    def run(grouped):
        layer.grouped = grouped
        graphdef, adapter, frozen = nnx.split(layer, LoRAParam, ...)

        def loss(adapter, x):
            return jnp.sum(nnx.merge(graphdef, adapter, frozen)(x, rows) * cotangent)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(adapter, x)

    (got_loss, got), (want_loss, want) = run("blocks"), run("dense")
    w = np.asarray(dequantize(jnp.asarray(codes), jnp.asarray(scales), quantization, jnp.float32))
    a, b, xs = np.asarray(layer.lora_a[...]), np.asarray(layer.lora_b[...]), np.asarray(x)
    y = np.stack([xs[j] @ (w[ex] + 1.5 * b[ex] @ a[ex]).T for j, ex in enumerate(np.asarray(rows.expert_a))])
    np.testing.assert_allclose(float(got_loss), float(np.sum(y * np.asarray(cotangent))), rtol=1e-5)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for got_grad, want_grad in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), rtol=1e-5,
                                   atol=1e-5 * np.abs(want_grad).max())


def _experts_with_adapters(e, k, d, f, seed):
    """An `Experts` of `e` random experts (hidden `d`, intermediate `f`, `k` a token) with random LoRA adapters."""
    from flax import nnx

    from jaxmodel import ModelConfig
    from jaxmodel.layers import LoRAParam
    from jaxmodel.moe import Experts

    config = ModelConfig(vocab_size=8, hidden_size=d, intermediate_size=2 * f, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=d // 2, num_experts=e,
                         num_experts_per_tok=k, moe_intermediate_size=f)
    experts = Experts(config, layers=None, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(seed), block=4)
    key = jax.random.key(seed)
    for linear in (experts.gate_up_proj, experts.down_proj):
        _, out, inp = linear.weight_shape
        key, ka, kb = jax.random.split(key, 3)
        linear.lora_a = LoRAParam(jax.random.normal(ka, (e, 2, inp)), axes=("experts", "lora_rank", "embed"))
        linear.lora_b = LoRAParam(jax.random.normal(kb, (e, out, 2)), axes=("experts", "mlp", "lora_rank"))
        linear.lora_scale = 0.5
    return experts


@pytest.mark.slow
@pytest.mark.parametrize("mesh, e, k, skewed", [
    ("dp=2,fsdp=4,cp=1,mp=1", 8, 3, False),  # two experts a device, fewer than a token's
    ("dp=1,fsdp=8,cp=1,mp=1", 8, 2, True),  # one a device; every token to experts 0 and 1: the worst routing
    ("dp=1,fsdp=2,cp=2,mp=2", 4, 2, True),  # mp taking part of each device's tokens, cp's devices alike
    ("dp=1,fsdp=4,cp=1,mp=2", 12, 4, False),
])
def test_experts_held_by_fsdps_devices_give_the_outputs_and_gradients_of_one_device(mesh, e, k, skewed):
    """The experts split over fsdp, the tokens dispatched to their owners and back: every row reaches its experts
    (none dropped under the worst routing) and the outputs and the gradients for the hidden states, the router's
    weights and the adapters are those of one device."""
    from flax import nnx

    from finetune.step.mesh import make_mesh
    from jaxmodel.moe import expert_axes
    from jaxmodel.sharding import DEFAULT_RULES, named_sharding

    t, d, f = 64, 8, 6
    rng = np.random.default_rng(7)
    weights, experts_tk = _routing(rng, t, e, k)
    if skewed:
        experts_tk = np.tile(np.arange(k, dtype=np.int32), (t, 1))
    x = rng.standard_normal((t, d)).astype(np.float32)
    experts = _experts_with_adapters(e, k, d, f, seed=1)
    graphdef, frozen, lora = nnx.split(experts, nnx.Param, ...)

    def loss(lora, frozen, x, weights):
        y = nnx.merge(graphdef, frozen, lora)(x, weights, jnp.asarray(experts_tk))
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

    grad = jax.grad(loss, argnums=(0, 2, 3), has_aux=True)
    (one_lora, one_x, one_w), one_y = jax.jit(grad)(lora, frozen, jnp.asarray(x), jnp.asarray(weights))

    device_mesh = make_mesh(mesh)
    assert expert_axes(device_mesh, DEFAULT_RULES, e) == ("fsdp",)

    def place(state):
        return jax.tree.map(lambda v: v.replace(jax.device_put(v[...], named_sharding(
            v.get_metadata()["axes"], v.shape, device_mesh))), state, is_leaf=lambda v: isinstance(v, nnx.Variable))

    with jax.set_mesh(device_mesh):
        rows = named_sharding(("act_batch", None), (t, 1), device_mesh)
        placed_lora, placed_frozen = place(lora), place(frozen)
        assert placed_frozen["gate_up_proj"]["weight"][...].sharding.spec[0] == "fsdp"
        (got_lora, got_x, got_w), got_y = jax.jit(grad)(placed_lora, placed_frozen, jax.device_put(x, rows),
                                                        jax.device_put(weights, rows))
    for got, expected in [(got_y, one_y), (got_x, one_x), (got_w, one_w),
                          *zip(jax.tree.leaves(got_lora), jax.tree.leaves(one_lora))]:
        got, expected = np.asarray(got), np.asarray(expected)
        assert np.abs(expected).max() > 0
        np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


@pytest.mark.parametrize("tokens, k, e, ways, block", [(64, 2, 8, 1, 4), (64, 2, 8, 1, 64), (32, 8, 128, 8, 4),
                                                        (96, 2, 8, 8, 16), (40, 3, 6, 2, 8), (2048, 2, 8, 1, None),
                                                        (1024, 2, 8, 2, None)])
def test_the_balanced_share_of_blocks_is_what_a_balanced_routing_runs(tokens, k, e, ways, block):
    """A routing that gives every expert the same rows (token j to experts jk, ..., jk + k - 1 mod e), laid out for
    the first device's experts as the dispatch lays it: the share of its blocks that hold rows (in the blocks the
    grouped matmul takes by default where `block` is None)."""
    from jaxmodel.moe import _block_layout, balanced_block_share, block_rows, dispatch_bounds

    gathered, held = ways * tokens, e // ways
    experts_tk = (np.arange(gathered)[:, None] * k + np.arange(k)) % e
    assert (np.bincount(experts_tk.ravel(), minlength=e) == gathered * k // e).all()
    bound = dispatch_bounds(tokens, k, held, ways)[0] if ways > 1 else None
    assert ways == 1 or held * gathered * k // e <= bound  # within the first bound: the dispatch takes it
    rows = group_rows(jnp.asarray(experts_tk, jnp.int32), held, 0, bound)
    _, block_expert, used = _block_layout(rows, block or block_rows(rows.expert_a.shape[0], held))
    assert balanced_block_share(tokens, k, e, ways, block) == int(used) / block_expert.shape[0]


@pytest.mark.parametrize("mesh", [None, "dp=1,fsdp=8,cp=1,mp=1"])
def test_under_dots_the_experts_keep_their_products_alone_and_under_expert_parallelism_nothing_bound_sized(mesh):
    """What a layer remat'ed with `dots` keeps of its experts for the backward pass (jax's saved residuals). One
    device: the projections' products, named as a Linear's (unnamed, the backward computed the experts' forward
    again). Experts owned by fsdp's devices: nothing as large as the dispatch's bound, only the gathered tokens."""
    import contextlib
    import io

    import jax.ad_checkpoint
    from flax import nnx

    from finetune.step.mesh import make_mesh
    from jaxmodel.model import REMAT_POLICIES
    from jaxmodel.moe import dispatch_bounds
    from jaxmodel.sharding import named_sharding

    t, e, k, d, f = 1024, 8, 2, 16, 64
    experts = _experts_with_adapters(e, k, d, f, seed=0)
    graphdef, frozen, lora = nnx.split(experts, nnx.Param, ...)
    rng = np.random.default_rng(0)
    weights, experts_tk = _routing(rng, t, e, k)
    args = [lora, jnp.asarray(rng.standard_normal((t, d)), jnp.float32), jnp.asarray(weights),
            jnp.asarray(experts_tk)]

    def layer(lora, x, weights, experts_tk):
        return jnp.sin(nnx.merge(graphdef, frozen, lora)(x, weights, experts_tk))

    remat = jax.checkpoint(layer, policy=REMAT_POLICIES["dots"])

    def saved(*args):  # (shape, where from) of each residual, as jax prints them
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(remat, *args)
        found = [re.match(r"\w+\[([\d,]*)\] (.*)", line).groups() for line in out.getvalue().splitlines()]
        return [(tuple(int(n) for n in shape.split(",") if n), source) for shape, source in found]

    if mesh is None:
        named = [shape for shape, source in saved(*args) if "named 'dot'" in source]
        assert (t * k, 2 * f) in named and (t * k, d) in named  # gate_up's and down's products
        return
    device_mesh = make_mesh(mesh)
    with jax.set_mesh(device_mesh):
        rows = named_sharding(("act_batch", None), (t, 1), device_mesh)
        args = [args[0], *(jax.device_put(a, rows) for a in args[1:])]
        residuals = saved(*args)
    per_device = t // 8
    capacity, _ = dispatch_bounds(per_device, k, e // 8, 8)
    largest = max(math.prod(shape) for shape, _ in residuals) // 8  # per device
    gathered = 8 * per_device * d  # a device's view of the layer's tokens
    assert largest <= gathered < capacity * 2 * f  # never the rows


@pytest.mark.slow
def test_a_routing_past_the_capacity_runs_in_passes_never_with_room_for_the_worst_case():
    """fsdp=8 holding two of 16 experts each, 2 a token: a device can receive 8x what a balanced routing sends it, so
    the worst case takes 4 passes of the capacity's rows; the step's temporaries stay below four gate_up products of
    the worst case's rows (room for the worst case at once, as the dispatch had it, took 6.7 of them here; passes
    3.2)."""
    from flax import nnx

    from finetune.step.mesh import make_mesh
    from jaxmodel.moe import dispatch_bounds
    from jaxmodel.sharding import named_sharding

    t, e, k, d, f = 512, 16, 2, 8, 256
    per_device = t // 8
    capacity, worst = dispatch_bounds(per_device, k, e // 8, 8)
    assert worst == 4 * capacity
    rng = np.random.default_rng(3)
    weights, experts_tk = _routing(rng, t, e, k)
    experts = _experts_with_adapters(e, k, d, f, seed=2)
    graphdef, frozen, lora = nnx.split(experts, nnx.Param, ...)

    def loss(lora, frozen, x, weights):
        return jnp.sum(nnx.merge(graphdef, frozen, lora)(x, weights, jnp.asarray(experts_tk)) ** 2)

    device_mesh = make_mesh("dp=1,fsdp=8,cp=1,mp=1")
    with jax.set_mesh(device_mesh):
        rows = named_sharding(("act_batch", None), (t, 1), device_mesh)
        args = (lora, frozen, jax.device_put(rng.standard_normal((t, d)).astype(np.float32), rows),
                jax.device_put(weights, rows))
        compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * worst * 2 * f * 4
