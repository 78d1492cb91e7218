"""Shared helpers of the benchmarks that drive the real command-line tools (`convert-llama`, `finetune-lora`)
as child processes and read what they leave behind: a locally built model, text data, a child's wall time and
peak RSS, the figures of a `finetune-lora --plan` report, and step times from a run's metrics.jsonl.

Nothing here imports jax, torch or the toolkit at module level (nor anywhere in this process): the benchmark
process stays a small plain Python process, which `run_cli`'s peak-RSS figure relies on (see there). Building
the model with torch happens in a child process too.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9

# Console scripts installed beside the interpreter that runs the benchmark (the venv's bin/).
BIN = Path(sys.executable).parent

_BUILD = r"""
import json, sys
from demo.tiny import build_tiny_model
build_tiny_model(sys.argv[1], json.loads(sys.argv[2]), seed=0)
"""


def choices(option: str) -> tuple[str, ...]:
    """finetune-lora's choices for `option` (a TrainConfig field)."""
    from typing import get_args, get_type_hints

    from finetune.config import TrainConfig

    return get_args(get_type_hints(TrainConfig)[option])


@dataclasses.dataclass
class CliRun:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # wall time of the child, start to exit
    peak_rss: int  # bytes: the child's ru_maxrss (see run_cli)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error_lines(self, n: int = 3) -> str:
        """The last few non-empty lines of stderr (then stdout), for a one-line failure report."""
        lines = [line for line in (self.stderr or self.stdout).splitlines() if line.strip()]
        return " | ".join(lines[-n:])


