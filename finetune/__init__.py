"""LoRA fine-tuning over a named device mesh (dp, fsdp, mp). Not built yet: see the issues."""
