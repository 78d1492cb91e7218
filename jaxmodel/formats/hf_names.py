"""Names between a family's HuggingFace tensors and this port's parameter paths, from the family's one table.

Converter, merged export, PEFT export and PEFT import all map names through `names_of(config)`. Each row of a
family's table (`jaxmodel.families`) pairs a HF module with the NNX module holding its parameters; `{i}` marks
a per-layer module, whose JAX parameters are stacked on a leading [layers] axis. The layout transform is the
identity for every row: the port keeps torch's `[out, in]` weights and HF's q/k are already in rotate-half
order, so a tensor is copied as it is into its slice.
"""

from __future__ import annotations

import functools
import re

from jaxmodel.families import FAMILIES

PARAMS = ("weight", "bias")

# Tensors some checkpoints carry that the model recomputes (older transformers saved the RoPE buffer).
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class NameTable:
    """One family's names: HF tensor names <-> (JAX parameter path, layer); the module names of transformers'
    class at run time (`runtime_module`, for adapters) and the checkpoint tensors outside the decoder
    (`is_other`)."""

    def __init__(self, modules: tuple[tuple[str, str], ...], runtime_prefixes: tuple[tuple[str, str], ...] = (),
                 other_tensors: str | None = None):
        self._by_hf = [(re.compile(re.escape(hf).replace(r"\{i\}", r"(\d+)") + r"\.(" + "|".join(PARAMS) + r")"),
                        jax) for hf, jax in modules]
        self._by_jax = {jax: hf for hf, jax in modules}
        self._runtime_prefixes = runtime_prefixes
        self._other = re.compile(other_tensors) if other_tensors else None

    def is_other(self, name: str) -> bool:
        """Whether checkpoint tensor `name` lies outside the decoder (a multimodal model's vision tower)."""
        return self._other is not None and self._other.fullmatch(name) is not None

    def runtime_module(self, jax_module: str, layer: int | None = None) -> str:
        """The module's name in transformers' class as it runs (PEFT's and vLLM's adapter keys): the checkpoint's
        module name, unless the family renames its prefix (a multimodal class)."""
        name = self.hf_module(jax_module, layer)
        for checkpoint, runtime in self._runtime_prefixes:
            if name.startswith(checkpoint):
                return runtime + name[len(checkpoint):]
        return name

    def hf_to_jax(self, name: str) -> tuple[str, int | None] | None:
        """`model.layers.3.mlp.up_proj.weight` -> (`layers.mlp.up_proj.weight`, 3); None for unknown names."""
        for pattern, jax_module in self._by_hf:
            match = pattern.fullmatch(name)
            if match:
                layer = int(match.group(1)) if match.re.groups == 2 else None
                return f"{jax_module}.{match.group(match.re.groups)}", layer
        return None

    def jax_to_hf(self, path: str, layer: int | None = None) -> str:
        """`layers.mlp.up_proj.weight`, 3 -> `model.layers.3.mlp.up_proj.weight`."""
        module, param = path.rsplit(".", 1)
        return f"{self.hf_module(module, layer)}.{param}"

    def hf_module(self, jax_module: str, layer: int | None = None) -> str:
        """The HF module name for a JAX module path (and layer, for per-layer modules)."""
        try:
            hf = self._by_jax[jax_module]
        except KeyError:
            raise KeyError(f"no HF name for JAX module '{jax_module}'") from None
        if "{i}" in hf:
            if layer is None:
                raise ValueError(f"'{jax_module}' is per-layer: a layer index is needed")
            return hf.format(i=layer)
        return hf

    def is_stacked(self, path: str) -> bool:
        """Whether a JAX parameter path has a leading [layers] axis."""
        module = path.rsplit(".", 1)[0]
        return "{i}" in self._by_jax.get(module, "")


@functools.cache
def _table(model_type: str) -> NameTable:
    family = FAMILIES[model_type]
    return NameTable(family.modules, family.runtime_prefixes, family.other_tensors)


def names_of(config) -> NameTable:
    """The name table of `config`'s family (`config`: a `jaxmodel.config.ModelConfig`)."""
    return _table(config.model_type)
