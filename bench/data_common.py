"""Shared parts of the data-preparation benchmarks (bench/data_speed.py, bench/data_memory.py,
bench/data_workers.py): the generated data, the models, the measured child processes and the report's
helpers. Nothing here is a measurement of its own.

Data (generated, seeded, kept in --workdir): `text` rows (`{"text"}`, words per row log-normal, median 150,
10-1000) and `chat` rows (`{"messages"}`: a system message in a third of the rows, then 2-4 user/assistant
exchanges; words per user message median 15 (3-200), per assistant message median 40 (5-400)); --row-scale
multiplies those word counts. Words are drawn with Zipf frequencies from a fixed vocabulary: demo.tiny's corpus
words as the most frequent ones and 20,000 pronounceable pseudo-words with English word lengths (mean about 5
letters), 8% followed by a comma and 6% by a period: realistic-ish characters per word, a long tail of rare
words (as real text has, which is what keeps a tokenizer's word cache from answering everything). A row
averages about 200 (text) and 230 (chat) words, some 800-900 tokens of the tiny tokenizer (which cuts the
pseudo-words into letters) and 450-550 of Llama 3's; 1M rows are 1.3-1.5 GB of JSONL.

Tokenizers: `tiny`, the byte-level BPE of the demo/test model (demo.tiny: vocab 512, Llama-3-style chat
template); `llama3`, a real tokenizer.json given by --tokenizer-json (Meta's Llama 3: vocab 128256), with the
Llama-3-style template of demo.tiny set on it when it has none. Each gets a small model built locally
(bench/data_model_child.py: demo.tiny's shape, vocab = the tokenizer's, max positions 8192) and converted with
`convert-llama`.

The measured sides, each a child process whose stderr is read line by line (timestamped as each line arrives)
and whose process tree's anonymous memory is sampled:
  limit        bench/data_limit_child.py: render each chat once and batch-encode every text, nothing else.
  CLI          `finetune-lora --steps 1 --batch-size 1 --seq-len 4096 --mesh dp=1,fsdp=1,cp=1,mp=1
               --no-progress --data-cache DIR` with its own HF_DATASETS_CACHE (cold: both empty, so the JSON ->
               Arrow conversion is part of a first run; warm: the same again, a cache hit). Its figure is the
               `prepared in S s` of its `finetune-lora: data: ... cache miss|hit ...` line on stderr; were the
               line to carry no seconds, the time from the process's start to the line (interpreter start,
               imports and the tokenizer's loading included). The run is stopped there (its process group
               killed: nothing after the line is measured) unless --whole-runs.
  load_data    bench/data_load_child.py: `finetune.data.prepare.load_data` alone, timed in a process that has
               imported everything (datasets too) and initialised JAX first: the preparation alone.
  start-up     the CLI's fixed part of its figures: a warm run on a 64-row chat file.
Tokenizer processes ("workers"): the processes that tokenize, as `finetune.data.workers.default_workers` gives
them for the rows and the `--data-workers` passed (none passed: one per core this process may use, at most one
per MIN_ROWS_PER_WORKER rows); one means the CLI's own process tokenizes, with no pool. Spawned tokenizer
processes are counted in each cold run's process tree (a warning when they are not the count planned less one:
the CLI's own process tokenizes beside them). Tokens: the store's exact count (meta.json of the cache entry the
data line names). Peak anonymous memory: the sum of RssAnon (/proc/PID/status: not file-backed or memory-mapped
file pages) over the process and all its children, sampled every 50 ms (new children found every 250 ms); for
CLI runs up to the data line (the data phase).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cli_runs import BIN

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# The measured children and the model's builder: small scripts of their own, run with this interpreter.
LIMIT_CHILD = BENCH / "data_limit_child.py"
LOAD_DATA_CHILD = BENCH / "data_load_child.py"
MODEL_CHILD = BENCH / "data_model_child.py"

KINDS = ("text", "chat")
TOKENIZERS = ("tiny", "llama3")
SEQ_LEN = 4096
MESH = "dp=1,fsdp=1,cp=1,mp=1"
SAMPLE_SECONDS = 0.05
RESCAN = 5  # samples between two searches for new child processes
DATA_VERSION = 2  # part of the data files' names: bump when the generator changes
STARTUP_ROWS = 64
LOAD_DATA_ROWS = 100_000  # --load-data-rows' default: each size up to it costs one more cold build

MB = 1e6
DATA_LINE = re.compile(r"^finetune-lora: data: (.*)$")
CACHE_STATUS = re.compile(r"cache (hit|miss) \(([^)]*)\)")
LINE_SECONDS = re.compile(r"\bin (\d+(?:\.\d+)?) ?s\b")  # "... in 12.3 s": used when the line carries it

TITLES = {"limit": "limit", "cli cold": "CLI cold", "cli warm": "CLI warm", "load_data cold": "load_data cold",
          "load_data warm": "load_data warm"}


def repo_import(name: str):
    """Module `name` from this repository, as the measured children import it (PYTHONPATH first)."""
    import importlib

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(name)


# ---- generated data -------------------------------------------------------------------------------------

# Share of English word tokens by length in letters (1..12), roughly as in running text.
_WORD_LENGTHS = (0.03, 0.17, 0.20, 0.16, 0.11, 0.09, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01)
_CONSONANTS, _VOWELS = "bcdfghjklmnprstvwyz", "aeiou"


def vocabulary(n_pseudo: int = 20_000, seed: int = 0) -> list[str]:
    """demo.tiny's corpus words, then `n_pseudo` distinct pronounceable pseudo-words with English word lengths:
    in order of frequency rank."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = list(repo_import("demo.tiny").CORPUS_WORDS)  # plain Python at import: no torch
    seen = set(words)
    lengths = rng.choice(np.arange(1, len(_WORD_LENGTHS) + 1), size=4 * n_pseudo,
                         p=np.array(_WORD_LENGTHS) / sum(_WORD_LENGTHS))
    wanted = len(words) + n_pseudo
    letters = rng.random((len(lengths), len(_WORD_LENGTHS))).tolist()
    for n, draws, first in zip(lengths.tolist(), letters, rng.integers(0, 2, len(lengths)).tolist()):
        if len(words) >= wanted:
            break
        # consonants and vowels alternating, starting with either
        alphabets = [_VOWELS if (k + first) % 2 else _CONSONANTS for k in range(n)]
        word = "".join(a[int(d * len(a))] for a, d in zip(alphabets, draws))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


