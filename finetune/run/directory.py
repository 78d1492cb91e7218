"""One run per run directory: the checks before a run writes anything, the lock held for the whole run, and
what a `--resume` may change.

- A new run needs an empty (or new) `--out`; `--overwrite` deletes a finetune-lora run found there, nothing else.
- `--resume` needs a run with a checkpoint, and the options that define the run (`IMMUTABLE`) unchanged; the
  others (`MUTABLE`) may change and each resume is recorded in RUN/resumes.jsonl (run_config.json stays as
  the run was started).
- `--resume` also needs the same tokens: RUN/run_data.json records, for --data and --eval-data, the digest of
  their tokenized examples (`finetune.data.cache.tokens_digest`) when the run started, and a resume whose
  data tokenizes otherwise (rows edited, added or removed, another tokenizer in --model, another tokenization)
  is refused. A run started without that record (an older version) resumes unchecked and is recorded then.
- The lock is an `flock` on RUN/.finetune-lock (pid and host inside): the OS releases it when the process
  dies, so a stale lock file never blocks; only process 0 of a multi-host run takes it (only it writes RUN).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
from pathlib import Path

from finetune.config import ConfigFileError, TrainConfig, flag_of
from finetune.run.data_record import describe_data_changes, read_data_record
from finetune.run.errors import RunDirError
from finetune.run.files import BASE_SOURCE, DAMAGED, DELETING, LOCK_FILE, METRICS, RESUMES, RUN_CONFIG, RUN_DATA
from finetune.run.lock import RunLock
from finetune.run.policy import PATHS, compare, describe_changes, same_path
from finetune.run.reading import checkpoint_steps, current_run_config
from jaxmodel.formats.checkpoint import MANIFEST, checkpoint_source, read_manifest
from jaxmodel.formats.markers import RUN, directory_kinds

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
    if out.is_dir() and config.model and same_path(out, config.model):
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
        """A new run: delete the run an --overwrite replaces, then write run_config.json (first), the record
        of its `data` (run_data.json) and the source of its base (base_source.json, when --model records one)."""
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
        source = checkpoint_source(read_manifest(config.model), Path(config.model) / MANIFEST)
        if source is not None:
            self._write(BASE_SOURCE, json.dumps(source, indent=1) + "\n")

    def check_data(self, data: dict[str, dict]) -> None:
        """Raise RunDirError when the tokens of `data` (`finetune.data.prepare.RunData.record`) differ from those
        recorded in run_data.json; a run without that record passes. Reads only (every process may check)."""
        recorded = read_data_record(self.out / RUN_DATA)
        if recorded is None:
            return
        data = json.loads(json.dumps(data))  # as it would be recorded (tuples are lists in JSON)
        changed = [name for name in ("data", "eval_data")
                   if name in recorded and name in data and recorded[name]["digest"] != data[name]["digest"]]
        if changed:
            raise RunDirError(f"--resume: {describe_data_changes(self.out, recorded, data, changed)}")

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
        path = self.out / METRICS
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
        self._write(METRICS, "".join(kept))

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

