"""`run_training(config)`: a LoRA fine-tuning run on a device mesh, resumable, with metrics and checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from finetune.run.checkpoints import CheckpointError, CheckpointSaveError, RunCheckpoints, describe_damaged
from finetune.config import TrainConfig
from finetune.step.mesh import initialize_distributed
from finetune.train.batches import batch_at, global_batch, pair_batch
from finetune.train.prefetch import Prefetcher
from finetune.step.flops import flops_per_token
from finetune.train.metrics import MetricsWriter, measure_peak_flops, peak_memory_gb
from finetune.run.directory import RunDir
from finetune.run.errors import RunDirError
from finetune.run.files import CHECKPOINTS, METRICS, TENSORBOARD
from finetune.rollout.rewards import Reward, RewardError, load_reward
from finetune.train.build import Run, setup, with_adapter_shape
from finetune.train.generations import eval_generations
from finetune.train.rollouts import Generation, Rollouts
from finetune.step.train_step import DTYPES, TrainState
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
    peak_memory_gb: float | None = None  # of the busiest device of this process; None where the backend says nothing

    def __str__(self) -> str:
        how = "stopped by SIGTERM after" if self.stopped_early else "trained"
        losses = f"loss {self.first_loss:.4f} -> {self.last_loss:.4f}" if self.last_loss is not None else "no steps"
        memory = f", peak device memory {self.peak_memory_gb:.1f} GB" if self.peak_memory_gb is not None else ""
        return f"{how} {self.steps} steps, {losses}, {self.tokens_per_s:,.0f} tokens/s, {self.seconds:.1f} s{memory}"


# Global batches built and sent to the devices ahead of the step that takes them (0: built in the step loop).
# Each one held ahead costs one more batch of device memory (a few int32/float32 [batch, seq] arrays).
PREFETCH_DEPTH = 2


def run_training(config: TrainConfig) -> RunSummary:
    """Train as `config` says (resuming if asked); returns the summary `finetune-lora` prints.

    `--out` is checked before anything is written (a new run needs an empty directory, a resume the same
    run settings) and locked for the whole run (see `finetune.run.directory`)."""
    initialize_distributed(config.coordinator, config.num_processes, config.process_id)
    is_main = jax.process_index() == 0  # the one process that writes the run directory
    rewards = [load_reward(spec) for spec in config.reward]  # a reward that does not load: before anything is written
    run_dir = _claim(config, is_main)
    try:
        return _train(config, run_dir, is_main, rewards)
    finally:
        run_dir.release()


def _on_every_process(check: Callable[[], None], elsewhere: str) -> None:
    """Run `check` on every process; when it raises a UserError on any of them, all raise together (that one its
    own error, the others RunDirError(`elsewhere`)) rather than some waiting for the others forever."""
    error = None
    try:
        check()
    except UserError as e:
        error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ok = multihost_utils.process_allgather(np.int32(error is None))
        if error is None and not np.all(ok):
            error = RunDirError(elsewhere)
    if error is not None:
        raise error


def _claim(config: TrainConfig, is_main: bool) -> RunDir:
    """The run directory, checked on every process and locked by process 0; all processes fail together."""
    claimed: list[RunDir] = []
    try:
        _on_every_process(lambda: claimed.append(RunDir(config, with_adapter_shape(config), writer=is_main)),
                          f"another process could not use --out {config.out} (see its error)")
    except UserError:
        for run_dir in claimed:
            run_dir.release()
        raise
    return claimed[0]


def resume(run_dir: RunDir, checkpoints: RunCheckpoints, state: TrainState, run: Run,
           is_main: bool) -> tuple[TrainState, int, dict | None]:
    """The state of the newest intact checkpoint, its data position (global batches consumed) and the batch of
    completions it was in the middle of (an online RL run's, else None). Damaged newer checkpoints are moved aside,
    metrics.jsonl loses the steps after the one resumed from, and the resume is recorded in resumes.jsonl."""
    out = Path(run.config.out)
    try:
        with jax.set_mesh(run.mesh):
            state, meta, restored, damaged = checkpoints.restore_newest_intact(state, run.batch_sharding)
    except CheckpointError as e:
        checkpoints.close()
        raise TrainingError(f"--resume: {e}") from None
    if damaged:
        moved = run_dir.move_damaged(sorted(damaged), out / CHECKPOINTS)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("finetune: damaged checkpoints moved")
        checkpoints.reload()
        if is_main:
            print(f"finetune-lora: warning: {out / CHECKPOINTS}: {describe_damaged(damaged)}; resuming from step "
                  f"{restored} (the damaged checkpoints are kept in {moved})", file=sys.stderr)
    run_dir.truncate_metrics(restored)  # metrics.jsonl never holds a step twice
    run_dir.record_resume(restored, damaged, run.data_record)
    return state, int(meta["data_position"]), meta.get("rollout")


class StopOnSigterm:
    """From `install()` to `restore()`, SIGTERM (a scheduler ending the job) asks the loop to stop after the step
    in flight, with a checkpoint, instead of killing the process."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def install(self) -> "StopOnSigterm":
        self._previous = signal.signal(signal.SIGTERM, self._request)
        return self

    def _request(self, *_) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _train(config: TrainConfig, run_dir: RunDir, is_main: bool, rewards: list[Reward]) -> RunSummary:
    def check_data(data: dict[str, dict]) -> None:  # every process compares with the record process 0 made
        _on_every_process(lambda: run_dir.check_data(data),
                          "--resume: another process found data other than the run's (see its error)")

    run = setup(config, check_data=check_data if config.resume else None)
    config = run.config  # with an --init-adapter's LoRA shape
    mesh, state, frozen = run.mesh, run.state, run.frozen
    out = Path(config.out)
    if not config.resume:  # what export-peft needs to rebuild the model and read the checkpoints, written first
        run_dir.start(config, run.data_record)
    checkpoints = RunCheckpoints(out / CHECKPOINTS, config.keep_checkpoints)
    position = 0  # global batches consumed
    rollouts = Rollouts(config, run, rewards) if config.policy else None
    if config.resume:
        state, position, generation = resume(run_dir, checkpoints, state, run, is_main)
        if generation is not None:  # stopped between the iterations of a batch of completions: the same batch goes on
            rollouts.current = Generation(**generation)
    start_step = int(jax.device_get(state.step))
    metrics = MetricsWriter(out, enabled=is_main, purge_step=start_step + 1 if config.resume else None)
    stop = StopOnSigterm().install()

    train_rows, batch_sharding = run.train_rows, run.batch_sharding
    flops = flops_per_token(run.llama, config.seq_len, reference_forward=config.reference_forward)
    peak = measure_peak_flops(DTYPES[config.dtype]) * mesh.devices.size  # the mesh may leave devices unused
    memory_devices = mesh.local_devices
    started = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=config.steps, initial=start_step, desc="finetune", disable=not (config.progress and is_main))
    last_step = min(config.steps, start_step + config.stop_after) if config.stop_after else config.steps
    evaluating = run.eval_rows is not None and config.eval_every > 0
    rows_per_step = train_rows.rows_per_step if config.preference else config.rows_per_step
    reader = _StepReader(config, checkpoints, bar, flops, peak, start_step, rows_per_step)

    def log(step: int, record: dict) -> None:  # called once the step is read, so the memory read waits on nothing
        if step % config.log_every == 0 or step == config.steps:
            peak_memory = peak_memory_gb(memory_devices)
            if peak_memory is not None:
                record = {**record, "peak_memory_gb": peak_memory}
            _write_metrics(metrics, out, step, record)

    def evaluation(state: TrainState, step: int) -> dict:
        try:
            if rollouts is not None:
                return rollouts.evaluate(state)
        except RewardError as e:  # the user's function: what it did, and what the run kept
            raise TrainingError(f"{e}; stopped at the evaluation of step {step}; {kept()}") from None
        record = evaluate(run, state, config)
        if config.eval_generate:
            record["eval_generations"] = eval_generations(run, state)
        return record

    def kept() -> str:
        """What a run that stops now leaves: its newest complete checkpoint (the save in flight waited for)."""
        try:
            checkpoints.check(wait=True)
        except CheckpointSaveError:
            pass  # raised, and reported, where the run goes on from
        newest = checkpoints.latest_step()
        return f"newest checkpoint kept: {'step ' + str(newest) if newest is not None else 'none'}"

    def save(state: TrainState, step: int) -> None:
        meta = {"data_position": position + step - start_step, "step": step}
        generation = None
        if rollouts is not None and step % config.num_iterations:  # the next step trains on the same completions
            generation = rollouts.current
        checkpoints.save(state, meta, generation)

    # Step s + 1 is started before step s's metrics are read, so the devices never wait for the host. A step
    # whose state is needed (eval, checkpoint) is read before the next one starts: the next step donates the
    # state, and a checkpoint must only ever hold steps whose loss was checked.
    started_step = saved = start_step
    pending = None  # (step, metrics) of the newest step started and not yet read
    make_batch = ((lambda g: pair_batch(train_rows, batch_sharding, g)) if config.preference
                  else (lambda g: batch_at(train_rows, config, batch_sharding, g)))
    # an online RL run's batches are sampled from the policy of the step before: nothing can be built ahead
    batches = (contextlib.nullcontext() if rollouts is not None else
               Prefetcher(make_batch, position, position + last_step - start_step, PREFETCH_DEPTH))
    finished = False  # the step loop and the last save came through: a close's own error is the run's
    try:
        with jax.set_mesh(mesh), batches:
            if rollouts is not None and run.eval_rows is not None and not config.resume:
                log(0, evaluation(state, 0))  # the base's held-out rewards, which training is measured against
                reader.restart_clock()
            while started_step < last_step and not stop.requested:
                try:
                    if rollouts is not None:
                        if pending is not None and rollouts.samples_at(started_step + 1):
                            # the sampler waits for the step before: read it now, so each step's time is its own
                            log(*reader.read(*pending))
                            pending = None
                        batch, generated = rollouts.batch_for(state, started_step + 1)
                    else:
                        _, batch = next(batches)
                except Exception as e:
                    if pending is not None:  # read first, as a loop that builds each batch after the step before
                        log(*reader.read(*pending))
                    if isinstance(e, RewardError):  # the user's function: what it did, and what the run kept
                        raise TrainingError(f"{e}; stopped before step {started_step + 1}; {kept()}") from None
                    raise
                state, m = run.train_step(state, frozen, batch)
                if rollouts is not None:
                    m = {**m, **generated}
                started_step += 1
                if pending is not None:
                    log(*reader.read(*pending))
                pending = (started_step, m)
                eval_now = evaluating and started_step % config.eval_every == 0
                if eval_now or started_step % config.checkpoint_every == 0:
                    step, record = reader.read(*pending)
                    pending = None
                    if step % config.checkpoint_every == 0:  # first: an evaluation that fails loses no step
                        save(state, step)
                        saved = step
                    if eval_now:
                        record.update(evaluation(state, step))
                    log(step, record)
                    reader.restart_clock()  # eval and saving are not step time
            if pending is not None:
                log(*reader.read(*pending))
                pending = None
            if reader.done > saved:  # the last step (the end, --stop-after, SIGTERM) is always checkpointed
                save(state, reader.done)
            if run.eval_rows is not None and not config.eval_every and reader.done == config.steps:
                _write_metrics(metrics, out, reader.done, evaluation(state, reader.done))
            checkpoints.close()  # waits for the last save: a run is done when its checkpoint is
            finished = True
    except CheckpointSaveError as e:
        kept = checkpoints.latest_step()
        raise TrainingError(f"{e}; stopped after step {reader.done}; newest checkpoint kept: "
                            f"{'step ' + str(kept) if kept is not None else 'none'}") from None
    finally:
        bar.close()
        try:
            checkpoints.close()
        except CheckpointSaveError:
            pass  # raised above already, or the run is failing for another reason being raised
        try:
            metrics.close()
        except OSError as e:  # TensorBoard's last flush, on a full disk: a failing run's own error goes first
            if finished:
                raise _write_failed(out / TENSORBOARD, e, reader.done) from None
        finally:
            stop.restore()
    elapsed = time.perf_counter() - started
    return RunSummary(reader.done - start_step, reader.first_loss, reader.last_loss,
                      reader.tokens_seen / max(elapsed, 1e-9), elapsed, stopped_early=stop.requested,
                      peak_memory_gb=peak_memory_gb(memory_devices))


