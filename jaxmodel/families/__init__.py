"""Model families: each HuggingFace `model_type` this port runs, as one small module (`Family`: its config.json
switches and its tensor-name table) over the one decoder.

Adding a family: a module here with its `FAMILY`, listed in `FAMILIES`; the decoder's switches
(`jaxmodel.config.ModelConfig`) where it needs one that is not there yet.
"""

from __future__ import annotations

from jaxmodel.families import deepseek_v3, gemma3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from jaxmodel.families.family import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY,
                                                           gemma3.FAMILY, gemma3.MULTIMODAL, qwen3_moe.FAMILY,
                                                           mixtral.FAMILY, deepseek_v3.FAMILY)}

__all__ = ["FAMILIES", "Family"]
