"""`run_training(config)`: a LoRA fine-tuning run on a device mesh, resumable, with metrics and checkpoints."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from finetune.checkpoints import CheckpointError, CheckpointSaveError, RunCheckpoints, describe_damaged
from finetune.config import TrainConfig
from finetune.data import Rows, row_indices
from finetune.mesh import initialize_distributed
from finetune.metrics import MetricsWriter, flops_per_token, measure_peak_flops
from finetune.run_guard import RunDir, RunDirError
from finetune.setup import Run, setup, with_adapter_shape
from finetune.step import DTYPES, TrainState
from jaxmodel.errors import UserError


class TrainingError(RuntimeError, UserError):
    """A run that cannot go on (e.g. a non-finite loss); the message says what happened and what was kept."""


@dataclasses.dataclass
class RunSummary:
    steps: int
    first_loss: float | None
    last_loss: float | None
    tokens_per_s: float
    seconds: float
    stopped_early: bool = False

    def __str__(self) -> str:
        how = "stopped by SIGTERM after" if self.stopped_early else "trained"
        losses = f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}" if self.last_loss is not None else "no steps"
        return f"{how} {self.steps} steps, {losses}, {self.tokens_per_s:,.0f} tokens/s, {self.seconds:.1f} s"


def global_batch(rows: Rows, indices_for, sharding: NamedSharding, batch_size: int) -> dict[str, jax.Array]:
    """The global batch as arrays laid out by `sharding`; this process reads only its own devices' rows."""
    seq_len = rows.input_ids.shape[1]
    index_map = sharding.addressable_devices_indices_map((batch_size, seq_len))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop if idx[0].stop is not None else batch_size for idx in index_map.values()})
    lo, hi = starts[0], stops[-1]
    local = rows.take(indices_for(lo, hi))
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, seq_len)) for k, v in local.items()}


def run_training(config: TrainConfig) -> RunSummary:
    """Train as `config` says (resuming if asked); returns the summary `finetune-lora` prints.

    `--out` is checked before anything is written (a new run needs an empty directory, a resume the same
    run settings) and locked for the whole run (see `finetune.run_guard`)."""
    initialize_distributed(config.coordinator, config.num_processes, config.process_id)
    is_main = jax.process_index() == 0  # the one process that writes the run directory
    run_dir = _claim(config, is_main)
    try:
        return _train(config, run_dir, is_main)
    finally:
        run_dir.release()


def _claim(config: TrainConfig, is_main: bool) -> RunDir:
    """The run directory, checked on every process and locked by process 0; all processes fail together."""
    error, run_dir = None, None
    try:
        run_dir = RunDir(config, with_adapter_shape(config), writer=is_main)
    except UserError as e:
        error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = multihost_utils.process_allgather(np.int32(error is None))
        if error is None and not np.all(ok):
            run_dir.release()
            error = RunDirError(f"another process could not use --out {config.out} (see its error)")
    if error is not None:
        raise error
    return run_dir


