"""The model FLOPs of a LoRA train step: what MFU counts, in training metrics and in `--plan`'s prediction."""

from __future__ import annotations

import math

from finetune.step.checks import layer_shapes
from jaxmodel.config import ModelConfig
from jaxmodel.lora import attention_targets


def flops_per_token(config: ModelConfig, seq_len: int, reference_forward: bool = False) -> float:
    """Model FLOPs per trained token of a LoRA step (frozen base), counted as:

    forward 2N (N = matmul weights a token goes through: the attention's projections (q, k, v, o; multi-head latent
    attention's q_a, q_b, kv_a, kv_b, o), gate, up, down per layer, and the LM head; in a sparse layer the router,
    its k experts' gate, up and down, not every expert's, and its shared experts') plus attention 2·L·T·(Hqk + Hv)
    (QKᵀ over Hqk = heads · the queries' width, AV over Hv = heads · the values' width; 4·L·T·H where both are H;
    T the sequence, causality not discounted; a layer with a sliding window of W keys counts min(T, W) for its T);
    the backward pass needs activation gradients only (no base-weight gradients): twice the forward's attention and
    2N. Total 4N + 6·L·T·(Hqk + Hv). LoRA's own matmuls (rank r) are under 1% at r=8 and are left out. With
    `reference_forward` (DPO, IPO: the reference model runs in the same step) one more forward.
    """
    n, attention = _weights_and_attention(config, seq_len)
    forward = 2.0 * n + 2.0 * attention
    return 4.0 * n + 6.0 * attention + (forward if reference_forward else 0.0)


def forward_flops_per_token(config: ModelConfig, context: int) -> float:
    """Model FLOPs of one token's forward pass over `context` earlier tokens (a sampler's decode step, a log-prob
    pass): 2N + 2·L·context·(Hqk + Hv), counted as `flops_per_token` counts them."""
    n, attention = _weights_and_attention(config, context)
    return 2.0 * n + 2.0 * attention


def _weights_and_attention(c: ModelConfig, seq_len: int) -> tuple[float, float]:
    """(N, L·T·(Hqk + Hv)) of `flops_per_token`."""
    shapes = layer_shapes(c)
    attention_weights = sum(math.prod(shapes[name]) for name in attention_targets(c))
    dense = 3 * c.hidden_size * c.intermediate_size
    experts = c.num_experts_per_tok + c.shared_experts
    sparse = c.hidden_size * (3 * c.moe_intermediate_size * experts + c.num_experts)
    n = sum(attention_weights + (sparse if s else dense) for s in c.sparse_layers or (False,) * c.num_hidden_layers)
    n += c.hidden_size * c.vocab_size
    widths = c.num_attention_heads * ((c.qk_head_dim + c.v_head_dim) if c.kv_lora_rank else 2 * c.head_dim)
    return float(n), float(sum(min(seq_len, w or seq_len) for w in c.layer_windows()) * widths)
