"""The limit of data preparation, in one plain process: read a JSONL file of `{"text"}` or `{"messages"}` rows
into memory (not timed), then render each chat once (`apply_chat_template(tokenize=False)`; a text row is its
text) and call the fast tokenizer's batch encoding (`tokenizer(texts, add_special_tokens=False)`) on batches
of 1024 rows, nothing else. Prints one JSON line: {"seconds": the rendering and encoding loop, "tokens": ids
produced, "read_seconds": the reading before it}.

The data benchmarks run it as a measured child (bench/data_common.py, with TOKENIZERS_PARALLELISM=true);
alone:

    python bench/data_limit_child.py MODEL_DIR DATA.jsonl text|chat
"""

from __future__ import annotations

import argparse
import json
import time

BATCH_ROWS = 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a directory with the tokenizer (a converted model's)")
    p.add_argument("data", help="the JSONL file")
    p.add_argument("kind", choices=("text", "chat"), help="text: {\"text\"} rows; chat: {\"messages\"} rows")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    with open(args.data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    read_seconds = time.perf_counter() - start
    tokens, start = 0, time.perf_counter()
    for lo in range(0, len(rows), BATCH_ROWS):
        batch = rows[lo:lo + BATCH_ROWS]
        if args.kind == "chat":
            texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in batch]
        else:
            texts = [row["text"] for row in batch]
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        tokens += sum(map(len, ids))
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": tokens, "read_seconds": read_seconds}))


if __name__ == "__main__":
    main()
