#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs torch and the build and test requirements
# into a virtual environment (reused when present), builds and installs rustc10d against that
# torch, checks the Rust code's format and lints, then runs the Rust core's tests (cargo test)
# and the multi-process pytest suite.
#
#   bash scripts/test.sh                                   # torch 2.15.0 into .venv
#   TORCH_VERSION=2.11.0 PYTHON_VERSION=3.12 VENV=/tmp/t211 bash scripts/test.sh
#   bash scripts/test.sh -m "not torch_independent"       # arguments go to pytest
#
# TORCH_VERSION: the torch to test against (scripts/torch-versions.txt lists the supported ones).
# PYTHON_VERSION: the Python to create VENV with (default: python3); VENV: the environment
# (default .venv). SKIP_CARGO=1 skips the torch-independent Rust checks (CI runs them once).
# RUSTC10D_FEATURES: cargo features of the build (default: lock-levels, the lock-order checker).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

TORCH_VERSION=${TORCH_VERSION:-2.15.0}
VENV=${VENV:-.venv}
# The two-host tests build network namespaces with iproute2 (they skip without root or ip).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null || echo "iproute2 unavailable: two-host tests will skip"
fi
ensure_env "$VENV" "$TORCH_VERSION" "${PYTHON_VERSION:-}"
# torchft where the torch can reconfigure a group; its tests then fail rather than skip without it.
if "$VENV/bin/python" -c "import sys, torch.distributed as d; sys.exit(not hasattr(d.ProcessGroup, 'reconfigure'))"; then
    PIP_NO_CACHE_DIR=1 "$VENV/bin/python" -m pip install -q "${TORCHFT_REQUIREMENTS[@]}"
    export RUSTC10D_REQUIRE_TORCHFT=1
fi
# With the lock-order checker (src/locks.rs): the suite's every process records a lock taken out
# of order in one file, and the run fails if it is not empty (RUSTC10D_FEATURES= builds without).
export RUSTC10D_FEATURES=${RUSTC10D_FEATURES-lock-levels}
build_rustc10d "$VENV"

if [ "${SKIP_CARGO:-0}" != 1 ]; then
    cargo fmt --check
    cargo clippy --locked --all-targets -- -D warnings
    PYO3_PYTHON="$(cd "$VENV" && pwd)/bin/python" cargo clippy --locked --all-targets --features extension -- -D warnings
    cargo test --locked
fi
lock_log=$(mktemp)
trap 'rm -f "$lock_log"' EXIT
status=0
RUSTC10D_LOCK_ORDER_LOG=$lock_log "$VENV/bin/python" -m pytest "$@" || status=$?
if [ -s "$lock_log" ]; then
    echo "=== locks taken out of their order (src/locks.rs), with where:" >&2
    cat "$lock_log" >&2
    status=1
fi
exit "$status"
