"""What the toolkit does on the JAX backend this process sees (CPU, ROCm, CUDA, TPU), in one table.

Needs only the JAX stack (jax, flax, optax, numpy) and this repository: random weights, random tokens, no
checkpoint, no network, no torch. It measures, on the devices JAX sees:

  matmul peak        FLOP/s of one device on a square matmul in float32 and bfloat16 (finetune-lora's own MFU
                     denominator, `finetune.train.metrics.measure_peak_flops`: `x @ x` on random operands in
                     that dtype, accumulated and returned in float32; float32 at the backend's default matmul
                     precision, which is TF32 on NVIDIA GPUs);
  LoRA train step    tokens/s of finetune-lora's jit step (`finetune.step.train_step.jit_steps`, the CLI's
                     defaults: LoRA r=8 on all seven projections, remat, attention, loss and MLP chunks, AdamW)
                     on a random-weight Llama, median of the timed steps after two warm-up steps, each waited
                     for; MFU = tokens/s x FLOPs per token (`finetune.step.flops.flops_per_token`:
                     4N + 12·L·T·H) / (devices of the step x one device's peak in the step's dtype);
  memory             `finetune-lora --plan`'s total per device for the same run (`finetune.planning.plan.plan`)
                     against the measured peak: the busiest device's `memory_stats()["peak_bytes_in_use"]`, or on
                     CPU (no memory_stats) the arrays the step holds on a device (weights, LoRA + AdamW state,
                     batch) plus the process's peak RSS growth over the steps divided by the devices of the step
                     (VmHWM reset after compiling, so the compiler's own memory is left out); not measured on
                     an accelerator whose backend reports no memory_stats();
  attention          forward + backward of one attention call, dense scores (`xla`) against `blockwise` and, on
                     an NVIDIA GPU, the fused kernels (`cudnn`, `pallas-triton`, `pallas-flash`), at the model's
                     heads for a row of each sequence length that fits (dense: scores at most half the device; up to
                     DENSE_SEQ_WITHOUT_LIMIT positions where the device reports no limit), with the share of the
                     matmul peak in attention FLOPs; the blockwise path with each of BLOCK_SIZES at one length
                     (8192 positions on an accelerator); and each kernel's check against the blockwise path (the
                     one a run passes before it takes the kernel);
  memory bandwidth   an elementwise op's, by the bytes it moves (64 KiB to 256 MiB), inside a compiled loop, and
                     the rate of exp (bench/device_measure.py); with the matmul peak, the figures `--plan` predicts
                     a step's time from (`--device-model report.json`): the report gives that prediction for its
                     own step beside the measured one;
  collectives        all-reduce and all-gather bus bandwidth over all local devices (nccl-tests' convention), and
                     all-reduce over 2, 4, ... of them at four sizes, with a small all-reduce's latency;
  parity             the same float32 random model on the default device and on the CPU backend, every matmul
                     at "highest" precision: max |logit difference| / max |logit| (0 where the default device
                     is the CPU).

A measurement after the train step that fails on the device (out of memory at some attention length, a
collective, parity) is reported as its error in the table and the JSON (`{"error": ...}`), the others are
kept, and the command exits with status 1 naming what failed.

Shapes. On CPU a fixed small model (hidden 512, 4 layers, vocab 8192; batch 4 x seq 256) on one device (the
CPU's simulated devices share its cores, so a mesh over them measures nothing); the report lists what it left
out for time. On an accelerator the model has Llama 3.1 8B's widths (hidden 4096, 32 / 8 heads, intermediate
14336, vocab 128256) and seq 2048 on a mesh over every local device (fsdp, as finetune-lora's default
mesh): layers chosen so the weights take at most 30% of the devices' memory (`memory_stats()["bytes_limit"]`,
which already counts XLA_CLIENT_MEM_FRACTION), rows per device so that what a row keeps for the backward (remat's
saved matmul outputs, a loss chunk's logits) takes at most 30% of one device (at most 8 rows); then the plan
checks the run fits, halving rows per device (then layers) until it does.
--layers / --seq / --batch / --steps / --step-devices replace any of these.

    python bench/device_report.py                      # at most ~3 minutes on a 2-core CPU
    python bench/device_report.py --json report.json   # also every figure as JSON
    python bench/device_report.py --dtype float32      # the step in float32 (default: bfloat16, as finetune-lora)
    python bench/device_report.py --attention xla      # the step's attention, as finetune-lora's (default: auto)
    python bench/device_report.py --quick              # a tiny model: checks the script (well under a minute)
    python bench/device_report.py --seq 32768 --batch 1 --step-only   # one step shape, its plan and MFU only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # neighbours: device_measure, cli_runs

import device_measure as dm
import jax  # creates no devices until one is asked for
import jaxlib
from cli_runs import OneLineErrorParser, choices, cpu_description, positive

from finetune.config import TrainConfig
from finetune.planning.devices import device_model_from_report
from finetune.planning.plan_json import json_path_problem
from finetune.train.metrics import TIMED_SAMPLE_SECONDS
from jaxmodel.attention import PORTABLE_IMPLS
from jaxmodel.attention_check import disagreement
from jaxmodel.config import ModelConfig
from jaxmodel.fused_attention import FUSED_IMPLS, KERNELS_ON, AttentionCall, kernel_platform, refusal
from jaxmodel.errors import UsageError, UserError
from jaxmodel.errors import report as report_error

PROG = "device_report.py"

# CPU: bench/train.py's model at half its depth and a quarter of its batch, so that everything fits in ~3
# minutes of a 2-core machine.
CPU_MODEL = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192}
QUICK_MODEL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1024}
# Accelerators: Llama 3.1 8B's widths, depth from the device's memory.
WIDE_MODEL = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072}
WEIGHT_SHARE = 0.3  # of all step devices' memory, for the frozen weights
ACTIVATION_SHARE = 0.3  # of one device's memory, for the saved activations of its rows
MAX_ROWS_PER_DEVICE = 8
WARMUP_STEPS = 2  # the first runs allocate and fill caches
PARITY_LAYERS = 2  # of the step's model: enough to pass through the layer scan; the CPU side stays quick
# Dense attention's longest length on an accelerator that reports no memory limit: its float32 scores for one row
# of Llama 3.1 8B's 32 heads take 6.4 GB there, and 100 GB at 16384 positions.
DENSE_SEQ_WITHOUT_LIMIT = 4096
# The blockwise path's (block_q, block_kv) timed against each other: jaxmodel/attention.py's 256 x 256 is a CPU
# figure, to be chosen per backend from these.
BLOCK_SIZES = ((128, 128), (256, 256), (512, 512), (128, 512), (512, 128))


@dataclasses.dataclass
class Shape:
    """Everything the report measures at, and how it was chosen."""
    model: dict  # ModelConfig fields
    batch: int
    seq: int
    devices: int  # of the train step
    steps: int
    matmul_size: int
    attention_seqs: tuple[int, ...]
    block_seq: int  # the length the blockwise path's block sizes are timed at (BLOCK_SIZES)
    collective_bytes: int  # per device
    parity_seq: int
    sized: str
    skipped: list[str]
    resizable: bool = False  # rows and layers may shrink until the plan fits (accelerator sizing)


class DoesNotFit(UsageError):
    """The smallest shape the sizing tries does not fit the device by --plan."""


def build_parser() -> argparse.ArgumentParser:
    """This benchmark's options (tests/test_docs_commands.py parses the docs' command lines with it)."""
    parser = OneLineErrorParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write every figure to this JSON file")
    parser.add_argument("--dtype", default=TrainConfig.dtype, choices=choices("dtype"),
                        help="compute and weight dtype of the train step (default: finetune-lora's, bfloat16)")
    parser.add_argument("--attention", default=TrainConfig.attention, choices=choices("attention"),
                        help="attention of the train step, as finetune-lora's --attention (default: auto)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and short lengths: checks the script")
    parser.add_argument("--step-only", action="store_true",
                        help="only the plan, the train step and the matmul peaks (no attention table, collectives or "
                             "parity)")
    parser.add_argument("--layers", type=positive, help="decoder layers of the model (default: by backend)")
    parser.add_argument("--seq", type=positive, help="tokens per row of the train step")
    parser.add_argument("--batch", type=positive, help="rows per train step, over all its devices")
    parser.add_argument("--steps", type=positive, help="timed train steps (after two warm-up steps)")
    parser.add_argument("--step-devices", type=positive,
                        help="devices of the train step (default: 1 on CPU, every local device otherwise)")
    return parser


# ---- shapes ------------------------------------------------------------------------------------------------

def cpu_shape(quick: bool) -> Shape:
    if quick:
        return Shape(QUICK_MODEL, batch=2, seq=64, devices=1, steps=2, matmul_size=256, attention_seqs=(64, 128),
                     block_seq=128, collective_bytes=2**20, parity_seq=16, sized="--quick: a tiny fixed model",
                     skipped=["everything at a real size (--quick)"])
    return Shape(CPU_MODEL, batch=4, seq=256, devices=1, steps=5, matmul_size=2048, attention_seqs=(256, 512),
                 block_seq=512, collective_bytes=16 * 2**20, parity_seq=64,
                 sized="fixed CPU shape (one device: simulated CPU devices share the cores)",
                 skipped=["Llama 3.1 8B widths sized to device memory (accelerators only)",
                          "attention at 1024 positions and more", "matmul peak at 8192² (2048² here)",
                          "collectives at 256 MiB per device (16 MiB here)"])


def accelerator_shape(bytes_limit: float | None, devices: int, itemsize: int) -> Shape:
    """Llama 3.1 8B widths, depth and rows per device from the device memory (see the module docstring)."""
    m = WIDE_MODEL
    q, kv = m["num_attention_heads"] * m["head_dim"], m["num_key_value_heads"] * m["head_dim"]
    hidden, inter, vocab = m["hidden_size"], m["intermediate_size"], m["vocab_size"]
    seq, layers, rows = 2048, 4, 1
    sized = "no memory_stats()['bytes_limit']: 4 layers, one row per device"
    if bytes_limit:
        layer_bytes = itemsize * (hidden * (2 * q + 2 * kv) + 3 * hidden * inter)
        fixed = itemsize * 2 * vocab * hidden  # embedding and LM head
        layers = int(min(m["num_hidden_layers"], max(1, (WEIGHT_SHARE * bytes_limit * devices - fixed) // layer_bytes)))
        # A row keeps each layer's matmul outputs for the backward (remat "dots": q, k, v, attention, o, gate,
        # up, down) and one loss chunk's float32 logits and their gradient.
        saved = itemsize * (2 * q + 2 * kv + 2 * hidden + 2 * inter)
        row_bytes = layers * saved * seq + 2 * 4 * min(seq, TrainConfig.loss_chunk) * vocab
        rows = int(min(MAX_ROWS_PER_DEVICE, max(1, ACTIVATION_SHARE * bytes_limit // row_bytes)))
        sized = (f"sized to {bytes_limit / 1e9:.1f} GB per device: weights <= {WEIGHT_SHARE:.0%} of all, a row's "
                 f"activations <= {ACTIVATION_SHARE:.0%} of one, then checked with --plan")
    return Shape({**m, "num_hidden_layers": layers}, batch=rows * devices, seq=seq, devices=devices, steps=10,
                 matmul_size=8192, attention_seqs=(1024, 2048, 4096, 8192, 16384, 32768),
                 block_seq=8192, collective_bytes=256 * 2**20, parity_seq=128, sized=sized, skipped=[],
                 resizable=bytes_limit is not None)


def apply_options(shape: Shape, args, local_devices: int) -> Shape:
    """The command line's --layers / --seq / --batch / --steps / --step-devices over the backend's shape."""
    devices = args.step_devices or shape.devices
    if devices > local_devices:
        raise UsageError(f"--step-devices {devices}: only {local_devices} local devices")
    batch = args.batch or -(-shape.batch // devices) * devices  # whole rows on every device
    model = {**shape.model, **({"num_hidden_layers": args.layers} if args.layers else {})}
    if args.seq:
        model["max_position_embeddings"] = max(model["max_position_embeddings"], args.seq)
    fixed = args.layers is not None and args.batch is not None
    return dataclasses.replace(shape, model=model, batch=batch, seq=args.seq or shape.seq, devices=devices,
                               steps=args.steps or shape.steps, resizable=shape.resizable and not fixed)


def shrink(shape: Shape, args) -> Shape | None:
    """Halve the rows per device, else the layers (what the options did not fix); None when neither can."""
    rows = shape.batch // shape.devices
    if args.batch is None and rows > 1:
        return dataclasses.replace(shape, batch=rows // 2 * shape.devices)
    layers = shape.model["num_hidden_layers"]
    if args.layers is None and layers > 1:
        return dataclasses.replace(shape, model={**shape.model, "num_hidden_layers": layers // 2})
    return None


# ---- measuring ---------------------------------------------------------------------------------------------

def llama_of(model: dict) -> ModelConfig:
    return ModelConfig(**model, rms_norm_eps=1e-5)


def planned(shape: Shape, args, dtype: str, bytes_limit: float | None, workdir: Path):
    """(shape, plan, config): the plan of the step; a resizable shape shrinks until its plan fits `bytes_limit`."""
    while True:
        llama = llama_of(shape.model)
        config = dm.train_config(dm.write_model_config(llama, workdir, dtype), shape.devices, shape.batch, shape.seq,
                                 dtype, bytes_limit or 0.0, args.attention)
        report = dm.plan_of(config)
        if not shape.resizable or report.total <= bytes_limit:
            return shape, report, config
        smaller = shrink(shape, args)
        if smaller is None:
            raise DoesNotFit(f"the train step needs {report.total / 1e9:.1f} GB per device by --plan, the device has "
                             f"{bytes_limit / 1e9:.1f} GB: give a smaller --layers or --batch")
        print(f"plan: {report.total / 1e9:.1f} GB per device does not fit {bytes_limit / 1e9:.1f} GB; shrinking",
              flush=True)
        shape = smaller


def measure_step(shape: Shape, config, devices: list) -> tuple[list[float], dict, float, str]:
    """(step seconds, memory measurement, compile seconds, attention path) of the train step."""
    step = dm.build_step(llama_of(shape.model), config, devices)
    # CPU: the peak RSS from here on is the steps' own (temporaries, and what the runtime allocates on a first
    # run): the compiler's working memory and the imports before it are left out.
    reset = dm.reset_peak_rss()
    compiled_rss = dm.current_rss()
    times = dm.timings(step.run, shape.steps, WARMUP_STEPS)
    growth = (dm.peak_rss() - compiled_rss) / shape.devices if reset and compiled_rss is not None else None
    memory = measured_memory(devices[0], dm.device_peak_bytes(devices), step.held_bytes(devices[0]), growth)
    return times, memory, step.compile_seconds, step.attention


def measured_memory(device, on_device: float | None, held: int, rss_growth: float | None) -> dict:
    """The step's measured peak per device: the devices' own `memory_stats()` peak; on the CPU, which reports
    none, the arrays held on a device plus the process's RSS growth over the steps per device (on any other
    backend the host's RSS says nothing about the device)."""
    if on_device is not None:
        return {"measured_peak_bytes": on_device, "measured_how": "max over the step's devices of "
                "memory_stats()['peak_bytes_in_use'] (since the process started)"}
    if device.platform == "cpu" and rss_growth is not None:
        return {"measured_peak_bytes": held + rss_growth,
                "measured_how": "arrays held on a device (weights, LoRA + AdamW, batch) + the process's peak "
                                "RSS growth over the steps / the step's devices"}
    no_vmhwm = " and /proc has no VmHWM" if device.platform == "cpu" else ""
    return {"measured_peak_bytes": None,
            "measured_how": f"not measured: the {device.platform} backend reports no memory_stats(){no_vmhwm}"}


