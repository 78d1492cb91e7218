"""One run per run directory: the checks before a run writes anything, the lock held for the whole run, and
what a `--resume` may change.

- A new run needs an empty (or new) `--out`; `--overwrite` deletes a finetune-lora run found there, nothing else.
- `--resume` needs a run with a checkpoint, and the options that define the run (`IMMUTABLE`) unchanged; the
  others (`MUTABLE`) may change and each resume is recorded in RUN/resumes.jsonl (run_config.json stays as
  the run was started).
- `--resume` also needs the same tokens: RUN/run_data.json records, for --data and --eval-data, the digest of
  their tokenized examples (`finetune.data_cache.tokens_digest`) when the run started, and a resume whose
  data tokenizes otherwise (rows edited, added or removed, another tokenizer in --model, another tokenization)
  is refused. A run started without that record (an older version) resumes unchecked and is recorded then.
- The lock is an `flock` on RUN/.finetune-lock (pid and host inside): the OS releases it when the process
  dies, so a stale lock file never blocks; only process 0 of a multi-host run takes it (only it writes RUN).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from finetune.config import ConfigFileError, TrainConfig, flag_of
from finetune.run_dir import RESUMES, checkpoint_steps, current_run_config
from jaxmodel.errors import UserError
from jaxmodel.formats.markers import RUN, RUN_CONFIG, directory_kinds

LOCK_FILE = ".finetune-lock"
# {"step": when recorded (0: at the start), "data": {...}, "eval_data": {...}} (`finetune.setup.RunData.record`:
# per file its path, the digest of its tokens, examples, tokens, the data's fingerprint, the tokenizer's digest).
RUN_DATA = "run_data.json"
DELETING = ".finetune-deleting-"  # prefix of the directory an --overwrite moves the old run into, then deletes
DAMAGED = "damaged-checkpoints"  # where a resume moves checkpoints that do not restore (kept, not deleted)

# Options a resume cannot change, and why: each either shapes what the checkpoints hold, decides which rows
# the data position counts, or defines the function being optimised (so the run would no longer be the one
# run_config.json describes, and export-peft reads the LoRA shape and base model from there).
IMMUTABLE = {
    "model": "the base weights the adapters belong to (export-peft reads it from run_config.json)",
    "data": "the rows the stored data position counts through",
    "eval_data": "the held-out set every eval_loss in metrics.jsonl is measured on",
    "eval_fraction": "which rows of --data are held out, so which rows train",
    "data_format": "how each row becomes tokens and training targets",
    "data_split": "which rows --data names", "data_subset": "which rows --data names",
    "eval_split": "the held-out set every eval_loss in metrics.jsonl is measured on",
    "rank": "the shape of the stored adapters",
    "alpha": "the adapters' scale (export writes it from run_config.json)",
    "targets": "which modules have stored adapters",
    "rslora": "the adapters' scale (export writes it from run_config.json)",
    "lora_dropout": "the function being trained",
    "init_adapter": "the starting point and shape of the adapters",
    "batch_size": "the rows per step the stored data position counts in",
    "grad_accum": "the micro-batches each step's dropout keys are split over",
    "seq_len": "the rows themselves (packing and truncation)",
    "pack": "the rows themselves",
    "seed": "the data order and dropout keys",
    "lr": "the optimisation the stored Adam moments belong to (and the model card's learning rate)",
    "schedule": "the optimisation the stored Adam moments belong to",
    "warmup_steps": "the optimisation the stored Adam moments belong to",
    "min_lr_ratio": "the optimisation the stored Adam moments belong to",
    "weight_decay": "the optimisation the stored Adam moments belong to",
    "adam_b1": "the meaning of the stored first moments",
    "adam_b2": "the meaning of the stored second moments",
    "adam_eps": "the optimisation the stored Adam moments belong to",
    "clip_norm": "the optimisation (and 0 <-> non-zero changes the stored optimizer state's structure)",
    "dtype": "the numerics of the function being trained",
    "param_dtype": "the frozen weights the adapters are trained against",
}
# Options a resume may change (recorded in resumes.jsonl), and why they may.
MUTABLE = {
    "steps": "the schedule's length: a run can be extended or shortened",
    "eval_every": "when to evaluate, not what",
    "mesh": "the layout only: restore reshards, and losses agree across meshes to 1e-5",
    "coordinator": "the hosts only", "num_processes": "the hosts only", "process_id": "the hosts only",
    "remat": "memory/speed only, same function", "attention": "memory/speed only, same function",
    "loss_chunk": "memory/speed only, same function", "mlp_chunk": "memory/speed only, same function",
    "checkpoint_every": "when to save", "keep_checkpoints": "how many to keep",
    "stop_after": "this invocation's length", "log_every": "how often to log", "progress": "display only",
    "show_sharding": "display only",
    "data_cache": "where tokenized data is kept: the same rows either way",
    "data_workers": "speed only: the same tokens either way",
    "quantize": "planning only", "quant_block": "planning only",
    "plan": "planning only", "model_config": "planning only", "hbm_gb": "planning only", "fit": "planning only",
}
# Not compared: where the run is (the same directory, however spelled) and how this invocation treats it.
NOT_COMPARED = ("out", "resume", "overwrite")
PATHS = ("model", "data", "eval_data", "init_adapter")


class RunDirError(UserError):
    """A run directory this run may not use as asked (in use, not empty, another run's settings, ...)."""


def _same_path(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if a is None or b is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def compare(stored: TrainConfig, new: TrainConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """({refused option: (old, new)}, {allowed option: (old, new)}) where `new` differs from `stored`."""
    refused, allowed = {}, {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in NOT_COMPARED:
            continue
        old, value = getattr(stored, f.name), getattr(new, f.name)
        if (_same_path(old, value) if f.name in PATHS else old == value):
            continue
        (refused if f.name in IMMUTABLE else allowed)[f.name] = (old, value)
    return refused, allowed


def describe_changes(changes: dict[str, tuple]) -> str:
    """`--rank: 8 -> 16, --seq-len: 32 -> 64`."""
    return ", ".join(f"--{flag_of(name)}: {old} -> {new}" for name, (old, new) in changes.items())


def describe_data_changes(out: Path, recorded: dict[str, Any], data: dict[str, dict], changed: list[str]) -> str:
    """`--data X: its tokenized examples differ from those the run started with (N examples, T tokens then; ...
    now; what changed since): what to do` for the `changed` entries of `data` against those `recorded`."""
    when = ("the run started with" if recorded["step"] == 0
            else f"recorded when the run resumed from step {recorded['step']}")
    parts, files, tokenizer = [], False, False
    for name in changed:
        old, new = recorded[name], data[name]
        files_changed, tokenizer_changed = old.get("source") != new["source"], old.get("tokenizer") != new["tokenizer"]
        if files_changed or tokenizer_changed:
            why = " and ".join(["its files"] * files_changed + ["the tokenizer in --model"] * tokenizer_changed)
            why += " changed since"
        else:
            why = ("its files and the tokenizer are as they were: this version of finetune-lora tokenizes them "
                   "differently")
        files, tokenizer = files or files_changed, tokenizer or tokenizer_changed
        parts.append(f"--{flag_of(name)} {new['path']}: its tokenized examples differ from those {when} "
                     f"({_counts(old)} then; {_counts(new)} now; {why})")
    if files or tokenizer:
        fix = f"restore {' and '.join(['the data'] * files + ['the tokenizer'] * tokenizer)} the run used"
    else:
        fix = "resume with the version of finetune-lora the run started with"
    return (f"{'; '.join(parts)}: {fix}, or start a new run in another --out (export-peft --run {out} --out ADAPTER, "
            "then --init-adapter ADAPTER to start from this run's adapters)")


def _is_data_record(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("digest"), str) and isinstance(entry.get("path"), str)
            and all(isinstance(entry.get(k), int) for k in ("examples", "tokens")))


def _counts(entry: dict[str, Any]) -> str:
    return f"{entry['examples']:,} examples, {entry['tokens']:,} tokens"


def _entries(out: Path) -> list[str]:
    """What `out` holds besides this module's own lock and leftovers."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE and not p.name.startswith(DELETING))


def _inside(path: str | None, directory: Path) -> bool:
    if not path:
        return False
    try:
        return Path(path).resolve().is_relative_to(directory.resolve())
    except OSError:
        return False


@dataclasses.dataclass
class Resume:
    """What a `--resume` found: the run's config as last run, and the options this invocation changes."""

    stored: TrainConfig
    changes: dict[str, tuple]


def check_run_dir(config: TrainConfig, effective: TrainConfig) -> Resume | None:
    """Raise RunDirError unless `config` may use its `--out` as asked; reads only. `effective` is `config` as
    the run trains it (an --init-adapter's LoRA shape)."""
    out = Path(config.out)
    if config.resume and config.overwrite:
        raise ConfigFileError("--resume continues the run in --out and --overwrite deletes it: give one of them")
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    if out.is_dir() and config.model and _same_path(out, config.model):
        raise RunDirError(f"--out {out} is the --model directory; a run needs a directory of its own")
    kind = next((k for k in directory_kinds(out) if k != RUN), None)  # another tool's output: never written over
    if kind:
        raise RunDirError(f"--out {out} holds a {kind}; a run needs an empty or new directory of its own")
    has_run = (out / RUN_CONFIG).is_file()
    if config.resume:
        if not has_run:
            raise RunDirError(f"--resume: {out} holds no finetune-lora run (no {RUN_CONFIG}); nothing to resume")
        stored = current_run_config(out)
        if not checkpoint_steps(out):
            raise RunDirError(f"--resume: {out} has no checkpoint to resume from (start it anew with --overwrite)")
        refused, allowed = compare(stored, effective)
        if refused:
            raise RunDirError(f"--resume: {out} was trained with other settings, which a resume cannot change: "
                              f"{describe_changes(refused)} (give them as they were, or start a new run)")
        return Resume(stored, allowed)
    entries = _entries(out)
    if entries and not config.overwrite:
        what = "a finetune-lora run" if has_run else f"{len(entries)} entries (e.g. '{entries[0]}')"
        raise RunDirError(f"--out {out} is not empty: it holds {what}; --resume continues a run, --overwrite "
                          "deletes it and starts anew")
    if entries and not has_run:
        raise RunDirError(f"--out {out} holds files that are not a finetune-lora run (e.g. '{entries[0]}'); "
                          "--overwrite deletes only a run")
    if entries:
        for name in PATHS:
            if _inside(getattr(config, name), out):
                raise RunDirError(f"--overwrite would delete --{flag_of(name)} {getattr(config, name)}, which is "
                                  f"inside --out {out}")
    return None


class RunLock:
    """An exclusive `flock` on RUN/.finetune-lock for as long as the run lasts; the file names the holder."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @staticmethod
    def check_free(run_dir: Path) -> None:
        """Raise RunDirError naming the holder if a run holds `run_dir`'s lock (creates nothing)."""
        try:
            fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _in_use(run_dir, fd) from None
        finally:
            os.close(fd)

    @classmethod
    def acquire(cls, run_dir: Path) -> "RunLock":
        path = run_dir / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                try:
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise _in_use(run_dir, fd) from None
                finally:
                    os.close(fd)
                # a file system without flock (e.g. Lustre mounted without it): run as before locks existed
                path.unlink(missing_ok=True)
                print(f"finetune-lora: warning: cannot lock {path} ({os.strerror(e.errno)}): a second run on this directory would "
                      "not be noticed", file=sys.stderr)
                return cls(path, -1)
            try:  # the holder before us may have removed the file it locked: lock the one now at `path`
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            self.path.unlink()  # while still held, so nobody holds a lock on a file that is gone
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1


def _in_use(run_dir: Path, fd: int) -> RunDirError:
    holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "a process that is starting"
    return RunDirError(f"--out {run_dir} is in use by another finetune-lora run ({holder}); wait for it to end or "
                       "choose another --out")


class RunDir:
    """`--out` claimed by this run: checked, locked (on the process that writes it) and written as the run goes."""

    def __init__(self, config: TrainConfig, effective: TrainConfig, writer: bool):
        self.out = Path(config.out)
        self.writer = writer
        try:
            self.resume = check_run_dir(config, effective)
        except RunDirError:
            RunLock.check_free(self.out)  # a run still going on is the better reason
            raise
        self.lock: RunLock | None = None
        self.created = False
        if not writer:
            return
        self.created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self.lock = RunLock.acquire(self.out)
            check_run_dir(config, effective)  # again, now that nobody else can change it
        except BaseException:
            self.release()
            raise

    def start(self, config: TrainConfig, data: dict[str, dict] | None = None) -> None:
        """A new run: delete the run an --overwrite replaces, then write run_config.json (first) and the record
        of its `data` (run_data.json)."""
        if not self.writer:
            return
        entries = _entries(self.out)
        if entries:  # checked: a finetune-lora run, and --overwrite; renamed away first, so never half deleted
            trash = self.out / f"{DELETING}{os.getpid()}"
            trash.mkdir()
            for name in entries:
                os.rename(self.out / name, trash / name)
        for leftover in self.out.glob(f"{DELETING}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        self._write(RUN_CONFIG, json.dumps(dataclasses.asdict(config), indent=1) + "\n")
        if data is not None:
            self._write(RUN_DATA, json.dumps({"step": 0, **data}, indent=1) + "\n")

    def check_data(self, data: dict[str, dict]) -> None:
        """Raise RunDirError when the tokens of `data` (`finetune.setup.RunData.record`) differ from those
        recorded in run_data.json; a run without that record passes. Reads only (every process may check)."""
        recorded = self._recorded_data()
        if recorded is None:
            return
        data = json.loads(json.dumps(data))  # as it would be recorded (tuples are lists in JSON)
        changed = [name for name in ("data", "eval_data")
                   if name in recorded and name in data and recorded[name]["digest"] != data[name]["digest"]]
        if changed:
            raise RunDirError(f"--resume: {describe_data_changes(self.out, recorded, data, changed)}")

    def _recorded_data(self) -> dict[str, Any] | None:
        path = self.out / RUN_DATA
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RunDirError(f"{path}: cannot be read ({getattr(e, 'msg', None) or e}); restore it, or delete it "
                              "to resume without checking the data") from None
        if not (isinstance(recorded, dict) and isinstance(recorded.get("step"), int)
                and _is_data_record(recorded.get("data"))
                and ("eval_data" not in recorded or _is_data_record(recorded["eval_data"]))):
            raise RunDirError(f'{path}: expected {{"step", "data": {{"digest", "examples", "tokens", ...}}}}; restore '
                              "it, or delete it to resume without checking the data")
        return recorded

    def record_resume(self, step: int, damaged: dict[int, str], data: dict[str, dict] | None = None) -> None:
        """Append this resume (time, step resumed from, changed options [old, new], damaged steps skipped); a
        run without a record of its data (started by an older version) gets `data`'s, from this `step`."""
        if not self.writer:
            return
        if data is not None and not (self.out / RUN_DATA).exists():
            self._write(RUN_DATA, json.dumps({"step": step, **data}, indent=1) + "\n")
        entry = {"time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "from_step": step,
                 "changes": {name: list(change) for name, change in self.resume.changes.items()}}
        if damaged:
            entry["damaged_steps"] = sorted(damaged, reverse=True)
        try:
            with open(self.out / RESUMES, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise RunDirError(f"cannot write {self.out / RESUMES}: {os.strerror(e.errno or 0)}") from None

    def move_damaged(self, steps: list[int], checkpoints_dir: Path) -> Path:
        """Move checkpoints that do not restore to RUN/damaged-checkpoints/ (a resume saves those steps anew)."""
        target = self.out / DAMAGED
        if self.writer:
            target.mkdir(exist_ok=True)
            for step in steps:
                name, n = str(step), 1
                while (target / name).exists():
                    name, n = f"{step}-{n}", n + 1
                os.rename(checkpoints_dir / str(step), target / name)
        return target

    def truncate_metrics(self, step: int) -> None:
        """Drop metrics.jsonl lines after `step` (written after the checkpoint resumed from), and torn lines."""
        path = self.out / "metrics.jsonl"
        if not (self.writer and path.is_file()):
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line + "\n")
        self._write("metrics.jsonl", "".join(kept))

    def _write(self, name: str, text: str) -> None:
        """Replace RUN/name with `text`, atomically (a temporary file renamed into place)."""
        path, tmp = self.out / name, self.out / f".{name}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise RunDirError(f"cannot write {path}: {os.strerror(e.errno or 0)}") from None

    def release(self) -> None:
        """Unlock; a directory this run created and left empty is removed again."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        if self.created and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()

