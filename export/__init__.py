"""PEFT adapter export and import, and merged HF checkpoints."""

from export.peft import AdapterError, load_peft_adapter, peft_tensors, save_peft_adapter

__all__ = ["AdapterError", "load_peft_adapter", "peft_tensors", "save_peft_adapter"]
