"""Flax NNX port of HuggingFace's Llama 3.x, Mistral, Qwen2/2.5 and Qwen3 (`jaxmodel.families`), numerically equal
to transformers' classes of each.

    from jaxmodel import load_pretrained, generate, LoraConfig, apply_lora
    model = load_pretrained("converted/llama-3.2-1b")            # a convert-llama output directory
    logits = model(input_ids)                                     # float32 [batch, seq, vocab]
    tokens = generate(model, input_ids, max_new_tokens=32)

`jaxmodel.formats` holds every on-disk format the tools share (HF checkpoints and names, the converted
checkpoint, PEFT adapters, directory markers). Names are imported on first use (see `jaxmodel.lazy`).
"""

from jaxmodel.lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "jaxmodel.config", "RopeConfig": "jaxmodel.config", "ConfigError": "jaxmodel.config",
    "CausalLM": "jaxmodel.model", "KVCache": "jaxmodel.model",
    "load_pretrained": "jaxmodel.pretrained",
    "generate": "jaxmodel.generation",
    "LoraConfig": "jaxmodel.lora", "apply_lora": "jaxmodel.lora",
    "load_peft_adapter": "jaxmodel.formats.peft_adapter", "save_peft_adapter": "jaxmodel.formats.peft_adapter",
    "UserError": "jaxmodel.errors",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
