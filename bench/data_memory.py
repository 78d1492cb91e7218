"""Data preparation memory through the real `finetune-lora`: the peak anonymous memory of preparing a training
file cold, at each size, and how much it grows per token of data from one size to the next at the same number
of tokenizer processes; beside it, the peak of the limit process (bench/data_limit_child.py: all rows in memory,
rendered and batch-encoded).

For each (data, rows, tokenizer), alternating the sides from one round and one size to the next:
  limit        bench/data_limit_child.py's peak.
  CLI cold     `finetune-lora --steps 1 ...` on empty caches (bench/data_common.py has the command), up to its
               data line: the data phase.
  load_data    (sizes up to --load-data-rows, default 100k) bench/data_load_child.py, cold: load_data alone in a
               process that imported everything first.
  next count   where the next size of the same data and tokenizer uses another number of tokenizer processes
               (10k rows: 1, 100k: 2 on 2 cores, as the CLI's rule stands), this size again at that count
               (`--data-workers W`): CLI cold, and load_data cold when the next size's load_data is measured. A
               tokenizer process adds memory that does not grow with the data (its imports and tokenizer: 100-250
               MB), so growth is only compared between runs with the same count.
Peak anonymous memory: RssAnon summed over the process tree, sampled every 50 ms (bench/data_common.py).
Growth per token: the difference of the peaks of two consecutive sizes over the difference of their tokens (the
CLI cold runs' exact counts), the larger size's run against the smaller size's run with the same number of
tokenizer processes; each figure names its count. Where the smaller size has no run at that count (the CLI
does not give that count there) the figure compares the default runs, is marked "a->b workers" and is left out
of the goal.

Reading it: goal <= 8 bytes of peak anonymous memory per token between consecutive sizes at the same count,
flat (within the same bound) from 100k to 1M rows, so a large file costs disk, not memory. The limit holds
every row in memory and grows with the data.

    python bench/data_memory.py [--sizes 10000,100000,1000000] [--kinds text,chat] [--rounds 1]
                                [--tokenizer-json /path/to/Llama-3/tokenizer.json] [--load-data-rows 100000]
                                [--row-scale 1] [--data-workers 0,0,0]
    python bench/data_memory.py --quick    # 500 and 2000 rows at --data-workers 1,2: checks the script

Run time: one cold build per size (two where load_data is measured, more with the next count's runs) and the
limit: at 1M rows on 2 cores, some 25-50 min each. Time only on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import data_common as dc

SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (500, 2_000)
QUICK_DATA_WORKERS = (1, 2)  # so that --quick's two sizes use different counts (on 2 cores or more)
GROWTH_GOAL = 8.0  # bytes of peak anonymous memory per token of data
SIDES = ("cli cold", "load_data cold")


@dataclasses.dataclass
class Size:
    """One size of one data kind and tokenizer: its run at its own count, and (where the next size uses another
    count) its run at the next size's."""

    default: dc.Config
    next_count: dc.Config | None = None
    next_count_load_data: bool = False  # whether load_data runs at the next count too (the next size's does)

    def runs(self) -> list[dc.Config]:
        return [self.default] + ([self.next_count] if self.next_count else [])


def plan(s: dc.Setup, data_workers: list[int], load_data_rows: int) -> tuple[list[list[Size]], list[str]]:
    """Each (data kind, tokenizer)'s sizes, smallest first, with the runs at the next size's count; and notes on
    the counts that could not be had."""
    series, notes = [], []
    by_rows = sorted(zip(s.sizes, data_workers))
    for kind in s.kinds:
        for name in s.tokenizers:
            sizes = [Size(dc.Config(kind, rows, name, s.models[name], s.data(kind, rows), workers))
                     for rows, workers in by_rows]
            notes += [f"{c.name}: --data-workers {c.data_workers} gives {c.workers} tokenizer process(es)"
                      for c in (size.default for size in sizes) if c.data_workers and c.workers != c.data_workers]
            for small, large in itertools.pairwise(sizes):
                a, b = small.default, large.default
                if a.workers == b.workers:
                    continue
                other = dataclasses.replace(a, data_workers=b.workers, measures={})
                if other.workers == b.workers:
                    small.next_count, small.next_count_load_data = other, b.rows <= load_data_rows
                else:
                    notes.append(f"{a.name}: --data-workers {b.workers} (the count at {b.rows:,} rows) gives "
                                 f"{other.workers} tokenizer process(es): its memory growth to {b.rows:,} rows "
                                 f"compares {a.workers} with {b.workers} (marked, not in the goal)")
            series.append(sizes)
    return series, notes


def growth(before: Size, c: dc.Config, side: str) -> tuple[float, int] | None:
    """Bytes of peak anonymous memory per token from `before` to `c` on `side`, and the count `before`'s run
    had: its run at `c`'s count where there is one, else its default run."""
    same = [r for r in before.runs() if r.workers == c.workers and side in r.measures]
    base = same[0] if same else before.default if side in before.default.measures else None
    if base is None or side not in c.measures:
        return None
    d_tokens = c.med("cli cold", "tokens") - before.default.med("cli cold", "tokens")
    if d_tokens <= 0:
        return None
    return (c.med(side, "peak_anon") - base.med(side, "peak_anon")) / d_tokens, base.workers


