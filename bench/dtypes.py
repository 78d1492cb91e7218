"""The LoRA train step in float32 and in bfloat16: `finetune-lora` (the whole command, a child process a run)
against transformers + PEFT (a child process a run), on bench/train.py's model, batch, LoRA and optimizer, every
side in each round, the order alternating between rounds.

- JAX: `finetune-lora --dtype float32` and `--dtype bfloat16 --param-dtype bfloat16` (weights and compute in bf16,
  the LoRA branch in float32), `--remat` finetune-lora's default; step seconds from metrics.jsonl (the wall time
  between finished steps), the first two steps of each run left out.
- torch + PEFT: the model in float32, or cast to bfloat16 before `get_peft_model` (PEFT keeps the adapters in
  float32 on a bf16 base); two warm-up steps, then each step timed.
- MFU: model FLOPs (4N + 12·L·T·H a token, finetune/train/metrics.py) against each framework's matmul peak in the
  step's dtype, measured in a child process each round: JAX's `measure_peak_flops` (bf16 operands, float32
  result), torch's 2048² matmul in that dtype.

    python bench/dtypes.py [--rounds 3] [--steps 8] [--workdir /tmp/llama-jax-bench]

`--shape smollm2-135m` takes a pretrained model's shape instead (SmolLM2-135M's: 30 layers, hidden 576, 9 heads
and 3 kv heads, intermediate 1536, vocab 49,152, tied embeddings), same batch and LoRA; `--dtypes float32` runs
one dtype only.

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import build_model, cpu_description, run_cli, step_seconds, write_text_data  # noqa: E402
from train import BATCH, CONFIG, SEQ, cli_args  # noqa: E402

DTYPES = ("float32", "bfloat16")
SHAPES = {
    "bench": CONFIG,
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
}

# A child process: the JAX matmul peaks and the model FLOPs per token.
_JAX_FIGURES = """
import json, sys
import jax.numpy as jnp
from finetune.step.flops import flops_per_token
from finetune.train.metrics import measure_peak_flops
from jaxmodel.config import ModelConfig
print(json.dumps({"float32": measure_peak_flops(jnp.float32, 2048, 10),
                  "bfloat16": measure_peak_flops(jnp.bfloat16, 2048, 10),
                  "flops_per_token": flops_per_token(
                      ModelConfig.from_hf({"model_type": "llama", **json.loads(sys.argv[1])}), int(sys.argv[2]))}))
"""

# A child process: torch + PEFT's step times in one dtype, and torch's matmul peak in it.
_TORCH = """
import json, os, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from train import torch_side
torch.set_num_threads(os.cpu_count() or 1)
dtype, steps = getattr(torch, sys.argv[2]), int(sys.argv[3])
step = torch_side(dtype, json.loads(sys.argv[4]))
for _ in range(2):
    step()
times = []
for _ in range(steps):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
a = torch.ones(2048, 2048, dtype=dtype)
a @ a
best = float("inf")
for _ in range(10):
    start = time.perf_counter()
    a @ a
    best = min(best, time.perf_counter() - start)