def dense_attention_fits(llama: ModelConfig, seq: int, bytes_limit: float | None, platform: str) -> bool:
    """Whether the dense path's float32 scores for one row of `seq` take at most half the device; an accelerator
    that reports no memory limit is tried up to DENSE_SEQ_WITHOUT_LIMIT positions (the CPU's lengths are fixed
    and small)."""
    if bytes_limit:
        return dm.dense_scores_bytes(llama, seq) <= bytes_limit / 2
    return platform == "cpu" or seq <= DENSE_SEQ_WITHOUT_LIMIT


def guarded(measure: Callable[[], object]):
    """`measure()`, or {"error": its exception's type and first line}: one measurement failing on a device (out
    of memory at some length, a collective the backend lacks) leaves the rest of the report standing."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - any backend's error is the finding this entry reports
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"error": f"{type(e).__name__}: {first}".rstrip(": ")}


def failed_sections(report: dict) -> list[str]:
    """The report's measurements that ended in an error (`guarded`), by name."""
    failed = [f"attention {impl} at {r['seq']} positions" for r in report["attention"]["rows"]
              for impl in timed_impls(r) if isinstance(r[impl], dict)]
    blocks = report["attention"].get("blocks", {})
    failed += [f"blockwise {size} at {blocks['seq']} positions" for size, value in blocks.get("seconds", {}).items()
               if isinstance(value, dict)]
    return failed + [name for name in ("collectives", "parity") if "error" in report[name]]


