"""What a tree of sharded arrays costs each device: a per-parameter table, a byte count, the adapter's line."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodel.lora import is_expert_projection


def sharding_table(*trees) -> list[str]:
    """One line per parameter: path, shape, dtype, PartitionSpec, bytes on one device."""
    lines = [f"{'parameter':<44} {'shape':<22} {'dtype':<9} {'spec':<30} {'MB/device':>10}"]
    for tree in trees:
        for path, var in nnx.to_flat_state(tree):
            value = _value(var)
            shard = value.sharding.shard_shape(value.shape)
            mb = math.prod(shard) * jnp.dtype(value.dtype).itemsize / 1e6
            name = ".".join(map(str, path))
            lines.append(f"{name:<44} {str(tuple(value.shape)):<22} {jnp.dtype(value.dtype).name:<9} "
                         f"{str(value.sharding.spec):<30} {mb:10.1f}")
    return lines


def per_device_bytes(tree) -> float:
    """Bytes one device holds of a tree of arrays / ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def adapter_summary(lora, opt_state) -> str:
    """A run's line on what it trains: the LoRA parameters (those on the routed experts among them) and what they
    and their optimizer state take on one device (split as the sharding rules split them)."""
    total = experts = 0
    for path, var in nnx.to_flat_state(lora):
        size = math.prod(_value(var).shape)
        total += size
        experts += size if is_expert_projection(".".join(map(str, path[:-1]))) else 0  # path: module, then lora_a/b
    on_experts = f" ({experts:,} of them on the routed experts)" if experts else ""
    held = per_device_bytes(lora) + per_device_bytes(opt_state)
    return f"{total:,} trainable parameters{on_experts}; {held / 1e6:,.1f} MB a device with their optimizer state"


def _value(var):
    """A state leaf's array: a Variable's value, or the leaf itself."""
    return var.get_value() if hasattr(var, "get_value") else var[...]
