"""`--plan-json PATH`: the plan as JSON, for scripts and for comparing layouts (docs/config.md lists the fields)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from finetune.config import ConfigFileError, TrainConfig


def json_path_problem(path: str) -> str | None:
    """Why `path` cannot be written, or None; checked before any work, by opening it for appending (a file that was
    not there is removed again)."""
    target = Path(path)
    if target.is_dir():
        return "is a directory"
    if not target.parent.is_dir():
        return f"directory {target.parent} does not exist"
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        target.unlink()
    return None


def check_plan_json(config: TrainConfig) -> None:
    if config.plan_json and (problem := json_path_problem(config.plan_json)):
        raise ConfigFileError(f"--plan-json {config.plan_json}: {problem}")


def plan_record(config: TrainConfig, report) -> dict:
    """The plan `report` of `config` as a JSON object (sizes in bytes per device, times in seconds)."""
    record = {"mesh": dict(report.mesh), "batch_size": config.batch_size,
              "seq_len": config.seq_len, "dtype": config.dtype, "remat": config.remat, "grad_accum": config.grad_accum,
              "objective": config.objective, "backend": report.backend,
              "memory": {"total_bytes": report.total, "fits": report.fits, "capacity_bytes": report.capacity,
                         "weights_bytes": report.weights, "lora_and_optimizer_bytes": report.lora_and_optimizer,
                         "batch_bytes": report.batch, "temporaries_bytes": report.temp, "margin_bytes": report.margin},
              "device_model": None, "predicted": None, "collectives": None}
    if report.prediction is not None:
        record["device_model"] = report.prediction.device
        record["predicted"] = report.prediction.as_json()
        record["collectives"] = report.prediction.collectives
    if report.rollout:  # an online RL run's sampler and log-prob passes, and a step with its share of them
        record["rollout"] = [phase.as_json() for phase in report.rollout]
        record["step_seconds_with_rollout"] = report.step_seconds
    return record


def write_plan_json(path: str, record: dict) -> None:
    """Write `record` to `path` whole or not at all (a temporary file renamed into place)."""
    target = Path(path)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