class WordSampler:
    """Zipf-distributed words (exponent 1 over the vocabulary's ranks), some followed by a comma or a period;
    word counts multiplied by `row_scale`."""

    def __init__(self, seed: int, row_scale: float = 1.0):
        import numpy as np

        words = vocabulary()
        ranks = np.arange(1, len(words) + 1)
        p = 1.0 / ranks
        # the same word plain, with a comma, with a period: one draw picks both
        self.forms = words + [w + "," for w in words] + [w + "." for w in words]
        self.p = np.concatenate([p * 0.86, p * 0.08, p * 0.06]) / p.sum()
        self.cdf = np.cumsum(self.p)
        self.rng = np.random.default_rng(seed)
        self.row_scale = row_scale

    def lengths(self, n: int, median: float, low: int, high: int, sigma: float = 0.8):
        """`n` word counts, log-normal around `median`, clipped to [low, high] (all three scaled)."""
        import numpy as np

        s = self.row_scale
        low, high = max(1, round(low * s)), max(2, round(high * s))
        return np.clip(np.rint(self.rng.lognormal(np.log(median * s), sigma, n)), low, high).astype(np.int64)

    def texts(self, counts) -> list[str]:
        """One text per count, of that many words."""
        import numpy as np

        draws = np.searchsorted(self.cdf, self.rng.random(int(counts.sum())) * self.cdf[-1]).tolist()
        forms, out, at = self.forms, [], 0
        for n in counts.tolist():
            out.append(" ".join([forms[i] for i in draws[at:at + n]]))
            at += n
        return out


def text_rows(sampler: WordSampler, n: int) -> list[dict]:
    return [{"text": t} for t in sampler.texts(sampler.lengths(n, 150, 10, 1000))]


