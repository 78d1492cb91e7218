"""Logical axis names -> mesh axes: the one table that decides how parameters are laid over devices."""

from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# The device mesh's axes, in mesh order: data parallel, fully sharded data parallel, context parallel (the
# sequence), model parallel.
MESH_AXES = ("dp", "fsdp", "cp", "mp")
# Logical axes of a batch of token rows `[batch, seq]` (input ids, targets, masks).
BATCH_AXES = ("act_batch", "act_seq")

# Weights are split over `fsdp` and `cp` together along the hidden ("embed") dimension and over `mp` along
# heads / MLP / vocab, so that every matrix is split over every device of a full mesh (with `cp` > 1 the
# frozen weights must still be model / devices per device). The layer axis stays whole: the scan walks it.
DEFAULT_RULES: Rules = (
    # parameters
    ("layers", None),
    ("embed", ("fsdp", "cp")),
    ("vocab", "mp"),
    ("heads", "mp"),
    ("kv_heads", "mp"),
    ("mlp", "mp"),
    ("norm", None),
    # a sparse layer's experts over fsdp's devices, their owners (jaxmodel/moe.py: `Experts`), so that an expert's
    # weights stay whole on one device; the embed rule then splits its hidden dimension over cp alone
    ("experts", "fsdp"),
    # B [r, out]: out is on mp, so r carries the fsdp (and cp) split; when they do not divide r, B's out
    # dimension (logical axes (out, "lora_rank"), see jaxmodel/lora.py) takes it instead.
    ("lora_rank", ("fsdp", "cp")),
    # activations: the batch over (dp, fsdp), the sequence over cp, the hidden state whole,
    # heads/mlp/vocab over mp
    ("act_batch", ("dp", "fsdp")),
    ("act_seq", "cp"),
    ("act_embed", None),
    ("act_vocab", "mp"),
)


def partition_spec(axes: Sequence[str | tuple[str, ...] | None], shape: Sequence[int], mesh: Mesh,
                   rules: Rules = DEFAULT_RULES, split_units: Sequence[int | None] | None = None) -> PartitionSpec:
    """The PartitionSpec for a parameter with logical `axes`. A dimension may name several logical axes:
    it is split over all their mesh axes that no earlier dimension took. Mesh axes of size 1 are left out
    (a spec names only real splits). A dimension that its mesh axes do not divide evenly stays unsplit
    (tiny test models; LoRA ranks below the fsdp size), as does one whose `split_units` entry (a parameter's
    metadata: FP8 codes and scales, `jaxmodel.quantization`) does not divide each part, or is None."""
    table = dict(rules)
    spec = []
    used: set[str] = set()
    units = split_units or (1,) * len(shape)
    for name, size, unit in zip(axes, shape, units):
        mesh_axes: list[str] = []
        for logical in (name,) if isinstance(name, str) or name is None else name:
            found = table.get(logical) if logical is not None else None
            mesh_axes += [found] if isinstance(found, str) else list(found or ())
        mesh_axes = tuple(dict.fromkeys(a for a in mesh_axes if mesh.shape.get(a, 1) > 1 and a not in used))
        ways = 1
        for a in mesh_axes:
            ways *= mesh.shape[a]
        if not mesh_axes or ways == 1 or unit is None or size % (ways * unit):
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def constrain(x, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES):
    """Pin an activation's sharding inside a jit when a mesh is set (`jax.set_mesh`); else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(axes, x.shape, mesh, rules))


def split_ways(logical: str, size: int, rules: Rules = DEFAULT_RULES) -> int:
    """Into how many parts the mesh set with `jax.set_mesh` splits a dimension of `size` on the logical axis
    `logical` (as `partition_spec` lays it out; 1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    entry = partition_spec((logical,), (size,), mesh, rules)[0]
    return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))


def named_sharding(axes, shape, mesh: Mesh, rules: Rules = DEFAULT_RULES, split_units=None) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, shape, mesh, rules, split_units))


def variable_sharding(var, mesh: Mesh, rules: Rules = DEFAULT_RULES, shape=None) -> NamedSharding:
    """How a parameter (an `nnx.Variable` with `axes` and maybe `split_units` metadata) lies on `mesh`."""
    metadata = var.get_metadata()
    return named_sharding(metadata["axes"], var.shape if shape is None else shape, mesh, rules,
                          metadata.get("split_units"))


def batch_mesh_axes(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes a batch's rows are split over (from the `act_batch` rule)."""
    found = dict(rules).get(BATCH_AXES[0])
    names = (found,) if isinstance(found, str) else tuple(found or ())
    return tuple(a for a in names if a in mesh.shape)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """How a batch `[batch, seq]` lies on the mesh: rows split over `batch_mesh_axes`, each row whole (callers
    check with `batch_ways` that the rows divide evenly). With `cp` the model splits the sequence itself, in
    its load-balanced order; the token rows are small next to the activations."""
    return NamedSharding(mesh, PartitionSpec(batch_mesh_axes(mesh, rules) or None))


def batch_ways(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """Into how many parts a batch's rows are split; every part must hold whole rows."""
    ways = 1
    for axis in batch_mesh_axes(mesh, rules):
        ways *= mesh.shape[axis]
    return ways
