"""The step loop's prefetching: batches built and sent ahead on a thread, metrics read a step late; the same
run bit for bit as without prefetching, a non-finite loss never checkpointed, errors and stops clean."""

import dataclasses
import json
import logging
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest
from conftest import write_jsonl
from flax import nnx

import finetune.train.loop
from finetune.config import TrainConfig
from finetune.data.order import row_indices
from finetune.data.rows import DataError
from finetune.run.reading import load_run
from finetune.train.build import setup
from finetune.train.prefetch import Prefetcher
from finetune.train.loop import TrainingError, global_batch, run_training


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == Prefetcher.THREAD_NAME]


# ---- the prefetcher on its own -----------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [0, 1, 2])
def test_items_come_in_order_each_once(depth):
    with Prefetcher(lambda p: p * p, 3, 9, depth) as items:
        assert list(items) == [(p, p * p) for p in range(3, 9)]
    assert not prefetch_threads()


def test_the_producer_runs_at_most_depth_ahead():
    produced = []
    with Prefetcher(produced.append, 0, 100, depth=2) as items:
        next(items)
        time.sleep(0.3)  # ample time to run ahead, were it allowed to
        # one taken, two queued, one built and waiting for room in the queue
        assert produced == [0, 1, 2, 3]
    assert not prefetch_threads()


def test_leaving_early_stops_the_producer():
    with Prefetcher(lambda p: p, 0, 10**9, depth=2) as items:
        assert next(items) == (0, 0)
    assert not prefetch_threads()


@pytest.mark.parametrize("depth", [0, 2])
def test_a_producer_error_is_raised_where_its_item_would_come(depth):
    def produce(p):
        if p == 2:
            raise DataError(f"row {p}: bad")
        return p

    got = []
    with pytest.raises(DataError, match=r"^row 2: bad$"):
        with Prefetcher(produce, 0, 5, depth) as items:
            for item in items:
                got.append(item)
    assert got == [(0, 0), (1, 1)]
    assert not prefetch_threads()


# ---- the training loop ---------------------------------------------------------------------------------------

def addition_rows(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": f"add {a} + {b} =", "completion": f" {a + b}"} for a, b in rng.integers(0, 40, (n, 2))]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", addition_rows())


def config(tiny_converted, data_file, out, **kw) -> TrainConfig:
    # Two adapters and no rematerialisation: the quickest step to compile (nothing here depends on either).
    values = {"model": str(tiny_converted), "data": str(data_file), "out": str(out), "mesh": "dp=1,fsdp=-1,mp=1",
              "steps": 4, "batch_size": 8, "seq_len": 32, "dtype": "float32", "lr": 3e-3, "progress": False,
              "checkpoint_every": 100, "targets": "q_proj,v_proj", "remat": "none"}
    values.update(kw)
    return TrainConfig(**values).validate()


@pytest.fixture(autouse=True)
def fixed_peak(monkeypatch):
    """A fixed peak FLOP/s instead of seconds of timed matmuls per run (MFU is not under test here)."""
    monkeypatch.setattr(finetune.train.loop, "measure_peak_flops", lambda dtype: 1e12)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved_steps(out) -> list[int]:
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def flat(state) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(jax.device_get(v[...])) for k, v in nnx.to_flat_state(state)}


def hand_loop_losses(cfg: TrainConfig) -> list[float]:
    """The losses of `cfg.steps` train steps taken one by one, batch g built right before step g + 1."""
    run = setup(cfg)
    state, losses = run.state, []
    with jax.set_mesh(run.mesh):
        for g in range(cfg.steps):
            batch = global_batch(run.train_rows, lambda lo, hi, g=g: row_indices(
                len(run.train_rows), cfg.seed, g, cfg.batch_size, lo, hi), run.batch_sharding, cfg.batch_size)
            state, metrics = run.train_step(state, run.base, batch)
            losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.slow
def test_prefetched_runs_equal_the_plain_loop_and_a_resume(tmp_path, tiny_converted, data_file, monkeypatch, caplog):
    """Depth 2 (the default), depth 0 (no thread), depth 2 stopped after 2 steps and resumed, and a hand-written
    loop: the same losses bit for bit, and the same LoRA arrays at the end."""
    assert finetune.train.loop.PREFETCH_DEPTH == 2
    runs = {name: tmp_path / name for name in ("prefetched", "plain", "resumed")}
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        run_training(config(tiny_converted, data_file, runs["prefetched"]))
        run_training(config(tiny_converted, data_file, runs["resumed"], stop_after=2))
        assert saved_steps(runs["resumed"]) == [2]
        run_training(config(tiny_converted, data_file, runs["resumed"], resume=True))
        with monkeypatch.context() as m:
            m.setattr(finetune.train.loop, "PREFETCH_DEPTH", 0)
            run_training(config(tiny_converted, data_file, runs["plain"]))
    # batches made on the prefetching thread are laid out as the step expects: one compilation per run
    assert sum(r.getMessage().startswith("Compiling jit(train_step)") for r in caplog.records) == 4
    expected = hand_loop_losses(config(tiny_converted, data_file, tmp_path / "hand"))
    assert len(set(expected)) == 4  # four different batches
    final = flat(load_run(runs["plain"])[0])
    for name, out in runs.items():
        assert [r["step"] for r in records(out)] == [1, 2, 3, 4], name
        assert [r["loss"] for r in records(out)] == expected, name  # bit for bit
        lora, _, step = load_run(out)
        assert step == 4
        for key, value in flat(lora).items():
            np.testing.assert_array_equal(value, final[key], err_msg=f"{name}: {key}")
    assert not prefetch_threads()