def report(series: list[list[Size]], args, n_cores: int) -> None:
    configs = [c for sizes in series for size in sizes for c in size.runs()]
    sides = [side for side in SIDES if any(side in c.measures for c in configs)]
    dc.print_header(args, n_cores)
    print("Peak anonymous memory, MB (RssAnon summed over the process tree; CLI: up to its data line), and its "
          "growth in bytes per token of data from the size before, between runs with the same number of tokenizer "
          "processes (the smaller size's run at the next size's count where the default counts differ; "
          "'a->b workers': different counts, not in the goal). workers: the processes that tokenize (1: the CLI's "
          "own, no pool), " + (f"--data-workers {args.data_workers}" if args.data_workers else
                               "the CLI's own rule, no --data-workers") + f", on {n_cores} cores.")
    print()
    print(dc.table_row(["data", "rows", "tokenizer", "workers", "limit MB"] + [f"{dc.TITLES[s]} MB" for s in sides]
                       + [f"growth B/token, {dc.TITLES[s]}" for s in sides]))
    print("|---|---|---|---|---|" + "---|" * 2 * len(sides))
    rates: dict[str, list[tuple[str, float, int, int]]] = {side: [] for side in sides}
    for sizes in series:
        for i, size in enumerate(sizes):
            for c in size.runs():
                cells = [c.kind, f"{c.rows:,}", c.tokenizer, str(c.workers)]
                cells += [c.spread(side, "peak_anon", "{:,.0f}", dc.MB) for side in ["limit", *sides]]
                for side in sides:
                    found = growth(sizes[i - 1], c, side) if i and c is size.default else None
                    if found is None:
                        cells.append("-")
                        continue
                    rate, a = found
                    rates[side].append((f"{c.kind} {c.tokenizer} {sizes[i - 1].default.rows:,}->{c.rows:,}", rate, a,
                                        c.workers))
                    cells.append(f"{rate:.2f} ({dc.workers_word(a)})" if a == c.workers
                                 else f"{rate:.2f} ({a}->{c.workers} workers)")
                print(dc.table_row(cells))
    print()
    for side in sides:
        same = [(f"{name} at {dc.workers_word(w)}", r) for name, r, w, w2 in rates[side] if w == w2]
        apart = [f"{name} at {w}->{w2} workers: {r:.2f}" for name, r, w, w2 in rates[side] if w != w2]
        print(f"peak anonymous memory growth <= {GROWTH_GOAL:g} B/token between sizes at the same number of "
              f"tokenizer processes, flat to the largest ({dc.TITLES[side]}): "
              f"{dc.verdict(all(r <= GROWTH_GOAL for _, r in same) if same else None)} "
              f"({', '.join(f'{name}: {r:.2f}' for name, r in same) or 'no pair of sizes'})"
              + (f"; not compared (different counts): {', '.join(apart)}" if apart else ""))
    dc.print_raw(configs)


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    p = dc.parser(__doc__, SIZES, f"{' and '.join(map(str, QUICK_SIZES))} rows at --data-workers "
                                  f"{','.join(map(str, QUICK_DATA_WORKERS))}")
    p.add_argument("--data-workers", help="finetune-lora --data-workers for each size, in --sizes' order (0: not "
                                          "passed, the CLI's own count; default: the CLI's own count at every size)")
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.data_workers is None and args.quick and not args.sizes:
        args.data_workers = ",".join(map(str, QUICK_DATA_WORKERS))
    s = dc.setup(p, args, QUICK_SIZES, SIZES)
    data_workers = dc.int_list(args.data_workers) if args.data_workers else [0] * len(s.sizes)
    if len(data_workers) != len(s.sizes) or min(data_workers) < 0:
        p.error("--data-workers takes one count per size (0: the CLI's own)")
    series, notes = plan(s, data_workers, args.load_data_rows)
    for line in notes:
        print(f"note: {line}", flush=True)
    print("tokenizer processes: " + "; ".join(
        f"{size.default.name} {dc.workers_word(size.default.workers)}"
        + (f" (and {size.next_count.workers}, the next size's)" if size.next_count else "")
        for sizes in series for size in sizes), flush=True)

    def cold(c: dc.Config, load_data: bool) -> None:
        dc.toolkit_side(c, s.workdir, args.seq_len, load_data, args.whole_runs, warm=False)

    groups = []
    for sizes in series:
        for size in sizes:
            c = size.default
            sides = [("limit", functools.partial(dc.limit_side, c)),
                     ("toolkit", functools.partial(cold, c, c.rows <= args.load_data_rows))]
            if size.next_count:
                sides.append((f"toolkit at {dc.workers_word(size.next_count.workers)}",
                              functools.partial(cold, size.next_count, size.next_count_load_data)))
            groups.append((c.name, sides))
    dc.run_rounds(args.rounds, groups)
    report(series, args, s.n_cores)


if __name__ == "__main__":
    main()