class _StepReader:
    """Reads each step's metrics once it is done: stops the run on a failed save or a non-finite loss, and
    makes the step's metrics.jsonl record and progress-bar update."""

    def __init__(self, config: TrainConfig, checkpoints: RunCheckpoints, bar, flops: float, peak: float,
                 start_step: int, rows_per_step: int):
        self.config, self.checkpoints, self.bar, self.flops, self.peak = config, checkpoints, bar, flops, peak
        self.done = start_step  # steps read and found finite
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.tokens_seen = 0.0
        self.tokens_per_step = rows_per_step * config.seq_len  # every position the step computes, padding too
        self.restart_clock()

    def restart_clock(self) -> None:
        """Time the next step from now (after work between steps that is not training)."""
        self._clock = time.perf_counter()

    def read(self, step: int, m: dict[str, jax.Array]) -> tuple[int, dict]:
        """(step, record) for the train step `step` that returned metrics `m`; waits for it to finish."""
        m = jax.device_get(m)
        now = time.perf_counter()  # steps run back to back: the wall time since the previous one finished
        seconds, self._clock = now - self._clock, now
        self.checkpoints.check()  # a save that failed in the background stops the run now
        loss = float(m["loss"])
        if not (math.isfinite(loss) and math.isfinite(float(m["grad_norm"]))):
            kept = self.checkpoints.latest_step()
            raise TrainingError(f"non-finite loss or gradient at step {step} (loss {loss}); stopped; newest checkpoint "
                                f"kept: {'step ' + str(kept) if kept is not None else 'none'}")
        assert step == self.done + 1, (step, self.done)
        self.done = step
        if "_positions" in m:  # an online RL step: its rows as long as their prompts' bucket, its sampling included
            m["time/step_s"] = seconds
        tokens = m.pop("_positions", self.tokens_per_step)
        self.tokens_seen += tokens
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss
        self.bar.update(1)
        postfix = {"loss": f"{loss:.4f}"}
        if "rewards/accuracies" in m:  # a preference objective: how often the chosen completion wins
            postfix["accuracy"] = f"{float(m['rewards/accuracies']):.2f}"
        if "reward" in m:  # an online RL objective: the mean reward of the step's completions
            postfix["reward"] = f"{float(m['reward']):.3f}"
        self.bar.set_postfix(postfix)
        record = {"loss": loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                  "tokens_per_s": tokens / seconds, "mfu": self.flops * tokens / seconds / self.peak,
                  "target_tokens": int(m["tokens"])}
        for name, value in m.items():  # an objective's own metrics, in the step's order
            if name not in ("loss", "lr", "grad_norm", "tokens"):
                record[name] = int(value) if name == "pairs" else value if isinstance(value, list) else float(value)
        return step, record


