"""LoRA fine-tuning over a named device mesh (dp, fsdp, cp, mp), resumable, with a memory plan before any run.

    from finetune import TrainConfig, run_training, plan
    summary = run_training(TrainConfig(model="converted/llama", data="train.jsonl", out="runs/r1").validate())

Names are imported on first use (see `jaxmodel.lazy`), so `--plan` can still choose its simulated devices.
"""

from jaxmodel.lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "finetune.config", "ConfigFileError": "finetune.config", "load_config": "finetune.config",
    "run_training": "finetune.train", "RunSummary": "finetune.train", "TrainingError": "finetune.train",
    "Run": "finetune.setup",
    "plan": "finetune.planning", "PlanReport": "finetune.planning", "fit": "finetune.fitting",
    "FitReport": "finetune.fitting", "usable_memory": "finetune.allocator",
    "load_run": "finetune.run_dir", "read_run_config": "finetune.run_dir", "RunError": "finetune.run_dir",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