def _train(config: TrainConfig, run_dir: RunDir, is_main: bool) -> RunSummary:
    run = setup(config)
    config = run.config  # with an --init-adapter's LoRA shape
    mesh, state, base = run.mesh, run.state, run.base
    out = Path(config.out)
    if not config.resume:  # what export-peft needs to rebuild the model and read the checkpoints, written first
        run_dir.start(config)
    checkpoints = RunCheckpoints(out / "checkpoints", config.keep_checkpoints)
    position = 0  # global batches consumed
    if config.resume:
        try:
            with jax.set_mesh(mesh):
                state, meta, restored, damaged = checkpoints.restore_newest_intact(state)
        except CheckpointError as e:
            checkpoints.close()
            raise TrainingError(f"--resume: {e}") from None
        position = int(meta["data_position"])
        if damaged:
            moved = run_dir.move_damaged(sorted(damaged), out / "checkpoints")
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("finetune: damaged checkpoints moved")
            checkpoints.reload()
            if is_main:
                print(f"finetune-lora: warning: {out / 'checkpoints'}: {describe_damaged(damaged)}; resuming from step "
                      f"{restored} (the damaged checkpoints are kept in {moved})", file=sys.stderr)
        run_dir.truncate_metrics(restored)  # metrics.jsonl never holds a step twice
        run_dir.record_resume(restored, damaged)
    start_step = int(jax.device_get(state.step))
    metrics = MetricsWriter(out, enabled=is_main, purge_step=start_step + 1 if config.resume else None)
    stop = {"sigterm": False}
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("sigterm", True))

    train_rows, batch_sharding = run.train_rows, run.batch_sharding
    flops = flops_per_token(run.llama, config.seq_len)
    peak = measure_peak_flops(DTYPES[config.dtype]) * jax.device_count()
    first_loss = last_loss = None
    tokens_seen, started = 0.0, time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=config.steps, initial=start_step, desc="finetune", disable=not (config.progress and is_main))
    step = start_step
    last_step = min(config.steps, start_step + config.stop_after) if config.stop_after else config.steps
    try:
        with jax.set_mesh(mesh):
            while step < last_step and not stop["sigterm"]:
                batch = global_batch(train_rows, lambda lo, hi, g=position: row_indices(
                    len(train_rows), config.seed, g, config.batch_size, lo, hi), batch_sharding, config.batch_size)
                t0 = time.perf_counter()
                new_state, m = run.train_step(state, base, batch)
                m = jax.device_get(m)
                seconds = time.perf_counter() - t0
                checkpoints.check()  # a save that failed in the background stops the run now
                if not (math.isfinite(float(m["loss"])) and math.isfinite(float(m["grad_norm"]))):
                    kept = checkpoints.latest_step()
                    raise TrainingError(f"non-finite loss or gradient at step {step + 1} (loss {float(m['loss'])}); "
                                        f"stopped; newest checkpoint kept: "
                                        f"{'step ' + str(kept) if kept is not None else 'none'}")
                state, position, step = new_state, position + 1, step + 1
                tokens = config.batch_size * config.seq_len
                tokens_seen += tokens
                loss = float(m["loss"])
                first_loss = loss if first_loss is None else first_loss
                last_loss = loss
                record = {"loss": loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                          "tokens_per_s": tokens / seconds, "mfu": flops * tokens / seconds / peak,
                          "target_tokens": int(m["tokens"])}
                if run.eval_rows is not None and config.eval_every and step % config.eval_every == 0:
                    record["eval_loss"] = evaluate(run, state, config)
                if step % config.log_every == 0 or step == config.steps:
                    _write_metrics(metrics, out, step, record)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
                if step % config.checkpoint_every == 0 or step == last_step or stop["sigterm"]:
                    checkpoints.save(state, {"data_position": position, "step": step})
            if run.eval_rows is not None and not config.eval_every and step == config.steps:
                _write_metrics(metrics, out, step, {"eval_loss": evaluate(run, state, config)})
            checkpoints.close()  # waits for the last save: a run is done when its checkpoint is
    except CheckpointSaveError as e:
        kept = checkpoints.latest_step()
        raise TrainingError(f"{e}; stopped after step {step}; newest checkpoint kept: "
                            f"{'step ' + str(kept) if kept is not None else 'none'}") from None
    finally:
        bar.close()
        try:
            checkpoints.close()
        except CheckpointSaveError:
            pass  # raised above already, or the run is failing for another reason being raised
        metrics.close()
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.perf_counter() - started
    return RunSummary(step - start_step, first_loss, last_loss, tokens_seen / max(elapsed, 1e-9), elapsed,
                      stopped_early=stop["sigterm"])


def _write_metrics(metrics: MetricsWriter, out: Path, step: int, record: dict) -> None:
    try:
        metrics.write(step, record)
    except OSError as e:
        raise TrainingError(f"cannot write {out / 'metrics.jsonl'}: {os.strerror(e.errno or 0)}; stopped at step "
                            f"{step}") from None


def evaluate(run: Run, state: TrainState, config: TrainConfig) -> float:
    """Mean target-token loss over the whole eval set (padded to whole batches with loss-free rows)."""
    rows = run.eval_rows
    loss_sum = tokens = 0.0
    for g in range(len(rows) // config.batch_size):
        batch = global_batch(rows, lambda lo, hi, g=g: np.arange(g * config.batch_size + lo, g * config.batch_size + hi),
                              run.batch_sharding, config.batch_size)
        l, n = jax.device_get(run.eval_step(state.lora, run.base, batch))
        loss_sum, tokens = loss_sum + float(l), tokens + float(n)
    return loss_sum / max(tokens, 1.0)
