"""Mistral (7B, Nemo, Small, Large): Llama's layer without biases; `sliding_window`, when set, on every layer."""

from __future__ import annotations

from jaxmodel.families.llama import MODULES
from jaxmodel.families.family import Family

# transformers' MistralConfig and Qwen2/Qwen3Config default, when config.json has no sliding_window (null: none)
DEFAULT_WINDOW = 4096


def read_window(fields) -> int | None:
    """`sliding_window`: DEFAULT_WINDOW when absent, None when null, else a positive integer."""
    if "sliding_window" not in fields.raw:
        return DEFAULT_WINDOW
    window = fields.get("sliding_window", int, None)
    if window is not None and window <= 0:
        raise fields.error(f"field 'sliding_window' must be a positive integer or null, got {window!r}")
    return window


def _read(fields) -> dict:
    window = read_window(fields)
    layers = fields.raw["num_hidden_layers"]
    return dict(sliding_window=window, sliding_layers=(True,) * layers if window else ())


def _write(config) -> dict:
    if config.qkv_bias or config.o_bias or config.mlp_bias:
        raise ValueError("Mistral has no biases")
    if config.sliding_window is not None and not all(config.sliding_layers):
        raise ValueError("Mistral's sliding window is on every layer or none")
    return {"sliding_window": config.sliding_window}


FAMILY = Family("mistral", "MistralForCausalLM", MODULES, _read, _write)
