"""What a preference step costs, through `finetune-lora` (child processes; this process imports neither jax nor
the toolkit): three comparisons on bench/train.py's model (hidden 512, 8 layers, vocab 8192; float32, LoRA r=8 on
all seven projections, one device), rounds alternating which side runs first.

1. `--objective dpo` (in-step reference: the base with adapters off) against SFT over the same tokens: B pairs
   unpacked are 2B rows; SFT trains the same 2B sequences (prompt + chosen, prompt + rejected) as 2B unpacked
   prompt-completion rows. Model FLOPs per token are 4N + 12·L·T·H for SFT and 6N + 16·L·T·H for DPO (the
   reference's forward, 2N + 4·L·T·H, added; finetune/train/metrics.py), a ratio of about 1.5: the DPO step
   should cost that ratio of SFT's. And `--objective dpo --precompute-reference` (the reference's values computed
   in one pass before training; a fresh data cache each run, so each round times the pass too): its step runs
   no reference forward, so it should cost what SFT's does.
2. Packed pairs against `--no-pack` on short pairs (prompt ~100, replies ~50 tokens) at `--seq-len 1024`:
   pairs per second of DPO steps (`--remat full` on both sides, to bound the unpacked side's memory).
3. Peak RSS of the DPO run (B pairs) against the SFT run of 2B rows (1.): the reference forward keeps no
   activations, so DPO should hold no more.

Step seconds are the wall time between finished steps (metrics.jsonl's tokens_per_s over the tokens a step
computes, padding included), each run's first two steps left out; MFU against the float32 matmul peak measured in
a child process in the same run.

    python bench/preference.py [--rounds 3] [--steps 8] [--workdir /tmp/llama-jax-bench]

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import GB, build_model, cpu_description, run_cli  # noqa: E402
from train import CONFIG, RANK, TARGETS  # noqa: E402

PAIRS, SEQ = 8, 256  # comparison 1 and 3: 8 pairs = 16 rows of 256
SHORT_PAIRS, SHORT_SEQ = 8, 1024  # comparison 2
_ROWS = re.compile(r"([\d,]+) (?:packed|padded) rows of (\d+) per step")
_PASS = re.compile(r"reference: ([\d,]+) sequences computed in ([\d.]+) s")
# A child process (this one imports no jax): the float32 peak and the model FLOPs per token of SFT and DPO.
_FIGURES = """
import json, sys
import jax.numpy as jnp
from finetune.step.flops import flops_per_token
from finetune.train.metrics import measure_peak_flops
from jaxmodel.config import ModelConfig
config, seq = ModelConfig(**json.loads(sys.argv[1])), int(sys.argv[2])
print(json.dumps([measure_peak_flops(jnp.float32, 2048, 10), flops_per_token(config, seq),
                  flops_per_token(config, seq, reference_forward=True)]))
"""


def words(rng: random.Random, n: int) -> str:
    from demo.tiny import CORPUS_WORDS  # plain Python

    return " ".join(rng.choices(CORPUS_WORDS, k=n))


def write_pairs(path: Path, n: int, prompt_words: int, reply_words: int, seed: int) -> Path:
    """`preference` rows: random-word prompts and replies (the tiny tokenizer makes about a token a word)."""
    rng = random.Random(seed)
    rows = [{"prompt": words(rng, prompt_words), "chosen": " " + words(rng, reply_words),
             "rejected": " " + words(rng, reply_words)} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_sft_of(pairs: Path, path: Path) -> Path:
    """The pairs' 2n sequences as prompt-completion rows: the tokens a DPO step on them computes."""
    rows = [json.loads(line) for line in pairs.read_text().splitlines()]
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r[side]}) + "\n"
                            for r in rows for side in ("chosen", "rejected")))
    return path


def train_args(model: Path, data: Path, steps: int, batch: int, seq: int, *extra, remat: str = "none") -> list:
    """`finetune-lora` on `data`, less `--out`."""
    return ["finetune-lora", "--model", model, "--data", data, "--steps", steps, "--batch-size", batch,
            "--seq-len", seq, "--dtype", "float32", "--mesh", "dp=1,fsdp=1,mp=1", "--rank", RANK,
            "--targets", ",".join(TARGETS), "--lr", "1e-4", "--schedule", "constant", "--clip-norm", "0",
            "--remat", remat, "--checkpoint-every", "100000", "--no-progress", *extra]


