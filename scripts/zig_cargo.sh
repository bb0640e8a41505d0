#!/bin/sh
# scripts/zig_cargo.sh: cargo as setuptools-rust calls it ($CARGO), but the build itself (`cargo
# rustc`) goes through cargo-zigbuild, which links with zig against the symbols of glibc
# $RUSTC10D_GLIBC (default 2.28, what torch's own wheels need): the core then runs wherever torch's
# manylinux_2_28 wheels do, though this machine's glibc is newer. Every other command (metadata)
# is plain cargo. scripts/build_wheels.sh sets it, with cargo-zigbuild and zig (the ziglang
# package) from the package index in the builder's environment, on PATH.
set -eu
case $1 in
    rustc)
        shift
        host=$(rustc -vV | sed -n 's/^host: //p')
        exec cargo-zigbuild rustc --target "$host.${RUSTC10D_GLIBC:-2.28}" "$@"
        ;;
    *) exec cargo "$@" ;;
esac
