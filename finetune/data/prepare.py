"""The data of a run: --data and --eval-data tokenized (from the cache, or now), --eval-fraction's split, and
the packed rows training and evaluation read, with the run's data summary and truncation warning lines. Data
of a preference layout (chosen/rejected pairs) goes with a preference --objective and becomes `PairRows`; prompts
(layout prompt-only) go with an online RL --objective and become `PromptRows`; other data goes with --objective
sft.

Imports no JAX: the caller says whether this is the process that prints (`main`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np

from finetune.config import TrainConfig
from finetune.data.cache import CachedData, load_tokenized, loaded_tokenizer_digest
from finetune.data.layouts import PREFERENCE_LAYOUTS, PROMPT_LAYOUT, Detection, detect, detect_prompts, is_preference
from finetune.data.packing import PackedRows, truncation_report_from_store
from finetune.data.pair_filter import keep_pairs
from finetune.data.pairs import PairRows, check_pair_batch, needed_rows_per_group
from finetune.data.prompts import PromptRows
from finetune.data.rows import DataError, TruncationReport
from finetune.data.sources import DataSource, names_files, open_source


def load_data(config: TrainConfig, tokenizer, tokenizer_from_model: bool = False, main: bool = True, *,
              ways: int = 1) -> tuple[PackedRows, PackedRows | None] | tuple[PairRows, PairRows | None]:
    """Training rows and held-out rows (--eval-data, or --eval-fraction of --data), packed from the data tokenized
    once and cached (finetune.data.cache). Examples cut to --seq-len are counted in one warning line on stderr;
    data left with no training target is an error. Process 0 shows the tokenizing progress and ends with one
    summary line on stderr. `tokenizer_from_model`: see `tokenize_data`; `main`: this process prints. Preference
    pairs become `PairRows` for `ways` batch shards (dp x fsdp)."""
    return pack_data(config, tokenize_data(config, tokenizer, tokenizer_from_model, main), main, ways=ways)


@dataclasses.dataclass(frozen=True)
class RunData:
    """--data (and --eval-data) tokenized, and which of their examples train and which are held out."""

    data: _Tokenized
    examples: np.ndarray  # int64: the examples of `data` that train (of preference data: its pairs, rows)
    held_out: _Tokenized | None  # `data` itself for --eval-fraction
    eval_examples: np.ndarray | None
    eval_name: str
    started: float  # perf_counter() when loading began

    def record(self, config: TrainConfig) -> dict[str, dict]:
        """What the run trains (`data`) and evaluates (`eval_data`, with --eval-data) on, as tokens: for each its
        path, the digest of its whole tokenized store (before --eval-fraction splits it), its counts, and
        what the tokens were made from (the data's fingerprint, the tokenizer's digest)."""
        record = {"data": self.data.record(config.data)}
        if config.eval_data:
            record["eval_data"] = self.held_out.record(config.eval_data)
        return record


def tokenize_data(config: TrainConfig, tokenizer, tokenizer_from_model: bool = False, main: bool = True) -> RunData:
    """--data and --eval-data tokenized (from the cache, or now) and --eval-fraction's split of --data.
    `tokenizer_from_model`: `tokenizer` is `AutoTokenizer.from_pretrained(config.model)`, unchanged, so the
    cache is keyed on --model's files (`loaded_tokenizer_digest`) rather than on the serialized tokenizer."""
    started = time.perf_counter()
    key = loaded_tokenizer_digest(config.model, tokenizer) if tokenizer_from_model else None
    data = _tokenized(config, open_source(config.data, split=config.data_split, subset=config.data_subset),
                      tokenizer, main, key)
    examples, held_out, eval_examples, eval_name = np.arange(len(data.source)), None, None, config.data
    if config.eval_data:
        subset = None if names_files(config.eval_data) else config.data_subset  # a subset is a dataset id's
        eval_source = open_source(config.eval_data, split=config.eval_split, subset=subset)
        held_out, eval_name = _tokenized(config, eval_source, tokenizer, main, key), config.eval_data
        eval_examples = np.arange(len(held_out.source))
    elif config.eval_fraction > 0:
        order = np.random.default_rng(config.seed).permutation(len(data.source))
        n_eval = max(1, int(len(data.source) * config.eval_fraction))
        eval_examples, examples = np.sort(order[:n_eval]), np.sort(order[n_eval:])
        held_out, eval_name = data, f"{config.data} (the rows held out by --eval-fraction)"
        if not len(examples):
            raise DataError(f"{config.data}: no training rows left after --eval-fraction {config.eval_fraction}")
    return RunData(data, examples, held_out, eval_examples, eval_name, started)


