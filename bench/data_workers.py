"""What another tokenizer process costs and gains in data preparation: the same file prepared cold with each of
--workers' counts of tokenizer processes (`finetune-lora --data-workers W`), its seconds and its peak anonymous
memory, at sizes around the CLI's threshold of one process per MIN_ROWS_PER_WORKER rows
(finetune.data.workers), so that the threshold can be judged where the CLI's rule changes the count.

For each (data, rows, tokenizer), every count in turn, the order alternating from one round and one size to the
next, each on fresh caches:
  CLI cold     `finetune-lora --steps 1 ... --data-workers W` (bench/data_common.py has the command): the
               `prepared in` seconds of its data line, and the peak anonymous memory up to it.
  load_data    (sizes up to --load-data-rows, default 100k) bench/data_load_child.py with `data_workers=W`, cold:
               load_data alone in a process that imported everything first.
A count of one means the CLI's own process tokenizes (in two threads, no pool); W > 1 spawns W - 1 processes
that tokenize beside it (counted in each run's process tree: a warning when they are not W - 1). A spawned
process imports transformers and receives the tokenizer before its first batch (a few seconds), and adds memory
that does not grow with the data (100-250 MB).

Reading it: the line under the table gives each count's seconds against the first count's ("text 10,000 tiny:
CLI cold 1 worker A s, 2 workers B s (B/A x; peak anon +M MB)"): below 1.00x the extra process pays off at
that size, above it the size is better left to fewer processes; the note at the top says which count the
CLI's own rule gives each size.

    python bench/data_workers.py [--sizes 10000] [--workers 1,2] [--kinds text,chat] [--rounds 1]
                                 [--tokenizer-json /path/to/Llama-3/tokenizer.json] [--row-scale 1]
    python bench/data_workers.py --quick    # 500 rows: checks the script

Run time: one or two cold builds per count and size (some 2-5 s each at 10k rows on 2 cores, plus the CLI's
start). Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import functools

import data_common as dc

SIZES = (10_000,)
QUICK_SIZES = (500,)
WORKERS = (1, 2)
SIDES = ("cli cold", "load_data cold")


def report(groups: list[list[dc.Config]], args, n_cores: int) -> None:
    configs = [c for runs in groups for c in runs]
    sides = [side for side in SIDES if any(side in c.measures for c in configs)]
    dc.print_header(args, n_cores)
    print("The same size with each count of tokenizer processes (cold runs on fresh caches; CLI s: its data line's "
          "`prepared in`; peak anonymous memory: RssAnon summed over the process tree, CLI: up to its data line):")
    print()
    print(dc.table_row(["data", "rows", "tokenizer", "workers"] + [f"{dc.TITLES[s]} s" for s in sides]
                       + [f"{dc.TITLES[s]} MB" for s in sides]))
    print("|---|---|---|---|" + "---|" * 2 * len(sides))
    for c in configs:
        print(dc.table_row([c.kind, f"{c.rows:,}", c.tokenizer, str(c.workers)] + [c.spread(s) for s in sides]
                           + [c.spread(s, "peak_anon", "{:,.0f}", dc.MB) for s in sides]))
    print()
    for first, *others in groups:
        parts = []
        for side in sides:
            if first.med(side) is None:
                continue
            against = [f"{dc.workers_word(c.workers)} {c.med(side):.2f} s ({c.med(side) / first.med(side):.2f}x; "
                       f"peak anon {(c.med(side, 'peak_anon') - first.med(side, 'peak_anon')) / dc.MB:+,.0f} MB)"
                       for c in others if c.med(side) is not None]
            parts.append(f"{dc.TITLES[side]} {dc.workers_word(first.workers)} {first.med(side):.2f} s, "
                         + ", ".join(against))
        print(f"{first.name}: " + "; ".join(parts))
        for c in others:
            if c.med("cli cold", "tokens") != first.med("cli cold", "tokens"):
                print(f"  warning: {c.med('cli cold', 'tokens'):,.0f} tokens at {dc.workers_word(c.workers)}, "
                      f"{first.med('cli cold', 'tokens'):,.0f} at {dc.workers_word(first.workers)}")
    dc.print_raw(configs)


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    p = dc.parser(__doc__, SIZES, f"{' and '.join(map(str, QUICK_SIZES))} rows")
    p.add_argument("--workers", default=",".join(map(str, WORKERS)),
                   help="the counts of tokenizer processes compared, each passed as finetune-lora --data-workers")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    counts = dc.int_list(args.workers)
    if len(counts) < 2 or min(counts) < 1:
        p.error("--workers takes two counts or more, each at least 1")
    s = dc.setup(p, args, QUICK_SIZES, SIZES)
    groups = [[dc.Config(kind, rows, name, s.models[name], s.data(kind, rows), w) for w in counts]
              for kind in s.kinds for rows in s.sizes for name in s.tokenizers]
    for runs in groups:
        own = dc.tokenizer_processes(runs[0].rows)
        print(f"note: {runs[0].name}: the CLI's own rule gives {dc.workers_word(own)} on {s.n_cores} cores", flush=True)
        for c in runs:
            if c.workers != c.data_workers:
                print(f"note: {c.name}: --data-workers {c.data_workers} gives {dc.workers_word(c.workers)} "
                      f"(its rows fill one batch)", flush=True)

    def cold(c: dc.Config) -> None:
        dc.toolkit_side(c, s.workdir, args.seq_len, c.rows <= args.load_data_rows, args.whole_runs, warm=False)

    dc.run_rounds(args.rounds, [(runs[0].name, [(dc.workers_word(c.workers), functools.partial(cold, c))
                                                for c in runs]) for runs in groups])
    report(groups, args, s.n_cores)


if __name__ == "__main__":
    main()
