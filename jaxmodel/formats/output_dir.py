"""The one rule for every directory a tool writes (convert-llama --out, export-peft --out / --merge), checked
before any work: nothing a user had may be lost to a mistyped path.

A target may be missing or empty; a target holding the tool's own kind of output is replaced only with
--overwrite; anything else (another tool's output, unrecognised files, the command's own inputs, its other
output) is refused, --overwrite or not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from jaxmodel.errors import UserError
from jaxmodel.formats.atomic import remove_stale_temporaries
from jaxmodel.formats.markers import directory_kind, directory_kinds


class OutputDirError(UserError):
    """An output directory that would replace something it must not; the message names the option and why."""


def check_output_dir(out: str | Path, *, option: str, writes: str, overwrite: bool = False,
                     inputs: Sequence[tuple[str, str | Path]] = (), separate: Sequence[tuple[str, str | Path]] = (),
                     error: type[UserError] = OutputDirError) -> Path:
    """Refuse `out` (the value of `option`) unless writing a `writes` (a `markers` kind) there loses nothing;
    returns `out` resolved (symlinks, `..`), the path to write to.

    `inputs`: (label, path) the command reads, which `out` must neither be nor contain. `separate`: (label, path)
    the command's other outputs, which `out` must neither be, contain, nor lie inside. Leftovers of killed
    writers beside `out` are cleared first (`remove_stale_temporaries`), so a directory one of them was
    replacing is back in place before it is judged.
    """
    where = f"{option} {out}"
    target = Path(out).expanduser()
    if target.exists() and not target.is_dir():
        raise error(f"{where}: exists and is not a directory")
    ancestor = next((p for p in target.parents if p.exists()), None)
    if ancestor is not None and not ancestor.is_dir():
        raise error(f"{where}: {ancestor} is not a directory")
    target = target.resolve()
    remove_stale_temporaries(target)
    for label, other in separate:
        resolved = Path(other).expanduser().resolve()
        if resolved == target:
            raise error(f"{where}: is the same directory as {label} ({other}); give each its own directory")
        if target in resolved.parents:
            raise error(f"{where}: contains {label} ({other}); give each its own directory")
        if resolved in target.parents:
            raise error(f"{where}: is inside {label} ({other}); give each its own directory")
    for label, path in inputs:
        resolved = Path(path).expanduser().resolve()
        if resolved == target or target in resolved.parents:
            relation = "is" if resolved == target else "contains"
            raise error(f"{where}: {relation} {label} ({path}), an input of this command; refusing to replace it")
    if not target.is_dir() or not any(target.iterdir()):
        return target
    kinds = directory_kinds(target)
    refuse = "refusing to replace it (choose another directory)"
    if not kinds:
        raise error(f"{where}: exists, is not empty and is not {_a(writes)}; {refuse}")
    others = [kind for kind in kinds if kind != writes]
    if others:
        raise error(f"{where}: holds {_a(others[0])}, not {_a(writes)}; {refuse}")
    for folder, dirs, _ in os.walk(target):  # os.walk does not follow symlinks: replacing removes only the link
        for name in dirs:
            inner = directory_kind(Path(folder) / name)
            if inner is not None and not (Path(folder) / name).is_symlink():
                raise error(f"{where}: holds {_a(inner)} in {Path(out) / Path(folder, name).relative_to(target)}; "
                            f"{refuse}")
    if not overwrite:
        raise error(f"{where}: already holds {_a(writes)} (pass --overwrite to replace it)")
    return target


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiouH" else "a ") + kind
