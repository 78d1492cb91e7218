"""Directories that appear complete or not at all: written under a temporary name, renamed into place.

The temporaries are `.{name}.{purpose}-{pid}` beside the output (`purpose`: converting, exporting, merging;
replaced for the old output moved aside, removing while it is deleted); a writer killed with SIGKILL leaves
them, and the next writer of the same output clears those whose process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPLACED = "replaced"


@contextmanager
def atomic_directory(out: Path, purpose: str) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; when the block succeeds it replaces `out` (an old
    `out` is removed only then). On any error nothing is left behind and `out` is untouched.
    `out` is resolved first: a symlink is written through, not replaced."""
    out = Path(out).resolve()
    remove_stale_temporaries(out)
    tmp = out.parent / f".{out.name}.{purpose}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.{REPLACED}-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            # Renamed before removal: a `.replaced-` directory is always a whole old output (restorable).
            trash = out.parent / f".{out.name}.removing-{os.getpid()}"
            old.rename(trash)
            shutil.rmtree(trash)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(out: Path) -> None:
    """Remove the temporaries beside `out` of writers that are no longer running (a live one is another
    writer at work: its temporaries are left alone). A writer killed after moving the old `out` aside but before
    renaming the new one in leaves no `out` and a `.replaced-` directory: that old output is put back."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(out.name)}\.([a-z]+)-(\d+)")
    stale = []
    for entry in out.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and not _running(int(match.group(2))):
            stale.append((match.group(1), entry))
    replaced = [entry for purpose, entry in stale if purpose == REPLACED and entry.is_dir()]
    if replaced and not os.path.lexists(out):
        max(replaced, key=lambda entry: entry.stat().st_mtime).rename(out)
    for _, entry in stale:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        elif os.path.lexists(entry):
            entry.unlink()


def _running(pid: int) -> bool:
    """Whether a process `pid` exists on this machine (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):
        return False
    return True
