"""The lock a run holds on its directory for as long as it lasts: an `flock` on RUN/.finetune-lock (pid and host
inside). The OS releases it when the process dies, so a stale lock file never blocks; only process 0 of a
multi-host run takes it (only it writes RUN)."""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import sys
from pathlib import Path

from finetune.run.errors import RunDirError
from finetune.run.files import LOCK_FILE


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