def attention_impls(platform: str) -> tuple[str, ...]:
    """The attention paths the report times: the portable ones everywhere, on a GPU its platform's fused kernels
    (`platform` as `kernel_platform` names it)."""
    return PORTABLE_IMPLS + KERNELS_ON.get(platform, ())


def timed_impls(row: dict) -> list[str]:
    return [impl for impl in row if impl in PORTABLE_IMPLS + FUSED_IMPLS]


def attention_rows(shape: Shape, dtype: str, bytes_limit: float | None, platform: str) -> list[dict]:
    llama, rows = llama_of(shape.model), []
    for seq in shape.attention_seqs:
        row = {"seq": seq}
        for impl in attention_impls(platform):
            if impl == "xla" and not dense_attention_fits(llama, seq, bytes_limit, platform):
                row[impl] = None
                continue
            row[impl] = guarded(functools.partial(dm.attention_seconds, llama, dm.DTYPES[dtype], seq, impl))
        rows.append(row)
    return rows


def block_sizes_row(shape: Shape, dtype: str) -> dict:
    """The blockwise path's forward + backward at `shape.block_seq` positions with each of BLOCK_SIZES."""
    llama = llama_of(shape.model)
    return {"seq": shape.block_seq, "seconds": {
        f"{bq}x{bk}": guarded(functools.partial(dm.attention_seconds, llama, dm.DTYPES[dtype], shape.block_seq,
                                                "blockwise", block=(bq, bk)))
        for bq, bk in BLOCK_SIZES}}