def chat_rows(sampler: WordSampler, n: int) -> list[dict]:
    """Chats: a system message in a third of them, then 2-4 user/assistant exchanges."""
    exchanges = sampler.rng.integers(2, 5, n).tolist()
    system = (sampler.rng.random(n) < 1 / 3).tolist()
    users = iter(sampler.texts(sampler.lengths(sum(exchanges), 15, 3, 200)))
    answers = iter(sampler.texts(sampler.lengths(sum(exchanges), 40, 5, 400)))
    systems = iter(sampler.texts(sampler.lengths(sum(system), 15, 5, 60, sigma=0.4)))
    rows = []
    for k, s in zip(exchanges, system):
        messages = [{"role": "system", "content": next(systems)}] if s else []
        for _ in range(k):
            messages += [{"role": "user", "content": next(users)}, {"role": "assistant", "content": next(answers)}]
        rows.append({"messages": messages})
    return rows


def write_data(workdir: Path, kind: str, n_rows: int, row_scale: float = 1.0, seed: int = 0) -> Path:
    """JSONL of `n_rows` generated rows of `kind` in `workdir` (reused when it is there; written to a temporary
    name and renamed, so a killed run leaves no partial file under the final name)."""
    scale = "" if row_scale == 1.0 else f"-x{row_scale:g}"
    path = workdir / f"{kind}-{n_rows}-s{seed}{scale}-v{DATA_VERSION}.jsonl"
    if path.is_file():
        return path
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"writing {path} ...", flush=True)
    start = time.perf_counter()
    sampler = WordSampler(seed * 1_000_003 + n_rows + (0 if kind == "text" else 1), row_scale)
    make = text_rows if kind == "text" else chat_rows
    partial = path.with_suffix(".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for lo in range(0, n_rows, 10_000):
            f.writelines(json.dumps(row) + "\n" for row in make(sampler, min(10_000, n_rows - lo)))
    partial.rename(path)
    print(f"  {path.stat().st_size / MB:,.0f} MB in {time.perf_counter() - start:.0f} s", flush=True)
    return path


# ---- models with a given tokenizer ----------------------------------------------------------------------

def build_model(workdir: Path, tokenizer_json: str | None) -> Path:
    """demo.tiny's model with max positions 8192 and the tiny tokenizer, or (with `tokenizer_json`) that
    tokenizer and a vocabulary its size, converted with `convert-llama`; reused from `workdir` when there (named
    by a hash of the config, the building script and the tokenizer file)."""
    config = {"max_position_embeddings": 8192}
    key_parts = {"config": config, "build": MODEL_CHILD.read_text()}
    if tokenizer_json:
        key_parts["tokenizer"] = hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:10]
    converted = workdir / f"converted-{key}"
    if (converted / "config.json").is_file():
        return converted
    hf_dir = workdir / f"hf-{key}"
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.rmtree(converted, ignore_errors=True)
    print(f"building the model in {hf_dir} and converting it to {converted} ...", flush=True)
    # a child process: torch never enters this one
    subprocess.run([sys.executable, str(MODEL_CHILD), str(hf_dir), json.dumps(config)]
                   + (["--tokenizer-json", tokenizer_json] if tokenizer_json else []),
                   check=True, env={**os.environ, "PYTHONPATH": _repo_path()})
    run = subprocess.run([str(BIN / "convert-llama"), "--src", str(hf_dir), "--out", str(converted), "--no-progress"],
                         capture_output=True, text=True, check=False)  # its stderr goes into the error
    if run.returncode:
        raise RuntimeError(f"convert-llama failed (exit {run.returncode}): {run.stderr.strip()[-500:]}")
    shutil.rmtree(hf_dir, ignore_errors=True)
    return converted


def _repo_path() -> str:
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


# ---- measuring child processes --------------------------------------------------------------------------

def rss_anon(pid: int) -> int:
    """RssAnon of process `pid` in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def is_spawned_worker(pid: int) -> bool:
    """Whether process `pid` is a worker multiprocessing's spawn started (its command line ends with
    `--multiprocessing-fork`; the resource tracker's does not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--multiprocessing-fork" in f.read().split(b"\0")
    except OSError:
        return False


