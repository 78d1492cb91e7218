"""Export a finetune-lora run: PEFT adapters (`PeftModel.from_pretrained` serves them), merged HF checkpoints."""

from jaxmodel.lazy import lazy_exports

_EXPORTS = {"export_adapter": "export.adapter", "export_merged": "export.adapter",
            "check_export_targets": "export.adapter",
            "save_merged": "export.merge", "parse_size": "export.merge",
            "save_peft_adapter": "jaxmodel.formats.peft_adapter", "peft_tensors": "jaxmodel.formats.peft_adapter",
            "adapter_config": "jaxmodel.formats.peft_adapter"}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