class RowsWith:
    """Training rows that hand out `change(batch)` instead of the batch at data position `position`."""

    def __init__(self, rows, config: TrainConfig, position: int, change):
        self.rows, self.change = rows, change
        self.bad_index = row_indices(len(rows), config.seed, position, config.batch_size)

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, index: np.ndarray) -> dict[str, np.ndarray]:
        batch = self.rows.take(index)
        return self.change(batch) if np.array_equal(index, self.bad_index) else batch


def with_train_rows(monkeypatch, position: int, change) -> None:
    """Runs started from now on read their training rows through RowsWith(..., position, change)."""
    real_setup = finetune.train.loop.setup

    def patched(cfg, *args, **kw):
        run = real_setup(cfg, *args, **kw)
        return dataclasses.replace(run, train_rows=RowsWith(run.train_rows, cfg, position, change))

    monkeypatch.setattr(finetune.train.loop, "setup", patched)


def nan_mask(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}


@pytest.mark.parametrize("bad_step, steps, checkpoint_every", [
    (3, 6, 1),  # every step a checkpoint
    (4, 6, 2),  # the bad step is a checkpoint step
    (4, 4, 100),  # the bad step is the last one (the final save)
    (3, 6, 100),  # read late: found after the next step was started
])
@pytest.mark.slow
def test_a_non_finite_loss_is_never_checkpointed(tmp_path, tiny_converted, data_file, monkeypatch, bad_step, steps,
                                                 checkpoint_every):
    with_train_rows(monkeypatch, bad_step - 1, nan_mask)
    out = tmp_path / "run"
    with pytest.raises(TrainingError) as raised:
        run_training(config(tiny_converted, data_file, out, steps=steps, checkpoint_every=checkpoint_every))
    kept = [s for s in range(1, bad_step) if s % checkpoint_every == 0]
    assert str(raised.value) == (f"non-finite loss or gradient at step {bad_step} (loss nan); stopped; newest "
                                 f"checkpoint kept: {f'step {kept[-1]}' if kept else 'none'}")
    assert saved_steps(out) == kept
    assert [r["step"] for r in records(out)] == list(range(1, bad_step))
    assert not prefetch_threads()


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_every", [1, 100])
def test_a_producer_error_is_the_error_of_the_plain_loop(tmp_path, tiny_converted, data_file, monkeypatch,
                                                         checkpoint_every):
    """Rows that fail to build the batch of step 3: with prefetching, the same error, after the same steps logged
    and checkpointed, as without."""
    def fail(batch):
        raise DataError("train.jsonl: cannot read the rows of the third batch")

    with_train_rows(monkeypatch, 2, fail)
    outcomes = []
    for depth in (0, 2):
        monkeypatch.setattr(finetune.train.loop, "PREFETCH_DEPTH", depth)
        out = tmp_path / f"depth{depth}"
        with pytest.raises(DataError) as raised:
            run_training(config(tiny_converted, data_file, out, steps=6, checkpoint_every=checkpoint_every))
        outcomes.append((str(raised.value), [(r["step"], r["loss"]) for r in records(out)], saved_steps(out)))
        assert not prefetch_threads()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "train.jsonl: cannot read the rows of the third batch"
    assert [step for step, _ in outcomes[0][1]] == [1, 2]
    assert outcomes[0][2] == ([1, 2] if checkpoint_every == 1 else [])


@pytest.mark.slow
def test_sigterm_while_batches_are_prefetched(tmp_path, tiny_converted, data_file, monkeypatch):
    """SIGTERM sent while the batch of step 4 is built, ahead of the device (at the earliest once step 1 has
    started): the run stops after the steps it has started and checkpoints the last one at its data position."""
    def sigterm(batch):
        os.kill(os.getpid(), signal.SIGTERM)
        return batch

    with_train_rows(monkeypatch, 3, sigterm)
    out = tmp_path / "run"
    summary = run_training(config(tiny_converted, data_file, out, steps=50))
    assert summary.stopped_early and 1 <= summary.steps <= 4
    assert [r["step"] for r in records(out)] == list(range(1, summary.steps + 1))
    assert saved_steps(out) == [summary.steps]
    assert json.loads((out / "checkpoints" / str(summary.steps) / "meta" / "metadata").read_text())[
        "data_position"] == summary.steps
    assert not prefetch_threads()
