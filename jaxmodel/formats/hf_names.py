"""Names between a family's HuggingFace tensors and this port's parameter paths, from the family's one table.

Converter, merged export, PEFT export and PEFT import all map names through `names_of(config)`. Each row of a
family's table (`jaxmodel.families`) pairs a HF module with the NNX module holding its parameters; `{i}` marks
a per-layer module, whose JAX parameters are stacked on a leading axis of that kind's layers: `layers` (dense MLP)
or `moe_layers` (experts), slice `j` of a stack being the model's layer `config.stack_layers(sparse)[j]`. A
family's per-layer rows name the `layers` stack; a sparse layer holds the same modules outside the MLP (attention
and norms) under `moe_layers`, and, instead of the dense MLP, the family's `moe_layers` rows (the router) and
experts (`Family.experts`: each expert's tensors as parts of the stacked `[e, out, in]` parameters).

The layout transform is the identity for every row: the port keeps torch's `[out, in]` weights and HF's q/k are
already in rotate-half order, so a tensor is copied as it is into its slice (an expert's tensor into its part).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import NamedTuple

from jaxmodel.families import FAMILIES
from jaxmodel.families.family import ExpertTensor

# DeepSeek-V3's router's selection bias; an FP8 checkpoint's scales of `weight`
PARAMS = ("weight", "bias", "e_score_correction_bias", "weight_scale_inv")
STACKS = {False: "layers", True: "moe_layers"}  # the JAX stack of each kind of layer (sparse: experts)

# Tensors some checkpoints carry that the model recomputes (older transformers saved the RoPE buffer).
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class Location(NamedTuple):
    """Where a HF tensor goes: JAX parameter `path`, slice `layer` of its stack (None: not per-layer), the model's
    layer `hf_layer`; for an expert's tensor, `expert` and its rows' `part` of `parts` (else None, 0, 1)."""

    path: str
    layer: int | None
    hf_layer: int | None = None
    expert: int | None = None
    part: int = 0
    parts: int = 1


class NameTable:
    """One family's names: HF tensor names <-> (JAX parameter path, slice); the module names of transformers'
    class at run time (`runtime_module`, for adapters) and the checkpoint tensors outside the decoder
    (`is_other`). `sparse_layers` is the config's flag per layer (empty: every layer dense)."""

    def __init__(self, modules: tuple[tuple[str, str], ...], runtime_prefixes: tuple[tuple[str, str], ...] = (),
                 other_tensors: str | None = None, experts: tuple[ExpertTensor, ...] = (),
                 sparse_layers: tuple[bool, ...] = (), runtime_modules: tuple[tuple[str, str], ...] = ()):
        # each present stack's layers (None: every layer, the one stack of a model without experts)
        self._stacks = {STACKS[False]: None} if not any(sparse_layers) else {
            STACKS[kind]: layers for kind in (False, True)
            if (layers := tuple(i for i, s in enumerate(sparse_layers) if s == kind))}
        rows = []
        for hf, jax in modules + runtime_modules:
            if jax.startswith(STACKS[False] + ".") and not jax.startswith(STACKS[False] + ".mlp."):
                rows.append((hf, jax))
                rows.append((hf, STACKS[True] + jax[len(STACKS[False]):]))  # in a sparse layer too
            else:
                rows.append((hf, jax))
        rows = [(hf, jax) for hf, jax in rows if jax.split(".", 1)[0] in self._stacks or "{i}" not in hf]
        self._by_hf = [(_pattern(hf + ".", PARAMS), jax, None) for hf, jax in rows]
        for suffix in ("", "_scale_inv"):  # an expert's weight, and its FP8 scales
            self._by_hf += [(_pattern(t.hf + suffix), t.jax.rsplit(".", 1)[0],
                             dataclasses.replace(t, jax=t.jax + suffix))
                            for t in experts if t.jax.split(".", 1)[0] in self._stacks]
        self._by_jax: dict[str, str] = {}
        for hf, jax in rows:
            if (hf, jax) not in runtime_modules:
                self._by_jax.setdefault(jax, hf)  # the first row naming a module is its name
        self._experts: dict[str, list[ExpertTensor]] = {}
        for t in experts:
            self._experts.setdefault(t.jax, []).append(t)
        self._runtime_prefixes = runtime_prefixes
        self._runtime_by_jax = {jax: hf for hf, jax in runtime_modules}
        self._other = re.compile(other_tensors) if other_tensors else None

    def is_other(self, name: str) -> bool:
        """Whether checkpoint tensor `name` lies outside the decoder (a multimodal model's vision tower)."""
        return self._other is not None and self._other.fullmatch(name) is not None

    def runtime_module(self, jax_module: str, layer: int | None = None, *, checkpoint_names: bool = False) -> str:
        """The module's name in transformers' class as it runs (PEFT's and vLLM's adapter keys): the checkpoint's
        module name, unless the family renames the module or its prefix (a multimodal class). `checkpoint_names`
        keeps the checkpoint's module names (transformers 4's, as the hub's per-expert layout has them: Mixtral's
        `block_sparse_moe.gate`)."""
        runtime = None if checkpoint_names else self._runtime_by_jax.get(jax_module)
        name = self.hf_module(jax_module, layer) if runtime is None else self._named(runtime, jax_module, layer)
        for checkpoint, runtime in self._runtime_prefixes:
            if name.startswith(checkpoint):
                return runtime + name[len(checkpoint):]
        return name

    def locate(self, name: str) -> Location | None:
        """Where HF tensor `name` goes; None for names outside the table or of a layer of the other kind."""
        for pattern, jax_module, expert_row in self._by_hf:
            match = pattern.fullmatch(name)
            if not match:
                continue
            groups = match.groupdict()
            hf_layer = int(groups["i"]) if groups.get("i") is not None else None
            layer = hf_layer if hf_layer is None else self._slice(jax_module, hf_layer)
            if hf_layer is not None and layer is None:
                continue  # a layer of the other kind
            if expert_row is not None:
                expert = int(groups["e"]) if groups.get("e") is not None else None
                return Location(expert_row.jax, layer, hf_layer, expert, expert_row.part, expert_row.parts)
            return Location(f"{jax_module}.{groups['param']}", layer, hf_layer)
        return None

    def hf_to_jax(self, name: str) -> tuple[str, int | None] | None:
        """`model.layers.3.mlp.up_proj.weight` -> (`layers.mlp.up_proj.weight`, 3); None for unknown names."""
        found = self.locate(name)
        return None if found is None else (found.path, found.layer)

    def jax_to_hf(self, path: str, layer: int | None = None) -> str:
        """`layers.mlp.up_proj.weight`, 3 -> `model.layers.3.mlp.up_proj.weight` (an experts' parameter: its fused
        name)."""
        if path in self._experts:
            fused = next(t for t in self._experts[path] if "{e}" not in t.hf)
            return fused.hf.format(i=self._hf_layer(path, layer))
        module, param = path.rsplit(".", 1)
        return f"{self.hf_module(module, layer)}.{param}"

    def expert_tensors(self, path: str) -> tuple[ExpertTensor, ...]:
        """An experts' parameter's tensors, one per expert and part, as the hub names them (empty for the others)."""
        return tuple(t for t in self._experts.get(path, ()) if "{e}" in t.hf)

    def expert_name(self, row: ExpertTensor, layer: int, expert: int) -> str:
        return row.hf.format(i=self._hf_layer(row.jax, layer), e=expert)

    def hf_module(self, jax_module: str, layer: int | None = None) -> str:
        """The HF module name for a JAX module path (and slice, for per-layer modules)."""
        try:
            hf = self._by_jax[jax_module]
        except KeyError:
            raise KeyError(f"no HF name for JAX module '{jax_module}'") from None
        return self._named(hf, jax_module, layer)

    def _named(self, hf: str, jax_module: str, layer: int | None) -> str:
        """A table row's HF name `hf` for `jax_module`, with the model's layer of slice `layer` for `{i}`."""
        if "{i}" in hf:
            if layer is None:
                raise ValueError(f"'{jax_module}' is per-layer: a layer index is needed")
            return hf.format(i=self._hf_layer(jax_module, layer))
        return hf

    def is_stacked(self, path: str) -> bool:
        """Whether a JAX parameter path has a leading [layers] axis."""
        if path in self._experts:
            return True
        module = path.rsplit(".", 1)[0]
        return "{i}" in self._by_jax.get(module, "")

    def _slice(self, jax_module: str, hf_layer: int) -> int | None:
        """The slice of `jax_module`'s stack holding the model's layer `hf_layer`; None for another stack's layer.
        A layer past the model's last is `hf_layer` itself, past the stack's end (the caller says so)."""
        layers = self._stacks[jax_module.split(".", 1)[0]]
        if layers is None:
            return hf_layer
        if hf_layer in layers:
            return layers.index(hf_layer)
        return hf_layer if hf_layer > max(max(v) for v in self._stacks.values()) else None

    def _hf_layer(self, jax_module: str, layer: int) -> int:
        layers = self._stacks[jax_module.split(".", 1)[0]]
        return layer if layers is None else layers[layer]


def _pattern(hf: str, params: tuple[str, ...] = ()) -> re.Pattern:
    """A row's HF name as a regex: `{i}` and `{e}` as named integers, then one of `params` (the group `param`)."""
    text = re.escape(hf).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
    return re.compile(text + (f"(?P<param>{'|'.join(params)})" if params else ""))


@functools.cache
def _table(model_type: str, sparse_layers: tuple[bool, ...]) -> NameTable:
    family = FAMILIES[model_type]
    return NameTable(family.modules, family.runtime_prefixes, family.other_tensors, family.experts, sparse_layers,
                     family.runtime_modules)


def names_of(config) -> NameTable:
    """The name table of `config`'s family and layers (`config`: a `jaxmodel.config.ModelConfig`)."""
    return _table(config.model_type, config.sparse_layers)
