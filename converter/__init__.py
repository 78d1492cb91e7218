"""Stream HuggingFace Llama 3.x checkpoints into the JAX port's checkpoint format."""

from converter.convert import ConversionSummary, convert
from converter.errors import ConversionError
from jaxmodel.checkpoint import verify_checkpoint as verify

__all__ = ["ConversionError", "ConversionSummary", "convert", "verify"]
