"""Run checkpoints with Orbax: LoRA parameters, optimizer state, step, data position and RNG, together.

Saves are asynchronous (training goes on while the bytes are written) and the newest `keep` are kept. A
save that fails in the background is noticed at the next `check()` (once per step), not at the end of the
run. A restore without a step takes the newest checkpoint that restores (damaged ones are skipped and
named); what Orbax detects as damage is listed in docs/design.md.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from finetune.step.train_step import TrainState
from jaxmodel.errors import UserError


# The checkpoint item (and meta.json key) of an online RL run's batch of completions between its iterations.
ROLLOUT = "rollout"


class CheckpointError(UserError):
    """A checkpoint that cannot be restored (damaged, or none intact); the message names the step and directory."""


class DamagedCheckpoint(CheckpointError):
    """One step's checkpoint does not restore; `reason` says why in a few words."""

    def __init__(self, directory: Path, step: int, reason: str):
        super().__init__(f"{directory / str(step)}: damaged ({reason})")
        self.step, self.reason = step, reason


class CheckpointSaveError(CheckpointError):
    """A checkpoint that could not be written (e.g. a full disk); the message names the cause and the directory."""


class RunCheckpoints:
    def __init__(self, directory: Path, keep: int, read_only: bool = False):
        self.directory = Path(directory).absolute()
        _quiet_orbax()
        _ignore_orphaned_async_errors()
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False,
                                                   save_interval_steps=0, max_to_keep=None)
        else:  # leftovers of a save that failed (Orbax's temporary directories) are removed when a run starts
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True,
                                                   cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._in_flight: int | None = None  # the step of the save that may still be running
        self._reported = False  # a save failure was raised already (close() does not raise it twice)
        self._closed = False
        self._failed_step: int | None = None

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def reload(self) -> None:
        """See the directory as it is now (after checkpoints were moved away)."""
        self.manager.reload()

    def save(self, state: TrainState, meta: dict[str, Any], generation=None) -> None:
        """Start writing the checkpoint of `state.step`; raises CheckpointSaveError if the previous save failed.
        `generation`: an online RL run's batch of completions (`finetune.train.rollouts.Generation`) that the steps
        after this one go on training on, kept with it (its arrays as the state's are, its metrics in `meta`)."""
        self.check(wait=True)
        step = int(jax.device_get(state.step))
        tree = {"step": state.step, "lora": state.lora, "opt_state": state.opt_state,
                "rng": jax.random.key_data(state.rng)}
        items = {}
        if generation is not None:
            meta = {**meta, ROLLOUT: {"k": generation.k, "metrics": generation.metrics,
                                      "arrays": {name: [list(x.shape), str(x.dtype)]
                                                 for name, x in generation.batch.items()}}}
            items[ROLLOUT] = ocp.args.StandardSave(generation.batch)
        self._in_flight = step
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                            meta=ocp.args.JsonSave(meta), **items), force=True)
        except Exception as e:  # noqa: BLE001 - a failed write, whatever the layer reports it as
            raise self._failed(step, e) from None

    def check(self, wait: bool = False) -> None:
        """Raise CheckpointSaveError if the save in flight has failed (waiting for it to end if `wait`)."""
        if self._in_flight is None or (not wait and self.manager.is_saving_in_progress()):
            return
        step, self._in_flight = self._in_flight, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(step, e) from None

    def _failed(self, step: int, error: BaseException) -> CheckpointSaveError:
        _ignore_unawaited_coroutines()
        self._reported = True
        self._failed_step = step  # its half-written directory is removed on close(), once Orbax has stopped
        return CheckpointSaveError(f"saving the checkpoint of step {step} failed: {save_failure_cause(error)} "
                                   f"at {self.directory / str(step)}")

    def _remove_partial(self) -> None:
        """Remove the half-written directory of a failed save (never read). TensorStore writers of that step may
        still be running and write into it again: the next run's start removes what they leave."""
        if self._failed_step is not None:
            for partial in self.directory.glob(f"{self._failed_step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)

    def restore(self, like: TrainState, step: int, batch_sharding=None) -> tuple[TrainState, dict[str, Any]]:
        """The state saved at `step`, laid out with `like`'s shardings; DamagedCheckpoint if it does not restore
        (or its metadata disagrees with its step). A batch of completions saved with it comes as `meta["rollout"]`
        `{"k", "batch", "metrics"}`, its arrays laid out by `batch_sharding`."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                {"step": like.step, "lora": like.lora, "opt_state": like.opt_state,
                                 "rng": jax.random.key_data(like.rng)})
        try:
            for item in ("state/_METADATA", "meta/metadata"):  # what Orbax would otherwise report obscurely
                if not (self.directory / str(step) / item).is_file():
                    raise FileNotFoundError(errno.ENOENT, "missing", item)
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                          meta=ocp.args.JsonRestore()))
            tree, meta = restored["state"], restored["meta"]
            if not (isinstance(meta, dict) and meta.get("step") == step and int(jax.device_get(tree["step"])) == step
                    and isinstance(meta.get("data_position"), int) and meta["data_position"] >= 0):
                raise ValueError(f"its step or data position does not match step {step}: {meta!r}"[:200])
            if ROLLOUT in meta:
                saved = meta[ROLLOUT]
                abstract = {name: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=batch_sharding)
                            for name, (shape, dtype) in saved["arrays"].items()}
                batch = self.manager.restore(step, args=ocp.args.Composite(
                    **{ROLLOUT: ocp.args.StandardRestore(abstract)}))[ROLLOUT]
                meta = {**meta, ROLLOUT: {"k": saved["k"], "batch": batch, "metrics": saved["metrics"]}}
        except Exception as e:  # noqa: BLE001 - Orbax and TensorStore report damage as many exception types
            raise DamagedCheckpoint(self.directory, step, restore_failure_cause(e)) from None
        state = TrainState(tree["step"], tree["lora"], tree["opt_state"], jax.random.wrap_key_data(tree["rng"]))
        return state, meta

    def restore_newest_intact(self, like: TrainState, batch_sharding=None
                              ) -> tuple[TrainState, dict[str, Any], int, dict[int, str]]:
        """(state, meta, its step, {damaged newer step: why}) of the newest checkpoint that restores (`restore`);
        CheckpointError naming every damaged one when none does (or there is none)."""
        damaged: dict[int, str] = {}
        for step in reversed(self.steps()):
            try:
                state, meta = self.restore(like, step, batch_sharding)
            except DamagedCheckpoint as e:
                damaged[step] = e.reason
                continue
            return state, meta, step, damaged
        if not damaged:
            raise CheckpointError(f"{self.directory}: no checkpoints")
        raise CheckpointError(f"{self.directory}: no intact checkpoint ({describe_damaged(damaged)})")

    def close(self) -> None:
        """Wait for the save in flight; raises CheckpointSaveError if it failed and that was not raised before."""
        if self._closed:
            return
        self._closed = True
        try:
            self.check(wait=True)
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - a failure already reported (or being reported) by check()
                if not self._reported:
                    raise
            finally:
                self._remove_partial()


def describe_damaged(damaged: dict[int, str]) -> str:
    """`step 20 damaged (why), step 15 damaged (why)`, newest first."""
    return ", ".join(f"step {step} damaged ({why})" for step, why in sorted(damaged.items(), reverse=True))


def restore_failure_cause(error: BaseException) -> str:
    """A short reason from what Orbax/TensorStore raise for a damaged checkpoint."""
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, FileNotFoundError):
        return f"missing {error.filename}" if error.filename else f"a file is missing ({_shorten(text, 100)})"
    for code, what in (("NOT_FOUND", "a tensor file is missing"), ("DATA_LOSS", "a tensor file is corrupt"),
                       ("OUT_OF_RANGE", "a tensor file is truncated")):
        if text.startswith(code) or f" {code}:" in text:
            return f"{what} ({code})"
    if isinstance(error, json.JSONDecodeError):
        return f"a metadata file is not valid JSON ({error.msg})"
    return f"{type(error).__name__}: {_shorten(text, 100)}"


def save_failure_cause(error: BaseException) -> str:
    """The OS's reason for a failed write (e.g. 'no space left on device'), else the error's first line."""
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, OSError) and e.errno:
            return os.strerror(e.errno)[0].lower() + os.strerror(e.errno)[1:]
        e = e.__cause__ or e.__context__
    text = " ".join(str(error).split())
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO):
        reason = os.strerror(code)
        if reason.lower() in text.lower():
            return reason[0].lower() + reason[1:]
    return _shorten(text or type(error).__name__)


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _QuietOrbax(logging.Filter):
    """Orbax logs a failed background save with its whole traceback, asyncio each of its writes that failed
    with it (the run reports the failure in one line instead); Orbax warns that a directory opened read-only
    is read-only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            text = record.getMessage()
            return not ("exception was never retrieved" in text and "orbax" in text)  # Task, Future, ...
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        return record.levelno < logging.ERROR and not str(record.msg).startswith("Given directory is read only")


_FILTER = _QuietOrbax()


def _quiet_orbax() -> None:
    for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def _ignore_unawaited_coroutines() -> None:
    """After a failed save, Orbax may leave writers of that checkpoint as coroutines that never ran; Python reports
    each as a RuntimeWarning when it collects them, often at exit, under the run's one-line error. A warning, not
    an unraisable error (`_ignore_orphaned_async_errors`), and its message names no module: silenced whole, from the
    failure on."""
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


def _ignore_orphaned_async_errors() -> None:
    """A failed Orbax restore or save leaves coroutines and closed event loops behind whose errors Python prints
    as tracebacks (sys.unraisablehook) when they run or are collected; the failure itself is reported instead."""
    previous: Callable = sys.unraisablehook
    if getattr(previous, "_finetune_filter", False):
        return

    def hook(unraisable) -> None:
        code = getattr(unraisable.object, "cr_code", None)
        orphaned = (isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in
                    str(unraisable.exc_value)) or (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename)
        if not orphaned:
            previous(unraisable)

    hook._finetune_filter = True
    sys.unraisablehook = hook
