#!/usr/bin/env bash
# One GPU session's measurements, in order of value, each bounded in time, their output in one folder:
#
#   bash bench/gpu_session.sh [FOLDER]     # default: $OUT, else ./gpu_session; at most ~9 minutes on an H100/H200
#
# The toolkit runs from this tree (PYTHONPATH at its root: nothing is installed). The GPU machine's image lacks
# `datasets` and `tensorboardX`, which finetune-lora's GRPO run needs: `bash bench/gpu_wheels.sh` here puts their
# wheels in .whl/ (ignored by git), and a session carries .whl to the machine, where this installs them first;
# without them the GRPO measurement is skipped, said in its file.
#
#   versions.json        the card, driver, CUDA, cuDNN and package versions
#   report.json / .txt   bench/device_report.py at its accelerator shape (Llama 3.1 8B widths, seq 2048, auto
#                        attention: the fused kernel the run takes and why), the attention table 1k-32k with every
#                        path (xla, blockwise, cudnn, pallas-triton, pallas-flash; share of the bf16 peak) and each
#                        kernel's check (packed rows, rows of one sequence, a cp chunk with a window)
#   sampler.txt          bench/sampler.py in bf16 on SmolLM2-135M's shapes (random weights: no network there), the
#                        rollout sampler against transformers' `generate` on the same GPU
#   step-*.json / .txt   the train step alone (--step-only) at 1 x 32768 (auto), then 4 x 2048 on the blockwise
#                        path, to set the kernel's step against the portable one (the report's step is 2048, auto)
#   profile-*.json/.txt  bench/step_profile.py, bf16, auto attention, 4 x 2048: at Llama 3.1 8B widths (16 layers),
#                        then Qwen3-30B-A3B's (8 layers of 128 experts, 8 a token, LoRA on attention and every
#                        expert): where the step's time goes, by model part, the experts' blocks among them (XLA's
#                        command buffers off, so that each kernel's trace event names its HLO instruction)
#   grpo.txt             bench/grpo.py, bf16, SmolLM2-135M's shapes: a GRPO step's time split into sampling, the
#                        log-prob pass, the rewards and the training step, through finetune-lora
#   profile-fp8-*.json/.txt  bench/step_profile.py at 8B widths (16 layers), bf16, 4 x 2048 on an FP8 base (random
#                        codes): dequantized layer by layer, then multiplied in FP8 (--fp8-matmul e4m3fn, the
#                        H100/H200's format), the step's time and where it goes
#
# A measurement that runs past its limit is cut off and the next one starts; what finished stays in the folder. The
# whole script keeps within $GPU_SESSION_SECONDS (default 530): a measurement's limit is cut to what is left, and
# one with under 30 s left is skipped.
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_session}}"
mkdir -p "$out"
budget="${GPU_SESSION_SECONDS:-530}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-session-site \
    .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-session-site"
fi

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

limited() {  # SECONDS: the limit cut to what is left of the budget, or nothing when under 30 s is left
  local left=$(( budget - SECONDS ))
  (( left >= 30 )) && echo $(( left < $1 ? left : $1 ))
}

measure() {  # NAME SECONDS ARGS...: bench/device_report.py ARGS, its table in NAME.txt and figures in NAME.json
  local name=$1 limit
  limit=$(limited "$2") || { echo "== $name skipped: under 30 s of the budget left"; return; }
  shift 2
  echo "== $name (at most ${limit} s): device_report.py $*"
  timeout "$limit" python bench/device_report.py --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? after $SECONDS s in all"
}

profile() {  # NAME SECONDS ARGS...: bench/step_profile.py ARGS, its table in NAME.txt and figures in NAME.json
  local name=$1 limit
  limit=$(limited "$2") || { echo "== $name skipped: under 30 s of the budget left"; return; }
  shift 2
  echo "== $name (at most ${limit} s): step_profile.py $*"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "$limit" \
    python bench/step_profile.py --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? after $SECONDS s in all"
}

bench() {  # NAME SECONDS SCRIPT ARGS...: python bench/SCRIPT ARGS, its output in NAME.txt
  local name=$1 limit script=$3
  limit=$(limited "$2") || { echo "== $name skipped: under 30 s of the budget left"; return; }
  shift 3
  echo "== $name (at most ${limit} s): $script $*"
  timeout "$limit" python "bench/$script" "$@" > "$out/$name.txt" 2>&1
  echo "   exit $? after $SECONDS s in all"
}

measure report 240
bench sampler 60 sampler.py --random-weights --dtype bfloat16 --rounds 1 --reps 2 --workdir /tmp/gpu-session
measure step-1x32768-auto 70 --step-only --seq 32768 --batch 1 --steps 3
measure step-4x2048-blockwise 50 --step-only --seq 2048 --batch 4 --steps 5 --attention blockwise
profile profile-4x2048 60 --shape 8b --layers 16 --dtype bfloat16 --batch 4 --seq 2048 --steps 2
profile profile-moe-4x2048 60 --shape 30b-a3b --layers 8 --dtype bfloat16 --batch 4 --seq 2048 --steps 2
if python -c "import datasets, tensorboardX" 2> /dev/null; then
  bench grpo 90 grpo.py --random-weights --dtype bfloat16 --steps 5 --workdir /tmp/gpu-session
else
  echo "skipped: datasets and tensorboardX are missing here (bash bench/gpu_wheels.sh, then carry .whl)" \
    | tee "$out/grpo.txt"
fi
profile profile-fp8-dequantized 60 --shape 8b --layers 16 --dtype bfloat16 --batch 4 --seq 2048 --steps 2 --quantize fp8
profile profile-fp8-matmul 60 --shape 8b --layers 16 --dtype bfloat16 --batch 4 --seq 2048 --steps 2 --quantize fp8 --fp8-matmul e4m3fn
