"""Stream HuggingFace checkpoints (Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3) into the JAX port's
checkpoint format.

`convert(src, out)` is `convert-llama`; `verify(out)` re-reads a converted checkpoint against its checksums.
"""

from jaxmodel.lazy import lazy_exports

_EXPORTS = {"convert": "converter.conversion", "ConversionSummary": "converter.conversion",
            "ConversionError": "converter.errors", "verify": "jaxmodel.formats.checkpoint:verify_checkpoint"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