# The calls each kernel's check is made on: packed rows, rows of one sequence, and a cp chunk's queries at their
# offset (with a sliding window) on packed rows.
CHECKED_CALLS = {"packed": dict(packed=True), "one sequence a row": dict(packed=False),
                 "packed, cp chunk, window": dict(packed=True, q_offset=True, window=True, q_len=1024)}


def attention_checks(llama: ModelConfig, dtype: str, platform: str) -> dict:
    """Each fused kernel's check before a run takes it (`jaxmodel.attention_check.disagreement`), at the model's
    heads in `dtype`, on each of CHECKED_CALLS: "agrees" or why not."""
    checks = {}
    for impl in KERNELS_ON.get(platform, ()):
        checks[impl] = {}
        for name, facts in CHECKED_CALLS.items():
            call = AttentionCall(dtype, llama.head_dim, llama.num_attention_heads, llama.num_key_value_heads,
                                 **{"q_len": 2048, "kv_len": 2048, "q_offset": False, "window": False, **facts})
            checks[impl][name] = refusal(impl, call) or disagreement(impl, call) or "agrees"
    return checks


def backend_shape(args, backend: str, bytes_limit: float | None, local_devices: int) -> Shape:
    """The shape for this backend before the command line's options: fixed on CPU (and with --quick), sized
    to the device elsewhere."""
    if backend == "cpu" or args.quick:
        return dataclasses.replace(cpu_shape(args.quick), devices=1 if backend == "cpu" else local_devices)
    itemsize = 2 if args.dtype == "bfloat16" else 4
    return accelerator_shape(bytes_limit, args.step_devices or local_devices, itemsize)