def build_model(workdir: str | Path, config: dict) -> Path:
    """A small Llama built locally (seeded random float32 weights and a tokenizer, demo.tiny) and converted with
    the real `convert-llama`; returns the converted directory. `config` overrides demo.tiny.TINY_CONFIG.

    The converted directory is named by a hash of `config`, and `config` is written beside it as JSON: a later
    call with the same config reuses it (compared field by field), anything else builds afresh.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    converted, written = workdir / f"converted-{key}", workdir / f"converted-{key}.json"
    if converted.is_dir() and written.is_file() and json.loads(written.read_text()) == config:
        return converted
    hf_dir = workdir / f"hf-{key}"
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.rmtree(converted, ignore_errors=True)
    written.unlink(missing_ok=True)
    print(f"building the model in {hf_dir} (torch, float32) and converting it to {converted} ...", flush=True)
    start = time.perf_counter()
    build_hf_model(hf_dir, config)
    run = run_cli(["convert-llama", "--src", str(hf_dir), "--out", str(converted), "--no-progress"])
    if not run.ok:
        raise RuntimeError(f"convert-llama failed (exit {run.returncode}): {run.error_lines()}")
    shutil.rmtree(hf_dir, ignore_errors=True)
    written.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    print(f"model ready in {time.perf_counter() - start:.0f} s", flush=True)
    return converted


def build_hf_model(out: str | Path, config: dict) -> Path:
    """demo.tiny.build_tiny_model(out, config, seed=0) in a child process: torch and the model's weights never
    enter this process (see run_cli)."""
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", _BUILD, str(out), json.dumps(config)], cwd=root, check=True)
    return Path(out)


def write_text_data(path: str | Path, tokens_needed: int, seed: int, row_words: int = 1000) -> Path:
    """JSONL of `{"text": ...}` rows of `row_words` random words from demo.tiny.CORPUS_WORDS, about
    2 x `tokens_needed` words in all: the tiny tokenizer makes about one token per word (plus BOS and EOS per
    row), so packing (finetune-lora's default) fills every batch of the requested steps. Pass
    `row_words = seq_len - 2` for one document per sequence, filling it exactly (a longer row is cut to one full
    sequence and the rest of it is lost; shorter rows are packed several to a sequence).
    """
    try:
        from demo.tiny import CORPUS_WORDS  # plain Python: no torch at import
    except ImportError:  # the repository's root, when the toolkit is not installed
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from demo.tiny import CORPUS_WORDS

    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    total, row_words = 2 * tokens_needed, max(1, row_words)
    with open(path, "w", encoding="utf-8") as f:
        while total > 0:
            f.write(json.dumps({"text": " ".join(rng.choices(CORPUS_WORDS, k=row_words))}) + "\n")
            total -= row_words
    return path


def console_script(name: str) -> list[str]:
    """The command line that runs console script `name`: the script installed beside sys.executable, or where the
    toolkit is not installed (a copy of the tree on a GPU machine, PYTHONPATH at its root) its entry point from
    pyproject.toml through this interpreter."""
    if (BIN / name).is_file():
        return [str(BIN / name)]
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    module, function = re.search(rf'^{re.escape(name)} = "([\w.]+):(\w+)"$', pyproject, re.MULTILINE).groups()
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.argv[0] = {name!r}; "
                                  f"sys.exit({function}())"]


def run_cli(args: list[str], env: dict | None = None) -> CliRun:
    """Run a console script installed beside sys.executable (`args[0]`, e.g. "finetune-lora") with its
    arguments; returns its exit code, output, wall seconds and peak RSS.

    The peak RSS is the child's ru_maxrss from wait4. Linux carries the parent's RSS peak across fork + exec
    into the child's maxrss (at exec the kernel keeps the high-water mark of the image it replaces, which is the
    parent's memory), so the figure is max(this process's peak RSS so far, the child's own peak). It is the
    child's own only because this process stays small: the benchmarks that use this never import jax, torch or
    the toolkit, and build models in child processes (own_peak_rss() shows the bound). Keep it that way.
    """
    command = [*console_script(args[0]), *map(str, args[1:])]
    full_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err, env=full_env)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        return CliRun(args=command, returncode=proc.returncode, stdout=out.read(), stderr=err.read(),
                      seconds=seconds, peak_rss=usage.ru_maxrss * 1024)


# `  NAME   12.34 GB`: two leading spaces, a name, two or more spaces (the report pads names to 40 characters and
# numbers to 10), a number, " GB", and possibly a remark after it (`  total  0.92 GB  (compiler's figure 0.89 GB)`).
# Verdict lines (`  fits in 750.0 GB per device`, `  usable: 1000 GB x 0.75 = ...`) have one space and do not match.
_FIGURE = re.compile(r"^  (\S.*?)\s{2,}(-?\d+(?:\.\d+)?) GB(?:\s.*)?$")


def plan_figures(stdout: str) -> dict:
    """The figures of a `finetune-lora --plan` report, in GB: {"frozen weights", "LoRA params + AdamW state",
    "batch", "activations / temporaries", "total", ...: float} as printed, plus

      "margin": the figure of a line whose name starts with "margin" (0.0 when there is none),
      "margin_name": that line's name (None when absent),
      "compiler": total - margin, the compiler's own figure (the report's "(compiler's figure X GB)" remark on
                  the total line when it has one: the same figure without the double rounding),
      "does_not_fit": whether the report says DOES NOT FIT.
    """
    figures: dict = {}
    margin, margin_name, compiler = 0.0, None, None
    for line in stdout.splitlines():
        match = _FIGURE.match(line)
        if not match:
            continue
        name, value = match.group(1).strip(), float(match.group(2))
        if name.startswith("margin"):
            margin, margin_name = value, name
        if name == "total":
            remark = re.search(r"compiler's figure (-?\d+(?:\.\d+)?) GB", line)
            compiler = float(remark.group(1)) if remark else None
        figures[name] = value
    figures["margin"], figures["margin_name"] = margin, margin_name
    if "total" in figures:
        figures["compiler"] = compiler if compiler is not None else figures["total"] - margin
    figures["does_not_fit"] = "DOES NOT FIT" in stdout
    return figures


def step_seconds(run_dir: str | Path) -> list[float]:
    """Seconds of each step after the first (which includes compilation), from RUN_DIR/metrics.jsonl
    (`tokens_per_s` per step; tokens per step = batch_size x seq_len from RUN_DIR/run_config.json)."""
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "run_config.json").read_text())
    tokens = config["batch_size"] * config["seq_len"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = sorted((r for r in records if "tokens_per_s" in r), key=lambda r: r["step"])
    return [tokens / r["tokens_per_s"] for r in records[1:]]


def own_peak_rss() -> int:
    """This process's peak RSS in bytes: a floor under every run_cli figure (see there), so it must stay small."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# The instructions that set a CPU's matmul peaks, in the order printed: AVX2 only where AVX-512 is missing (its FMA
# is then the float32 peak), AVX-512 with BF16 dot products, and AMX tiles (a bf16 peak several times float32's).
MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description(cpuinfo: str | None = None, cores: int | None = None) -> str:
    """`model name` from /proc/cpuinfo (or `cpuinfo`), the cores this process may use, and which of MATMUL_FLAGS
    the CPU has: two machines of the same core count can differ 1.5-1.8x in their float32 peak and 4x in bf16."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    if "avx512f" in flags:
        flags.discard("avx2")
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    named = [flag for flag in MATMUL_FLAGS if flag in flags]
    return f"{model}, {cores} cores" + (f" ({', '.join(named)})" if named else "")


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the option (`PROG: error: ...`), no usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
