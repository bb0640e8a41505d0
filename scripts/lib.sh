# Shell helpers of scripts/test.sh, scripts/torch_matrix.sh and .ci/run (source it): the Python
# of a version, an environment with a given torch, and a build of rustc10d into it.

# What building and testing rustc10d needs besides torch (numpy: torch warns without it;
# expecttest: torch's own test modules import it, tests/py/torch_suite/run.py runs them).
REQUIREMENTS=("setuptools>=70.1" "setuptools-rust>=1.12" wheel pytest pytest-timeout numpy expecttest)

# torchft, for tests/py/torchft/test_torchft.py on a torch with the native reconfigure API (2.14 on): the
# nightly the tests were written against (its own tests, which they run, change between nightlies).
TORCHFT_REQUIREMENTS=("torchft-nightly==2026.10.26" parameterized)

# What scripts/build_wheels.sh links the core with, so that it needs no glibc newer than torch's
# wheels do (manylinux_2_28): zig's linker and its stubs of every glibc, through cargo-zigbuild.
ZIG_REQUIREMENTS=("ziglang==0.17.1" "cargo-zigbuild==0.24.1")

# Where CI and torch_matrix.sh keep one environment per (torch, Python), reused between runs.
ENVS=${RUSTC10D_ENVS:-$HOME/.cache/rustc10d/envs}

env_dir() {  # env_dir TORCH PY
    echo "$ENVS/torch-$1-py$2"
}

# The interpreter of Python X.Y: pyenv's newest X.Y.*, else pythonX.Y on PATH.
python_for() {
    local v=$1 full
    if command -v pyenv >/dev/null; then
        full=$(pyenv versions --bare --skip-aliases 2>/dev/null | grep -E "^${v//./\\.}\.[0-9]+$" | sort -V | tail -1)
        if [ -n "$full" ]; then
            echo "$(pyenv root)/versions/$full/bin/python$v"
            return
        fi
    fi
    command -v "python$v" || { echo "no Python $v (neither pyenv nor python$v on PATH)" >&2; return 1; }
}

# ensure_env DIR TORCH [PY]: a virtual environment at DIR (created with Python PY, or python3)
# holding torch==TORCH and REQUIREMENTS. An existing one is reused; pip skips what it has.
ensure_env() {
    local dir=$1 torch=$2 py=${3:-}
    if [ ! -x "$dir/bin/python" ]; then
        "$( [ -n "$py" ] && python_for "$py" || echo python3 )" -m venv "$dir"
        PIP_NO_CACHE_DIR=1 "$dir/bin/python" -m pip install -q --upgrade pip
    fi
    if [ -n "$py" ]; then
        "$dir/bin/python" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$py'.split('.'))))" ||
            { echo "$dir has Python $("$dir/bin/python" -V), not $py: remove it, or choose another" >&2; return 1; }
    fi
    # No pip cache: each torch is about 5 GB, and the environment keeps it anyway.
    PIP_NO_CACHE_DIR=1 "$dir/bin/python" -m pip install -q "torch==$torch" "${REQUIREMENTS[@]}"
}

# build_rustc10d DIR: build rustc10d against DIR's torch and install it there. Each environment
# keeps its own cargo target folder, so that a rebuild against the same torch is incremental.
build_rustc10d() {
    local dir=$1
    CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$dir/target} "$dir/bin/python" -m pip install -q --no-build-isolation --no-deps .
}
