"""LoRA fine-tuning over a named device mesh (dp, fsdp, cp, mp), resumable, with a memory plan before any run.

    from finetune import TrainConfig, run_training, plan
    summary = run_training(TrainConfig(model="converted/llama", data="train.jsonl", out="runs/r1").validate())

Names are imported on first use (see `jaxmodel.lazy`), so `--plan` can still choose its simulated devices.
"""

from jaxmodel.lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "finetune.config", "ConfigFileError": "finetune.config", "load_config": "finetune.config",
    "run_training": "finetune.train.loop", "RunSummary": "finetune.train.loop", "TrainingError": "finetune.train.loop",
    "Run": "finetune.train.build",
    "plan": "finetune.planning.plan", "PlanReport": "finetune.planning.plan", "fit": "finetune.planning.fit",
    "FitReport": "finetune.planning.fit", "usable_memory": "finetune.planning.allocator",
    "load_run": "finetune.run.reading", "read_run_config": "finetune.run.reading", "RunError": "finetune.run.reading",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
