"""Flax NNX port of HuggingFace's Llama 3.x, numerically equal to transformers' LlamaForCausalLM."""

from jaxmodel.config import ConfigError, LlamaConfig, RopeConfig
from jaxmodel.model import KVCache, LlamaForCausalLM

__all__ = ["ConfigError", "KVCache", "LlamaConfig", "LlamaForCausalLM", "RopeConfig"]
