"""A quantized frozen base (`convert-llama --quantize nf4|int8`) against the unquantized bf16 one: the CPU
train-step time, conversion throughput, and `--plan` tables of the sizes a quantized base is for.

    python bench/quantized.py steps    [--rounds 3] [--steps 8]   # about 5 minutes on 2 cores
    python bench/quantized.py convert  [--layers 2] [--repeats 3] # about 3 minutes
    python bench/quantized.py plans    [--only 405b]              # about 10 minutes (compile only)

steps: bench/train.py's model (hidden 512, 8 layers, vocab 8192; batch 8 x seq 256, LoRA r=8 on all seven
projections, float32 compute, remat dots) built once in HF format and converted three ways (`--dtype bfloat16`,
and the same with `--quantize nf4` / `--quantize int8`), each trained by the real `finetune-lora` command on one
device, rounds alternating the order of the three; step times from each run's metrics.jsonl (steps 3 on). The
goal: a quantized base costs at most 1.3x the bf16 base's step (the dequantization runs once in the forward
pass and once more in the backward pass of every projection).

convert: bench/convert.py's synthetic bf16 checkpoint with Llama 3.1 8B tensor shapes, read from the page cache:
a plain copy of its files, `convert-llama`, and `convert-llama --quantize nf4|int8`, medians over --repeats.

plans: `finetune-lora --plan --quantize ...` through the CLI at XLA_CLIENT_MEM_FRACTION=0.95 on 192 GB devices
(bench/plan_tables.py's settings): 405B NF4 on 2 devices and int8 on 4 (seq 4096, one sequence per device,
remat full), and 70B NF4 on one device at seq 32768.

Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_runs import cpu_description, run_cli, step_seconds, write_text_data  # noqa: E402
from plan_tables import L70, L405, ONE, plan_command, plan_table  # noqa: E402

BASES = {"bf16": [], "nf4": ["--quantize", "nf4"], "int8": ["--quantize", "int8"]}
GOAL = 1.3  # step time of a quantized base / the bf16 base's

# name: (config, mesh, batch, seq, extra flags)
PLANS = {
    "405b-nf4-fsdp2-2x4096-full": (L405, "dp=1,fsdp=2,mp=1", 2, 4096, ["--remat", "full", "--quantize", "nf4"]),
    "405b-int8-fsdp4-4x4096-full": (L405, "dp=1,fsdp=4,mp=1", 4, 4096, ["--remat", "full", "--quantize", "int8"]),
    "70b-nf4-1dev-1x32768-full": (L70, ONE, 1, 32768, ["--remat", "full", "--quantize", "nf4"]),
}

_BUILD_HF = r"""
import json, sys
from demo.tiny import build_tiny_model
build_tiny_model(sys.argv[1], json.loads(sys.argv[2]), seed=0)
"""

# Converts in a fresh process and reports its own seconds (imports excluded), as bench/convert.py's child does.
_CONVERT = r"""
import json, sys, time
from converter import convert
quantize = sys.argv[3] if sys.argv[3] != "none" else None
t = time.perf_counter()
summary = convert(sys.argv[1], sys.argv[2], quantize=quantize, overwrite=True, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": summary.bytes}))
"""


def build_bases(workdir: Path) -> dict[str, Path]:
    """bench/train.py's model in HF format (float32, built once) converted as each of BASES (reused if present)."""
    from train import CONFIG

    hf = workdir / "hf"
    if not (hf / "config.json").is_file():
        print(f"building the model in {hf} ...", flush=True)
        subprocess.run([sys.executable, "-c", _BUILD_HF, str(hf), json.dumps({**CONFIG, "rms_norm_eps": 1e-5})],
                       check=True)
    converted = {}
    for name, flags in BASES.items():
        out = workdir / f"converted-{name}"
        if not (out / "jax_checkpoint.json").is_file():
            run = run_cli(["convert-llama", "--src", hf, "--out", out, "--dtype", "bfloat16", *flags,
                           "--overwrite", "--no-progress"])
            if not run.ok:
                raise SystemExit(f"convert-llama {' '.join(flags)} failed: {run.error_lines()}")
        converted[name] = out
    return converted


def steps_main(args) -> None:
    from train import BATCH, SEQ, cli_args

    workdir = Path(args.workdir)
    bases = build_bases(workdir)
    steps = max(args.steps, 4)
    data = write_text_data(workdir / f"train-{SEQ}.jsonl", BATCH * SEQ * steps, seed=0, row_words=SEQ - 2)
    times: dict[str, list[float]] = {name: [] for name in bases}
    order = list(bases)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:  # each base first in turn
            out = workdir / "runs" / f"{name}-{r}"
            shutil.rmtree(out, ignore_errors=True)
            run = run_cli(cli_args(bases[name], data, out, steps, "dots"))
            if not run.ok:
                raise SystemExit(f"finetune-lora on the {name} base failed: {run.error_lines()}")
            measured = step_seconds(out)[1:]  # steps 3 on
            times[name] += measured
            shutil.rmtree(out, ignore_errors=True)
            print(f"round {r + 1} {name}: {', '.join(f'{t:.3f}' for t in measured)} s", flush=True)
    bf16 = statistics.median(times["bf16"])
    print(f"\nCPU: {cpu_description()}; bench/train.py's model, batch {BATCH} x seq {SEQ}, float32 compute, remat "
          f"dots, one device; {args.rounds} rounds x steps 3..{steps}")
    print("| base | step s (median) | min-max | x bf16 base |")
    print("|---|---|---|---|")
    for name, values in times.items():
        ratio = statistics.median(values) / bf16
        mark = "" if name == "bf16" else (" (goal met)" if ratio <= GOAL else f" (goal {GOAL}x missed)")
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} | "
              f"{ratio:.2f}x{mark} |")