def pack_data(config: TrainConfig, run_data: RunData, main: bool = True, *, ways: int = 1
              ) -> tuple[PackedRows, PackedRows | None] | tuple[PairRows, PairRows | None]:
    """`run_data`'s training and held-out rows packed (see `load_data`), with its warning and summary lines;
    preference pairs as `PairRows` (`pack_pairs`)."""
    if is_preference(run_data.data.layout.layout):
        return pack_pairs(config, run_data, main, ways=ways)
    if run_data.data.layout.layout == PROMPT_LAYOUT:
        return prompt_rows(config, run_data, main)
    data, examples, held_out, eval_examples = (run_data.data, run_data.examples, run_data.held_out,
                                               run_data.eval_examples)
    report = data.report(examples, config.seq_len)
    report.require_targets(config.data)
    if held_out is not None:
        eval_report = held_out.report(eval_examples, config.seq_len)
        eval_report.require_targets(run_data.eval_name)
        report = _both(report, eval_report)
    train_rows = PackedRows.build(data.cached.data, examples, config.seq_len, config.pack)
    eval_rows = None if held_out is None else PackedRows.build(held_out.cached.data, eval_examples, config.seq_len,
                                                              config.pack)
    if main:
        kind = "packed" if config.pack else "padded"
        line = (f"{data.layout.report(len(data.source))}; {_amount(data.cached.data.meta['tokens'])} tokens -> "
                f"{len(train_rows):,} {kind} rows of {config.seq_len}")
        if eval_rows is not None:
            line += f" (+ {len(eval_rows):,} held out, from {len(eval_examples):,} rows)"
        line += f"; {report.truncated:,} truncated, {report.examples - report.with_targets:,} with no targets"
        _print_summary(config, run_data, report.warning(), line + _prompts_cut(config, run_data))
    return train_rows, None if eval_rows is None else eval_rows.padded_to_multiple(config.batch_size)


def pack_pairs(config: TrainConfig, run_data: RunData, main: bool = True, *, ways: int = 1
               ) -> tuple[PairRows, PairRows | None]:
    """`run_data`'s training and held-out preference pairs as `PairRows` of steps of --batch-size pairs over `ways`
    batch shards, training and evaluation batches of one shape; pairs with a side left with no training target
    within --seq-len dropped, counted with the pairs cut in one warning line, and the summary line."""
    data, held_out = run_data.data, run_data.held_out
    check_pair_batch(config.batch_size, config.grad_accum, ways)
    train, report = keep_pairs(data.cached.data, run_data.examples, config.seq_len, data.source.where)
    report.require_pairs(config.data)
    evaluated = None
    if held_out is not None:
        evaluated, eval_report = keep_pairs(held_out.cached.data, run_data.eval_examples, config.seq_len,
                                            held_out.source.where)
        eval_report.require_pairs(run_data.eval_name)
        report = report + eval_report
    shape = dict(pack=config.pack, batch_size=config.batch_size, grad_accum=config.grad_accum, ways=ways)
    rows_per_group = needed_rows_per_group(data.cached.data, train, config.seq_len, **shape)
    if evaluated is not None:  # walked once in order: a group never holds a pair twice
        rows_per_group = max(rows_per_group, needed_rows_per_group(held_out.cached.data, evaluated, config.seq_len,
                                                                   repeats=1, **shape))
    train_rows = PairRows.build(data.cached.data, train, config.seq_len, seed=config.seed,
                                rows_per_group=rows_per_group, **shape)
    eval_rows = None if evaluated is None else PairRows.build(held_out.cached.data, evaluated, config.seq_len,
                                                              seed=config.seed, rows_per_group=rows_per_group,
                                                              **shape)
    if main:
        kind = "packed" if config.pack else "padded"
        line = (f"{data.layout.report(len(data.source))}; {_amount(data.cached.data.meta['tokens'])} tokens -> "
                f"{train_rows.rows_per_step:,} {kind} rows of {config.seq_len} per step of {config.batch_size:,} pairs")
        if eval_rows is not None:
            line += f" (+ {len(eval_rows):,} held-out pairs, {eval_rows.eval_steps:,} steps)"
        line += f"; {report.truncated:,} truncated, {report.dropped:,} dropped"
        _print_summary(config, run_data, report.warning(), line + _prompts_cut(config, run_data))
    return train_rows, eval_rows


def prompt_rows(config: TrainConfig, run_data: RunData, main: bool = True) -> tuple[PromptRows, PromptRows | None]:
    """`run_data`'s training and held-out prompts (layout prompt-only), with the summary line."""
    data, held_out = run_data.data, run_data.held_out
    train = PromptRows(data.cached.data, run_data.examples, data.source)
    evaluated = None if held_out is None else PromptRows(held_out.cached.data, run_data.eval_examples, held_out.source)
    if main:
        line = (f"{data.layout.report(len(data.source))}; {_amount(data.cached.data.meta['tokens'])} tokens, the "
                f"longest prompt {train.longest():,}")
        if evaluated is not None:
            line += f" (+ {len(evaluated):,} held out)"
        _print_summary(config, run_data, None, line + _prompts_cut(config, run_data))
    return train, evaluated


