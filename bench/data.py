"""Data preparation through the real `finetune-lora`: how long tokenizing a training file takes the first time
(cold) and again from the tokenized-data cache (warm), against the limit of rendering and batch-encoding the
same rows in one plain process; how the peak anonymous memory grows with the data at a given number of
tokenizer processes; and what one more tokenizer process costs and gains at the sizes where the CLI's rule
changes the count.

Data (generated, seeded, kept in --workdir): `text` rows (`{"text"}`, words per row log-normal, median 150,
10-1000) and `chat` rows (`{"messages"}`: a system message in a third of the rows, then 2-4 user/assistant
exchanges; words per user message median 15 (3-200), per assistant message median 40 (5-400)). Words are
drawn with Zipf frequencies from a fixed vocabulary: demo.tiny's corpus words as the most frequent ones and
20,000 pronounceable pseudo-words with English word lengths (mean about 5 letters), 8% followed by a comma and
6% by a period: realistic-ish characters per word, a long tail of rare words (as real text has, which is what
keeps a tokenizer's word cache from answering everything).

Tokenizers: `tiny`, the byte-level BPE of the demo/test model (demo.tiny: vocab 512, Llama-3-style chat
template); `llama3`, a real tokenizer.json given by --tokenizer-json (Meta's Llama 3: vocab 128256), with the
Llama-3-style template of demo.tiny set on it when it has none. Each gets a small model built locally
(demo.tiny's shape, vocab = the tokenizer's, max positions 8192) and converted with `convert-llama`.

Tokenizer processes ("workers"): each size's count is the CLI's own rule (finetune.tokenization.default_workers,
computed here from the same code on the cores this process may use: one per core, at most one per
MIN_ROWS_PER_WORKER rows; one means the CLI's own process tokenizes, with no pool), and the CLI runs get no
--data-workers. With --rows-per-worker N (--quick: 1000) the counts follow that threshold instead and every
run is given them as --data-workers: to exercise the comparison below on small sizes, not to measure the rule.
A tokenizer process adds memory that does not grow with the data (its imports and tokenizer: 100-250 MB), so
where the next size of the same data and tokenizer uses another count (10k rows: 1, 100k: 2 on 2 cores, as the
rule stands), the smaller size also gets "forced" runs at
the next size's count (`--data-workers W`, W being that count): a cold CLI run, and a cold load_data when
the next size's load_data is measured. Spawned tokenizer processes are counted in each run's process tree
(a warning when they are not the count planned less one: the CLI's own process tokenizes beside them).

For each (data, rows, tokenizer), alternating the sides from one round and one config to the next (limit,
toolkit, forced; reversed every other time):
  limit        a child process renders each chat once (`apply_chat_template(tokenize=False)`; a text row is its
               text) and calls the fast tokenizer's batch encoding (`tokenizer(texts, add_special_tokens=False)`,
               TOKENIZERS_PARALLELISM=true) on batches of 1024 rows, nothing else: the seconds of that loop
               (reading the JSONL into memory beforehand is not timed; shown apart as "read s").
  CLI cold     `finetune-lora --steps 1 --batch-size 1 --seq-len 4096 --mesh dp=1,fsdp=1,cp=1,mp=1
               --no-progress --data-cache EMPTY_DIR` with an empty HF_DATASETS_CACHE too (the JSON -> Arrow
               conversion is part of a first run). Its figure is the `prepared in S s` of its
               `finetune-lora: data: ... cache miss ...` line on stderr (read line by line, timestamped as each
               arrives); were the line to carry no seconds, the time from the process's start to the line
               (interpreter start, imports and the tokenizer's loading included). The run is stopped there (its
               process group killed: nothing after the line is measured) unless --whole-runs.
  CLI warm     the same command again with the same caches (`cache hit`).
  start-up     the CLI's fixed part of those figures: a warm run on a 64-row chat file, per tokenizer and
               round (the preparation alone is "CLI less start-up" when load_data is not measured).
  load_data    (sizes up to --load-data-rows, default 100k) `finetune.setup.load_data` timed in a child that has
               imported everything (datasets too) and initialised JAX first: cold (empty caches) then warm;
               the preparation alone.
  forced       (the sizes above) CLI cold, and load_data cold, as above with `--data-workers W`
               (load_data: `data_workers=W`): their seconds are printed beside the default count's ("text 10,000
               tiny: CLI cold 1 worker A s, 2 workers B s (B/A x; peak anon +M MB)"), so the rule's threshold
               can be judged at that size, and the memory growth to the next size uses their peaks.
Tokens: the store's exact count (meta.json of the cache entry the data line names). Tokens/s per core =
tokens / seconds / cores, with the seconds of the preparation alone (load_data's). Peak anonymous memory: the
sum of RssAnon (/proc/PID/status: not file-backed or memory-mapped file pages) over the process and all its
children, sampled every 50 ms (new children found every 250 ms); for CLI runs up to the data line (the data
phase). Growth per token: the difference of that peak between two consecutive sizes over the difference of
their tokens (the CLI cold runs' counts), between runs with the same number of tokenizer processes: the
larger size's default run against the smaller size's default run, or its forced run where the counts
differ; each figure names its count. Where no run at the same count exists (the CLI does not give that
count at the smaller size) the figure compares the default runs, is marked "a->b workers" and is left out
of the goal.

Goals: cold <= 1.5x the limit on 2 cores; warm <= 5% of cold (both on the preparation alone: load_data's
seconds where measured, else the CLI's less its start-up, marked *); growth of peak anonymous memory <= 8 bytes per
token between consecutive sizes at the same number of tokenizer processes, flat (within the same bound) from
100k to 1M rows.

    python bench/data.py [--sizes 10000,100000,1000000] [--kinds text,chat] [--rounds 1]
                         [--tokenizer-json /path/to/Llama-3/tokenizer.json] [--load-data-rows 100000]
                         [--rows-per-worker N]
    python bench/data.py --quick          # 500 and 2000 rows at 1000 rows per worker: checks the script
                                          # (4-7 min per tokenizer)

Size: a row averages about 200 (text) and 230 (chat) words, some 800-900 tokens of the tiny tokenizer (which
cuts the pseudo-words into letters) and 450-550 of Llama 3's; 1M rows are 1.3-1.5 GB of JSONL, 0.5-0.9 billion
tokens. Run time: a cold build is tokens / (cores x the toolkit's tokens/s per core, which --quick prints), some
25-50 min at 1M rows on 2 cores; a 1M-row config is about twice that (the limit, a cold CLI run; load_data only up
to --load-data-rows); the forced runs add one or two cold builds of the smaller size. Data files stay in
--workdir for the next run; caches are removed after each config.
Time only on an idle machine: anything running beside it changes the figures several-fold.
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
from pathlib import Path

from cli_runs import BIN

SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (500, 2_000)
QUICK_ROWS_PER_WORKER = 1_000  # --quick's sizes then use 1 and 2 tokenizer processes (on 2 cores or more)
KINDS = ("text", "chat")
SEQ_LEN = 4096
MESH = "dp=1,fsdp=1,cp=1,mp=1"
LIMIT_BATCH_ROWS = 1024
SAMPLE_SECONDS = 0.05
RESCAN = 5  # samples between two searches for new child processes
DATA_VERSION = 2  # part of the data files' names: bump when the generator changes

COLD_GOAL = 1.5  # cold <= this x the limit
WARM_GOAL = 0.05  # warm <= this x cold
GROWTH_GOAL = 8.0  # bytes of peak anonymous memory per token of data

MB = 1e6
DATA_LINE = re.compile(r"^finetune-lora: data: (.*)$")
CACHE_STATUS = re.compile(r"cache (hit|miss) \(([^)]*)\)")
LINE_SECONDS = re.compile(r"\bin (\d+(?:\.\d+)?) ?s\b")  # "... in 12.3 s": used when the line carries it


def _import_demo_tiny():
    try:
        import demo.tiny as tiny  # plain Python at import: no torch
    except ImportError:  # the repository's root, when the toolkit is not installed
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        import demo.tiny as tiny
    return tiny


# ---- generated data -------------------------------------------------------------------------------------

# Share of English word tokens by length in letters (1..12), roughly as in running text.
_WORD_LENGTHS = (0.03, 0.17, 0.20, 0.16, 0.11, 0.09, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01)
_CONSONANTS, _VOWELS = "bcdfghjklmnprstvwyz", "aeiou"


def vocabulary(n_pseudo: int = 20_000, seed: int = 0) -> list[str]:
    """demo.tiny's corpus words, then `n_pseudo` distinct pronounceable pseudo-words with English word lengths:
    in order of frequency rank."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = list(_import_demo_tiny().CORPUS_WORDS)
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
    """Zipf-distributed words (exponent 1 over the vocabulary's ranks), some followed by a comma or a period."""

    def __init__(self, seed: int):
        import numpy as np

        words = vocabulary()
        ranks = np.arange(1, len(words) + 1)
        p = 1.0 / ranks
        # the same word plain, with a comma, with a period: one draw picks both
        self.forms = words + [w + "," for w in words] + [w + "." for w in words]
        self.p = np.concatenate([p * 0.86, p * 0.08, p * 0.06]) / p.sum()
        self.cdf = np.cumsum(self.p)
        self.rng = np.random.default_rng(seed)

    def lengths(self, n: int, median: float, low: int, high: int, sigma: float = 0.8):
        """`n` word counts, log-normal around `median`, clipped to [low, high]."""
        import numpy as np

        return np.clip(np.rint(self.rng.lognormal(np.log(median), sigma, n)), low, high).astype(np.int64)

    def texts(self, counts) -> list[str]:
        """One text per count, of that many words."""
        import numpy as np

        draws = np.searchsorted(self.cdf, self.rng.random(int(counts.sum())) * self.cdf[-1]).tolist()
        forms, out, at = self.forms, [], 0
        for n in counts.tolist():
            out.append(" ".join([forms[i] for i in draws[at:at + n]]))
            at += n
        return out