def _write_metrics(metrics: MetricsWriter, out: Path, step: int, record: dict) -> None:
    try:
        metrics.write(step, record)
    except OSError as e:
        raise _write_failed(out / METRICS, e, step) from None


def _write_failed(path: Path, error: OSError, step: int) -> TrainingError:
    """The one line of a run stopped by a metrics file it could not write."""
    return TrainingError(f"cannot write {path}: {os.strerror(error.errno or 0)}; stopped at step {step}")


def evaluate(run: Run, state: TrainState, config: TrainConfig) -> dict[str, float]:
    """{"eval_loss": mean target-token loss over the whole eval set} (padded to whole batches with loss-free
    rows); with a preference objective the mean pair loss and `eval_` + each of its metrics, over every pair."""
    rows = run.eval_rows
    if config.preference:
        sums: dict[str, float] = {}
        for g in range(rows.eval_steps):
            out = jax.device_get(run.eval_step(state.lora, run.frozen, pair_batch(rows, run.batch_sharding, g, True)))
            sums = {k: sums.get(k, 0.0) + float(v) for k, v in out.items()}
        pairs = max(sums.pop("pairs"), 1.0)
        sums.pop("tokens")
        return {f"eval_{k}": v / pairs for k, v in sums.items()}
    loss_sum = tokens = 0.0
    b = config.batch_size
    for g in range(len(rows) // b):
        batch = global_batch(rows, lambda lo, hi, g=g: np.arange(g * b + lo, g * b + hi), run.batch_sharding, b,
                             config.seq_len)
        l, n = jax.device_get(run.eval_step(state.lora, run.frozen, batch))
        loss_sum, tokens = loss_sum + float(l), tokens + float(n)
    return {"eval_loss": loss_sum / max(tokens, 1.0)}
