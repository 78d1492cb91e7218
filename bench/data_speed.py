"""Data preparation speed through the real `finetune-lora`: how long tokenizing a training file takes the first
time (cold) and again from the tokenized-data cache (warm), against the limit of rendering and batch-encoding
the same rows in one plain process.

For each (data, rows, tokenizer), alternating the two sides from one round and one config to the next:
  limit        bench/data_limit_child.py (TOKENIZERS_PARALLELISM=true): each chat rendered once and every text
               batch-encoded, 1024 rows a batch: the seconds of that loop ("read s", reading the JSONL into
               memory beforehand, is shown apart and not timed).
  CLI cold     `finetune-lora --steps 1 ...` on an empty --data-cache and HF_DATASETS_CACHE: the `prepared in`
               seconds of its data line (bench/data_common.py has the command and how it is read).
  CLI warm     the same command again with the same caches (`cache hit`).
  load_data    (sizes up to --load-data-rows, default 100k) bench/data_load_child.py: load_data alone in a
               process that imported everything first: cold (empty caches) then warm.
  start-up     once per tokenizer and round, before the configs: a warm CLI run on a 64-row chat file, the CLI's
               fixed part of its figures (the preparation alone is "CLI less start-up" where load_data is not
               measured).
Every run gets the same --data-workers (default: none, the CLI's own count for the size, which the "workers"
column shows). Tokens/s per core = tokens / seconds / cores, with the seconds of the preparation alone.

Reading it: "cold / limit" is what the toolkit's tokenizing costs over the bare encoding (goal <= 1.5x on 2
cores); "warm / cold" what a cached start costs against a first one (goal <= 5%); both on the preparation
alone: load_data's seconds where measured, else the CLI's less its start-up, marked *. Memory is
bench/data_memory.py's measurement and the worker count's effect bench/data_workers.py's; each run's peak
anonymous memory is printed with it here only as a check.

    python bench/data_speed.py [--sizes 10000,100000,1000000] [--kinds text,chat] [--rounds 1]
                               [--tokenizer-json /path/to/Llama-3/tokenizer.json] [--load-data-rows 100000]
                               [--row-scale 1] [--data-workers N]
    python bench/data_speed.py --quick     # 500 rows: checks the script

Run time: a cold build is tokens / (cores x the toolkit's tokens/s per core, which --quick prints), some 25-50 min
at 1M rows on 2 cores; a 1M-row config is about twice that (the limit and a cold CLI run; load_data only up to
--load-data-rows). Data files stay in --workdir for the next run; caches are removed after each config.
Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import data_common as dc

SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (500,)
COLD_GOAL = 1.5  # cold <= this x the limit
WARM_GOAL = 0.05  # warm <= this x cold


def report(configs: list[dc.Config], startups: dict[str, list[dc.Measure]], args, n_cores: int) -> None:
    load = any(s.startswith("load_data") for c in configs for s in c.measures)
    startup = {name: statistics.median(m.seconds for m in ms) for name, ms in startups.items() if ms}

    def prep(c: dc.Config, state: str) -> float | None:
        """Seconds of preparation alone: load_data's when measured, else the CLI's less its start-up."""
        if f"load_data {state}" in c.measures:
            return c.med(f"load_data {state}")
        value = c.med(f"cli {state}")
        return None if value is None or c.tokenizer not in startup else value - startup[c.tokenizer]

    basis = "load_data; * CLI less its start-up where load_data was not measured" if load else "CLI less its start-up"
    dc.print_header(args, n_cores)
    print("CLI s: the `prepared in` seconds of `finetune-lora`'s `data:` line (from its start to the line where the "
          "line has none); CLI start-up (the same on a warm 64-row file): "
          + ", ".join(f"{name} {dc.median_spread([m.seconds for m in ms])} s" for name, ms in startups.items()))
    if load:
        print("load_data s: `finetune.data.prepare.load_data` alone, timed in a process that imported everything "
              "first.")
    print(f"cold / limit, warm / cold and tokens/s/core cold: from {basis}.")
    print("workers: the processes that tokenize (1: the CLI's own, no pool): "
          + (f"--data-workers {args.data_workers}" if args.data_workers else "the CLI's own rule, no --data-workers")
          + f", on {n_cores} cores.")
    print()
    sides = ["limit", "cli cold", "cli warm"] + (["load_data cold", "load_data warm"] if load else [])
    print(dc.table_row(["data", "rows", "tokenizer", "workers", "tokens"] + [f"{dc.TITLES[s]} s" for s in sides]
                       + ["cold / limit", "warm / cold", "tokens/s/core limit", "tokens/s/core cold"]))
    print("|---|---|---|---|---|" + "---|" * (len(sides) + 4))
    for c in configs:
        tokens, limit, limit_tokens = c.med("cli cold", "tokens"), c.med("limit"), c.med("limit", "tokens")
        cold, warm = prep(c, "cold"), prep(c, "warm")
        star = "*" if load and "load_data cold" not in c.measures else ""
        print(dc.table_row([c.kind, f"{c.rows:,}", c.tokenizer, str(c.workers), f"{tokens:,.0f}" if tokens else "-"]
                           + [c.spread(s) for s in sides]
                           + [f"{cold / limit:.2f}x{star}" if cold and limit else "-",
                              f"{warm / cold:.1%}{star}" if warm and cold else "-",
                              f"{limit_tokens / limit / n_cores:,.0f}" if limit else "-",
                              f"{tokens / cold / n_cores:,.0f}{star}" if tokens and cold and cold > 0 else "-"]))
    print()
    colds = [(c, prep(c, "cold") / c.med("limit")) for c in configs if prep(c, "cold") and c.med("limit")]
    print(f"cold <= {COLD_GOAL}x the limit on {n_cores} cores ({basis}): "
          f"{dc.verdict(all(r <= COLD_GOAL for _, r in colds) if colds else None)} "
          f"({', '.join(f'{c.name}: {r:.2f}x' for c, r in colds)})")
    warms = [(c, prep(c, "warm") / prep(c, "cold")) for c in configs if prep(c, "warm") and prep(c, "cold")]
    print(f"warm <= {WARM_GOAL:.0%} of cold ({basis}): "
          f"{dc.verdict(all(r <= WARM_GOAL for _, r in warms) if warms else None)} "
          f"({', '.join(f'{c.name}: {r:.1%}' for c, r in warms)})")
    dc.print_raw(configs, startups)


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    p = dc.parser(__doc__, SIZES, f"{' and '.join(map(str, QUICK_SIZES))} rows")
    p.add_argument("--data-workers", type=int, default=0,
                   help="finetune-lora --data-workers for every run (default 0: not passed, the CLI's own count)")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.data_workers < 0:
        p.error("--data-workers takes a count of processes (0: the CLI's own)")
    s = dc.setup(p, args, QUICK_SIZES, SIZES)
    configs = [dc.Config(kind, rows, name, s.models[name], s.data(kind, rows), args.data_workers)
               for kind in s.kinds for rows in s.sizes for name in s.tokenizers]
    print("tokenizer processes: " + "; ".join(f"{c.name} {dc.workers_word(c.workers)}" for c in configs), flush=True)

    startups: dict[str, list[dc.Measure]] = {name: [] for name in s.tokenizers}

    def startup(name: str) -> None:
        startups[name].append(dc.measure_startup(s.models[name], s.workdir, args.seq_len, args.whole_runs,
                                                 args.row_scale))
        print(f"  CLI start-up ({name}) {startups[name][-1].seconds:.2f} s", flush=True)

    def toolkit(c: dc.Config) -> None:
        dc.toolkit_side(c, s.workdir, args.seq_len, c.rows <= args.load_data_rows, args.whole_runs)

    # the start-ups lead each round; then each config's two sides, in alternating order
    groups = [(f"CLI start-up ({name})", [("start-up", functools.partial(startup, name))]) for name in s.tokenizers]
    groups += [(c.name, [("limit", functools.partial(dc.limit_side, c)), ("toolkit", functools.partial(toolkit, c))])
               for c in configs]
    dc.run_rounds(args.rounds, groups)
    report(configs, startups, args, s.n_cores)


if __name__ == "__main__":
    main()
