"""Mistral (7B, Nemo, Small, Large): Llama's layer without biases; `sliding_window`, when set, on every layer."""

from __future__ import annotations

from jaxmodel.families.llama import MODULES
from jaxmodel.families.family import Family, read_window


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