def convert_main(args) -> None:
    from convert import build_checkpoint, plain_copy, tensor_shapes, warm

    workdir = Path(args.workdir) / "convert"
    src = workdir / f"hf-{args.layers}l"
    if not (src / "config.json").is_file():
        print(f"building a {args.layers}-layer synthetic checkpoint in {src} ...", flush=True)
        build_checkpoint(src, args.layers)
    data_bytes = sum(math.prod(s) * 2 for s in tensor_shapes(args.layers).values())
    warm(src)
    seconds: dict[str, list[float]] = {"copy": [], "none": [], "nf4": [], "int8": []}
    written: dict[str, int] = {}
    for _ in range(args.repeats):  # alternate the sides so drift hits all of them
        seconds["copy"].append(plain_copy(src, workdir / "copy"))
        shutil.rmtree(workdir / "copy")
        for scheme in ("none", "nf4", "int8"):
            out = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(workdir / "jax"), scheme],
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            seconds[scheme].append(result["seconds"])
            written[scheme] = result["bytes"]
            shutil.rmtree(workdir / "jax")
    copy_gbps = data_bytes / statistics.median(seconds["copy"]) / 1e9
    print(f"\nCPU: {cpu_description()}; synthetic bf16 checkpoint, Llama 3.1 8B shapes, {args.layers} layers, "
          f"{data_bytes / 1e9:.2f} GB; medians of {args.repeats}")
    print("| conversion | seconds | source GB/s | x plain copy | written GB |")
    print("|---|---|---|---|---|")
    print(f"| plain copy | {statistics.median(seconds['copy']):.2f} | {copy_gbps:.2f} | 1.00x | "
          f"{data_bytes / 1e9:.2f} |")
    for scheme, label in (("none", "convert-llama"), ("nf4", "--quantize nf4"), ("int8", "--quantize int8")):
        gbps = data_bytes / statistics.median(seconds[scheme]) / 1e9
        print(f"| {label} | {statistics.median(seconds[scheme]):.2f} | {gbps:.2f} | {gbps / copy_gbps:.2f}x | "
              f"{written[scheme] / 1e9:.2f} |")
    shutil.rmtree(workdir, ignore_errors=True)


def plans_main(args) -> None:
    env = {"XLA_CLIENT_MEM_FRACTION": args.fraction}
    print(f"CPU: {cpu_description()}; XLA_CLIENT_MEM_FRACTION={args.fraction}, --hbm-gb 192", flush=True)
    plan_table(PLANS, env, args.only)


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", nargs="?", default="all", choices=("steps", "convert", "plans", "all"),
                        help="which measurement (default: all three, about 18 minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=3, help="steps: rounds over the three bases")
    parser.add_argument("--steps", type=int, default=8, help="steps: steps per run (the first two not counted)")
    parser.add_argument("--layers", type=int, default=2, help="convert: layers of the synthetic checkpoint")
    parser.add_argument("--repeats", type=int, default=3, help="convert: repeats of each side")
    parser.add_argument("--only", default="", help="plans: rows whose name contains this text")
    parser.add_argument("--fraction", default="0.95", help="plans: XLA_CLIENT_MEM_FRACTION the plans are judged at")
    parser.add_argument("--workdir", default="/tmp/llama-jax-bench-quantized")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    started = time.perf_counter()
    for part, run in (("steps", steps_main), ("convert", convert_main), ("plans", plans_main)):
        if args.part in (part, "all"):
            run(args)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
