"""Qwen3 (dense): an RMSNorm over head_dim on every query and key head, after the projection and before RoPE;
`attention_bias` for q, k, v and o; sliding windows as Qwen2's."""

from __future__ import annotations

from jaxmodel.families.llama import MODULES as LLAMA_MODULES
from jaxmodel.families.qwen2 import read_windows, write_windows
from jaxmodel.families.family import Family

_NORMS = (
    ("model.layers.{i}.self_attn.q_norm",  "layers.self_attn.q_norm"),
    ("model.layers.{i}.self_attn.k_norm",  "layers.self_attn.k_norm"),
)  # fmt: skip
MODULES = LLAMA_MODULES[:6] + _NORMS + LLAMA_MODULES[6:]


def _read(fields) -> dict:
    bias = fields.get("attention_bias", bool, False)
    # transformers' Qwen3Config defaults head_dim to 128, not hidden / heads
    return dict(head_dim=fields.positive("head_dim", 128), qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                **read_windows(fields))


def _write(config) -> dict:
    if config.qkv_bias != config.o_bias or config.mlp_bias or not config.qk_norm:
        raise ValueError("Qwen3 has q/k norms, one attention_bias for q, k, v and o, and no MLP bias")
    return {"attention_bias": config.qkv_bias, **write_windows(config)}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", MODULES, _read, _write)