class AnonSampler:
    """Samples the summed RssAnon of a process and all its descendants every SAMPLE_SECONDS on a thread; keeps
    the peak, and the peak up to `mark()`."""

    def __init__(self, pid: int):
        import psutil

        self.process = psutil.Process(pid)
        self.peak = self.peak_at_mark = 0
        self.marked = False
        self.samples = 0
        self.pids = [pid]
        self.pool_workers: set[int] = set()  # descendants started by multiprocessing's spawn
        self._looked_at: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def tree_anon(self) -> int:
        """The summed RssAnon of the tree. Finding the children scans all of /proc (this kernel may have no
        /proc/PID/task/TID/children), so it is done every RESCAN samples; the known processes are read each
        time (a child is missed for at most RESCAN x SAMPLE_SECONDS after it starts, while it imports)."""
        import psutil

        if self.samples % RESCAN == 0:
            try:
                self.pids = [self.process.pid] + [c.pid for c in self.process.children(recursive=True)]
            except psutil.Error:
                self.pids = [self.process.pid]
            for child in self.pids[1:]:
                if child not in self._looked_at:
                    self._looked_at.add(child)
                    if is_spawned_worker(child):
                        self.pool_workers.add(child)
        return sum(rss_anon(pid) for pid in self.pids)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(SAMPLE_SECONDS)

    def _sample(self) -> None:
        value = self.tree_anon()
        self.samples += 1
        self.peak = max(self.peak, value)
        if not self.marked:
            self.peak_at_mark = self.peak

    def mark(self) -> None:
        """End of the phase whose peak `peak_at_mark` is (after one last sample)."""
        self._sample()
        self.marked = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclasses.dataclass
class ChildRun:
    returncode: int
    seconds: float  # start to exit
    stdout: str
    stderr_lines: list[tuple[float, str]]  # (seconds since start, line)
    peak_anon: int  # whole run
    peak_anon_phase: int  # up to the line `until` matched (the whole run when none did)
    line_seconds: float | None  # seconds from start to that line
    line: str | None
    pool_workers: int = 0  # spawned worker processes seen in its tree

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error_lines(self, n: int = 3) -> str:
        lines = [line for _, line in self.stderr_lines if line.strip()] or self.stdout.splitlines()
        return " | ".join(lines[-n:])

    def last_json(self) -> dict:
        """The JSON object a child script prints last on stdout."""
        return json.loads(self.stdout.strip().splitlines()[-1])


def run_child(command: list[str], env: dict, until: re.Pattern | None = None, stop: bool = False) -> ChildRun:
    """Run `command`, reading its stderr line by line (each line timestamped as it arrives) and sampling the
    anonymous memory of its process tree; `until` marks the end of the phase measured apart, and with `stop`
    the child's process group is killed there (returncode 0 then stands for "stopped as asked")."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, env=env, text=True, bufsize=1,
                                errors="replace", start_new_session=stop)
        sampler = AnonSampler(proc.pid)
        lines, hit = [], None
        for line in proc.stderr:
            now = time.perf_counter() - start
            line = line.rstrip("\n")
            lines.append((now, line))
            if hit is None and until is not None and until.match(line):
                sampler.mark()
                hit = (now, line)
                if stop:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and its children only
        proc.wait()
        seconds = time.perf_counter() - start
        sampler.stop()
        out.seek(0)
        returncode = 0 if stop and hit and proc.returncode == -signal.SIGKILL else proc.returncode
        return ChildRun(returncode, seconds, out.read(), lines, sampler.peak,
                        sampler.peak_at_mark if hit else sampler.peak, hit[0] if hit else None, hit[1] if hit else None,
                        len(sampler.pool_workers))


def child_env(**extra: str) -> dict:
    """The environment of a measured child: offline hub, the user's default tokenizer threading, the repo."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=_repo_path(), **extra)
    return env


# ---- the measured sides ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Measure:
    seconds: float
    peak_anon: int
    tokens: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)


def measure_limit(model: Path, data: Path, kind: str) -> Measure:
    run = run_child([sys.executable, str(LIMIT_CHILD), str(model), str(data), kind],
                    child_env(TOKENIZERS_PARALLELISM="true"))
    if not run.ok:
        raise RuntimeError(f"limit failed (exit {run.returncode}): {run.error_lines()}")
    result = run.last_json()
    return Measure(result["seconds"], run.peak_anon, result["tokens"], {"read_seconds": result["read_seconds"]})


def cli_args(model: Path, data: Path, out: Path, cache: Path, seq_len: int, data_workers: int = 0) -> list[str]:
    """The measured `finetune-lora` command; `data_workers` > 0 adds `--data-workers data_workers`."""
    return [str(BIN / "finetune-lora"), "--model", str(model), "--data", str(data), "--out", str(out),
            "--steps", "1", "--batch-size", "1", "--seq-len", str(seq_len), "--mesh", MESH,
            "--checkpoint-every", "100000", "--no-progress", "--data-cache", str(cache)] + (
        ["--data-workers", str(data_workers)] if data_workers else [])


