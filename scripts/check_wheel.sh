#!/usr/bin/env bash
# scripts/check_wheel.sh WHEEL_DIR TORCH PY: rustc10d's wheel installed as a user installs it.
# A fresh virtual environment with Python PY gets torch==TORCH from PyPI (and numpy, which
# torch warns without), then, with nothing but that environment on PATH (no Rust, no C++
# compiler), `pip install` of the wheel for PY from WHEEL_DIR, timed, and a 2-rank job of every
# op under torchrun, plain and staged like CUDA tensors. The environment is deleted after.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

[ $# -eq 3 ] || { echo "usage: $0 WHEEL_DIR TORCH PY" >&2; exit 2; }
wheels=$(cd "$1" && pwd) torch=$2 py=$3
wheel=$(ls "$wheels"/rustc10d-*-cp${py/./}-cp${py/./}-*.whl)
venv=$(mktemp -d -t rustc10d-wheel-check.XXXXXX)
trap 'rm -rf "$venv"' EXIT

"$(python_for "$py")" -m venv "$venv"
PIP_NO_CACHE_DIR=1 "$venv/bin/python" -m pip install -q --upgrade pip
PIP_NO_CACHE_DIR=1 "$venv/bin/python" -m pip install -q "torch==$torch" numpy
t0=$(date +%s%N)
env -i HOME="$HOME" PATH="$venv/bin" "$venv/bin/python" -m pip install -q --no-deps "$wheel"
echo "pip install $(basename "$wheel") (torch $torch, Python $py, no compiler on PATH): $((($(date +%s%N) - t0) / 1000000)) ms"
for staged in 0 1; do
    timeout 300 env -i HOME="$HOME" PATH="$venv/bin" OMP_NUM_THREADS=1 RUSTC10D_TEST_STAGING=$staged \
        "$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 tests/py/packaging/every_op_job.py 2>&1 |
        grep -E "ops checked|^OK|Error" | tail -3
done
env -i HOME="$HOME" PATH="$venv/bin" "$venv/bin/python" -c \
    "import rustc10d; print('rustc10d', rustc10d.__version__, 'for torch', rustc10d.BUILT_FOR_TORCH, 'from', rustc10d.__file__)"