def measured(args: list, workdir: Path, name: str) -> dict:
    """One run: its steady-state step seconds, rows and tokens a step, peak RSS, and the seconds of a
    --precompute-reference pass (None without)."""
    out, cache = workdir / "runs" / name, workdir / "runs" / f"{name}-cache"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    run = run_cli([*args, "--out", out, "--data-cache", cache])
    if not run.ok:
        raise SystemExit(f"finetune-lora failed (exit {run.returncode}): {run.error_lines()}")
    config = json.loads((out / "run_config.json").read_text())
    match = _ROWS.search(run.stderr)
    rows = int(match.group(1).replace(",", "")) if match else config["batch_size"]  # SFT: the batch's rows
    tokens = rows * config["seq_len"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = sorted((r for r in records if "tokens_per_s" in r), key=lambda r: r["step"])
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    reference_pass = _PASS.search(run.stderr)
    return {"pass_seconds": float(reference_pass.group(2)) if reference_pass else None, "seconds": [tokens / r["tokens_per_s"] for r in records[2:]], "mfu": [r["mfu"] for r in records[2:]],
            "rows": rows, "tokens": tokens, "peak_rss": run.peak_rss, "batch": config["batch_size"]}


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    return f"{median(values):.3f} ({min(values):.3f}-{max(values):.3f}, {len(values)})"


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each comparison")
    parser.add_argument("--steps", type=int, default=8, help="steps of each run (the first two are left out)")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench", help="model, data and runs")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    workdir = Path(args.workdir)
    model = build_model(workdir, {**CONFIG, "rms_norm_eps": 1e-5})
    peak, sft_flops, dpo_flops = json.loads(subprocess.run(
        [sys.executable, "-c", _FIGURES, json.dumps({**CONFIG, "rms_norm_eps": 1e-5}), str(SEQ)],
        capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    # 1 and 3: pairs whose sequences fill about 3/4 of 256 (prompt 100 + reply 90 words)
    pairs = write_pairs(workdir / "pairs-256.jsonl", 64, 100, 90, seed=0)
    sft = write_sft_of(pairs, workdir / "sft-of-pairs-256.jsonl")
    sides = {"sft": train_args(model, sft, args.steps, 2 * PAIRS, SEQ, "--no-pack"),
             "dpo": train_args(model, pairs, args.steps, PAIRS, SEQ, "--no-pack", "--objective", "dpo"),
             "dpo --precompute-reference": train_args(model, pairs, args.steps, PAIRS, SEQ, "--no-pack", "--objective",
                                                      "dpo", "--precompute-reference")}
    # 2: short pairs at 1024
    short = write_pairs(workdir / "pairs-short.jsonl", 256, 100, 50, seed=1)
    # --remat full: 16 unpacked rows of 1024 with every activation kept would take ~16 GB of RSS
    packing = {"dpo --no-pack": train_args(model, short, args.steps, SHORT_PAIRS, SHORT_SEQ, "--no-pack",
                                           "--objective", "dpo", remat="full"),
               "dpo --pack": train_args(model, short, args.steps, SHORT_PAIRS, SHORT_SEQ, "--pack",
                                        "--objective", "dpo", remat="full")}
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for group in (sides, packing):
            names = list(group) if r % 2 == 0 else list(group)[::-1]
            for name in names:
                result = measured(group[name], workdir, name.replace(" ", ""))
                results.setdefault(name, []).append(result)
                print(f"round {r + 1} {name}: {spread(result['seconds'])} s a step, {result['rows']} rows, "
                      f"peak RSS {result['peak_rss'] / GB:.2f} GB", flush=True)
    report(results, peak, dpo_flops / sft_flops, args)


def report(results: dict[str, list[dict]], peak: float, flop_ratio: float, args) -> None:
    def pooled(name: str, key: str) -> list[float]:
        return [v for r in results[name] for v in r[key]]

    sft, dpo = median(pooled("sft", "seconds")), median(pooled("dpo", "seconds"))
    print(f"\nCPU: {cpu_description()}; float32 matmul peak {peak / 1e9:.0f} GFLOP/s (measured in this run); "
          f"{args.rounds} rounds x steps 3..{args.steps}")
    print("\n| run | step s: median (min-max, steps) | rows a step | MFU (median) | peak RSS GB (median) |")
    print("|---|---|---|---|---|")
    for name in results:
        rss = median([r["peak_rss"] for r in results[name]]) / GB
        print(f"| {name} | {spread(pooled(name, 'seconds'))} | {results[name][0]['rows']} | "
              f"{median(pooled(name, 'mfu')):.1%} | {rss:.2f} |")
    print(f"\nDPO / SFT step time over the same {2 * PAIRS} x {SEQ} tokens: {dpo / sft:.3f} "
          f"(model FLOP ratio {flop_ratio:.3f}: {dpo / sft / flop_ratio - 1:+.1%} from it)")
    once = median(pooled("dpo --precompute-reference", "seconds"))
    passes = [r["pass_seconds"] for r in results["dpo --precompute-reference"]]
    print(f"DPO --precompute-reference / SFT step time: {once / sft:.3f} (its pass over the 64 pairs: "
          f"{median(passes):.1f} s, {min(passes):.1f}-{max(passes):.1f}, once before training)")
    unpacked, packed = median(pooled("dpo --no-pack", "seconds")), median(pooled("dpo --pack", "seconds"))
    print(f"packed / unpacked pairs per second, {SHORT_PAIRS} pairs a step at seq {SHORT_SEQ}: "
          f"{unpacked / packed:.2f}x")
    dpo_rss = median([r["peak_rss"] for r in results["dpo"]])
    sft_rss = median([r["peak_rss"] for r in results["sft"]])
    print(f"peak RSS, DPO {PAIRS} pairs / SFT {2 * PAIRS} rows: {dpo_rss / sft_rss:.3f}")


if __name__ == "__main__":
    main()