print(json.dumps({"seconds": times, "peak": 2.0 * 2048**3 / best}))
"""


# finetune-lora as it runs without its huge-page restart (finetune/train/host_memory.py): a malloc setting of
# the user's own, glibc's default value, leaves malloc as it is
DEFAULT_MALLOC = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
# each side's framework: its name in the table, and the environment its runs get
NAMES = {"jax": "finetune-lora --dtype {dtype}", "torch": "torch + PEFT, {dtype}",
         "jax, default malloc": "finetune-lora --dtype {dtype}, "
                                + " ".join(f"{k}={v}" for k, v in DEFAULT_MALLOC.items())}
ENVIRONMENTS = {"jax, default malloc": DEFAULT_MALLOC}


def jax_run(model: Path, data: Path, workdir: Path, dtype: str, steps: int, env: dict | None = None) -> list[float]:
    out = workdir / "runs" / f"dtypes-{dtype}"
    shutil.rmtree(out, ignore_errors=True)
    args = cli_args(model, data, out, steps, "dots")
    args[args.index("--dtype") + 1] = dtype
    args[args.index("--remat"):args.index("--remat") + 2] = []  # finetune-lora's default
    if dtype != "float32":
        args += ["--param-dtype", dtype]
    run = run_cli(args, env)
    if not run.ok:
        raise SystemExit(f"finetune-lora failed (exit {run.returncode}): {run.error_lines()}")
    seconds = step_seconds(out)[1:]  # step_seconds leaves out step 1 already
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def torch_run(dtype: str, steps: int, config: dict) -> dict:
    child = subprocess.run([sys.executable, "-c", _TORCH, str(Path(__file__).resolve().parent), dtype, str(steps),
                            json.dumps(config)],
                           capture_output=True, text=True)
    if child.returncode:
        raise SystemExit(f"torch side failed: {child.stderr[-2000:]}")
    return json.loads(child.stdout.splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every side, the order alternating")
    parser.add_argument("--steps", type=int, default=8, help="steps of each run (JAX: the first two left out)")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench", help="model, data and runs")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench",
                        help="the model's shape: bench/train.py's (default) or a pretrained model's")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: float32, bfloat16 (default both)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="also finetune-lora in float32 with glibc's default malloc (no huge pages)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    workdir = Path(args.workdir)
    config = {**SHAPES[args.shape], "rms_norm_eps": 1e-5}
    dtypes = [d for d in DTYPES if d in args.dtypes.split(",")]
    model = build_model(workdir, config)
    data = write_text_data(workdir / f"train-{SEQ}.jsonl", BATCH * SEQ * args.steps, seed=0, row_words=SEQ - 2)
    sides = [("jax", d) for d in dtypes] + [("torch", d) for d in dtypes]
    if args.default_malloc:
        sides.insert(1, ("jax, default malloc", "float32"))
    seconds = {side: [] for side in sides}
    peaks = {side: [] for side in sides}
    flops = None
    for r in range(args.rounds):
        figures = json.loads(subprocess.run([sys.executable, "-c", _JAX_FIGURES, json.dumps(config), str(SEQ)],
                                            capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        flops = figures["flops_per_token"]
        for side in sides if r % 2 == 0 else sides[::-1]:
            framework, dtype = side
            if framework != "torch":
                times = jax_run(model, data, workdir, dtype, args.steps, ENVIRONMENTS.get(framework))
                peaks[side].append(figures[dtype])
            else:
                result = torch_run(dtype, args.steps - 2, config)
                times = result["seconds"]
                peaks[side].append(result["peak"])
            seconds[side] += times
            print(f"round {r + 1} {framework} {dtype}: {', '.join(f'{t:.3f}' for t in times)} s", flush=True)
    report(seconds, peaks, flops, args)


def report(seconds: dict, peaks: dict, flops: float, args) -> None:
    tokens = BATCH * SEQ
    print(f"\nCPU: {cpu_description()}; shape {args.shape}; batch {BATCH} x seq {SEQ}, LoRA r=8 on all seven "
          f"projections; {args.rounds} rounds; model FLOPs {flops / 1e6:.1f} MFLOP a token")
    print("\n| side | step s: median (min-max, steps) | tokens/s | matmul peak in its dtype: median (min-max) | MFU |")
    print("|---|---|---|---|---|")
    rate = {}
    for (framework, dtype), times in seconds.items():
        side_peaks = peaks[(framework, dtype)]
        median, peak = statistics.median(times), statistics.median(side_peaks)
        rate[(framework, dtype)] = tokens / median
        name = NAMES[framework].format(dtype=dtype)
        # the peak moves between rounds about as much as the step: its range is part of the MFU's
        spread = f" ({min(side_peaks) / 1e9:.0f}-{max(side_peaks) / 1e9:.0f})" if len(side_peaks) > 1 else ""
        print(f"| {name} | {median:.3f} ({min(times):.3f}-{max(times):.3f}, {len(times)}) | {tokens / median:,.0f} | "
              f"{peak / 1e9:.0f} GFLOP/s{spread} | {flops * tokens / median / peak:.1%} |")
    if ("jax", "bfloat16") in rate and ("jax", "float32") in rate:
        print(f"\nJAX bf16 / JAX float32 tokens/s: {rate[('jax', 'bfloat16')] / rate[('jax', 'float32')]:.2f}x")
    if ("jax, default malloc", "float32") in rate and ("jax", "float32") in rate:
        print(f"finetune-lora float32 / the same with glibc's default malloc: "
              f"{rate[('jax', 'float32')] / rate[('jax, default malloc', 'float32')]:.2f}x")
    for dtype in DTYPES:
        if ("jax", dtype) in rate and ("torch", dtype) in rate:
            print(f"JAX {dtype} / torch+PEFT {dtype}: {rate[('jax', dtype)] / rate[('torch', dtype)]:.2f}x")


if __name__ == "__main__":
    main()
