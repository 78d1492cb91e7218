"""`Family`: what one HuggingFace `model_type` adds to the one decoder, and its tensor names; `read_window`,
the `sliding_window` field as the windowed families read it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the one decoder (`jaxmodel.model.CausalLM`) with the switches its config.json sets.

    `modules` is the family's table between HF module names and this port's module paths (`{i}` marks a
    per-layer module, whose parameters are stacked on a leading [layers] axis). `read(fields)` gives the
    `ModelConfig` fields the family decides from its config.json, over the common reading's (`fields`:
    `jaxmodel.config.Fields`); `write(config)` gives them back as the family's config.json spells them.

    `defaults` are transformers' values for config.json fields it leaves out, where the common reading has none.
    A multimodal class whose decoder this port runs (Gemma 3 from 4B up) also has `text_config`: the key of the
    part of its config.json that describes the decoder, read as the family's; `runtime_prefixes`: where the module
    names of transformers' class (which PEFT and vLLM adapters use) differ from its checkpoint's tensor names, as
    (checkpoint prefix, module prefix) pairs; and `other_tensors`: a regex of the checkpoint's tensors outside the
    decoder (the vision tower), which conversion leaves out; `adapter_excludes`: a regex of the class's modules
    an adapter leaves alone (PEFT's `exclude_modules`), so that its target names match in the decoder only."""

    model_type: str
    architecture: str  # transformers' class, written into converted and merged configs
    modules: tuple[tuple[str, str], ...]
    read: Callable[[Any], dict[str, Any]]
    write: Callable[[Any], dict[str, Any]]
    defaults: tuple[tuple[str, Any], ...] = ()
    text_config: str | None = None
    text_model_type: str | None = None  # the model_type written under text_config
    runtime_prefixes: tuple[tuple[str, str], ...] = ()
    other_tensors: str | None = None
    adapter_excludes: str | None = None


# transformers' ACT2FN names of the MLP gate's activations the decoder runs (`jaxmodel.layers.ACTIVATIONS`)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# the names of `layer_types` in transformers' configs (Qwen2, Qwen3, Gemma 3)
LAYER_TYPES = ("full_attention", "sliding_attention")


def read_layer_types(fields) -> tuple[bool, ...] | None:
    """`layer_types` as one flag per layer, True for a sliding-window layer; None when absent."""
    layers = fields.raw["num_hidden_layers"]
    types = fields.get("layer_types", list, None)
    if types is None:
        return None
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise fields.error(f"field 'layer_types' must list {layers} of {', '.join(LAYER_TYPES)}")
    return tuple(t == "sliding_attention" for t in types)


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