def _prompts_cut(config: TrainConfig, run_data: RunData) -> str:
    """The data line's count of the rows (pairs) of --data and --eval-data whose prompt --max-prompt-len cut, and
    the first of them; nothing without the option."""
    if not config.max_prompt_len:
        return ""
    stores = [run_data.data] + ([run_data.held_out] if config.eval_data else [])
    cut = sum(tokenized.cached.data.meta["prompts_cut"] for tokenized in stores)
    firsts = [tokenized.source.where(tokenized.cached.data.meta["first_prompt_cut"]) for tokenized in stores
              if tokenized.cached.data.meta["first_prompt_cut"] is not None]
    first = f" (first: {firsts[0]})" if firsts else ""
    return f"; {cut:,} prompts cut to --max-prompt-len {config.max_prompt_len}{first}"


def _print_summary(config: TrainConfig, run_data: RunData, warning: str | None, line: str) -> None:
    """The truncation `warning` line, if any, then the run's one data line: what was prepared (`line`), where its
    cache entries are, and how long it took."""
    if warning:
        print(f"finetune-lora: warning: {warning}", file=sys.stderr)
    line += f"; {run_data.data.cache_status()}"
    if config.eval_data:
        line += f"; --eval-data {run_data.held_out.cache_status()}"
    print(f"finetune-lora: data: {line}; prepared in {time.perf_counter() - run_data.started:.1f} s", file=sys.stderr)


def check_objective(config: TrainConfig, source: DataSource, layout: Detection) -> None:
    """DataError naming `source` when its layout does not go with --objective: preference pairs train only a
    preference objective, and other rows only sft."""
    objective = config.objective
    first = f" (first row: {source.where(0)})" if len(source) else ""
    if layout.layout == PROMPT_LAYOUT and not config.policy:
        raise DataError(f"{source.description}: the rows are prompts alone (layout {PROMPT_LAYOUT}){first}, which "
                        f"--objective {objective} cannot train on: choose an online RL objective (--objective grpo or "
                        "rloo) or give rows with the replies to train on")
    if config.policy:
        return  # `detect_prompts` took the prompts of whatever columns the rows have
    if is_preference(layout.layout) and objective == "sft":
        raise DataError(f"{source.description}: the rows are preference pairs (layout {layout.layout}){first}, which "
                        "--objective sft cannot train on: choose a preference objective (--objective dpo, ipo, "
                        "simpo or orpo) or give rows of an SFT layout")
    if not is_preference(layout.layout) and config.preference:
        found = "layouts decided per row" if layout.layout == "auto" else f"layout {layout.layout}"
        expected = " | ".join(f"{name} ({keys})" for name, keys in PREFERENCE_LAYOUTS.items())
        raise DataError(f"{source.description}: --objective {objective} trains on chosen/rejected pairs, but the rows "
                        f"are not pairs ({found}; columns {', '.join(layout.columns)}){first}: give a preference "
                        f"layout ({expected}) or use --objective sft")


@dataclasses.dataclass(frozen=True)
class _Tokenized:
    source: DataSource
    layout: Detection
    cached: CachedData

    def report(self, examples: np.ndarray, seq_len: int) -> TruncationReport:
        return truncation_report_from_store(self.cached.data, examples, seq_len, self.source.where)

    def cache_status(self) -> str:
        return f"cache {'hit' if self.cached.hit else 'miss'} ({self.cached.directory})"

    def record(self, path: str) -> dict[str, Any]:
        store = self.cached.data
        return {"path": path, "digest": self.cached.digest, "examples": len(store), "tokens": int(store.starts[-1]),
                "source": self.cached.key["data"], "tokenizer": self.cached.key["tokenizer"]}


def _tokenized(config: TrainConfig, source: DataSource, tokenizer, main: bool,
               tokenizer_key: str | None = None) -> _Tokenized:
    """`source` tokenized by --data-format: from the cache, or now (with a progress bar on process 0)."""
    if config.policy:  # prompts alone, whatever other columns the rows have (the rewards read them)
        layout = detect_prompts(source.dataset.column_names, source.description, config.data_format, config.objective)
    else:
        layout = detect(source.dataset.column_names, source.description, config.data_format,
                        getattr(source.dataset, "features", None))
    check_objective(config, source, layout)
    seq_len = None if config.policy else config.seq_len  # a prompt is bounded by --max-prompt-len alone
    cached = load_tokenized(source, tokenizer, seq_len, layout.layout, cache=config.data_cache,
                            workers=config.data_workers, progress=config.progress and main, tokenizer_key=tokenizer_key,
                            max_prompt=config.max_prompt_len or None)
    return _Tokenized(source, layout, cached)


def _both(a: TruncationReport, b: TruncationReport) -> TruncationReport:
    """One report of the examples of `a` followed by those of `b`."""
    return TruncationReport(seq_len=a.seq_len, examples=a.examples + b.examples, truncated=a.truncated + b.truncated,
                            first_truncated=a.first_truncated or b.first_truncated, lost=a.lost + b.lost,
                            first_lost=a.first_lost or b.first_lost, with_targets=a.with_targets + b.with_targets)


def _amount(n: int) -> str:
    """A count for people: 1234567 -> 1.2M."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
