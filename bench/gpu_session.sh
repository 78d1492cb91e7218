#!/usr/bin/env bash
# One GPU session's measurements, in order of value, each bounded in time, their output in one folder:
#
#   bash bench/gpu_session.sh [FOLDER]     # default: $OUT, else ./gpu_session; under ~8 minutes on an H100/H200
#
#   versions.json        the card, driver, CUDA, cuDNN and package versions
#   report.json / .txt   bench/device_report.py at its accelerator shape (Llama 3.1 8B widths, seq 2048, auto
#                        attention: the fused kernel the run takes and why), the attention table 1k-32k with every
#                        path (xla, blockwise, cudnn, pallas-triton, pallas-flash; share of the bf16 peak) and each
#                        kernel's check (packed rows, rows of one sequence, a cp chunk with a window)
#   step-*.json / .txt   the train step alone (--step-only) at 1 x 32768 (auto), then 4 x 2048 on the blockwise
#                        path, to set the kernel's step against the portable one (the report's step is 2048, auto)
#   profile-*.json/.txt  bench/step_profile.py, bf16, auto attention, 4 x 2048: at Llama 3.1 8B widths (16 layers),
#                        then Qwen3-30B-A3B's (8 layers of 128 experts, 8 a token, LoRA on attention and every
#                        expert): where the step's time goes, by model part, the experts' blocks among them (XLA's
#                        command buffers off, so that each kernel's trace event names its HLO instruction)
#
# A measurement that runs past its limit is cut off and the next one starts; what finished stays in the folder.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_session}}"
mkdir -p "$out"

python - > "$out/versions.json" 2>&1 <<'EOF'
import json, subprocess
import jax, jaxlib, flax, optax
versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "devices": [d.device_kind for d in jax.devices()], "platform_version": jax.devices()[0].client.platform_version}
try:
    from jax._src.lib import cuda_versions
    versions["cudnn"] = cuda_versions.cudnn_get_version()
    versions["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
except Exception as error:  # noqa: BLE001 - a version that cannot be read is said, not fatal
    versions["cudnn"] = f"unknown: {error}"
try:
    versions["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit", "--format=csv"],
        capture_output=True, text=True, timeout=30).stdout
except Exception as error:  # noqa: BLE001
    versions["nvidia_smi"] = f"unavailable: {error}"
print(json.dumps(versions, indent=1))
EOF

measure() {  # NAME SECONDS ARGS...: bench/device_report.py ARGS, its table in NAME.txt and figures in NAME.json
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): device_report.py $*"
  timeout "$limit" python bench/device_report.py --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? after $SECONDS s in all"
}

profile() {  # NAME SECONDS ARGS...: bench/step_profile.py ARGS, its table in NAME.txt and figures in NAME.json
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): step_profile.py $*"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "$limit" \
    python bench/step_profile.py --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? after $SECONDS s in all"
}

measure report 240
measure step-1x32768-auto 70 --step-only --seq 32768 --batch 1 --steps 3
measure step-4x2048-blockwise 50 --step-only --seq 2048 --batch 4 --steps 5 --attention blockwise
profile profile-4x2048 60 --shape 8b --layers 16 --dtype bfloat16 --batch 4 --seq 2048 --steps 2
profile profile-moe-4x2048 60 --shape 30b-a3b --layers 8 --dtype bfloat16 --batch 4 --seq 2048 --steps 2
