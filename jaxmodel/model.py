"""The decoder-only causal LM as Flax NNX modules, numerically transformers' class of each family
(`jaxmodel.families`: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
Gemma3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM).

Shapes: b batch, t query positions, s key positions, d hidden, n query heads, k kv heads,
r = n // k query heads per kv head, h head_dim, f intermediate, v vocab, l layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmodel import scopes
from jaxmodel.attention import ATTENTION_IMPLS, attention, cached_attention
from jaxmodel.context_parallel import context_parallel_attention, cp_order, cp_size
from jaxmodel.config import ModelConfig
from jaxmodel.layers import Embed, Linear, LoRAParam, QuantizedParam, RMSNorm, swiglu
from jaxmodel.matmul import DOT_POLICIES, einsum_acc32, remat_name
from jaxmodel.moe import SparseMoeBlock
from jaxmodel.quantization import Quantization, quantize
from jaxmodel.rope import apply_rope, cos_sin, inv_freq
from jaxmodel.sharding import DEFAULT_RULES, Rules, constrain

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # the outputs of jaxmodel.matmul's contractions (custom VJPs, no dot_general to the plain policies) too
    "dots": DOT_POLICIES["dots"],
    "dots_no_batch": DOT_POLICIES["dots_no_batch"],
    # keep the attention projections (q, k, v, attention output, o_proj) and nothing of attention's
    # internals or the MLP: linear in the sequence whatever the attention path
    "projections": jax.checkpoint_policies.save_only_these_names("projection"),
    # keep nothing on the device; the layer's input goes to host memory where the backend has it
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
        offload_src="device", offload_dst="pinned_host"),
}


# A layer without a sliding window attends within this many keys: every key (sequences stay far below it).
FULL_WINDOW = 2**30


def _split(key, n: int) -> list:
    """`n` independent keys from `key`, or `n` Nones when there is no key (no dropout)."""
    return [None] * n if key is None else list(jax.random.split(key, n))


class KVCache(NamedTuple):
    """Keys and values of every layer, `[l, b, k, s, h]` (each head's slots together, as attention's matmuls read
    them: with the slots first, every decode step transposed each layer's whole cache), filled up to the decode
    position."""

    k: jax.Array
    v: jax.Array


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, layers: int | None, dtype, param_dtype,
                 quantization: Quantization | None = None, rngs: nnx.Rngs):
        c = config
        kw = dict(layers=layers, dtype=dtype, param_dtype=param_dtype, quantization=quantization, rngs=rngs)
        qkv, o = dict(use_bias=c.qkv_bias, **kw), dict(use_bias=c.o_bias, **kw)
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, axes=("heads", "embed"), **qkv)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, axes=("kv_heads", "embed"), **qkv)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, axes=("kv_heads", "embed"), **qkv)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, axes=("embed", "heads"), **o)
        if c.qk_norm:  # one weight over head_dim, shared by every head
            norm = dict(eps=c.rms_norm_eps, layers=layers, param_dtype=param_dtype, unit_offset=c.norm_unit_offset)
            self.q_norm = RMSNorm(c.head_dim, **norm)
            self.k_norm = RMSNorm(c.head_dim, **norm)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.dtype = dtype

    def __call__(self, x_btd, cos_bth, sin_bth, mask: dict, kv: tuple | None, cache_index, key=None,
                 rules: Rules = DEFAULT_RULES):
        """`mask`: keyword arguments of `jaxmodel.attention.attention` (implementation, mask, query offset,
        window)."""
        b, t, _ = x_btd.shape
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        keys = _split(key, 4)
        q_btnh = self.q_proj(x_btd, keys[0]).reshape(b, t, n, h)
        k_btkh = self.k_proj(x_btd, keys[1]).reshape(b, t, k, h)
        if self.q_norm is not None:
            q_btnh, k_btkh = self.q_norm(q_btnh), self.k_norm(k_btkh)
        q_btnh = apply_rope(q_btnh, cos_bth, sin_bth)
        k_btkh = apply_rope(k_btkh, cos_bth, sin_bth)
        v_btkh = self.v_proj(x_btd, keys[2]).reshape(b, t, k, h)
        out_btnh, kv = _attend(q_btnh, k_btkh, v_btkh, mask, kv, cache_index, self.dtype, rules)
        return remat_name(self.o_proj(out_btnh.reshape(b, t, n * h), keys[3]), "projection"), kv


def _attend(q_btnh, k_btkh, v_btkh, mask: dict, kv: tuple | None, cache_index, dtype, rules: Rules):
    """Attention over this step's keys and values, or (`kv`: the layer's cache `[b, k, s, h]`) over the cache's
    slots before `cache_index` and them; returns the output `[b, t, n, h]` and, with a cache, this step's keys and
    values `[b, t, k, h]` (for the cache's slots from `cache_index` on)."""
    if kv is not None:  # over the cache's earlier slots and these tokens; the caller writes them into the cache
        with jax.named_scope(scopes.ATTENTION):
            out_btnh = cached_attention(q_btnh, k_btkh, v_btkh, kv[0], kv[1], dtype=dtype, **mask)
        return out_btnh, (k_btkh, v_btkh)
    q_btnh, k_btkh, v_btkh = (remat_name(x, "projection") for x in (q_btnh, k_btkh, v_btkh))
    attend = context_parallel_attention if "segment_ids_bt" in mask else attention
    with jax.named_scope(scopes.ATTENTION):
        out_btnh = attend(q_btnh, k_btkh, v_btkh, dtype=dtype, **mask)
    # The output (and so its gradient) pinned where its tokens are, heads over mp: left to XLA, a step with few
    # tokens a device split the attention's backward over heads (all-to-alls) and reduced partial input
    # gradients of the whole batch in the projections around it.
    out_btnh = constrain(out_btnh, ("act_batch", "act_seq", "heads", None), rules)
    return remat_name(out_btnh, "projection"), kv


# transformers' DeepSeek-V3 norms its two latents with RMSNorm's default epsilon, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, transformers' `DeepseekV3Attention`): queries through the
    `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` bottleneck (or one `q_proj`), and from `kv_a_proj_with_mqa` a
    latent (normed by `kv_a_layernorm`, then `kv_b_proj` gives every head its key part and value) beside a rotary
    key part shared by the heads. RoPE turns the queries' and keys' last `head_dim` dimensions only (interleaved
    pairs with `rope_interleave`: taken evens then odds, the rotate-half layout, which changes no score). The
    values (or, where they are wider, the queries and keys) are zero-padded to one head width
    (`ModelConfig.attention_width`) so that every attention path and the cache take one, and the padding is sliced
    off the output: exact, at the price of attention's value matmul on `qk_head_dim` columns instead of
    `v_head_dim`."""

    def __init__(self, config: ModelConfig, *, layers: int | None, dtype, param_dtype,
                 quantization: Quantization | None = None, rngs: nnx.Rngs):
        c = config
        kw = dict(layers=layers, dtype=dtype, param_dtype=param_dtype, quantization=quantization, rngs=rngs)
        n, qk, nope, v = c.num_attention_heads, c.qk_head_dim, c.qk_nope_head_dim, c.v_head_dim
        norm = dict(eps=LATENT_NORM_EPS, layers=layers, param_dtype=param_dtype)
        if c.q_lora_rank:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, axes=("latent", "embed"), use_bias=c.qkv_bias, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, **norm)
            self.q_b_proj = Linear(c.q_lora_rank, n * qk, axes=("heads", "latent"), **kw)
            self.q_proj = None
        else:
            self.q_proj = Linear(c.hidden_size, n * qk, axes=("heads", "embed"), **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.head_dim, axes=("latent", "embed"),
                                         use_bias=c.qkv_bias, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, **norm)
        self.kv_b_proj = Linear(c.kv_lora_rank, n * (nope + v), axes=("heads", "latent"), **kw)
        self.o_proj = Linear(n * v, c.hidden_size, axes=("embed", "heads"), use_bias=c.o_bias, **kw)
        self.num_heads, self.nope, self.rope_dim, self.v_dim = n, nope, c.head_dim, v
        self.kv_lora_rank, self.interleave, self.width = c.kv_lora_rank, c.rope_interleave, c.attention_width
        self.dtype = dtype

    def __call__(self, x_btd, cos_bth, sin_bth, mask: dict, kv: tuple | None, cache_index, key=None,
                 rules: Rules = DEFAULT_RULES):
        b, t, _ = x_btd.shape
        n, nope, rope, v = self.num_heads, self.nope, self.rope_dim, self.v_dim
        keys = _split(key, 5)
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_btd, keys[0])), keys[1])
        else:
            q = self.q_proj(x_btd, keys[0])
        q_btnh = q.reshape(b, t, n, nope + rope)
        latent_btl = self.kv_a_proj_with_mqa(x_btd, keys[2])
        kv_btnh = self.kv_b_proj(self.kv_a_layernorm(latent_btl[..., :self.kv_lora_rank]), keys[3]).reshape(
            b, t, n, nope + v)
        q_rot, k_rot = q_btnh[..., nope:], latent_btl[..., self.kv_lora_rank:][:, :, None, :]
        if self.interleave:
            q_rot, k_rot = (jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1) for x in (q_rot, k_rot))
        q_rot, k_rot = apply_rope(q_rot, cos_bth, sin_bth), apply_rope(k_rot, cos_bth, sin_bth)
        width = self.width

        def padded(x):  # zero columns change neither a score nor an output column
            return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - x.shape[-1])))

        q_btnh = padded(jnp.concatenate([q_btnh[..., :nope], q_rot], axis=-1))
        k_btnh = padded(jnp.concatenate([kv_btnh[..., :nope], jnp.broadcast_to(k_rot, (b, t, n, rope))], axis=-1))
        v_btnh = padded(kv_btnh[..., nope:])
        out_btnh, kv = _attend(q_btnh, k_btnh, v_btnh, mask, kv, cache_index, self.dtype, rules)
        return remat_name(self.o_proj(out_btnh[..., :v].reshape(b, t, n * v), keys[4]), "projection"), kv


class MLP(nnx.Module):
    """A gated MLP: `down(act(gate(x)) * up(x))`, SwiGLU with `silu`."""

    def __init__(self, config: ModelConfig, *, layers: int | None, dtype, param_dtype,
                 quantization: Quantization | None = None, rngs: nnx.Rngs, intermediate_size: int | None = None):
        c = config
        f = c.intermediate_size if intermediate_size is None else intermediate_size
        kw = dict(use_bias=c.mlp_bias, layers=layers, dtype=dtype, param_dtype=param_dtype,
                  quantization=quantization, rngs=rngs)
        self.gate_proj = Linear(c.hidden_size, f, axes=("mlp", "embed"), **kw)
        self.up_proj = Linear(c.hidden_size, f, axes=("mlp", "embed"), **kw)
        self.down_proj = Linear(f, c.hidden_size, axes=("embed", "mlp"), **kw)
        self.activation = c.hidden_act

    def __call__(self, x_btd, key=None, chunk: int = 0, rules: Rules = DEFAULT_RULES):
        """With `chunk`, tokens go through in chunks of `chunk` positions per device (a scan with remat), so
        the `[tokens, intermediate]` activations and their gradients exist for one chunk at a time."""
        b, t, d = x_btd.shape
        cp = cp_size()  # chunks stay within each device's part of the sequence

        # The [tokens, intermediate] values, whole `[b, t, i]` or a chunk's `[b, cp, chunk, i]`, pinned where their
        # tokens are (rows over the batch axes, the sequence over cp, the intermediate over mp), and so their
        # gradients: unpinned, with few tokens a device or a wide model's chunks, XLA split them over the
        # intermediate axis in the backward pass instead, with all-to-alls (405B on fsdp=8: 24.6 GB a step at
        # 16 x 64, 1.4 TB at 8 x 8192 in chunks).
        def pin(x):
            return constrain(x, ("act_batch", "act_seq", *(None,) * (x.ndim - 3), "mlp"), rules)

        if not chunk or t // cp <= chunk or (t // cp) % chunk:
            return self._swiglu(x_btd, key, pin)
        n = t // cp // chunk
        x_nbccd = x_btd.reshape(b, cp, n, chunk, d).transpose(2, 0, 1, 3, 4)
        keys = None if key is None else jax.random.split(key, n)

        def step(_, xs):
            x_bccd, chunk_key = xs
            return None, self._swiglu(x_bccd, chunk_key, pin)

        _, y_nbccd = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), None, (x_nbccd, keys))
        return y_nbccd.transpose(1, 2, 0, 3, 4).reshape(b, t, d)

    def _swiglu(self, x, key=None, pin=lambda x: x):
        keys = _split(key, 3)
        gated = swiglu(pin(self.gate_proj(x, keys[0])), pin(self.up_proj(x, keys[1])), self.activation)
        return self.down_proj(pin(gated), keys[2])


class DecoderLayer(nnx.Module):
    """Pre-norm residual blocks, attention then the MLP: `input_layernorm` before attention and
    `post_attention_layernorm` before the MLP (Llama's names). With `sandwich_norms`, `attn_output_norm` and
    `mlp_output_norm` norm each block's output before its residual add too. A `sparse` layer's MLP is the mixture
    of experts (`jaxmodel.moe.SparseMoeBlock`)."""

    def __init__(self, config: ModelConfig, *, layers: int | None = None, sparse: bool = False, dtype, param_dtype,
                 quantization: Quantization | None = None, rngs: nnx.Rngs):
        kw = dict(layers=layers, dtype=dtype, param_dtype=param_dtype, quantization=quantization, rngs=rngs)
        d = config.hidden_size
        norm = dict(eps=config.rms_norm_eps, layers=layers, param_dtype=param_dtype,
                    unit_offset=config.norm_unit_offset)
        self.input_layernorm = RMSNorm(d, **norm)
        self.self_attn = (LatentAttention if config.kv_lora_rank else Attention)(config, **kw)
        self.post_attention_layernorm = RMSNorm(d, **norm)
        if sparse:
            shared = None if not config.shared_experts else MLP(
                config, **kw, intermediate_size=config.moe_intermediate_size * config.shared_experts)
            self.mlp = SparseMoeBlock(config, layers=layers, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                      quantization=quantization, shared_experts=shared)
        else:
            self.mlp = MLP(config, **kw)
        self.sparse = sparse
        if config.sandwich_norms:
            self.attn_output_norm, self.mlp_output_norm = RMSNorm(d, **norm), RMSNorm(d, **norm)
        else:
            self.attn_output_norm = self.mlp_output_norm = None

    def __call__(self, x_btd, cos_bth, sin_bth, mask: dict, kv, cache_index, key=None, mlp_chunk: int = 0,
                 rules: Rules = DEFAULT_RULES, real_bt=None):
        """The layer's output `[b, t, d]`, the updated cache, a sparse layer's experts of each token `[b, t, k]`
        and, given which tokens are real (`real_bt`), its routing's `jaxmodel.moe.RouterStats` (each None for a
        dense layer)."""
        attn_key, mlp_key = _split(key, 2)
        attn_btd, kv = self.self_attn(self.input_layernorm(x_btd), cos_bth, sin_bth, mask, kv, cache_index,
                                      attn_key, rules)
        if self.attn_output_norm is not None:
            attn_btd = self.attn_output_norm(attn_btd)
        h_btd = x_btd + attn_btd
        experts_btk = stats = None
        if self.sparse:
            mlp_btd, experts_btk, stats = self.mlp(self.post_attention_layernorm(h_btd), rules, real_bt)
        else:
            mlp_btd = self.mlp(self.post_attention_layernorm(h_btd), mlp_key, mlp_chunk, rules)
        if self.mlp_output_norm is not None:
            mlp_btd = self.mlp_output_norm(mlp_btd)
        return h_btd + mlp_btd, kv, experts_btk, stats


class CausalLM(nnx.Module):
    """The causal LM of every family (`config.model_type`, with its switches). Decoder layers are stacked modules
    run with `jax.lax.scan`, so compile time does not grow with depth: `layers` holds the layers with a dense MLP and
    `moe_layers` those with experts (`config.sparse_layers`; None where a model has no layer of that kind), each
    run of consecutive layers of one kind one scan over its slice of the stack. `remat` names the
    rematerialisation policy of the scanned body and `attention` the attention implementation without a cache:
    "xla" (dense scores) or "blockwise" (memory linear in the sequence, `jaxmodel.attention.blockwise_attention`).
    `mlp_chunk` > 0 runs the MLP over chunks of that many positions. Under a mesh with a `cp` axis the sequence
    is split over it (`jaxmodel.context_parallel`). With `quantization`, the seven projections of every layer
    hold their frozen weights quantized (`jaxmodel.quantization`), and a sparse layer's experts theirs; embeddings,
    norms, routers and the LM head do not."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, remat: str = "none",
                 attention: str = "xla", mlp_chunk: int = 0, rules: Rules = DEFAULT_RULES,
                 quantization: Quantization | None = None, rngs: nnx.Rngs):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {list(ATTENTION_IMPLS)}, got {attention!r}")
        self.config = config
        self.dtype = dtype
        self.remat = remat
        self.attention = attention
        self.mlp_chunk = mlp_chunk
        self.quantization = quantization
        self.rules = tuple(rules)  # logical axes -> mesh axes, for activations under a mesh
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                  scale=config.hidden_size ** 0.5 if config.scale_embeddings else None, rngs=rngs)
        # Two stacks, not one holding both kinds of MLP in every layer: that would hold a dense MLP and every expert
        # for each layer (DeepSeek-V3's 3 dense layers would hold 3 x 256 experts they never use).
        stacks = {}
        for sparse in (False, True):
            count = len(config.stack_layers(sparse))
            stacks[sparse] = DecoderLayer(config, layers=count, sparse=sparse, dtype=dtype, param_dtype=param_dtype,
                                          quantization=quantization, rngs=rngs) if count else None
        self.layers, self.moe_layers = stacks[False], stacks[True]
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=param_dtype,
                            unit_offset=config.norm_unit_offset)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, axes=("vocab", "embed"), dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)

    def __call__(self, input_ids, *, attention_mask=None, positions=None, segment_ids=None,
                 dropout_key=None) -> jax.Array:
        """float32 logits `[b, t, v]` for int ids `[b, t]`.

        `attention_mask` `[b, t]` marks real tokens (padding is 0). `segment_ids` `[b, t]` numbers the
        documents packed into a row (0 = padding): a token attends only within its own document, and
        `positions` should then restart at each document's start. `dropout_key` switches on LoRA dropout.
        """
        h_btd = self.hidden_states(input_ids, attention_mask=attention_mask, positions=positions,
                                   segment_ids=segment_ids, dropout_key=dropout_key)
        order = self.sequence_order(input_ids.shape[1])
        if order is not None:
            h_btd = jnp.take(h_btd, np.argsort(order), axis=1)
        return self.head(h_btd)

    def sequence_order(self, t: int) -> np.ndarray | None:
        """The order of positions in `hidden_states`' output: None for the natural one; under a mesh with
        `cp` > 1, `order[p]` is the original position of the token at `p` (`jaxmodel.context_parallel`)."""
        cp = cp_size()
        return None if cp == 1 else cp_order(t, cp)

    def hidden_states(self, input_ids, *, attention_mask=None, positions=None, segment_ids=None,
                      dropout_key=None, router_stats: bool = False):
        """The final normed hidden states `[b, t, d]` (compute dtype), positions in `sequence_order(t)`; with
        `router_stats`, also the sparse layers' `jaxmodel.moe.RouterStats` summed over them and the real tokens."""
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        order = self.sequence_order(t)
        segments_bt = _segments(attention_mask, segment_ids)
        if order is not None:
            segments_bt = jnp.ones((b, t), jnp.int32) if segments_bt is None else segments_bt
            input_ids, positions, segments_bt = (jnp.take(x, order, axis=1) for x in (input_ids, positions, segments_bt))
            mask = dict(impl=self.attention, segment_ids_bt=segments_bt)
        elif self.attention != "xla":  # blockwise and the fused kernels take segment ids
            mask = dict(impl=self.attention, q_segment_ids=segments_bt, kv_segment_ids=segments_bt)
        else:  # causality is added by `attention`, from the positions' indices
            mask = dict(impl=self.attention, mask_bts=_dense_key_mask(attention_mask, segment_ids))
        real_bt = None
        if router_stats:
            real_bt = jnp.ones((b, t), bool) if segments_bt is None else segments_bt != 0
        h_btd, _, _, stats = self._layers(input_ids, positions, mask, None, 0, dropout_key, real_bt)
        return (self.norm(h_btd), stats) if router_stats else self.norm(h_btd)

    def routes(self, input_ids, *, attention_mask=None) -> jax.Array:
        """The experts each token is routed to at each sparse layer, `[sparse layers, b, t, k]` int32 (largest
        weight first), in the model's layer order; positions in `sequence_order(t)`."""
        if self.moe_layers is None:
            raise ValueError("the model has no sparse layers")
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        mask = dict(impl="xla", mask_bts=_dense_key_mask(attention_mask, None))
        return self._layers(input_ids, positions, mask, None, 0)[2]

    def head(self, h_btd) -> jax.Array:
        """float32 logits `[..., v]` of hidden states `[..., d]`: the LM head (or the tied embedding), with
        its LoRA adapter when `lm_head` has one (without dropout: the loss may run the head in chunks)."""
        with jax.named_scope(scopes.LM_HEAD):
            logits = einsum_acc32("...d,vd->...v", h_btd.astype(self.dtype), self._head_weight())
            if self.lm_head is not None and self.lm_head.lora_a is not None:
                *lead, d = h_btd.shape
                logits = logits + self.lm_head.lora_delta(h_btd.reshape(-1, d)).reshape(*lead, -1)
            if logits.ndim == 3:
                logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"), self.rules)
            return logits

    def frozen_head_weight(self) -> jax.Array | None:
        """The head's weight `[v, d]` in the compute dtype, as `head` multiplies by it, or None when `lm_head`
        carries a LoRA adapter (then the head has trained parameters)."""
        if self.lm_head is not None and self.lm_head.lora_a is not None:
            return None
        return self._head_weight()

    @property
    def trains_router(self) -> bool:
        """Whether the sparse layers' routers carry LoRA adapters (target `gate`): a run training them adds the
        load-balancing loss (`jaxmodel.moe.load_balancing_loss`)."""
        return self.moe_layers is not None and self.moe_layers.mlp.gate.lora_a is not None

    def _head_weight(self) -> jax.Array:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.weight[...].astype(self.dtype)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.attention_width)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

    def decode(self, input_ids, positions, key_valid, cache: KVCache, cache_index, *, last_only: bool = False):
        """Run `t` new tokens written at cache slots `[cache_index, cache_index + t)`.

        `key_valid` `[b, s]` marks cache slots holding real tokens (False for left padding).
        Returns float32 logits `[b, t, v]` (`last_only`: the last token's, `[b, 1, v]`, all a prefill of
        left-padded prompts needs: a 1024-token prompt's logits over a 152k vocabulary are 0.6 GB a row) and the
        updated cache.
        """
        b, t, s = *input_ids.shape, cache.k.shape[3]
        # query i sits at slot cache_index + i and sees slots up to it (attention's q_offset)
        mask_bts = jnp.broadcast_to(key_valid.astype(bool)[:, None, :], (b, t, s))
        mask = dict(impl="xla", mask_bts=mask_bts, q_offset=cache_index)
        h_btd, cache, _, _ = self._layers(input_ids, positions, mask, cache, cache_index)
        if last_only:
            h_btd = h_btd[:, -1:]
        return self.head(self.norm(h_btd)), cache

    def _layers(self, input_ids, positions, mask: dict, cache: KVCache | None, cache_index, dropout_key=None,
                real_bt=None):
        """The decoder stack: hidden states `[b, t, d]` before the final norm, the updated cache, each sparse
        layer's experts of each token `[sparse layers, b, t, k]` (None without sparse layers) and, given which tokens
        are real (`real_bt`), the sparse layers' `RouterStats` summed (else None)."""
        c = self.config
        if c.query_pre_attn_scalar is not None or c.kv_lora_rank:
            mask = {**mask, "scale": c.attention_scale}
        cos_bth, sin_bth = cos_sin(positions, inv_freq(c.rope, c.head_dim), self.dtype, c.rope.attention_scaling)
        # The windowed layers take local_rope, where it differs, by a scanned flag.
        if c.local_rope not in (None, c.rope) and any(c.layer_windows()):
            local_cos_sin = cos_sin(positions, inv_freq(c.local_rope, c.head_dim), self.dtype,
                                    c.local_rope.attention_scaling)
            local_xs = np.asarray([w > 0 for w in c.layer_windows()])
        else:
            local_cos_sin, local_xs = None, None
        h_btd = constrain(self.embed_tokens(input_ids, self.rules), ("act_batch", "act_seq", "act_embed"), self.rules)
        act = ("act_batch", "act_seq", "act_embed")
        # Each layer's window, a scanned value, so that one layer body serves windowed and full layers; none at all
        # (no mask term) when no layer has one.
        windows = c.layer_windows()
        window_xs = np.asarray([w or FULL_WINDOW for w in windows], np.int32) if any(windows) else None
        layer_keys = None if dropout_key is None else jax.random.split(dropout_key, c.num_hidden_layers)
        layer_index = None if cache is None else np.arange(c.num_hidden_layers, dtype=np.int32)
        per_layer = (layer_index, layer_keys, window_xs, local_xs)
        kv = None if cache is None else (cache.k, cache.v)
        routes, stats = [], []
        for sparse, first, count in c.layer_runs():
            stack = self.moe_layers if sparse else self.layers
            start = c.stack_layers(sparse).index(first)
            run = jax.tree.map(lambda x: x[first:first + count], per_layer)
            h_btd, kv, (experts, run_stats) = self._scan(stack, (start, count), h_btd, kv, run, (cos_bth, sin_bth),
                                                         local_cos_sin, mask, cache_index, act, real_bt)
            routes += [] if experts is None else [experts]
            stats += [] if run_stats is None else [jax.tree.map(lambda x: jnp.sum(x, axis=0), run_stats)]
        routes = jnp.concatenate(routes) if routes else None
        stats = jax.tree.map(lambda *xs: sum(xs), *stats) if stats else None
        return h_btd, None if kv is None else KVCache(*kv), routes, stats

    def _scan(self, stack: "DecoderLayer", part: tuple[int, int], h_btd, kv, per_layer, cos_sin, local_cos_sin,
              mask: dict, cache_index, act, real_bt=None):
        """Layers `[start, start + count)` of `stack` (`part`) over `h_btd`, one scan; `kv` the whole model's KV
        cache (keys, values `[l, b, k, s, h]`, or None), `per_layer` these layers' indices in it, dropout keys,
        windows and local-RoPE flags (each None when unused). Returns the hidden states, the cache with these
        layers' new tokens written, and each layer's (experts of each token, router stats) stacked.

        The cache crosses the scan read-only in its carry, the layers' new keys and values written into it once
        after the scan: scanned over as per-layer values and stacked back, every decode step copied the whole cache
        (SmolLM2-135M at 64 x 168 slots: 0.57 s a step against 0.16 s for the same forward without a cache)."""
        graphdef, lora_state, frozen_state = nnx.split(stack, LoRAParam, ...)
        start, count = part
        if count != len(self.config.stack_layers(stack.sparse)):  # a run of part of the stack: its slice
            lora_state, frozen_state = jax.tree.map(lambda x: x[start:start + count], (lora_state, frozen_state))
        # The frozen weights cross the scan as the integers of their bits when they are 16-bit floats: XLA:CPU
        # runs a bf16 dynamic-slice in float32, converting the whole [layers, ...] stack of every weight at each
        # step. Nothing is differentiated through them; the LoRA state, which is, crosses as it is.
        dtypes = jax.tree.map(lambda x: x.dtype, frozen_state)
        frozen_bits = jax.tree.map(_as_bits, frozen_state)
        cos_bth, sin_bth = cos_sin

        def layer_step(carry, xs):
            h_btd, cache = carry
            (lora, frozen), index, key, window, local = xs
            frozen = jax.tree.map(_from_bits, frozen, dtypes)
            h_btd = checkpoint_name(h_btd, "layer_input")
            layer_mask = mask if window is None else {**mask, "window": window}
            cos, sin = (cos_bth, sin_bth) if local is None else (
                jnp.where(local, local_cos_sin[0], cos_bth), jnp.where(local, local_cos_sin[1], sin_bth))
            kv = None if cache is None else tuple(jax.lax.dynamic_index_in_dim(c, index, keepdims=False)
                                                  for c in cache)
            h_btd, kv, experts, stats = nnx.merge(graphdef, lora, frozen)(h_btd, cos, sin, layer_mask, kv, cache_index,
                                                                          key, self.mlp_chunk, self.rules, real_bt)
            # this layer's new tokens' keys and values `[b, k, t, h]`, written into the cache after the scan
            new = None if cache is None else tuple(x.astype(c.dtype).transpose(0, 2, 1, 3) for c, x in zip(cache, kv))
            return (constrain(h_btd, act, self.rules), cache), (new, experts, stats)

        policy = REMAT_POLICIES[self.remat]
        if self.remat != "none":
            layer_step = jax.checkpoint(layer_step, policy=policy, prevent_cse=False)
        (h_btd, kv), (new, *ys) = jax.lax.scan(layer_step, (h_btd, kv), ((lora_state, frozen_bits), *per_layer))
        if kv is not None:
            first = per_layer[0][0]
            kv = tuple(jax.lax.dynamic_update_slice(c, n, (first, 0, 0, cache_index, 0)) for c, n in zip(kv, new))
        return h_btd, kv, tuple(ys)