def measure_cli(model: Path, data: Path, workdir: Path, cache: Path, datasets_cache: Path, seq_len: int,
                expect: str, whole: bool = False, data_workers: int = 0) -> Measure:
    """One `finetune-lora --steps 1` run (with `--data-workers data_workers` when > 0): its preparation seconds
    (the data line's, else start to the line) and the data phase's peak. Stopped at its data line unless
    `whole`."""
    out = workdir / "run"
    shutil.rmtree(out, ignore_errors=True)
    run = run_child(cli_args(model, data, out, cache, seq_len, data_workers),
                    child_env(HF_DATASETS_CACHE=str(datasets_cache)), until=DATA_LINE, stop=not whole)
    shutil.rmtree(out, ignore_errors=True)
    if not run.ok or run.line is None:
        raise RuntimeError(f"finetune-lora failed (exit {run.returncode}, data line "
                           f"{'seen' if run.line else 'not seen'}): {run.error_lines()}")
    status = CACHE_STATUS.search(run.line)
    if not status or status.group(1) != expect:
        raise RuntimeError(f"expected a cache {expect}, the data line says: {run.line}")
    meta = json.loads((Path(status.group(2)) / "meta.json").read_text())
    own = LINE_SECONDS.search(DATA_LINE.match(run.line).group(1))
    seconds = float(own.group(1)) if own else run.line_seconds
    return Measure(seconds, run.peak_anon_phase, meta["tokens"],
                   {"to_line": run.line_seconds, "whole_run": run.seconds, "whole_peak": run.peak_anon,
                    "store_seconds": meta.get("seconds"), "line": run.line, "from_line": bool(own),
                    "data_workers": data_workers, "pool_workers_seen": run.pool_workers})


def measure_load_data(model: Path, data: Path, workdir: Path, cache: Path, datasets_cache: Path,
                      seq_len: int, data_workers: int = 0) -> Measure:
    """`finetune.data.prepare.load_data` alone (`data_workers` as given) in a child that imported everything."""
    run = run_child([sys.executable, str(LOAD_DATA_CHILD), str(model), str(data), "--out", str(workdir / "unused-run"),
                     "--data-cache", str(cache), "--seq-len", str(seq_len), "--data-workers", str(data_workers)],
                    child_env(HF_DATASETS_CACHE=str(datasets_cache)), until=DATA_LINE)
    if not run.ok:
        raise RuntimeError(f"load_data failed (exit {run.returncode}): {run.error_lines()}")
    return Measure(run.last_json()["seconds"], run.peak_anon, None,
                   {"line": run.line, "data_workers": data_workers, "pool_workers_seen": run.pool_workers})


def measure_startup(model: Path, workdir: Path, seq_len: int, whole: bool, row_scale: float) -> Measure:
    """The CLI's fixed cost before its data line: start to the line of a warm run on a 64-row chat file."""
    scratch = workdir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    data = write_data(workdir, "chat", STARTUP_ROWS, row_scale)
    cache, datasets_cache = scratch / "data-cache", scratch / "hf-datasets"
    measure_cli(model, data, scratch, cache, datasets_cache, seq_len, "miss", whole)
    m = measure_cli(model, data, scratch, cache, datasets_cache, seq_len, "hit", whole)
    shutil.rmtree(scratch, ignore_errors=True)
    return m


# ---- configurations -------------------------------------------------------------------------------------

def tokenizer_processes(rows: int, data_workers: int = 0) -> int:
    """Processes that tokenize `rows` rows in `finetune-lora --data-workers data_workers` (0: not given, the
    CLI's own rule, on the cores this process may use); one (the CLI's own process, no pool) when that is one or
    when the rows fill one batch, as finetune.data.workers.tokenize_to_store does."""
    workers = repo_import("finetune.data.workers")  # numpy only: no jax, torch or transformers
    count = workers.default_workers(data_workers, rows)
    return 1 if rows <= workers.BATCH_ROWS else count


