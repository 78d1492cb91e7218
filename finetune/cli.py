"""`finetune-lora`: LoRA fine-tuning of a converted Llama on a device mesh."""

from __future__ import annotations

import math
import os
import sys

from finetune.config import ConfigFileError, load_config

DESCRIPTION = """LoRA fine-tuning of a converted Llama 3.x checkpoint on a (dp, fsdp, mp) device mesh.

  finetune-lora --model CONVERTED_DIR --data train.jsonl --out RUN_DIR [--mesh dp=1,fsdp=8,mp=1] ...
  finetune-lora --plan --model-config config.json --mesh dp=1,fsdp=8,mp=1 --batch-size 16 --seq-len 64

Every option can also come from a YAML file (--config FILE.yaml); flags override it."""


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv, "finetune-lora", DESCRIPTION, validate=False)
        if config.plan and "jax" not in sys.modules:
            _simulate_devices_for_plan(config.mesh)
        config.validate()
    except ConfigFileError as e:
        print(f"finetune-lora: error: {e}", file=sys.stderr)
        return 2
    from finetune.data import DataError
    from finetune.mesh import MeshError
    from finetune.train import TrainingError
    from jaxmodel.checkpoint import CheckpointError
    from jaxmodel.config import ConfigError

    from export.peft import AdapterError

    user_errors = (ConfigFileError, DataError, MeshError, CheckpointError, ConfigError, TrainingError, AdapterError)
    try:
        if config.plan:
            from finetune.plan import plan

            report = plan(config)
            print(report)
            return 0 if report.fits else 1
        from finetune.train import train

        summary = train(config)
    except user_errors as e:
        print(f"finetune-lora: error: {e}", file=sys.stderr)
        return 1
    print(summary)
    return 0


def _simulate_devices_for_plan(mesh: str) -> None:
    """Give the CPU backend as many devices as the mesh names, so a plan compiles on a laptop too
    (accelerators, where present, are used instead)."""
    sizes = [int(part.partition("=")[2]) for part in mesh.split(",") if "=" in part]
    count = math.prod(s for s in sizes if s > 0) * (8 if -1 in sizes else 1)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


if __name__ == "__main__":
    sys.exit(main())