def environment(local: list, bytes_limit: float | None) -> dict:
    return {"backend": jax.default_backend(), "device_kind": local[0].device_kind, "device_count": len(local),
            "platform_version": local[0].client.platform_version, "jax_version": jax.__version__,
            "jaxlib_version": jaxlib.__version__, "host_cpu": cpu_description(), "device_bytes_limit": bytes_limit}


def step_section(shape: Shape, args, bytes_limit: float | None, devices: list) -> tuple[Shape, dict]:
    """(the shape as the plan left it, the report's model, matmul peaks, step and memory): the plan, then the
    step, then the peaks its MFU is measured against (after the step, so that the device's peak memory is the
    step's)."""
    with tempfile.TemporaryDirectory(prefix="device-report-") as workdir:
        print("planning the train step (finetune-lora --plan) ...", flush=True)
        shape, plan, config = planned(shape, args, args.dtype, bytes_limit, Path(workdir))
    print(f"training {WARMUP_STEPS} + {shape.steps} steps ...", flush=True)
    try:
        times, memory, compile_seconds, impl = measure_step(shape, config, devices)
    except Exception as e:  # the backend's out-of-memory error is the user's to act on; any other is re-raised
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        limit = gb(bytes_limit) if bytes_limit else "no reported limit"
        raise DoesNotFit(f"the train step ran out of device memory (--plan: {gb(plan.total)} per device, the device "
                         f"has {limit}): give a smaller --layers, --batch or --seq") from None
    print(f"matmul peaks ({shape.matmul_size}²), memory bandwidth ...", flush=True)
    peaks = dm.matmul_peaks(shape.matmul_size)
    table = dm.memory_bandwidth_table()
    bandwidth = {"memory_bandwidth": {"bytes_per_s": table[-1][1], "table": table},
                 "transcendentals_per_s": dm.transcendentals_per_s()}
    llama = llama_of(shape.model)
    notes = []
    if devices[0].platform == "cpu" and args.dtype == "bfloat16":
        notes.append("the CPU compiler runs bf16 matmuls in float32 and holds float32 copies of the weights: "
                     "--plan's bf16 figure is its accelerator estimate (the float32 step's, halved)")
    if bytes_limit and plan.total > bytes_limit:
        notes.append(f"--plan's total exceeds the device's {bytes_limit / 1e9:.1f} GB")
    measured = device_model_from_report({"device_kind": devices[0].device_kind, "matmul_peak_flops": peaks,
                                         **bandwidth}, "this run")
    predicted = plan.prediction.on(plan.cost, measured) if plan.prediction is not None else None
    return shape, {"model": {"config": llama.to_hf(), "sized": shape.sized},
            "matmul_peak_flops": peaks, **bandwidth,
            "predicted_step": None if predicted is None else {
                "seconds": predicted.ops_seconds, "compute_seconds": predicted.compute_seconds,
                "memory_seconds": predicted.memory_seconds, "communication_seconds": predicted.communication_seconds,
                "how": "finetune-lora --plan's prediction (its compute and memory) on this run's measured figures"},
            "matmul": {"size": shape.matmul_size,
                       "op": "x @ x, random operands in the dtype, float32 result (measure_peak_flops)"},
            "step": {**dm.step_figures(llama, config, times, peaks[args.dtype], len(devices)), "attention": impl,
                     "compile_seconds": compile_seconds, "layers": llama.num_hidden_layers},
            "memory": {"plan_peak_bytes": plan.total, "plan_compiler_bytes": plan.compiler_total, **memory,
                       "per": "device"},
            "notes": notes}


