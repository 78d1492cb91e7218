"""A mixture of experts' LoRA train step against a dense model of the same active parameters, on the CPU, through
`finetune-lora`.

Both are bench/train.py's shape (hidden 512, 8 layers, 8 heads, 2 kv heads, vocab 8192; batch 8 x seq 256, float32
compute, remat dots, one device): the dense one a Mistral with intermediate 1536, the sparse one a Mixtral with 8
experts of 768, 2 a token (each token through 2 x 768 = 1536 of MLP, plus the router's 512 x 8). LoRA r=8 on the
default targets of each (the dense: all seven projections; the sparse: attention and every expert's gate_up and
down, as PEFT's target_parameters). Rounds alternate which goes first; step times from each run's metrics.jsonl
(steps 3 on). The goal: the sparse step costs at most 1.5x the dense one's a token (a grouped matmul over every
expert, as a masked ragged_dot lowers on XLA:CPU, would be about 8x in the MLP).

    python bench/moe.py [--rounds 3] [--steps 8] [--workdir /tmp/llama-jax-bench-moe]

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_runs import build_model, cpu_description, run_cli, step_seconds, write_text_data  # noqa: E402

GOAL = 1.5  # the sparse step's time / the dense step's
SHAPE = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5)
MODELS = {
    "dense (Mistral, MLP 1536)": {**SHAPE, "model_type": "mistral", "intermediate_size": 1536, "sliding_window": None},
    "sparse (Mixtral, 2 of 8 experts of 768)": {**SHAPE, "model_type": "mixtral", "intermediate_size": 768,
                                                "num_local_experts": 8, "num_experts_per_tok": 2},
}
BATCH, SEQ = 8, 256

def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the two models")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first two not counted)")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench-moe", help="models, data and runs")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    models = {name: build_model(workdir, config) for name, config in MODELS.items()}
    steps = max(args.steps, 4)
    data = write_text_data(workdir / f"train-{SEQ}.jsonl", BATCH * SEQ * steps, seed=0, row_words=SEQ - 2)
    times: dict[str, list[float]] = {name: [] for name in models}
    peaks: dict[str, list[int]] = {name: [] for name in models}
    order = list(models)
    for r in range(args.rounds):
        for name in order[r % 2:] + order[:r % 2]:  # each first in turn
            out = workdir / "runs" / f"{order.index(name)}-{r}"
            shutil.rmtree(out, ignore_errors=True)
            run = run_cli(["finetune-lora", "--model", models[name], "--data", data, "--out", out, "--steps", steps,
                           "--batch-size", BATCH, "--seq-len", SEQ, "--dtype", "float32", "--mesh", "dp=1,fsdp=1,mp=1",
                           "--rank", 8, "--alpha", 16, "--lr", "1e-4", "--schedule", "constant", "--remat", "dots",
                           "--checkpoint-every", "100000", "--no-progress"])
            if not run.ok:
                raise SystemExit(f"finetune-lora on the {name} model failed: {run.error_lines()}")
            measured = step_seconds(out)[1:]  # steps 3 on
            times[name] += measured
            peaks[name].append(run.peak_rss)
            shutil.rmtree(out, ignore_errors=True)
            print(f"round {r + 1} {name}: {', '.join(f'{t:.3f}' for t in measured)} s", flush=True)
    dense = statistics.median(times[order[0]])
    print(f"\nCPU: {cpu_description()}; batch {BATCH} x seq {SEQ}, float32 compute, remat dots, one device; "
          f"{args.rounds} rounds x steps 3..{steps}")
    print("| model | step s (median) | min-max | tokens/s | x dense | peak RSS GB |")
    print("|---|---|---|---|---|---|")
    for name, values in times.items():
        ratio = statistics.median(values) / dense
        mark = "" if name == order[0] else (" (goal met)" if ratio <= GOAL else f" (goal {GOAL}x missed)")
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} | "
              f"{BATCH * SEQ / statistics.median(values):,.0f} | {ratio:.2f}x{mark} | {max(peaks[name]) / 1e9:.2f} |")


if __name__ == "__main__":
    main()
