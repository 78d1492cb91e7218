"""PEFT adapter export, merged HF checkpoints and PEFT import. Not built yet: see the issues."""
