"""`--plan`'s predicted step time against the measured one, on one device of this machine, several shapes.

    python bench/plan_time.py [--dtype DTYPE] [--steps 5] [--json PATH] [--quick]

The device model is measured first, in the same run: the matmul peak in the step's dtype (`measure_peak_flops`, a
2048² matmul on a CPU, 8192² on an accelerator) and the memory bandwidth an elementwise op reaches by its size, 64
KiB to 256 MiB moved (bench/device_measure.py's `memory_bandwidth_table`: caches make small ops faster), and the
rate of `exp` on cache-resident data (`transcendentals_per_s`: what bounds a softmax or a SiLU on a CPU). It is written as a `bench/device_report.py --json`-style file
and given to `finetune-lora --plan --device-model FILE` for each shape: the plan compiles the step from abstract
shapes and predicts its compute and memory time (finetune/planning/timing.py). Then the same step
(`finetune.step.train_step.jit_steps`, bench/device_measure.py's `build_step`, finetune-lora's defaults) runs with
random weights on one device, timed after two warm-up steps; the table gives the median and the spread.

One device has no collectives: the communication part of the prediction is not measured here (tests/test_plan_time.py
checks the collectives' counts against what each layout implies instead). Time only on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # neighbours: device_measure, cli_runs

import device_measure as dm  # noqa: E402
import jax  # noqa: E402  (creates no devices until one is asked for)
import jax.numpy as jnp  # noqa: E402
from cli_runs import OneLineErrorParser, cpu_description, positive  # noqa: E402

from finetune.planning.plan import plan  # noqa: E402
from finetune.planning.plan_json import json_path_problem  # noqa: E402
from finetune.train.metrics import measure_peak_flops  # noqa: E402
from jaxmodel.config import ModelConfig  # noqa: E402

PROG = "plan_time.py"
# name: (model shape, batch, seq); heads of 64 dims, rms_norm_eps 1e-5, rope defaults
SHAPES = {
    "bench 8x256": (dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2), 8, 256),
    "bench 2x1024": (dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2), 2, 1024),
    "wide 4x128": (dict(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                        num_attention_heads=16, num_key_value_heads=4), 4, 128),
    "narrow 16x128": (dict(vocab_size=16384, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2), 16, 128),
}
QUICK = {"tiny 2x64": (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2), 2, 64)}


def measured_device(dtype: str, accelerator: bool) -> dict:
    """The device model's figures, in bench/device_report.py's JSON fields."""
    peak = measure_peak_flops(getattr(jnp, dtype), 8192 if accelerator else 2048, 5)
    table = dm.memory_bandwidth_table()
    return {"device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "matmul_peak_flops": {dtype: peak}, "memory_bandwidth": {"bytes_per_s": table[-1][1], "table": table},
            "transcendentals_per_s": dm.transcendentals_per_s(), "collectives": {"skipped": "one device"}}


def measure_shape(name: str, shape: tuple, dtype: str, steps: int, model_file: Path, workdir: Path) -> dict:
    model, batch, seq = shape
    llama = ModelConfig.from_hf({"model_type": "llama", "rms_norm_eps": 1e-5, "head_dim": 64, **model})
    directory = workdir / name.replace(" ", "-")
    directory.mkdir()
    config_path = dm.write_model_config(llama, directory, dtype)
    config = dm.train_config(config_path, 1, batch, seq, dtype, 1e15)
    report = plan(dataclasses.replace(config, plan=True, device_model=str(model_file)).validate())
    predicted = report.prediction
    step = dm.build_step(llama, config, jax.devices()[:1])
    times = dm.timings(step.run, steps, warmup=2)
    measured = statistics.median(times)
    return {"shape": name, "batch": batch, "seq": seq, "layers": llama.num_hidden_layers,
            "hidden": llama.hidden_size, "predicted_seconds": predicted.ops_seconds,
            "predicted_compute_seconds": predicted.compute_seconds,
            "predicted_memory_seconds": predicted.memory_seconds, "measured_seconds": measured,
            "measured_min": min(times), "measured_max": max(times), "ratio": predicted.ops_seconds / measured,
            "flops_per_device": predicted.hlo_flops, "bytes_per_device": predicted.hlo_bytes}


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = OneLineErrorParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="the step's dtype (default: float32 on a CPU, bfloat16 on an accelerator)")
    parser.add_argument("--steps", type=positive, default=5, help="timed steps a shape (default 5)")
    parser.add_argument("--only", help="the shapes whose name contains this text")
    parser.add_argument("--quick", action="store_true", help="one tiny shape, to check the script")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.json and (problem := json_path_problem(args.json)):
        print(f"{PROG}: error: --json {args.json}: {problem}", file=sys.stderr)
        return 2
    accelerator = jax.default_backend() != "cpu"
    dtype = args.dtype or ("bfloat16" if accelerator else "float32")
    shapes = QUICK if args.quick else {k: v for k, v in SHAPES.items() if not args.only or args.only in k}
    device = measured_device(dtype, accelerator)
    where = cpu_description() if not accelerator else device["device_kind"]
    memory = ", ".join(f"{size / 2**20:g} MiB {bw / 1e9:.0f}" for size, bw in device["memory_bandwidth"]["table"])
    print(f"{where}; {jax.default_backend()}; {dtype}; measured now: matmul peak "
          f"{device['matmul_peak_flops'][dtype] / 1e12:.3f} TFLOP/s; exp {device['transcendentals_per_s'] / 1e9:.2f} "
          f"G/s; memory GB/s by bytes an op moves: {memory}\n")
    print("| shape | layers x hidden | predicted: compute + memory | measured step (median, min-max) | "
          "predicted / measured |")
    print("|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        model_file = Path(workdir) / "device.json"
        model_file.write_text(json.dumps(device))
        for name, shape in shapes.items():
            row = measure_shape(name, shape, dtype, args.steps, model_file, Path(workdir))
            rows.append(row)
            print(f"| {name} | {row['layers']} x {row['hidden']} | {row['predicted_seconds'] * 1e3:,.1f} ms "
                  f"({row['predicted_compute_seconds'] * 1e3:,.1f} + {row['predicted_memory_seconds'] * 1e3:,.1f}) | "
                  f"{row['measured_seconds'] * 1e3:,.1f} ms ({row['measured_min'] * 1e3:,.1f}-"
                  f"{row['measured_max'] * 1e3:,.1f}) | {row['ratio']:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "dtype": dtype, "shapes": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