# Row lengths multiplied by this (`--row-scale`): shorter rows make 1M-row runs fit a shorter session.
ROW_SCALE = 1.0


def _words(median: float, low: int, high: int) -> tuple[float, int, int]:
    return median * ROW_SCALE, max(1, round(low * ROW_SCALE)), max(2, round(high * ROW_SCALE))


def text_rows(sampler: WordSampler, n: int) -> list[dict]:
    return [{"text": t} for t in sampler.texts(sampler.lengths(n, *_words(150, 10, 1000)))]


def chat_rows(sampler: WordSampler, n: int) -> list[dict]:
    """Chats: a system message in a third of them, then 2-4 user/assistant exchanges."""
    exchanges = sampler.rng.integers(2, 5, n).tolist()
    system = (sampler.rng.random(n) < 1 / 3).tolist()
    users = iter(sampler.texts(sampler.lengths(sum(exchanges), *_words(15, 3, 200))))
    answers = iter(sampler.texts(sampler.lengths(sum(exchanges), *_words(40, 5, 400))))
    systems = iter(sampler.texts(sampler.lengths(sum(system), *_words(15, 5, 60), sigma=0.4)))
    rows = []
    for k, s in zip(exchanges, system):
        messages = [{"role": "system", "content": next(systems)}] if s else []
        for _ in range(k):
            messages += [{"role": "user", "content": next(users)}, {"role": "assistant", "content": next(answers)}]
        rows.append({"messages": messages})
    return rows


