"""Mutation check: plant each plausible bug of tests/mutations.toml in a copy of the repository, one at a time,
run the tests that should catch it there, and report which bugs survived.

    python tests/mutate.py [--only TEXT ...] [--list] [--no-baseline] [--keep] [--timeout SECONDS]

Each mutation replaces an exact `old` text, which must occur exactly once in its file, with `new`; the list is
refused otherwise, so it cannot rot silently. The working tree is copied (without .git, .tox, virtual
environments and caches) and pytest runs with the copy as its working directory and first on PYTHONPATH, so
the mutated modules are the ones imported, not an installed (editable) package's; a sentinel mutation checks
that first, for pytest and for the subprocesses tests start. A baseline run then checks that the selected
tests pass on the unmutated copy. Per mutation it prints caught/survived, seconds and the failing test.

A node id that selects no test (not written yet, or renamed) is reported; a mutation left without tests
counts as survived. Exit status: 0 when every mutation was caught, 1 when one was not (survived, no tests,
failing unmutated, timeout), 2 when the list or the copy is unusable.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTATIONS = Path(__file__).resolve().parent / "mutations.toml"
PACKAGES = ("jaxmodel", "finetune", "export", "converter", "demo")
# Never copied: version control, environments, caches, build output.
SKIPPED = {".git", ".tox", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "build",
           "dist", "runs", "demo-output"}


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, at least one of which must fail under the mutation
    why: str = ""


@dataclasses.dataclass
class Outcome:
    mutation: Mutation
    status: str  # caught, survived, no tests, error, timeout, invalid (its tests fail unmutated)
    seconds: float
    detail: str = ""


def load_mutations(path: Path = MUTATIONS) -> list[Mutation]:
    """The mutations of a TOML file (`[[mutation]]` tables with name, file, old, new, tests, why)."""
    raw = tomllib.loads(path.read_text())
    mutations = []
    for i, entry in enumerate(raw.get("mutation", []), 1):
        missing = {"name", "file", "old", "new", "tests"} - entry.keys()
        unknown = entry.keys() - {f.name for f in dataclasses.fields(Mutation)}
        if missing or unknown:
            raise SystemExit(f"{path}: mutation {i} ({entry.get('name', '?')}): "
                             f"missing {sorted(missing)}, unknown {sorted(unknown)}")
        mutations.append(Mutation(**{**entry, "tests": tuple(entry["tests"])}))
    names = [m.name for m in mutations]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"{path}: duplicate mutation names {duplicates}")
    return mutations


def problems(mutations: list[Mutation], root: Path) -> list[str]:
    """Why mutations cannot be applied to the tree at `root`: an `old` text not found exactly once, or no change."""
    found = []
    for m in mutations:
        target = root / m.file
        if not target.is_file():
            found.append(f"{m.name}: {m.file} does not exist")
            continue
        count = target.read_text().count(m.old)
        if count != 1:
            found.append(f"{m.name}: `old` occurs {count} times in {m.file} (must be exactly once)")
        if m.old == m.new:
            found.append(f"{m.name}: `old` and `new` are the same")
    return found


def copy_tree(source: Path, destination: Path) -> Path:
    """The working tree without version control, environments and caches."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in SKIPPED or n.endswith(".egg-info")}
        # any virtual environment, whatever its name
        return skip | {n for n in names if (Path(directory) / n / "pyvenv.cfg").exists()}

    shutil.copytree(source, destination, ignore=ignore, symlinks=True)
    return destination


class Planted:
    """A mutation applied to a file of the copy for the duration of a `with` block."""

    def __init__(self, root: Path, file: str, old: str, new: str):
        self.path, self.old, self.new = root / file, old, new

    def __enter__(self):
        self.original = self.path.read_text()
        assert self.original.count(self.old) == 1, self.path
        self.path.write_text(self.original.replace(self.old, self.new))
        return self

    def __exit__(self, *exc):
        self.path.write_text(self.original)


# A pytest plugin for the runs: a failing hypothesis example is enough to catch a mutation, so none is shrunk
# (shrinking can take minutes). Loaded once the conftest has chosen its profile, before test modules import.
PLUGIN = '''
from hypothesis import Phase, settings


def pytest_sessionstart(session):
    settings.register_profile("mutations", parent=settings.default, phases=(Phase.explicit, Phase.generate))
    settings.load_profile("mutations")
'''
PLUGIN_NAME = "mutation_run_settings"


