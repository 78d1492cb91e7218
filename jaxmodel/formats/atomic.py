"""Directories that appear complete or not at all: written under a temporary name, renamed into place."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_directory(out: Path, purpose: str) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; when the block succeeds it replaces `out` (an old
    `out` is removed only then). On any error nothing is left behind and `out` is untouched."""
    tmp = out.parent / f".{out.name}.{purpose}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.replaced-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