def write_data(workdir: Path, kind: str, n_rows: int, seed: int = 0) -> Path:
    """JSONL of `n_rows` generated rows of `kind` in `workdir` (reused when it is there; written to a temporary
    name and renamed, so a killed run leaves no partial file under the final name)."""
    scale = "" if ROW_SCALE == 1.0 else f"-x{ROW_SCALE:g}"
    path = workdir / f"{kind}-{n_rows}-s{seed}{scale}-v{DATA_VERSION}.jsonl"
    if path.is_file():
        return path
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"writing {path} ...", flush=True)
    start = time.perf_counter()
    sampler = WordSampler(seed * 1_000_003 + n_rows + (0 if kind == "text" else 1))
    make = text_rows if kind == "text" else chat_rows
    partial = path.with_suffix(".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for lo in range(0, n_rows, 10_000):
            f.writelines(json.dumps(row) + "\n" for row in make(sampler, min(10_000, n_rows - lo)))
    partial.rename(path)
    print(f"  {path.stat().st_size / MB:,.0f} MB in {time.perf_counter() - start:.0f} s", flush=True)
    return path


# ---- models with a given tokenizer ----------------------------------------------------------------------

_BUILD = r"""
import json, sys
from pathlib import Path
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from demo.tiny import CHAT_TEMPLATE, build_tiny_llama

hf_dir, config, tokenizer_json = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
if tokenizer_json:
    source = Path(tokenizer_json)
    if (source.parent / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(source.parent)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source))
    if tokenizer.bos_token is None and "<|begin_of_text|>" in tokenizer.get_vocab():
        tokenizer.bos_token = "<|begin_of_text|>"
    if tokenizer.eos_token is None and "<|eot_id|>" in tokenizer.get_vocab():
        tokenizer.eos_token = "<|eot_id|>"
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    config.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    build_tiny_llama(hf_dir, config, seed=0, tokenizer=False)
    tokenizer.save_pretrained(hf_dir)
else:
    build_tiny_llama(hf_dir, config, seed=0)
"""


def build_model(workdir: Path, tokenizer_json: str | None) -> Path:
    """demo.tiny's model with max positions 8192 and the tiny tokenizer, or (with `tokenizer_json`) that
    tokenizer and a vocabulary its size, converted with `convert-llama`; reused from `workdir` when there."""
    config = {"max_position_embeddings": 8192}
    key_parts = {"config": config, "build": _BUILD}
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
    subprocess.run([sys.executable, "-c", _BUILD, str(hf_dir), json.dumps(config), tokenizer_json or ""],
                   check=True, env={**os.environ, "PYTHONPATH": _repo_path()})
    run = subprocess.run([str(BIN / "convert-llama"), "--src", str(hf_dir), "--out", str(converted), "--no-progress"],
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"convert-llama failed (exit {run.returncode}): {run.stderr.strip()[-500:]}")
    shutil.rmtree(hf_dir, ignore_errors=True)
    return converted


def _repo_path() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


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


# ---- the two sides ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Measure:
    seconds: float
    peak_anon: int
    tokens: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)