def write_plugin(work: Path) -> Path:
    """The plugin's directory (outside the copy, so the copy stays the working tree)."""
    directory = work / "plugins"
    directory.mkdir(exist_ok=True)
    (directory / f"{PLUGIN_NAME}.py").write_text(PLUGIN)
    return directory


def pytest_env(copy: Path) -> dict[str, str]:
    """The copy first on the import path (also for subprocesses tests start), then the plugin; no bytecode
    caches (a mutation and its undo may share a file's size and mtime second); derandomized hypothesis draws."""
    path = [str(copy), str(write_plugin(copy.parent)), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1",
            "HYPOTHESIS_PROFILE": "ci"}


def run_pytest(copy: Path, args: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, output) of pytest in the copy."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-p", PLUGIN_NAME, "-rfE",
           "--basetemp", str(copy.parent / "pytest-tmp"), *args]
    proc = subprocess.Popen(cmd, cwd=copy, env=pytest_env(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: pytest and any process a test started
        out, _ = proc.communicate()
        return None, out
    except BaseException:  # interrupted: leave no test processes behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def failed_ids(output: str) -> list[str]:
    """Node ids pytest's short summary (-rfE) reports as failed or errored."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)


SENTINEL_TEST = '''
import importlib, os, subprocess, sys

import pytest

PACKAGES = {packages!r}


def test_the_copy_and_its_mutation_are_imported():
    for name in PACKAGES:
        module = importlib.import_module(name)
        assert module.__file__.startswith({root!r}), (name, module.__file__)
        assert getattr(module, "MUTATION_SENTINEL", None) == {token!r}, name


@pytest.mark.slow
def test_subprocesses_import_the_copy_too():
    code = "import importlib; print([getattr(importlib.import_module(n), 'MUTATION_SENTINEL', None) for n in %r])"
    out = subprocess.run([sys.executable, "-c", code % (PACKAGES,)], capture_output=True, text=True, cwd="/",
                         env=os.environ, check=True).stdout
    assert out.strip() == str([{token!r}] * len(PACKAGES))
'''


def check_sentinel(copy: Path, timeout: float) -> str | None:
    """None if a trivial mutation planted in each package of the copy is what pytest (and a subprocess
    started from a test) imports; else what went wrong."""
    token = f"sentinel-{os.getpid()}-{time.time_ns()}"
    test_file = copy / "tests" / "mutation_sentinel_check.py"
    test_file.write_text(SENTINEL_TEST.format(packages=PACKAGES, root=str(copy) + os.sep, token=token))
    inits = {copy / name / "__init__.py": (copy / name / "__init__.py").read_text() for name in PACKAGES}
    try:
        for path, text in inits.items():
            path.write_text(text + f"\nMUTATION_SENTINEL = {token!r}\n")
        code, out = run_pytest(copy, [str(test_file.relative_to(copy))], timeout)
    finally:
        for path, text in inits.items():
            path.write_text(text)
        test_file.unlink()
    return None if code == 0 else out[-3000:]


def collect(copy: Path, mutations: list[Mutation], timeout: float) -> set[str]:
    """Node ids of every test in the test files the mutations name (files that do not exist are left out)."""
    files = sorted({n.split("::")[0] for m in mutations for n in m.tests if (copy / n.split("::")[0]).is_file()})
    if not files:
        return set()
    _, out = run_pytest(copy, ["--collect-only", "--continue-on-collection-errors", *files], timeout)
    return {line.strip() for line in out.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))}


def selects(node_id: str, test_id: str) -> bool:
    """Whether `node_id` (a file, a test, or a parametrized test) selects the collected `test_id`."""
    return test_id == node_id or test_id.startswith((node_id + "::", node_id + "["))


def resolve(m: Mutation, collected: set[str]) -> tuple[list[str], list[str]]:
    """(the mutation's node ids that select collected tests, those that select none: not written or renamed)."""
    present = [n for n in m.tests if any(selects(n, t) for t in collected)]
    return present, [n for n in m.tests if n not in present]


def run_mutation(copy: Path, m: Mutation, tests: list[str], missing: list[str], timeout: float) -> Outcome:
    note = f"no such test: {', '.join(missing)}" if missing else ""
    if not tests:
        return Outcome(m, "no tests", 0.0, note)
    start = time.perf_counter()
    with Planted(copy, m.file, m.old, m.new):
        code, out = run_pytest(copy, ["-x", *tests], timeout)  # the first failure is enough
    seconds = time.perf_counter() - start
    if code is None:
        return Outcome(m, "timeout", seconds, note)
    if code in (1, 2):  # tests failed, or collection failed (the mutation broke an import)
        return Outcome(m, "caught", seconds, " ".join(failed_ids(out)[:3]) or out.strip().splitlines()[-1])
    if code == 0:
        return Outcome(m, "survived", seconds, note)
    return Outcome(m, "error", seconds, f"pytest exit {code}: {out.strip().splitlines()[-1] if out.strip() else ''}")


def baseline(copy: Path, node_ids: list[str], timeout: float) -> tuple[list[str], str]:
    """(tests among `node_ids` that fail on the unmutated copy, pytest's last line): a mutation that such a
    test 'catches' would prove nothing."""
    if not node_ids:
        return [], ""
    code, out = run_pytest(copy, node_ids, timeout * 4)
    last = out.strip().splitlines()[-1] if out.strip() else f"pytest exit {code}"
    return ([] if code == 0 else failed_ids(out) or ["(no summary)"]), last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="run mutations whose name contains TEXT")
    parser.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the selected tests unmutated")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per mutation's test run")
    parser.add_argument("--mutations", type=Path, default=MUTATIONS, help="the mutation list (TOML)")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    # SIGTERM (tox, CI cancelling) unwinds like Ctrl-C: the running tests are killed, the copy removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    mutations = load_mutations(args.mutations)
    if args.only:
        mutations = [m for m in mutations if any(text in m.name for text in args.only)]
    wrong = problems(mutations, ROOT)
    if args.list:
        for m in mutations:
            print(f"{m.name}\n  {m.file}: {m.why}\n  tests: {' '.join(m.tests)}")
    if wrong:
        print("mutations that cannot be applied:\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 2
    if args.list:
        return 0

    work = Path(tempfile.mkdtemp(prefix="mutate-"))
    try:
        copy = copy_tree(ROOT, work / "repo")
        print(f"copy of {ROOT} in {copy}", flush=True)
        wrong = problems(mutations, copy)  # the copy is what gets mutated: check it too
        sentinel = check_sentinel(copy, args.timeout)
        if wrong or sentinel:
            print("\n".join(wrong) or f"the tests do not import the mutated copy:\n{sentinel}", file=sys.stderr)
            return 2
        print("sentinel: pytest and its subprocesses import the copy", flush=True)
        collected = collect(copy, mutations, args.timeout)
        selections = {m.name: resolve(m, collected) for m in mutations}
        broken: dict[str, list[str]] = {}
        if not args.no_baseline:
            start = time.perf_counter()
            node_ids = list(dict.fromkeys(n for present, _ in selections.values() for n in present))
            failing, last = baseline(copy, node_ids, args.timeout)
            print(f"baseline: {last} ({time.perf_counter() - start:.0f} s)", flush=True)
            for m in mutations:
                hit = [f for f in failing if f == "(no summary)" or any(selects(n, f) for n in selections[m.name][0])]
                if hit:
                    broken[m.name] = hit
        started = time.perf_counter()
        outcomes = []
        for m in mutations:
            if m.name in broken:
                outcome = Outcome(m, "invalid", 0.0, "fails unmutated: " + " ".join(broken[m.name]))
            else:
                outcome = run_mutation(copy, m, *selections[m.name], args.timeout)
            outcomes.append(outcome)
            print(f"{outcome.status:>9}  {outcome.seconds:6.0f} s  {m.name}" +
                  (f"  [{outcome.detail}]" if outcome.detail else ""), flush=True)
        total = time.perf_counter() - started
        survivors = [o for o in outcomes if o.status != "caught"]
        print(f"\n{len(outcomes) - len(survivors)} of {len(outcomes)} mutations caught; mutations {total:.0f} s, "
              f"total with copy, sentinel, collection and baseline {time.perf_counter() - began:.0f} s")
        for o in survivors:
            print(f"  {o.status}: {o.mutation.name} ({o.mutation.file}); tests: {' '.join(o.mutation.tests)}")
        return 1 if survivors else 0
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
