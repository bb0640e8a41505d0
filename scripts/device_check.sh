#!/usr/bin/env bash
# The checks that need the lent GPU machine (one H200, 16 cores; Python 3.12, torch 2.11, no Rust,
# no network), prepared so that one short run does them. Build the wheel here first:
#
#   bash ../shared/tools/device-wheel.sh
#
# then call the device tool's run with carry [".device-carry"] and, as the command,
#
#   d=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --target $d .device-carry/*.whl \
#     && PYTHONPATH=$d PARTS="cuda node" bash scripts/device_check.sh
#
# PARTS (run in this order, each under its own time limit, each writing into $OUT as it goes):
#   cuda  scripts/gpu_check.sh: every CUDA check, with RUSTC10D_CUDA_WAIT=host then =stream
#         (issue #16: wait() under 1 ms while the inputs are still being produced, a failed op
#         leaves its tensor as it was, DDP and FSDP2 as with Gloo, FSDP2's step time); about 3 minutes
#   node  the benchmark against Gloo at W=4, 8, 16 on this host (issue #14's table: all_reduce
#         f32 and bf16, all_gather, reduce_scatter, broadcast, ping-pong, 16 B to 64 MiB, with
#         copies and wake-ups per byte); about 5 minutes
# CUDA_LIMIT and NODE_LIMIT (seconds) bound each part; what finished is in $OUT either way.
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
for p in ${PARTS:-cuda node}; do
    case $p in
        cuda)
            part cuda "${CUDA_LIMIT:-300}" env PYTHON="$PYTHON" bash scripts/gpu_check.sh
            grep -E "CHECK .* FAIL|WAIT |BUSBW|STEP |gpu_check:" "$OUT/cuda.log"
            ;;
        node)
            part node "${NODE_LIMIT:-330}" "$PYTHON" -m rustc10d.bench --worlds 4,8,16 --transports shm \
                --ops all_reduce,all_gather,reduce_scatter,broadcast,pingpong --dtypes float32,bfloat16 \
                --min-size 16 --step 4 --max-size 64M --rounds 3 --budget 0.05 --timeout 100 \
                --json "$OUT/node.json" --plot "$OUT/node.png"
            tail -60 "$OUT/node.log"
            ;;
        *) echo "unknown part $p (cuda, node)"; status=2 ;;
    esac
done
exit $status
