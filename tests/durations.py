"""Where the suite's time goes: runs pytest (the README's `pytest -n 2`, any arguments passed on) with tests/timing.py
recording each test, then prints the slowest tests and a table by file: wall time, the part spent tracing, lowering
and compiling JAX programs in the test's own process, and the CPU time of the processes the tests started.

    python tests/durations.py                      # the whole suite
    python tests/durations.py -- -m "not slow and not e2e"
    python tests/durations.py --read DIR           # print the tables of an earlier run's records
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def read_records(directory: Path) -> list[dict]:
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def tables(records: list[dict], slowest: int = 50) -> str:
    lines = [f"{len(records)} tests; wall {sum(r['wall_s'] for r in records) / 60:.1f} test-minutes, of which "
             f"compiling in the test's process {sum(r['compile_s'] for r in records) / 60:.1f}; processes started "
             f"{sum(r['children_cpu_s'] for r in records) / 60:.1f} CPU-minutes", "",
             f"The {slowest} slowest tests (seconds)", "",
             "| wall | compiling | processes' CPU | test |", "|---:|---:|---:|---|"]
    for r in sorted(records, key=lambda r: -r["wall_s"])[:slowest]:
        lines.append(f"| {r['wall_s']:.1f} | {r['compile_s']:.1f} | {r['children_cpu_s']:.1f} | `{r['test']}` |")
    by_file = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for r in records:
        row = by_file[r["test"].split("::")[0]]
        row[0] += 1
        row[1] += r["wall_s"]
        row[2] += r["compile_s"]
        row[3] += r["children_cpu_s"]
    lines += ["", "By file (seconds; compiling and processes' CPU as shares of the file's wall time)", "",
              "| file | tests | wall | compiling | processes' CPU |", "|---|---:|---:|---:|---:|"]
    for name, (n, wall, compiling, children) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{name}` | {n} | {wall:.0f} | {compiling / wall:.0%} | {children / wall:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--read", type=Path, help="print the tables of the records in this directory; run nothing")
    parser.add_argument("--keep", type=Path, help="write the records to this directory (default: a temporary one)")
    parser.add_argument("--slowest", type=int, default=50)
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest, after --")
    args = parser.parse_args(argv)
    if args.read:
        print(tables(read_records(args.read), args.slowest))
        return 0
    directory = args.keep or Path(tempfile.mkdtemp(prefix="llama-jax-test-times-"))
    env = {**os.environ, "LLAMA_JAX_TEST_TIMES": str(directory)}
    start = time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "pytest", "-n", "2", *args.pytest_args],
                           cwd=Path(__file__).parent.parent, env=env)
    print(f"\npytest: {(time.perf_counter() - start) / 60:.1f} minutes of wall time, exit {code}; records in "
          f"{directory}\n")
    print(tables(read_records(directory), args.slowest))
    return code


if __name__ == "__main__":
    sys.exit(main())
