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
    `jaxmodel.config.Fields`); `write(config)` gives them back as the family's config.json spells them."""

    model_type: str
    architecture: str  # transformers' class, written into converted and merged configs
    modules: tuple[tuple[str, str], ...]
    read: Callable[[Any], dict[str, Any]]
    write: Callable[[Any], dict[str, Any]]


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