def measure_limit(model: Path, data: Path, kind: str) -> Measure:
    run = run_child([sys.executable, __file__, "_limit", str(model), str(data), kind],
                    child_env(TOKENIZERS_PARALLELISM="true"))
    if not run.ok:
        raise RuntimeError(f"limit failed (exit {run.returncode}): {run.error_lines()}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return Measure(result["seconds"], run.peak_anon, result["tokens"], {"read_seconds": result["read_seconds"]})


def _limit_child(model: str, data: str, kind: str) -> None:
    """Render each chat once and batch-encode every text: prints {"seconds", "tokens", "read_seconds"}."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    start = time.perf_counter()
    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    read_seconds = time.perf_counter() - start
    tokens, start = 0, time.perf_counter()
    for lo in range(0, len(rows), LIMIT_BATCH_ROWS):
        batch = rows[lo:lo + LIMIT_BATCH_ROWS]
        if kind == "chat":
            texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in batch]
        else:
            texts = [row["text"] for row in batch]
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        tokens += sum(map(len, ids))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": tokens, "read_seconds": read_seconds}))


def cli_args(model: Path, data: Path, out: Path, cache: Path, seq_len: int, workers: int = 0) -> list[str]:
    """The measured `finetune-lora` command; `workers` > 0 adds `--data-workers workers`."""
    return [str(BIN / "finetune-lora"), "--model", str(model), "--data", str(data), "--out", str(out),
            "--steps", "1", "--batch-size", "1", "--seq-len", str(seq_len), "--mesh", MESH,
            "--checkpoint-every", "100000", "--no-progress", "--data-cache", str(cache)] + (
        ["--data-workers", str(workers)] if workers else [])


def measure_cli(model: Path, data: Path, workdir: Path, cache: Path, datasets_cache: Path, seq_len: int,
                expect: str, whole: bool = False, workers: int = 0) -> Measure:
    """One `finetune-lora --steps 1` run (with `--data-workers workers` when > 0): its preparation seconds
    (the data line's, else start to the line) and the data phase's peak. Stopped at its data line unless
    `whole`."""
    out = workdir / "run"
    shutil.rmtree(out, ignore_errors=True)
    run = run_child(cli_args(model, data, out, cache, seq_len, workers),
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
                    "data_workers": workers, "pool_workers_seen": run.pool_workers})


def measure_load_data(model: Path, data: Path, workdir: Path, cache: Path, datasets_cache: Path,
                      seq_len: int, workers: int = 0) -> Measure:
    """`finetune.setup.load_data` alone (its `data_workers` = `workers`) in a child that imported everything."""
    run = run_child([sys.executable, __file__, "_load_data", str(model), str(data), str(workdir / "unused-run"),
                     str(cache), str(seq_len), str(workers)], child_env(HF_DATASETS_CACHE=str(datasets_cache)),
                    until=DATA_LINE)
    if not run.ok:
        raise RuntimeError(f"load_data failed (exit {run.returncode}): {run.error_lines()}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return Measure(result["seconds"], run.peak_anon, None,
                   {"line": run.line, "data_workers": workers, "pool_workers_seen": run.pool_workers})


def _load_data_child(model: str, data: str, out: str, cache: str, seq_len: str, workers: str = "0") -> None:
    """`finetune.setup.load_data` timed alone, after the imports and JAX's start: prints {"seconds", "rows"}."""
    import datasets  # noqa: F401  (imported lazily by the data sources: an import is start-up, not preparation)
    import jax
    from transformers import AutoTokenizer

    from finetune.config import TrainConfig
    from finetune.setup import load_data

    config = TrainConfig(model=model, data=data, out=out, seq_len=int(seq_len), data_cache=cache,
                         data_workers=int(workers), progress=False).validate()
    tokenizer = AutoTokenizer.from_pretrained(model)
    jax.process_index()  # the backend's start is not data preparation
    start = time.perf_counter()
    train_rows, _ = load_data(config, tokenizer, tokenizer_from_model=True)  # as the CLI loads it
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "rows": len(train_rows)}))


# ---- one configuration ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    kind: str
    rows: int
    tokenizer: str
    model: Path
    data: Path
    measures: dict[str, list[Measure]] = dataclasses.field(default_factory=dict)
    data_workers: int = 0  # passed as --data-workers (0: not passed, the CLI's own choice)
    workers: int = 1  # tokenizer processes that gives
    forced_data_workers: int = 0  # for the "forced" runs (0: none): the next size's count
    forced_workers: int = 0
    forced_for_rows: int = 0  # the next size, whose count that is

    @property
    def name(self) -> str:
        return f"{self.kind} {self.rows:,} {self.tokenizer}"

    def add(self, side: str, measure: Measure) -> None:
        self.measures.setdefault(side, []).append(measure)

    def workers_of(self, side: str) -> int:
        return self.forced_workers if side.endswith(FORCED) else self.workers


FORCED = " forced"  # suffix of the sides measured at the next size's worker count


