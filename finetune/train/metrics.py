"""Per-step metrics: RUN_DIR/metrics.jsonl (one JSON object per step) and TensorBoard event files."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from finetune.run.files import METRICS, TENSORBOARD


def peak_matmul(dtype):
    """The jitted matmul `measure_peak_flops` times: operands in `dtype`, accumulated and returned in float32,
    the form every backend's fast low-precision path takes (XLA:CPU runs a bf16 dot with a bf16 result as a
    float32 one, at half the speed)."""
    return jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))


# The shortest a timed sample lasts (the matmul peak, the device report's collectives): an accelerator's call of a
# few milliseconds or less is timed several calls at a time, so that dispatching and waiting for them stay a small
# part of the sample.
TIMED_SAMPLE_SECONDS = 0.02


def seconds_per_call(call: Callable[[], object], samples: int) -> list[float]:
    """Seconds per call of `call()` (which dispatches work and returns its result without waiting), one figure a
    sample. The first sample is one call; a sample shorter than TIMED_SAMPLE_SECONDS sets how many calls, issued
    back to back, the next ones take. Compile before: every call is timed."""
    calls, seconds = 1, []
    for _ in range(samples):
        start = time.perf_counter()
        jax.block_until_ready([call() for _ in range(calls)])
        elapsed = time.perf_counter() - start
        seconds.append(elapsed / calls)
        calls = max(calls, math.ceil(TIMED_SAMPLE_SECONDS / max(elapsed / calls, 1e-9)))
    return seconds


def measure_peak_flops(dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of one device on a square matmul with operands in `dtype` (`peak_matmul`): the denominator of the
    MFU estimate of a step computing in `dtype`. Best of `repeats` samples (`seconds_per_call`). The operands are
    random: constant ones let a power-limited accelerator run its matmul faster than on real data."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    matmul = peak_matmul(dtype)
    jax.block_until_ready(matmul(a))  # compiles
    return 2.0 * size**3 / min(seconds_per_call(lambda: matmul(a), repeats))


def peak_memory_gb(devices) -> float | None:
    """The most memory any of `devices` has held at once since the process started, in GB (1e9 bytes), or None
    where the backend does not report it (`memory_stats()` is None on CPU). A host call: read it after a
    step's metrics, never between dispatches."""
    stats = [device.memory_stats() or {} for device in devices]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return max(peaks) / 1e9 if peaks else None


class MetricsWriter:
    """Writes on process 0 only; every process calls it. `purge_step`: on resume, TensorBoard drops the
    events of this step and later that an interrupted run had written (metrics.jsonl is truncated alike)."""

    def __init__(self, run_dir: Path, enabled: bool, purge_step: int | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(run_dir / METRICS, "a", encoding="utf-8")
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(run_dir / TENSORBOARD), purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            if isinstance(value, list):  # records (sampled completions): a table of text
                self._tb.add_text(key, _markdown_table(value), step)
            elif value is not None:
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def _markdown_table(records: list[dict]) -> str:
    """Records as a Markdown table (TensorBoard renders a text summary as Markdown)."""
    if not records:
        return ""
    columns = list(records[0])

    def cell(value) -> str:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in records]
    return "\n".join(lines)
