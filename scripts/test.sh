#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs torch and the build and
# test requirements into .venv (reused when present), builds and installs
# rustc10d against that torch, then runs the Rust core's tests (cargo test) and
# the multi-process pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TORCH_VERSION:-2.15.0}
# The two-host tests build network namespaces with iproute2 (they skip without root or ip).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null || echo "iproute2 unavailable: two-host tests will skip"
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}" "setuptools>=70.1" "setuptools-rust>=1.12" wheel \
    pytest pytest-timeout numpy
.venv/bin/python -m pip install -q --no-build-isolation .

cargo test --locked
.venv/bin/python -m pytest