@dataclasses.dataclass
class Config:
    """One data file and tokenizer, prepared with one number of tokenizer processes."""

    kind: str
    rows: int
    tokenizer: str
    model: Path
    data: Path
    data_workers: int = 0  # passed as --data-workers (0: not passed, the CLI's own choice)
    measures: dict[str, list[Measure]] = dataclasses.field(default_factory=dict)

    @property
    def workers(self) -> int:
        """The tokenizer processes that gives."""
        return tokenizer_processes(self.rows, self.data_workers)

    @property
    def name(self) -> str:
        return f"{self.kind} {self.rows:,} {self.tokenizer}"

    def add(self, side: str, measure: Measure) -> None:
        self.measures.setdefault(side, []).append(measure)

    def med(self, side: str, attr: str = "seconds") -> float | None:
        values = [getattr(m, attr) for m in self.measures.get(side, [])]
        return statistics.median(values) if values else None

    def spread(self, side: str, attr: str = "seconds", fmt: str = "{:.2f}", scale: float = 1.0) -> str:
        return median_spread([getattr(m, attr) / scale for m in self.measures.get(side, [])], fmt)


def print_run(config: Config, side: str, m: Measure) -> None:
    print(f"  {config.name}: {side} ({workers_word(config.workers)}) {m.seconds:.2f} s, "
          f"peak anon {m.peak_anon / MB:,.0f} MB" + (f", {m.tokens:,} tokens" if m.tokens else "")
          + (f" (store built in {m.extra['store_seconds']} s)" if side.startswith("cli") else ""), flush=True)
    seen, expected = m.extra.get("pool_workers_seen"), config.workers - 1  # the CLI's own process is one
    if "cold" in side and seen is not None and seen != expected:
        print(f"  warning: {seen} spawned tokenizer process(es) seen, {expected} expected", flush=True)


def toolkit_side(config: Config, workdir: Path, seq_len: int, load_data: bool, whole: bool,
                 warm: bool = True) -> None:
    """CLI cold (then warm) on fresh caches; then (with `load_data`) load_data cold (then warm) on other fresh
    caches; each with `config`'s --data-workers."""
    scratch = workdir / "scratch"
    states = ("cold", "warm") if warm else ("cold",)
    for via in ("cli", "load_data") if load_data else ("cli",):
        shutil.rmtree(scratch, ignore_errors=True)
        cache, datasets_cache = scratch / "data-cache", scratch / "hf-datasets"
        for state in states:
            if via == "cli":
                m = measure_cli(config.model, config.data, scratch, cache, datasets_cache, seq_len,
                                "miss" if state == "cold" else "hit", whole, config.data_workers)
            else:
                m = measure_load_data(config.model, config.data, scratch, cache, datasets_cache, seq_len,
                                      config.data_workers)
            config.add(f"{via} {state}", m)
            print_run(config, f"{via} {state}", m)
    shutil.rmtree(scratch, ignore_errors=True)


def limit_side(config: Config) -> None:
    m = measure_limit(config.model, config.data, config.kind)
    config.add("limit", m)
    print(f"  {config.name}: limit {m.seconds:.2f} s ({m.tokens:,} tokens; read {m.extra['read_seconds']:.1f} s, "
          f"not timed), peak anon {m.peak_anon / MB:,.0f} MB", flush=True)


def run_rounds(rounds: int, groups: list[tuple[str, list[tuple[str, Callable[[], None]]]]]) -> None:
    """Each group's (label, measure) sides, every round, in an order reversed from one group and one round to
    the next: what runs first (a cold disk, a warm CPU) does not always favour the same side."""
    for r in range(rounds):
        for i, (name, sides) in enumerate(groups):
            sides = sides if (i + r) % 2 == 0 else sides[::-1]
            print(f"round {r + 1}, {name}: {' then '.join(label for label, _ in sides)}", flush=True)
            for _, measure in sides:
                measure()


# ---- the command line -----------------------------------------------------------------------------------

