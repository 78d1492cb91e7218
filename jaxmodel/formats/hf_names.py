"""The one table between HuggingFace Llama tensor names and this port's parameter paths.

Converter, merged export, PEFT export and PEFT import all map names through here. Each row pairs a
HF module with the NNX module holding its parameters; `{i}` marks a per-layer module, whose JAX
parameters are stacked on a leading [layers] axis. The layout transform is the identity for every row:
the port keeps torch's `[out, in]` weights and HF's q/k are already in rotate-half order, so a tensor
is copied as it is into its slice.
"""

from __future__ import annotations

import re

#   HF module                                    JAX module
MODULES: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens",                         "embed_tokens"),
    ("model.layers.{i}.input_layernorm",           "layers.input_layernorm"),
    ("model.layers.{i}.self_attn.q_proj",          "layers.self_attn.q_proj"),
    ("model.layers.{i}.self_attn.k_proj",          "layers.self_attn.k_proj"),
    ("model.layers.{i}.self_attn.v_proj",          "layers.self_attn.v_proj"),
    ("model.layers.{i}.self_attn.o_proj",          "layers.self_attn.o_proj"),
    ("model.layers.{i}.post_attention_layernorm",  "layers.post_attention_layernorm"),
    ("model.layers.{i}.mlp.gate_proj",             "layers.mlp.gate_proj"),
    ("model.layers.{i}.mlp.up_proj",               "layers.mlp.up_proj"),
    ("model.layers.{i}.mlp.down_proj",             "layers.mlp.down_proj"),
    ("model.norm",                                 "norm"),
    ("lm_head",                                    "lm_head"),
)  # fmt: skip
PARAMS = ("weight", "bias")

# Tensors some checkpoints carry that the model recomputes (older transformers saved the RoPE buffer).
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_BY_HF = [(re.compile(re.escape(hf).replace(r"\{i\}", r"(\d+)") + r"\.(" + "|".join(PARAMS) + r")"), jax)
          for hf, jax in MODULES]
_BY_JAX = {jax: hf for hf, jax in MODULES}


def hf_to_jax(name: str) -> tuple[str, int | None] | None:
    """`model.layers.3.mlp.up_proj.weight` -> (`layers.mlp.up_proj.weight`, 3); None for unknown names."""
    for pattern, jax_module in _BY_HF:
        match = pattern.fullmatch(name)
        if match:
            layer = int(match.group(1)) if match.re.groups == 2 else None
            return f"{jax_module}.{match.group(match.re.groups)}", layer
    return None


def jax_to_hf(path: str, layer: int | None = None) -> str:
    """`layers.mlp.up_proj.weight`, 3 -> `model.layers.3.mlp.up_proj.weight`."""
    module, param = path.rsplit(".", 1)
    hf = hf_module(module, layer)
    return f"{hf}.{param}"


def hf_module(jax_module: str, layer: int | None = None) -> str:
    """The HF module name for a JAX module path (and layer, for per-layer modules)."""
    try:
        hf = _BY_JAX[jax_module]
    except KeyError:
        raise KeyError(f"no HF name for JAX module '{jax_module}'") from None
    if "{i}" in hf:
        if layer is None:
            raise ValueError(f"'{jax_module}' is per-layer: a layer index is needed")
        return hf.format(i=layer)
    return hf


def is_stacked(path: str) -> bool:
    """Whether a JAX parameter path has a leading [layers] axis."""
    module = path.rsplit(".", 1)[0]
    return "{i}" in _BY_JAX.get(module, "")
