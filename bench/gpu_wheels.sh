#!/usr/bin/env bash
# The wheels bench/gpu_session.sh installs on a GPU machine whose image lacks them (finetune-lora's data and
# TensorBoard packages: datasets, its dill and multiprocess, tensorboardX), at the versions this tree's environment
# runs, into .whl/ at the repository's root (ignored by git through .git/info/exclude). Run here, where pip reaches
# the index; the session then carries .whl (the device tool's `carry`).
#
#   bash bench/gpu_wheels.sh [PYTHON]      # PYTHON: the interpreter whose versions to take (default: python3)
set -eu
cd "$(dirname "$0")/.."
python="${1:-python3}"
grep -qx '/.whl/' .git/info/exclude 2> /dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
pins=$("$python" -c "
from importlib.metadata import version
print(' '.join(f'{name}=={version(name)}' for name in ('datasets', 'dill', 'multiprocess', 'tensorboardX')))")
# shellcheck disable=SC2086  # one argument a pin
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
