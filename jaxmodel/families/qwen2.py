"""Qwen2 and Qwen2.5: biases on q, k and v (not o, not the MLP); a sliding window only where
`use_sliding_window` is true, on the layers `layer_types` names (by default those from `max_window_layers` on)."""

from __future__ import annotations

from jaxmodel.families.llama import MODULES
from jaxmodel.families.family import LAYER_TYPES, Family, read_layer_types, read_window


def read_windows(fields) -> dict:
    """`sliding_window` and `sliding_layers` as transformers' Qwen2 and Qwen3 configs decide them."""
    layers = fields.raw["num_hidden_layers"]
    window = read_window(fields) if fields.get("use_sliding_window", bool, False) else None
    sliding = read_layer_types(fields)
    if sliding is None:
        first = fields.get("max_window_layers", int, 28)
        sliding = tuple(i >= first for i in range(layers))
    if window is None or not any(sliding):
        return dict(sliding_window=None, sliding_layers=())
    return dict(sliding_window=window, sliding_layers=sliding)


def write_windows(config) -> dict:
    sliding = config.sliding_layers or (False,) * config.num_hidden_layers
    return {
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "max_window_layers": sliding.index(True) if any(sliding) else config.num_hidden_layers,
        "layer_types": [LAYER_TYPES[s] for s in sliding],
    }


def _read(fields) -> dict:
    return dict(qkv_bias=True, o_bias=False, mlp_bias=False, **read_windows(fields))


def _write(config) -> dict:
    if not config.qkv_bias or config.o_bias or config.mlp_bias:
        raise ValueError("Qwen2 has biases on q, k and v only")
    return write_windows(config)


FAMILY = Family("qwen2", "Qwen2ForCausalLM", MODULES, _read, _write)