def measure(args, done=lambda report: None) -> dict:
    """Every measurement, in the order that keeps them apart (the step first: see step_section); `done(report)`
    after each section with what was measured so far."""
    local = jax.local_devices()
    bytes_limit = (local[0].memory_stats() or {}).get("bytes_limit")
    shape = apply_options(backend_shape(args, jax.default_backend(), bytes_limit, len(local)), args, len(local))
    shape, section = step_section(shape, args, bytes_limit, local[:shape.devices])
    report = {**environment(local, bytes_limit), **section}
    done(report)
    if args.step_only:
        return {**report, "attention": {"dtype": args.dtype, "batch": 1, "rows": [], "checks": {}},
                "collectives": {"skipped": "--step-only"}, "parity": {"skipped": "--step-only"},
                "skipped": shape.skipped + ["attention, collectives and parity (--step-only)"]}
    print(f"attention at {', '.join(map(str, shape.attention_seqs))} positions ...", flush=True)
    platform = kernel_platform(local[0])
    report["attention"] = {"dtype": args.dtype, "batch": 1,
                           "rows": attention_rows(shape, args.dtype, bytes_limit, platform),
                           "blocks": block_sizes_row(shape, args.dtype),
                           "checks": attention_checks(llama_of(shape.model), args.dtype, platform)}
    done(report)
    if len(local) > 1:
        print(f"collectives over {len(local)} devices ...", flush=True)
        report["collectives"] = guarded(lambda: {
            **dm.collective_bandwidth(local, shape.collective_bytes),
            **dm.collective_table(local, tuple(shape.collective_bytes // 4**k for k in (3, 2, 1, 0)))})
    else:
        report["collectives"] = {"skipped": "one device"}
    done(report)
    print("logits parity with the CPU backend ...", flush=True)
    layers = min(PARITY_LAYERS, shape.model["num_hidden_layers"])
    report["parity"] = guarded(lambda: dm.logits_parity(llama_of({**shape.model, "num_hidden_layers": layers}),
                                                        shape.parity_seq))
    why = ("its scores would take half the device" if bytes_limit else
           f"no memory_stats()['bytes_limit']: dense attention tried up to {DENSE_SEQ_WITHOUT_LIMIT} positions")
    report["skipped"] = shape.skipped + [f"dense attention at {r['seq']} positions ({why})"
                                         for r in report["attention"]["rows"] if r["xla"] is None]
    return report


# ---- the table ---------------------------------------------------------------------------------------------

def gb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e9:.2f} GB" if value >= 1e9 else f"{value / 1e6:.1f} MB"


def seconds(value: float | dict | None) -> str:
    if isinstance(value, dict):
        return f"failed: {value['error']}"
    return "does not fit" if value is None else f"{value * 1e3:,.1f} ms"


def row(name: str, figure: str, how: str = "") -> str:
    return f"| {name} | {figure} | {how} |"


def matmul_rows(report: dict) -> list[str]:
    size = report["matmul"]["size"]
    return [row(f"matmul peak {dtype}", f"{flops / 1e12:.3f} TFLOP/s",
                f"one device, {size}² `x @ x`, random {dtype} operands, float32 result, best of 5 samples of "
                f"calls back to back, >= {TIMED_SAMPLE_SECONDS * 1e3:g} ms each after the first")
            for dtype, flops in report["matmul_peak_flops"].items()]


def step_row(report: dict) -> str:
    step, c = report["step"], report["model"]["config"]
    return row("LoRA train step", f"{step['tokens_per_s']:,.0f} tokens/s, MFU {step['mfu']:.1%}",
               f"{step['dtype']}, {step['layers']} layers x hidden {c['hidden_size']}, {c['num_attention_heads']}/"
               f"{c['num_key_value_heads']} heads, vocab {c['vocab_size']}; batch {step['batch']} x seq {step['seq']} "
               f"on {step['devices']} device(s) ({step['mesh']}), remat {step['remat']}, attention "
               f"{step['attention']}; median of {step['timed_steps']} steps ({step['median_step_seconds']:.3f} s); "
               f"{step['flops_per_token'] / 1e6:,.1f} MFLOP/token")


def prediction_row(report: dict) -> str:
    p = report["predicted_step"]
    if p is None:
        return row("LoRA train step: predicted", "-", "no prediction (a bf16 plan on a CPU without its bf16 compile)")
    measured = report["step"]["median_step_seconds"]
    return row("LoRA train step: predicted", f"{p['seconds']:.3f} s ({p['seconds'] / measured:.2f} of the measured)",
               f"finetune-lora --plan's compute {p['compute_seconds']:.3f} s + memory {p['memory_seconds']:.3f} s on "
               f"this run's matmul peak and memory bandwidth by op size (communication {p['communication_seconds']:.3f}"
               f" s at the model's bus figures: not in the comparison)")


def memory_bandwidth_row(report: dict) -> str:
    table = report["memory_bandwidth"]["table"]
    return row("memory bandwidth", ", ".join(f"{size / 2**20:g} MiB {bw / 1e9:,.0f} GB/s" for size, bw in table),
               "an elementwise op moving that many bytes (read + written), inside a compiled loop; exp "
               f"{report['transcendentals_per_s'] / 1e9:.2f} G elements/s")


def memory_rows(report: dict) -> list[str]:
    memory = report["memory"]
    measured, planned_total = memory["measured_peak_bytes"], memory["plan_peak_bytes"]
    ratio = f" (measured / plan {measured / planned_total:.2f})" if measured else ""
    return [row("memory per device: plan", gb(planned_total),
                f"finetune-lora --plan's total (compiler's figure {gb(memory['plan_compiler_bytes'])} + margin)"),
            row("memory per device: measured", gb(measured) + ratio, memory["measured_how"])]


def attention_table_rows(report: dict) -> list[str]:
    attention, c = report["attention"], report["model"]["config"]
    peak = report["matmul_peak_flops"].get(attention["dtype"])
    how = (f"one row, {attention['dtype']}, the model's heads; % of the {attention['dtype']} matmul peak in attention "
           "FLOPs (3.5 x the forward's two matmuls, causal counted as half the square)")

    def timed(r, impl):
        value = r[impl]
        if isinstance(value, dict) or value is None or not peak:
            return f"{impl} {seconds(value)}"
        flops = attention_flops(c["num_attention_heads"], c["head_dim"], r["seq"])
        return f"{impl} {seconds(value)} ({flops / value / peak:.0%})"

    rows = [row(f"attention fwd+bwd, {r['seq']} positions", ", ".join(timed(r, impl) for impl in timed_impls(r)), how)
            for r in attention["rows"]]
    if blocks := attention.get("blocks"):
        rows.append(row(f"blockwise blocks, {blocks['seq']} positions",
                        ", ".join(f"{size} {seconds(value)}" for size, value in blocks["seconds"].items()),
                        "block_q x block_kv of the blockwise path; one row, as above"))
    return rows + [row(f"attention check: {impl}", "; ".join(f"{rows}: {said}" for rows, said in by_rows.items()),
                       "the check a run passes before it takes the kernel (jaxmodel/attention_check.py)")
                   for impl, by_rows in attention.get("checks", {}).items()]


def attention_flops(heads: int, head_dim: int, seq: int) -> float:
    """FLOPs of one causal attention call's forward + backward for one row: the forward's two matmuls (4 x heads x
    head_dim x seq², half of it causal) and the backward's five (2.5 times the forward's)."""
    return 3.5 * 4 * heads * head_dim * seq * seq / 2


def collectives_row(col: dict) -> str:
    if "error" in col:
        return row("collectives", f"failed: {col['error']}")
    if "skipped" in col:
        return row("collectives", f"skipped: {col['skipped']}")
    by_group = "; ".join(f"{group} devices: " + ", ".join(f"{size / 2**20:g} MiB {bw / 1e9:,.1f}" for size, bw in rows)
                         for group, rows in col.get("table", {}).items())
    return row(f"collectives, {col['devices']} devices",
               f"all-reduce {col['all_reduce_bus_bytes_per_s'] / 1e9:,.1f} GB/s, all-gather "
               f"{col['all_gather_bus_bytes_per_s'] / 1e9:,.1f} GB/s; all-reduce GB/s by group and size: {by_group}; "
               f"latency {col.get('latency_s', 0) * 1e6:,.0f} us",
               f"bus bandwidth, {col['bytes_per_device'] / 2**20:g} MiB float32 per device, median of 5 samples of "
               f"calls back to back, >= {TIMED_SAMPLE_SECONDS * 1e3:g} ms each after the first; the table: median "
               "of 3; latency: a 4 KiB all-reduce over every device")


def parity_row(p: dict) -> str:
    if "error" in p:
        return row("logits parity", f"failed: {p['error']}")
    if "skipped" in p:
        return row("logits parity", f"skipped: {p['skipped']}")
    return row("logits parity", f"{p['relative_difference']:.2e}", f"max abs difference / max abs logit, "
               f"{p['compared']}, float32, matmul precision {p['matmul_precision']}, {p['layers']} layers, "
               f"{p['seq']} tokens")


def table(report: dict) -> list[str]:
    """The report as one markdown table, with a line of what ran where above it and the shape, notes and what
    was skipped below it."""
    where = (f"backend {report['backend']} ({report['device_kind']}, {report['platform_version']}), "
             f"{report['device_count']} device(s), jax {report['jax_version']}, jaxlib {report['jaxlib_version']}; "
             f"host: {report['host_cpu']}")
    return [where, "", row("measurement", "figure", "how"), "|---|---|---|", *matmul_rows(report),
            memory_bandwidth_row(report), step_row(report), prediction_row(report), *memory_rows(report),
            *attention_table_rows(report), collectives_row(report["collectives"]),
            parity_row(report["parity"]), "", f"shape: {report['model']['sized']}",
            *(f"note: {note}" for note in report["notes"]),
            "skipped: " + ("; ".join(report["skipped"]) or "nothing")]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.json and (problem := json_path_problem(args.json)):
        print(f"{PROG}: error: --json {args.json}: {problem}", file=sys.stderr)
        return 2
    def write(report: dict) -> str | None:
        """None, or why the JSON could not be written."""
        try:
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        except OSError as e:
            return e.strerror
        return None

    try:
        # a run cut off (a session's time limit) leaves the sections it finished, marked unfinished; a write that
        # fails here is said by the last one
        report = measure(args, done=lambda report: write({**report, "unfinished": "cut off after this section"}))
    except UserError as e:
        return report_error(PROG, e)
    print("\n".join(table(report)))
    if problem := write(report):
        print(f"{PROG}: error: --json {args.json}: {problem}", file=sys.stderr)
        return 1
    if failed := failed_sections(report):
        print(f"{PROG}: error: measurements failed (the table has the errors): {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from finetune.train.host_memory import restart_with_hugepages

    restart_with_hugepages()  # as finetune-lora does on the CPU
    sys.exit(main())
