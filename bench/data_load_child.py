"""`finetune.data.prepare.load_data` timed alone: in a process that has first imported everything it uses
(datasets too, which the data sources import lazily) and started JAX's backend, so that the figure is the
preparation only (tokenizing, or opening the cache, and packing), as a `finetune-lora` run does it with the
tokenizer loaded from the model. Prints one JSON line: {"seconds", "rows": the training rows}; load_data's own
`finetune-lora: data: ...` line goes to stderr.

The data benchmarks run it as a measured child (bench/data_common.py); alone:

    python bench/data_load_child.py MODEL_DIR DATA.jsonl --data-cache DIR [--seq-len 4096] [--data-workers N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a converted model's directory (its tokenizer is used)")
    p.add_argument("data", help="the --data file")
    p.add_argument("--data-cache", required=True, help="finetune-lora --data-cache")
    p.add_argument("--seq-len", type=int, default=4096, help="finetune-lora --seq-len")
    p.add_argument("--data-workers", type=int, default=0, help="finetune-lora --data-workers (0: the CLI's rule)")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "data-load-child-run"),
                   help="finetune-lora --out: a run directory's name, which nothing is written to nor created")
    args = p.parse_args()

    import datasets  # noqa: F401  (an import is start-up, not preparation)
    import jax
    from transformers import AutoTokenizer

    from finetune.config import TrainConfig
    from finetune.data.prepare import load_data

    config = TrainConfig(model=args.model, data=args.data, out=args.out, seq_len=args.seq_len, data_cache=args.data_cache,
                         data_workers=args.data_workers, progress=False).validate()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    jax.process_index()  # the backend's start is not data preparation
    start = time.perf_counter()
    train_rows, _ = load_data(config, tokenizer, tokenizer_from_model=True)  # as the CLI loads it
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "rows": len(train_rows)}))


if __name__ == "__main__":  # load_data spawns tokenizer processes: they import this file without running main
    main()