def _as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as uint16 bits (a bitcast: no copy); anything else as it is."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_bits(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def quantize_model(model: CausalLM, quantization: Quantization) -> CausalLM:
    """A new model with `model`'s parameters and its projections quantized (numpy, on the host: the
    converter's `--quantize` stores the same codes without holding a whole weight in memory)."""
    if model.quantization is not None:
        raise ValueError("the model is already quantized")
    param_dtype = model.embed_tokens.weight[...].dtype
    quantized = nnx.eval_shape(lambda: CausalLM(
        model.config, dtype=model.dtype, param_dtype=param_dtype, remat=model.remat, attention=model.attention,
        mlp_chunk=model.mlp_chunk, rules=model.rules, quantization=quantization, rngs=nnx.Rngs(0)))
    source = {".".join(map(str, path)): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for path, var in nnx.to_flat_state(nnx.state(quantized, nnx.Param)):
        name = ".".join(map(str, path))
        if isinstance(var, QuantizedParam):
            module, part = name.rsplit(".", 1)
            codes, scales = quantize(np.asarray(source[module + ".weight"][...]), quantization)
            var.set_value(jnp.asarray(codes.view(quantization.held_dtype) if part == "codes" else scales))
        else:
            var.set_value(source[name][...])
    return quantized


def _dense_key_mask(attention_mask, segment_ids) -> jax.Array | None:
    """`[b, t, t]`: key j is a real token of query i's document (None: every key is)."""
    if attention_mask is None and segment_ids is None:
        return None
    b, t = (attention_mask if segment_ids is None else segment_ids).shape
    mask_bts = jnp.ones((b, t, t), bool)
    if attention_mask is not None:
        mask_bts = mask_bts & attention_mask.astype(bool)[:, None, :]
    if segment_ids is not None:
        same_doc_bts = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask_bts = mask_bts & same_doc_bts & (segment_ids != 0)[:, None, :]
    return mask_bts


def _segments(attention_mask, segment_ids) -> jax.Array | None:
    """Segment ids `[b, t]` with padding (attention_mask 0) as segment 0; None when neither is given."""
    if attention_mask is None:
        return segment_ids
    real_bt = attention_mask.astype(bool)
    return jnp.where(real_bt, 1 if segment_ids is None else segment_ids, 0).astype(jnp.int32)