def _import_tokenization():
    """finetune.tokenization from this repository, as the measured children import it (PYTHONPATH first)."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    import finetune.tokenization as tokenization  # numpy only: no jax, torch or transformers

    return tokenization


def tokenizer_processes(rows: int, data_workers: int = 0, rows_per_worker: int | None = None) -> int:
    """Processes that tokenize `rows` rows in `finetune-lora --data-workers data_workers` (0: not given): the
    CLI's own rule (finetune.tokenization.default_workers, on the cores this process may use), with
    `rows_per_worker` in place of its MIN_ROWS_PER_WORKER when given; one (the CLI's own process, no pool)
    when that is one or when the rows fill one batch."""
    from unittest import mock

    tokenization = _import_tokenization()
    threshold = tokenization.MIN_ROWS_PER_WORKER if rows_per_worker is None else rows_per_worker
    with mock.patch.object(tokenization, "MIN_ROWS_PER_WORKER", threshold):
        count = tokenization.default_workers(data_workers, rows)
    batches = -(-rows // tokenization.BATCH_ROWS)
    return 1 if count <= 1 or batches <= 1 else min(count, batches)


def plan_workers(configs: list[Config], rows_per_worker: int | None) -> list[str]:
    """Set each config's tokenizer-process counts; return notes on what could not be planned.

    Default runs: the CLI's own choice (no --data-workers), or with `rows_per_worker` the count that threshold
    gives, passed as --data-workers. Where the next size of the same data and tokenizer uses another count, the
    smaller size also gets "forced" runs with --data-workers set to that count, so that the memory growth
    between the two compares runs with the same number of processes."""
    notes = []
    for c in configs:
        c.data_workers = 0 if rows_per_worker is None else tokenizer_processes(c.rows, 0, rows_per_worker)
        c.workers = tokenizer_processes(c.rows, c.data_workers)
        if c.data_workers and c.workers != c.data_workers:
            notes.append(f"{c.name}: --data-workers {c.data_workers} gives {c.workers} tokenizer process(es)")
    series: dict[tuple[str, str], list[Config]] = {}
    for c in sorted(configs, key=lambda c: c.rows):
        series.setdefault((c.kind, c.tokenizer), []).append(c)
    for same in series.values():
        for small, large in zip(same, same[1:]):
            if small.workers == large.workers:
                continue
            got = tokenizer_processes(small.rows, large.workers)
            if got == large.workers:
                small.forced_data_workers, small.forced_workers, small.forced_for_rows = large.workers, got, large.rows
            else:
                notes.append(f"{small.name}: --data-workers {large.workers} (the count at {large.rows:,} rows) gives "
                             f"{got} tokenizer process(es): its memory growth to {large.rows:,} rows compares "
                             f"{small.workers} with {large.workers} (marked, not in the goal)")
    return notes


def _print_run(config: Config, side: str, m: Measure) -> None:
    print(f"  {config.name}: {side} ({_workers(config.workers_of(side))}) {m.seconds:.2f} s, "
          f"peak anon {m.peak_anon / MB:,.0f} MB" + (f", {m.tokens:,} tokens" if m.tokens else "")
          + (f" (store built in {m.extra['store_seconds']} s)" if side.startswith("cli") else ""), flush=True)
    seen, expected = m.extra.get("pool_workers_seen"), config.workers_of(side) - 1  # the CLI's process is one
    if "cold" in side and seen is not None and seen != expected:
        print(f"  warning: {seen} spawned tokenizer process(es) seen, {expected} expected", flush=True)


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def toolkit_side(config: Config, workdir: Path, seq_len: int, load_data: bool, whole: bool,
                 forced: bool = False) -> None:
    """CLI cold then warm on fresh caches; then (with `load_data`) load_data cold then warm on other fresh
    caches. `forced`: cold runs only, at `--data-workers config.forced_data_workers`."""
    scratch = workdir / "scratch"
    workers, states, suffix = ((config.forced_data_workers, ("cold",), FORCED) if forced
                               else (config.data_workers, ("cold", "warm"), ""))
    for via in ("cli", "load_data") if load_data else ("cli",):
        shutil.rmtree(scratch, ignore_errors=True)
        cache, datasets_cache = scratch / "data-cache", scratch / "hf-datasets"
        for state in states:
            if via == "cli":
                m = measure_cli(config.model, config.data, scratch, cache, datasets_cache, seq_len,
                                "miss" if state == "cold" else "hit", whole, workers)
            else:
                m = measure_load_data(config.model, config.data, scratch, cache, datasets_cache, seq_len, workers)
            config.add(f"{via} {state}{suffix}", m)
            _print_run(config, f"{via} {state}{suffix}", m)
    shutil.rmtree(scratch, ignore_errors=True)


def limit_side(config: Config) -> None:
    m = measure_limit(config.model, config.data, config.kind)
    config.add("limit", m)
    print(f"  {config.name}: limit {m.seconds:.2f} s ({m.tokens:,} tokens; read {m.extra['read_seconds']:.1f} s, "
          f"not timed), peak anon {m.peak_anon / MB:,.0f} MB", flush=True)


STARTUP_ROWS = 64


def measure_startup(model: Path, workdir: Path, seq_len: int, whole: bool) -> Measure:
    """The CLI's fixed cost before its data line: start to the line of a warm run on a 64-row chat file."""
    scratch = workdir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    data = write_data(workdir, "chat", STARTUP_ROWS)
    cache, datasets_cache = scratch / "data-cache", scratch / "hf-datasets"
    measure_cli(model, data, scratch, cache, datasets_cache, seq_len, "miss", whole)
    m = measure_cli(model, data, scratch, cache, datasets_cache, seq_len, "hit", whole)
    shutil.rmtree(scratch, ignore_errors=True)
    return m


# ---- report -------------------------------------------------------------------------------------------------

def median_spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def med(config: Config, side: str, attr: str = "seconds") -> float | None:
    values = [getattr(m, attr) for m in config.measures.get(side, [])]
    return statistics.median(values) if values else None


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "OK" if ok else "NOT MET"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worker_rule(rows_per_worker: int | None, n_cores: int) -> str:
    """The rule the runs' tokenizer-process counts follow, in words."""
    threshold = _import_tokenization().MIN_ROWS_PER_WORKER
    if rows_per_worker is None:
        return (f"tokenizer processes: the CLI's own rule (one per core, {n_cores} here; at most one per "
                f"{threshold:,} rows), no --data-workers")
    return (f"tokenizer processes: --rows-per-worker {rows_per_worker:,} passed as --data-workers (one per core, "
            f"{n_cores} here; at most one per {rows_per_worker:,} rows), NOT the CLI's own rule (one per "
            f"{threshold:,} rows)")


def report(configs: list[Config], startups: dict[str, list[Measure]], args, n_cores: int) -> None:
    load = any(s.startswith("load_data") for c in configs for s in c.measures)
    startup = {name: statistics.median(m.seconds for m in ms) for name, ms in startups.items() if ms}

    def prep(c: Config, state: str) -> float | None:
        """Seconds of preparation alone: load_data's when measured, else the CLI's less its start-up."""
        if f"load_data {state}" in c.measures:
            return med(c, f"load_data {state}")
        value = med(c, f"cli {state}")
        return None if value is None or c.tokenizer not in startup else value - startup[c.tokenizer]

    basis = "load_data; * CLI less its start-up where load_data was not measured" if load else "CLI less its start-up"
    print()
    print(f"CPU: {cpu_model()}, {n_cores} cores; {args.rounds} round(s), median (min-max) when more than one; "
          f"--seq-len {args.seq_len}")
    print("CLI s: the `prepared in` seconds of `finetune-lora`'s `data:` line (from its start to the line where the "
          "line has none); CLI start-up (the same on a warm 64-row file): "
          + ", ".join(f"{name} {median_spread([m.seconds for m in ms])} s" for name, ms in startups.items()))
    if load:
        print("load_data s: `finetune.setup.load_data` alone, timed in a process that imported everything first.")
    print(f"cold / limit, warm / cold and tokens/s/core cold: from {basis}.")
    print(worker_rule(args.rows_per_worker, n_cores) + "; workers: the processes that tokenize (1: the CLI's own, "
          "no pool).")
    print()
    sides = ["limit", "cli cold", "cli warm"] + (["load_data cold", "load_data warm"] if load else [])
    titles = {"limit": "limit s", "cli cold": "CLI cold s", "cli warm": "CLI warm s",
              "load_data cold": "load_data cold s", "load_data warm": "load_data warm s"}
    print("| data | rows | tokenizer | workers | tokens | " + " | ".join(titles[s] for s in sides)
          + " | cold / limit | warm / cold | tokens/s/core limit | tokens/s/core cold |")
    print("|---|---|---|---|---|" + "---|" * (len(sides) + 4))
    for c in configs:
        tokens, limit, limit_tokens = med(c, "cli cold", "tokens"), med(c, "limit"), med(c, "limit", "tokens")
        cold, warm = prep(c, "cold"), prep(c, "warm")
        cells = [c.kind, f"{c.rows:,}", c.tokenizer, str(c.workers), f"{tokens:,.0f}" if tokens else "-"]
        cells += [median_spread([m.seconds for m in c.measures.get(s, [])]) for s in sides]
        star = "*" if load and "load_data cold" not in c.measures else ""
        cells += [f"{cold / limit:.2f}x{star}" if cold and limit else "-",
                  f"{warm / cold:.1%}{star}" if warm and cold else "-",
                  f"{limit_tokens / limit / n_cores:,.0f}" if limit else "-",
                  f"{tokens / cold / n_cores:,.0f}{star}" if tokens and cold and cold > 0 else "-"]
        print("| " + " | ".join(cells) + " |")
    forced = [c for c in configs if any(side.endswith(FORCED) for side in c.measures)]
    if forced:
        print()
        print("The same size with the tokenizer processes of the next size (cold runs on fresh caches; CLI s: its "
              "data line's `prepared in`; peak anonymous memory as below):")
        print()
        cold_sides = ["cli cold"] + (["load_data cold"] if load else [])
        print("| data | rows | tokenizer | workers | " + " | ".join(titles[s] for s in cold_sides)
              + " | " + " | ".join(f"{titles[s][:-2]} MB" for s in cold_sides) + " |")
        print("|---|---|---|---|" + "---|" * 2 * len(cold_sides))
        for c in forced:
            for suffix in ("", FORCED):
                cells = [c.kind, f"{c.rows:,}", c.tokenizer, str(c.workers_of(suffix))]
                cells += [median_spread([m.seconds for m in c.measures.get(s + suffix, [])]) for s in cold_sides]
                cells += [median_spread([m.peak_anon / MB for m in c.measures.get(s + suffix, [])], "{:,.0f}")
                          for s in cold_sides]
                print("| " + " | ".join(cells) + " |")
        print()
        for c in forced:
            parts = []
            for side in cold_sides:
                fewer, more = med(c, side), med(c, side + FORCED)
                if fewer is not None and more is not None:
                    extra_mb = (med(c, side + FORCED, "peak_anon") - med(c, side, "peak_anon")) / MB
                    parts.append(f"{titles[side][:-2]} {_workers(c.workers)} {fewer:.2f} s, "
                                 f"{_workers(c.forced_workers)} {more:.2f} s ({more / fewer:.2f}x; "
                                 f"peak anon {extra_mb:+,.0f} MB)")
            print(f"{c.name}: " + "; ".join(parts))
            forced_tokens = med(c, f"cli cold{FORCED}", "tokens")
            if forced_tokens is not None and forced_tokens != med(c, "cli cold", "tokens"):
                print(f"  warning: {forced_tokens:,.0f} tokens at {_workers(c.forced_workers)}, "
                      f"{med(c, 'cli cold', 'tokens'):,.0f} at {_workers(c.workers)}")
    print()
    print("Peak anonymous memory, MB (RssAnon summed over the process tree; CLI: up to its data line), and its "
          "growth in bytes per token of data from the size before, between runs with the same number of tokenizer "
          "processes (the smaller size's run at the next size's count where the default counts differ; "
          "'a->b workers': different counts, not in the goal):")
    print()
    growth_sides = ["cli cold"] + (["load_data cold"] if load else [])
    print("| data | rows | tokenizer | workers | " + " | ".join(f"{titles[s][:-2]} MB" for s in sides)
          + "".join(f" | growth B/token, {titles[s][:-2]}" for s in growth_sides) + " |")
    print("|---|---|---|---|" + "---|" * (len(sides) + len(growth_sides)))
    # (side, kind, tokenizer) -> (rows before, rows, rate, workers before, workers)
    growth: dict[tuple[str, str, str], list[tuple[int, int, float, int, int]]] = {}
    previous: dict[tuple[str, str], Config] = {}
    for c in sorted(configs, key=lambda c: (c.kind, c.tokenizer, c.rows)):
        key = (c.kind, c.tokenizer)
        cells = [c.kind, f"{c.rows:,}", c.tokenizer, str(c.workers)]
        cells += [median_spread([m.peak_anon / MB for m in c.measures.get(s, [])], "{:,.0f}") for s in sides]
        before = previous.get(key)
        for side in growth_sides:
            cell = "-"
            if before and side in c.measures:
                # the smaller size's run with this size's count, else its default run (marked)
                same = [s for s in (side, side + FORCED) if s in before.measures and before.workers_of(s) == c.workers]
                base = same[0] if same else side if side in before.measures else None
                d_tokens = med(c, "cli cold", "tokens") - med(before, "cli cold", "tokens")
                if base and d_tokens > 0:
                    rate = (med(c, side, "peak_anon") - med(before, base, "peak_anon")) / d_tokens
                    a = before.workers_of(base)
                    growth.setdefault((side, *key), []).append((before.rows, c.rows, rate, a, c.workers))
                    cell = f"{rate:.2f} ({_workers(a)})" if a == c.workers else f"{rate:.2f} ({a}->{c.workers} workers)"
            cells.append(cell)
        previous[key] = c
        print("| " + " | ".join(cells) + " |")
    print()

    colds = [(c, prep(c, "cold") / med(c, "limit")) for c in configs if prep(c, "cold") and med(c, "limit")]
    print(f"cold <= {COLD_GOAL}x the limit on {n_cores} cores ({basis}): "
          f"{verdict(all(r <= COLD_GOAL for _, r in colds) if colds else None)} "
          f"({', '.join(f'{c.name}: {r:.2f}x' for c, r in colds)})")
    warms = [(c, prep(c, "warm") / prep(c, "cold")) for c in configs if prep(c, "warm") and prep(c, "cold")]
    print(f"warm <= {WARM_GOAL:.0%} of cold ({basis}): "
          f"{verdict(all(r <= WARM_GOAL for _, r in warms) if warms else None)} "
          f"({', '.join(f'{c.name}: {r:.1%}' for c, r in warms)})")
    for side in growth_sides:
        items = [(key, *item) for key, items in growth.items() if key[0] == side for item in items]
        same = [(f"{k[1]} {k[2]} {a:,}->{b:,} at {_workers(w)}", r) for k, a, b, r, w, w2 in items if w == w2]
        apart = [f"{k[1]} {k[2]} {a:,}->{b:,} at {w}->{w2} workers: {r:.2f}" for k, a, b, r, w, w2 in items if w != w2]
        print(f"peak anonymous memory growth <= {GROWTH_GOAL:g} B/token between sizes at the same number of "
              f"tokenizer processes, flat to the largest ({titles[side][:-2]}): "
              f"{verdict(all(r <= GROWTH_GOAL for _, r in same) if same else None)} "
              f"({', '.join(f'{name}: {r:.2f}' for name, r in same) or 'no pair of sizes'})"
              + (f"; not compared (different counts): {', '.join(apart)}" if apart else ""))
    print()
    print("raw figures:")
    for name, ms in startups.items():
        for m in ms:
            print(f"  CLI start-up {name}: {m.seconds:.3f} s, peak anon {m.peak_anon / MB:,.1f} MB")
    for c in configs:
        for side, ms in c.measures.items():
            for m in ms:
                detail = {k: v for k, v in m.extra.items() if k != "line"}
                print(f"  {c.name} {side}: {m.seconds:.3f} s, peak anon {m.peak_anon / MB:,.1f} MB, "
                      f"tokens {m.tokens}, {detail}")
    lines = {m.extra["line"] for c in configs for ms in c.measures.values() for m in ms if m.extra.get("line")}
    for line in sorted(lines)[:4]:
        print(f"  e.g. {line}")
    print()
    print(f"reproduce: python bench/data.py {shlex.join(sys.argv[1:])}")


# ---- main ------------------------------------------------------------------------------------------------------

def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_limit", "_load_data"):
        (_limit_child if sys.argv[1] == "_limit" else _load_data_child)(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", help=f"comma-separated row counts (default {','.join(map(str, SIZES))})")
    parser.add_argument("--kinds", default=",".join(KINDS), help="data kinds: text, chat")
    parser.add_argument("--tokenizer-json", help="a real tokenizer.json (e.g. Meta's Llama 3) measured beside the "
                                                 "tiny one; its tokenizer_config.json beside it is used when there")
    parser.add_argument("--tokenizers", help="which of tiny, llama3 (default: tiny, and llama3 with --tokenizer-json)")
    parser.add_argument("--row-scale", type=float, default=1.0,
                        help="multiply the generated rows' word counts by this (e.g. 0.25 for short SFT rows)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every measurement, alternating the sides")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="finetune-lora --seq-len")
    parser.add_argument("--load-data-rows", type=int, default=100_000,
                        help="time finetune.setup.load_data in-process (cold and warm) for sizes up to this many "
                             "rows (0: never; each is one more cold build)")
    parser.add_argument("--whole-runs", action="store_true",
                        help="let each finetune-lora run finish its step (default: stop it at its data line)")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench-data", help="models, data files and caches")
    parser.add_argument("--rows-per-worker", type=int,
                        help="plan the runs' tokenizer processes with this many rows per worker instead of the "
                             "CLI's own threshold, passing the counts as --data-workers (default: the CLI's rule, "
                             f"no --data-workers; {QUICK_ROWS_PER_WORKER} with --quick, so that its sizes use "
                             "different counts)")
    parser.add_argument("--quick", action="store_true", help=f"{' and '.join(map(str, QUICK_SIZES))} rows: to check "
                                                            "the script")
    args = parser.parse_args()
    if args.rows_per_worker is None and args.quick:
        args.rows_per_worker = QUICK_ROWS_PER_WORKER
    if args.rows_per_worker is not None and args.rows_per_worker < 1:
        parser.error("--rows-per-worker takes a positive number of rows")
    global ROW_SCALE
    ROW_SCALE = args.row_scale

    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    names = ([t.strip() for t in args.tokenizers.split(",") if t.strip()] if args.tokenizers
             else ["tiny"] + (["llama3"] if args.tokenizer_json else []))
    if "llama3" in names and not (args.tokenizer_json and Path(args.tokenizer_json).is_file()):
        parser.error("--tokenizers llama3 needs --tokenizer-json PATH to an existing tokenizer.json")
    if not set(kinds) <= set(KINDS) or not set(names) <= {"tiny", "llama3"}:
        parser.error(f"--kinds takes {', '.join(KINDS)}; --tokenizers takes tiny, llama3")
    workdir = Path(args.workdir)
    n_cores = cores()
    print(f"CPU: {cpu_model()}, {n_cores} cores", flush=True)
    models = {name: build_model(workdir, args.tokenizer_json if name == "llama3" else None) for name in names}
    configs = [Config(kind, rows, name, models[name], write_data(workdir, kind, rows))
               for kind in kinds for rows in sizes for name in names]
    for line in plan_workers(configs, args.rows_per_worker):
        print(f"note: {line}", flush=True)
    print(worker_rule(args.rows_per_worker, n_cores) + "; " + "; ".join(
        f"{c.name} {_workers(c.workers)}" + (f" (and {c.forced_workers}, for {c.forced_for_rows:,} rows)"
                                             if c.forced_workers else "") for c in configs), flush=True)
    startups: dict[str, list[Measure]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names:
            startups[name].append(measure_startup(models[name], workdir, args.seq_len, args.whole_runs))
            print(f"round {r + 1}: CLI start-up ({name}) {startups[name][-1].seconds:.2f} s", flush=True)
        for i, config in enumerate(configs):
            sides = ["limit", "toolkit"] + ([f"toolkit at {_workers(config.forced_workers)}"]
                                            if config.forced_workers else [])
            sides = sides if (i + r) % 2 == 0 else sides[::-1]
            print(f"round {r + 1}, {config.name}: {' then '.join(sides)}", flush=True)
            for side in sides:
                if side == "limit":
                    limit_side(config)
                elif side == "toolkit":
                    toolkit_side(config, workdir, args.seq_len, config.rows <= args.load_data_rows, args.whole_runs)
                else:
                    toolkit_side(config, workdir, args.seq_len, config.forced_for_rows <= args.load_data_rows,
                                 args.whole_runs, forced=True)
    report(configs, startups, args, n_cores)


if __name__ == "__main__":
    main()
