"""The model FLOPs of a LoRA train step: what MFU counts, in training metrics and in `--plan`'s prediction."""

from __future__ import annotations

from jaxmodel.config import ModelConfig


def flops_per_token(config: ModelConfig, seq_len: int, reference_forward: bool = False) -> float:
    """Model FLOPs per trained token of a LoRA step (frozen base), counted as:

    forward 2N (N = matmul weights a token goes through: q, k, v, o, gate, up, down per layer, and the LM head;
    in a sparse layer the router and its k experts' gate, up and down, not every expert's) plus attention
    4·L·T·H (QKᵀ and AV with H = heads·head_dim, T the sequence, causality not discounted; a layer with a
    sliding window of W keys counts min(T, W) for its T); the backward pass needs activation gradients only
    (no base-weight gradients): 2N + 8·L·T·H. Total
    4N + 12·L·T·H. LoRA's own matmuls (rank r) are under 1% at r=8 and are left out. With
    `reference_forward` (DPO, IPO: the reference model runs in the same step) one more forward: 6N + 16·L·T·H.
    """
    c = config
    q = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    attention_weights = c.hidden_size * (2 * q + 2 * kv)
    dense = 3 * c.hidden_size * c.intermediate_size
    sparse = c.hidden_size * (3 * c.moe_intermediate_size * c.num_experts_per_tok + c.num_experts)
    n = sum(attention_weights + (sparse if s else dense) for s in c.sparse_layers or (False,) * c.num_hidden_layers)
    n += c.hidden_size * c.vocab_size
    attention = sum(min(seq_len, w or seq_len) for w in c.layer_windows()) * q
    forward = 2.0 * n + 4.0 * attention
    return 4.0 * n + 12.0 * attention + (forward if reference_forward else 0.0)
