"""Where the LoRA train step's time goes: a `jax.profiler` trace of finetune-lora's compiled step, in-process, each
op grouped by the part of the model it computes, with the matmuls' FLOPs and rates.

    python bench/step_profile.py [--shape bench] [--dtype float32] [--steps 3] [--json PATH]
    python bench/step_profile.py --shape 8b --dtype bfloat16 --batch 4 --seq 2048     # on a GPU

The step is the one `finetune-lora` runs (`finetune.step.train_step.jit_steps` through bench/device_measure.py's
`build_step`) with bench/dtypes.py's command at its shape: bench/train.py's batch, LoRA and optimizer, `--dtype`
and `--param-dtype` the given dtype, the other options finetune-lora's defaults (`--attention auto`: on an NVIDIA
GPU the fused kernel the run would take), one device. `--shape 8b` is Llama 3.1 8B's widths (all 32 layers unless
`--layers`, random weights: bench/device_report.py's accelerator model); `--shape 30b-a3b` is Qwen3-30B-A3B's
(bench/configs; 128 experts of 768, 8 a token) and `--shape moe` bench/moe.py's Mixtral (8 experts of 768, 2 a
token), both with LoRA on attention and every expert's gate_up and down (the default targets of a mixture of
experts); `--batch`, `--seq` and `--attention` replace bench/train.py's 4 x 256 and the default attention.

How the table is made:
- Part: each op's HLO metadata names the `jax.named_scope`s it was traced in (jaxmodel/scopes.py: projections,
  LoRA, attention, RoPE, ...), in the forward pass, its recomputation and the gradients alike; the innermost one
  counts (LoRA inside a projection is LoRA; an expert's adapter, multiplied in its experts' blocks, counts
  there). A fused op counts under the op_name XLA gives it. Ops outside every part: the layer scan's slices of the
  stacked weights and saved values and its writes of them ("layer scan"), the zero-filling of the buffers the scan
  writes into ("zero fill"), the rest ("other": residual adds, casts, the gradients' sums).
- Wall ms a step: each instant of the traced steps shared equally among the ops running then (XLA runs independent
  ops at once on the CPU's threads), so the rows add up to the traced step's time with "no op running". Op ms: the
  ops' own durations, which overlap.
- Matmul GFLOP: 2 x the output's size x the contracted size of every dot in the compiled program, as often as it
  runs; GFLOP/s: those over the part's wall time.
- The last line: the model's FLOPs a step (4N + 12·L·T·H a token, finetune/train/metrics.py) at the matmul peak
  measured in the same run (`measure_peak_flops`, 2048² on a CPU, 8192² on an accelerator), against the untraced
  step's median time: the step's MFU.

Op events are matched to the compiled program by the HLO instruction their `hlo_op` argument names (XLA:CPU's
profiler also names the event so). Where the trace has device rows (`/device:...` processes: a GPU's or TPU's
kernels, their names the kernels'), only those count: the host's rows there hold the kernels' launches. Each event
counts its instruction's FLOPs, which is right where an instruction runs as one kernel (every op on the CPU).
Checked on the CPU only; where no event names an instruction of the step, the script says so in one line.
Time only on an idle machine: anything running beside it changes the figures several-fold.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import OneLineErrorParser, choices, cpu_description, positive  # noqa: E402
from dtypes import SHAPES  # noqa: E402
from moe import MODELS as MOE_MODELS  # noqa: E402
from train import ALPHA, BATCH, LR, RANK, SEQ, TARGETS, step_times  # noqa: E402

from finetune.planning.hlo_cost import Instruction, matmul_flops, parse_hlo  # noqa: E402
from finetune.planning.plan_json import json_path_problem  # noqa: E402

from jaxmodel import scopes  # noqa: E402

PROG = "step_profile.py"
SCAN, ZERO_FILL, OTHER = "layer scan", "zero fill", "other"
WIDE = "8b"  # --shape: Llama 3.1 8B's widths
# --shape: mixtures of experts, with LoRA on attention and every expert (the toolkit's default targets for them)
MOE_SHAPES = {
    "30b-a3b": json.loads((Path(__file__).resolve().parent / "configs" / "qwen3-30b-a3b-config.json").read_text()),
    "moe": MOE_MODELS["sparse (Mixtral, 2 of 8 experts of 768)"],  # bench/moe.py's
}
# the scan's own ops: `jax.lax.scan` slices its inputs and writes its outputs with these
_SCAN_OPS = ("dynamic_index_in_dim", "dynamic_update_index_in_dim")
# `transpose(jvp(lm_head))` and the like: a scope traced at the top of a differentiated function
_WRAPPED = re.compile(r"^(?:[\w\-]+\()+|\)+$")


def part_of(inst: Instruction, name: str) -> str:
    """The part an op computes: the innermost model scope in its op_name, else what the scan or XLA made it for."""
    components = [_WRAPPED.sub("", c) for c in inst.op_name.split("/")]
    for component in reversed(components):
        if component in scopes.PARTS:
            return component
    if any(c in _SCAN_OPS for c in components):
        return SCAN
    if name.startswith("wrapped_broadcast") or inst.opcode == "broadcast":
        return ZERO_FILL
    return OTHER


def op_events(trace_dir: str) -> list[dict]:
    """The complete ('X') events of the newest trace under `trace_dir`: those of its device rows where it has any."""
    files = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
    with gzip.open(files[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    return [e for e in complete if e.get("pid") in devices] if devices else complete


def instruction_name(event: dict) -> str:
    """The HLO instruction an op event ran: its `hlo_op` argument, else its name."""
    return event.get("args", {}).get("hlo_op", event["name"])


def profile_table(events: list[dict], hlo_text: str, steps: int) -> dict:
    """Per part (and matmul / other ops within it): wall ms, op ms and matmul GFLOP a step, from the events of
    `steps` traced steps of the program `hlo_text`."""
    module = parse_hlo(hlo_text)
    instructions = module.instructions
    ops = [e for e in events if instruction_name(e) in instructions]
    if not ops:
        raise SystemExit(f"{PROG}: no event of the trace names an instruction of the compiled step "
                         "(this backend's profiler names its kernels otherwise)")
    row_of, flops_of = [], []  # per event of `ops`
    for e in ops:
        name = instruction_name(e)
        inst = instructions[name]
        flops = matmul_flops(module, inst)
        row_of.append((part_of(inst, name), "matmuls" if flops is not None else "other ops"))
        flops_of.append(flops or 0)
    # sweep over the events' starts and ends: each interval's time is shared among the ops running in it
    edges = sorted([(e["ts"], 1, i) for i, e in enumerate(ops)] + [(e["ts"] + e["dur"], -1, i)
                                                                     for i, e in enumerate(ops)],
                   key=lambda edge: (edge[0], edge[1]))
    wall, running, idle, last = collections.Counter(), set(), 0.0, None
    for t, kind, i in edges:
        if last is not None and t > last:
            for j in running:
                wall[row_of[j]] += (t - last) / len(running)
            if not running:
                idle += t - last
        last = t
        (running.add if kind == 1 else running.discard)(i)
    op_time, flops = collections.Counter(), collections.Counter()
    for e, row, f in zip(ops, row_of, flops_of):
        op_time[row] += e["dur"]
        flops[row] += f
    rows = {row: {"wall_ms": wall[row] / 1e3 / steps, "op_ms": op_time[row] / 1e3 / steps,
                  "matmul_gflop": flops[row] / 1e9 / steps} for row in wall}
    span = (edges[-1][0] - edges[0][0]) / 1e3 / steps
    return {"rows": rows, "idle_ms": idle / 1e3 / steps, "span_ms": span}


def ordered(rows: dict) -> list[tuple[str, str]]:
    order = [*scopes.PARTS, SCAN, ZERO_FILL, OTHER]
    return sorted(rows, key=lambda row: (order.index(row[0]), row[1]))


def label(part: str) -> str:
    return scopes.PARTS.get(part, part)


def print_table(table: dict) -> None:
    print("| part | ops | wall ms a step | op ms a step | matmul GFLOP a step | matmul GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for part, kind in ordered(table["rows"]):
        row = table["rows"][(part, kind)]
        rate = (f"{row['matmul_gflop'] / row['wall_ms'] * 1e3:.0f}" if kind == "matmuls" and row["wall_ms"] else "")
        gflop = f"{row['matmul_gflop']:.2f}" if kind == "matmuls" else ""
        print(f"| {label(part)} | {kind} | {row['wall_ms']:.1f} | {row['op_ms']:.1f} | {gflop} | {rate} |")
    print(f"| no op running | | {table['idle_ms']:.1f} | | | |")
    print(f"| the traced step | | {table['span_ms']:.1f} | | "
          f"{sum(r['matmul_gflop'] for r in table['rows'].values()):.2f} | |")


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = OneLineErrorParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=[*sorted(SHAPES), WIDE, *MOE_SHAPES], default="bench",
                        help="the model's shape: bench/train.py's (default), a pretrained model's (bench/dtypes.py), "
                             "Llama 3.1 8B's widths (8b) or a mixture of experts' (30b-a3b, moe)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="--dtype and --param-dtype of the step (default float32)")
    parser.add_argument("--layers", type=positive, help="decoder layers (default: the shape's)")
    parser.add_argument("--batch", type=positive, default=BATCH, help=f"rows a step (default {BATCH})")
    parser.add_argument("--seq", type=positive, default=SEQ, help=f"tokens a row (default {SEQ})")
    parser.add_argument("--attention", choices=choices("attention"), default="auto",
                        help="finetune-lora's --attention (default auto)")
    parser.add_argument("--quantize", choices=choices("quantize"), default="none",
                        help="a frozen base quantized this way, random codes (finetune-lora --plan --quantize)")
    parser.add_argument("--fp8-matmul", choices=choices("fp8_matmul"), default="off",
                        help="with --quantize fp8: finetune-lora's --fp8-matmul")
    parser.add_argument("--steps", type=positive, default=3, help="steps timed untraced, and steps traced (default 3)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.json and (problem := json_path_problem(args.json)):
        raise SystemExit(f"{PROG}: error: --json {args.json}: {problem}")
    import device_measure as dm
    import jax
    import jax.numpy as jnp

    from finetune.config import MOE_DEFAULT_TARGETS, TrainConfig
    from finetune.step.flops import flops_per_token
    from finetune.train.metrics import measure_peak_flops
    from jaxmodel.config import ModelConfig

    if args.shape == WIDE:
        from device_report import WIDE_MODEL as base
    else:
        base = {**SHAPES, **MOE_SHAPES}[args.shape]
    shape = {**base, "rms_norm_eps": 1e-5}
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    llama = ModelConfig.from_hf({"model_type": "llama", **shape})
    targets = MOE_DEFAULT_TARGETS if args.shape in MOE_SHAPES else TARGETS
    config = TrainConfig(mesh="dp=1,fsdp=1,mp=1", batch_size=args.batch, seq_len=args.seq, dtype=args.dtype,
                         param_dtype=args.dtype, rank=RANK, alpha=ALPHA, targets=",".join(targets), lr=LR,
                         schedule="constant", clip_norm=0.0, steps=10**6, attention=args.attention,
                         quantize=args.quantize, fp8_matmul=args.fp8_matmul)
    step = dm.build_step(llama, config, jax.devices()[:1])
    for _ in range(2):
        step.run()
    seconds = statistics.median(step_times(step.run, args.steps))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.steps):
            step.run()
        jax.profiler.stop_trace()
        table = profile_table(op_events(trace_dir), step.compiled.as_text(), args.steps)
    on_cpu = jax.default_backend() == "cpu"
    peak = measure_peak_flops(getattr(jnp, args.dtype), 2048 if on_cpu else 8192, 10)
    model_flops = flops_per_token(llama, args.seq) * args.batch * args.seq
    machine = f"CPU: {cpu_description()}" if on_cpu else f"device: {jax.devices()[0].device_kind}"
    base = "" if args.quantize == "none" else f"; base {args.quantize}" + (
        "" if args.fp8_matmul == "off" else f" multiplied in {args.fp8_matmul}")
    print(f"{machine}; shape {args.shape} ({llama.num_hidden_layers} layers); batch {args.batch} x seq {args.seq}; "
          f"{args.dtype}{base}; attention {step.attention}; {args.steps} steps traced\n")
    print_table(table)
    print(f"\nstep {seconds:.3f} s untraced (median of {args.steps}); model FLOPs {model_flops / 1e9:.1f} GFLOP a "
          f"step, at the {args.dtype} matmul peak of {peak / 1e9:.0f} GFLOP/s measured now: "
          f"{model_flops / peak * 1e3:.0f} ms, MFU {model_flops / peak / seconds:.1%}")
    if args.json:
        rows = {f"{part} {kind}": row for (part, kind), row in table["rows"].items()}
        Path(args.json).write_text(json.dumps({
            "shape": args.shape, "dtype": args.dtype, "quantize": args.quantize, "fp8_matmul": args.fp8_matmul,
            "layers": llama.num_hidden_layers, "batch": args.batch,
            "seq": args.seq, "attention": step.attention, "machine": machine, "step_seconds": seconds,
            "model_flops": model_flops, "matmul_peak_flops": peak, "traced_step_ms": table["span_ms"],
            "idle_ms": table["idle_ms"], "parts": rows}, indent=1))


if __name__ == "__main__":
    main()
