"""`Family`: what one HuggingFace `model_type` adds to the one decoder, and its tensor names."""

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