def parser(doc: str, sizes: tuple[int, ...], quick: str) -> argparse.ArgumentParser:
    """The options every data benchmark takes; `sizes` is --sizes' default, `quick` what --quick runs."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help=f"comma-separated row counts (default {','.join(map(str, sizes))})")
    p.add_argument("--kinds", default=",".join(KINDS), help="data kinds: text, chat")
    p.add_argument("--tokenizer-json", help="a real tokenizer.json (e.g. Meta's Llama 3) measured beside the "
                                            "tiny one; its tokenizer_config.json beside it is used when there")
    p.add_argument("--tokenizers", help="which of tiny, llama3 (default: tiny, and llama3 with --tokenizer-json)")
    p.add_argument("--row-scale", type=float, default=1.0,
                   help="multiply the generated rows' word counts by this (e.g. 0.25 for short SFT rows)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every measurement, alternating the sides")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="finetune-lora --seq-len")
    p.add_argument("--load-data-rows", type=int, default=LOAD_DATA_ROWS,
                   help="time finetune.data.prepare.load_data in a child of its own for sizes up to this many rows "
                        "(0: never; each is one more cold build)")
    p.add_argument("--whole-runs", action="store_true",
                   help="let each finetune-lora run finish its step (default: stop it at its data line)")
    p.add_argument("--workdir", default="/tmp/llama-jax-bench-data", help="models, data files and caches")
    p.add_argument("--quick", action="store_true", help=f"{quick}: to check the script")
    return p


def int_list(text: str) -> list[int]:
    """`10000,100000` -> [10000, 100000]."""
    return [int(part) for part in text.split(",") if part.strip()]


@dataclasses.dataclass
class Setup:
    sizes: list[int]
    kinds: list[str]
    tokenizers: list[str]
    models: dict[str, Path]
    workdir: Path
    n_cores: int
    row_scale: float

    def data(self, kind: str, rows: int) -> Path:
        """The generated JSONL of `rows` rows of `kind` (written now unless it is there)."""
        return write_data(self.workdir, kind, rows, self.row_scale)


def setup(p: argparse.ArgumentParser, args, quick_sizes: tuple[int, ...], sizes: tuple[int, ...]) -> Setup:
    """Check the common options, print the machine, build (or reuse) the models."""
    chosen = int_list(args.sizes) if args.sizes else list(quick_sizes if args.quick else sizes)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    names = ([t.strip() for t in args.tokenizers.split(",") if t.strip()] if args.tokenizers
             else ["tiny"] + (["llama3"] if args.tokenizer_json else []))
    if "llama3" in names and not (args.tokenizer_json and Path(args.tokenizer_json).is_file()):
        p.error("--tokenizers llama3 needs --tokenizer-json PATH to an existing tokenizer.json")
    if not set(kinds) <= set(KINDS) or not set(names) <= set(TOKENIZERS):
        p.error(f"--kinds takes {', '.join(KINDS)}; --tokenizers takes {', '.join(TOKENIZERS)}")
    if not chosen or min(chosen) < 1:
        p.error("--sizes takes positive row counts")
    workdir, n_cores = Path(args.workdir), cores()
    print(f"CPU: {cpu_model()}, {n_cores} cores", flush=True)
    models = {name: build_model(workdir, args.tokenizer_json if name == "llama3" else None) for name in names}
    return Setup(chosen, kinds, names, models, workdir, n_cores, args.row_scale)


# ---- report ---------------------------------------------------------------------------------------------

def median_spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "OK" if ok else "NOT MET"


def workers_word(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def print_header(args, n_cores: int) -> None:
    print()
    print(f"CPU: {cpu_model()}, {n_cores} cores; {args.rounds} round(s), median (min-max) when more than one; "
          f"--seq-len {args.seq_len}")


def table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def print_raw(configs: list[Config], startups: dict[str, list[Measure]] | None = None) -> None:
    """Every single measurement, then a few of the CLI's data lines, then the command that reproduces them."""
    print()
    print("raw figures:")
    for name, ms in (startups or {}).items():
        for m in ms:
            print(f"  CLI start-up {name}: {m.seconds:.3f} s, peak anon {m.peak_anon / MB:,.1f} MB")
    for c in configs:
        for side, ms in c.measures.items():
            for m in ms:
                detail = {k: v for k, v in m.extra.items() if k != "line"}
                count = "" if side == "limit" else f" ({workers_word(c.workers)})"  # the limit is one process
                print(f"  {c.name} {side}{count}: {m.seconds:.3f} s, "
                      f"peak anon {m.peak_anon / MB:,.1f} MB, tokens {m.tokens}, {detail}")
    lines = {m.extra["line"] for c in configs for ms in c.measures.values() for m in ms if m.extra.get("line")}
    for line in sorted(lines)[:4]:
        print(f"  e.g. {line}")
    print()
    print(f"reproduce: python bench/{Path(sys.argv[0]).name} {shlex.join(sys.argv[1:])}")
