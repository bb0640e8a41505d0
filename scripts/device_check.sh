#!/usr/bin/env bash
# The checks that need the lent GPU machine (one H200, 16 cores; Python 3.12, torch 2.11, no Rust,
# no network), prepared so that one short run does them. Build the wheel here first:
#
#   bash ../shared/tools/device-wheel.sh
#
# then call the device tool's run with carry [".device-carry"] and, as the command,
#
#   d=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $d .device-carry/*.whl \
#     && PYTHONPATH=$d PARTS="cuda latency node" DS_OP=.device-carry/ds/deepspeed_shm_comm.so \
#        bash scripts/device_check.sh
#
# DS_OP: DeepSpeed's shm all_reduce op built here for that torch and Python (the image has no
# deepspeed and no network), for the latency part to run it side by side; build it after the wheel,
# whose script empties .device-carry:
#
#   DS=<a deepspeed install>/deepspeed/ops/csrc; ~/.cache/rustc10d-device/venv-t2.11.0-py3.12.1/bin/python -c \
#     "from torch.utils.cpp_extension import load; load(name='deepspeed_shm_comm', \
#      sources=['$DS/cpu/comm/shm_interface.cpp', '$DS/cpu/comm/shm.cpp'], extra_include_paths=['$DS/cpu/includes'], \
#      extra_cflags=['-std=c++20', '-O2', '-fopenmp'], build_directory='.device-carry/ds')"
#
# PARTS (run in this order, each under its own time limit, each writing into $OUT as it goes):
#   cuda  scripts/gpu_check.sh: every CUDA check, with RUSTC10D_CUDA_WAIT=host then =stream
#         (issue #16: wait() under 1 ms while the inputs are still being produced, a failed op
#         leaves its tensor as it was, DDP and FSDP2 as with Gloo, FSDP2's step time); about 3 minutes
#   latency  small all_reduces (8 B to 1 MiB, float32 and bfloat16) at W=2, 8 and 16, back to back and
#         after 2 ms idle: rustc10d (dist.all_reduce and its direct op), Gloo, and DeepSpeed's shm op
#         where DS_OP is given (issue #30); about 2 minutes
#   node  the benchmark against Gloo at W=4, 8, 16 on this host (issue #14's table: all_reduce
#         f32 and bf16, all_gather, reduce_scatter, broadcast, ping-pong, 16 B to 64 MiB, with
#         copies and wake-ups per byte); about 5 minutes
# CUDA_LIMIT, LATENCY_LIMIT and NODE_LIMIT (seconds) bound each part; what finished is in $OUT either way.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
status=0

part() {  # part <name> <limit s> <command...>: its output to $OUT/<name>.log and the terminal's tail
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s)"
    local t0=$SECONDS
    timeout --kill-after 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ $rc = 0 ] || status=1
}

nproc; nvidia-smi -L 2>/dev/null || true
"$PYTHON" -c 'import torch, rustc10d; print("torch", torch.__version__, "rustc10d from", rustc10d.__file__)' || exit 1
for p in ${PARTS:-cuda latency node}; do
    case $p in
        cuda)
            part cuda "${CUDA_LIMIT:-300}" env PYTHON="$PYTHON" bash scripts/gpu_check.sh
            grep -E "CHECK .* FAIL|WAIT |BUSBW|STEP |gpu_check:" "$OUT/cuda.log"
            ;;
        latency)
            part latency "${LATENCY_LIMIT:-150}" "$PYTHON" -m rustc10d.bench --latency --worlds 2,8,16 \
                --sizes 8,4K,64K,1M --dtypes float32,bfloat16 --iters 200 --rounds 4 --timeout 60 \
                ${DS_OP:+--deepspeed-op "$DS_OP"} --json "$OUT/latency.json"
            grep -vE "^  W=" "$OUT/latency.log" | tail -70
            ;;
        node)
            part node "${NODE_LIMIT:-330}" "$PYTHON" -m rustc10d.bench --worlds 4,8,16 --transports shm \
                --ops all_reduce,all_gather,reduce_scatter,broadcast,pingpong --dtypes float32,bfloat16 \
                --min-size 16 --step 4 --max-size 64M --rounds 3 --budget 0.05 --timeout 100 \
                --json "$OUT/node.json" --plot "$OUT/node.png"
            tail -60 "$OUT/node.log"
            ;;
        *) echo "unknown part $p (cuda, latency, node)"; status=2 ;;
    esac
done
exit $status
