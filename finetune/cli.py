"""`finetune-lora`: LoRA fine-tuning of a converted checkpoint on a device mesh."""

from __future__ import annotations

import math
import os
import sys

from finetune.config import load_config
from jaxmodel.errors import UserError, report

DESCRIPTION = """LoRA fine-tuning of a converted checkpoint (Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3) on a
(dp, fsdp, cp, mp) device mesh.

  finetune-lora --model CONVERTED_DIR --data train.jsonl --out RUN_DIR [--mesh dp=1,fsdp=8,mp=1] ...
  finetune-lora --plan --model-config config.json --mesh dp=1,fsdp=8,mp=1 --batch-size 16 --seq-len 64
  finetune-lora --plan --fit --model-config config.json --mesh dp=1,fsdp=8,mp=1 --batch-size 16 --seq-len 8192

Every option can also come from a YAML file (--config FILE.yaml); flags override it."""


def console() -> int:
    """The `finetune-lora` command: `main`, in a process whose malloc uses huge pages when JAX computes on the
    CPU (the command executes itself again for that: finetune/train/host_memory.py)."""
    from finetune.train.host_memory import restart_with_hugepages

    restart_with_hugepages()
    return main()


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv, "finetune-lora", DESCRIPTION, validate=False)
        if config.plan and not _jax_started():
            _simulate_devices_for_plan(config.mesh)
        config.validate()
        if config.plan:
            return _plan(config)
        from finetune.train.loop import run_training

        summary = run_training(config)
    except UserError as e:
        return report("finetune-lora", e)
    print(summary)
    return 0


def _plan(config) -> int:
    """`--plan` (`--fit`): print the plan, write it to `--plan-json`; exit 0 when it fits, else 1."""
    from finetune.planning.plan_json import check_plan_json, write_plan_json

    check_plan_json(config)  # before any compile
    if config.fit:
        from finetune.planning.fit import fit

        plan_report = fit(config)
    else:
        from finetune.planning.plan import plan

        plan_report = plan(config)
    print(plan_report)
    if config.plan_json:
        write_plan_json(config.plan_json, plan_report.record(config))
    return 0 if plan_report.fits else 1


def _jax_started() -> bool:
    """Whether JAX has created its devices already (importing jax alone does not; `XLA_FLAGS` is read then)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:
        return True
    return getattr(xla_bridge, "backends_are_initialized", lambda: True)()


def _simulate_devices_for_plan(mesh: str) -> None:
    """Give the CPU backend as many devices as the mesh names, so a plan compiles on a laptop too
    (accelerators, where present, are used instead)."""
    sizes = [int(part.partition("=")[2]) for part in mesh.split(",") if "=" in part]
    count = math.prod(s for s in sizes if s > 0) * (8 if -1 in sizes else 1)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


if __name__ == "__main__":
    sys.exit(console())
