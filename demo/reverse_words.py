"""The demo's task: reverse three words. A skill one can check by exact match, learnable by LoRA on a small
random-weight Llama in a few minutes of CPU, and one that generalises: the test prompts are word orders
the training set never contains.

    python -m demo.reverse_words --out DIR   # writes DIR/train.jsonl and DIR/test.jsonl (chat rows)
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Sixteen of demo.tiny.CORPUS_WORDS, each a single token of its tokenizer with its leading space
# (tests/test_demo.py checks both).
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "answer", "question", "llama", "model", "train",
         "token", "sum", "what")
INSTRUCTION = "reverse: "


def example(words: Sequence[str]) -> dict[str, Any]:
    """One chat row: the user gives the words, the assistant answers them in reverse order."""
    return {"messages": [{"role": "user", "content": INSTRUCTION + " ".join(words)},
                         {"role": "assistant", "content": " ".join(reversed(words))}]}


def split(seed: int = 0, test_size: int = 200) -> tuple[list[dict], list[dict]]:
    """Every ordered triple of distinct WORDS (3,360), shuffled by `seed`: `test_size` held out, the rest train."""
    triples = list(itertools.permutations(WORDS, 3))
    random.Random(seed).shuffle(triples)
    if not 0 < test_size < len(triples):
        raise ValueError(f"test_size must be in 1..{len(triples) - 1}, got {test_size}")
    return [example(t) for t in triples[test_size:]], [example(t) for t in triples[:test_size]]


def write_dataset(out_dir: str | Path, seed: int = 0, test_size: int = 200) -> tuple[Path, Path]:
    """`out_dir/train.jsonl` and `out_dir/test.jsonl`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, rows in zip(paths, split(seed, test_size)):
        tmp = path.with_name(f".{path.name}.writing")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        tmp.rename(path)
    return paths


def answer(row: dict[str, Any]) -> str:
    return row["messages"][-1]["content"]


def accuracy(outputs: Sequence[str], rows: Sequence[dict[str, Any]]) -> float:
    """Fraction of generated answers equal to the expected one (surrounding whitespace ignored)."""
    return sum(out.strip() == answer(row) for out, row in zip(outputs, rows, strict=True)) / len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.reverse_words", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed of the train/test split (default: 0)")
    parser.add_argument("--test-size", type=int, default=200, help="held-out word orders (default: 200)")
    args = parser.parse_args(argv)
    try:
        train, test = write_dataset(args.out, args.seed, args.test_size)
    except ValueError as e:
        parser.error(f"--test-size: {e}")
    print(f"wrote {train} and {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
