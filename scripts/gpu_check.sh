#!/usr/bin/env bash
# The CUDA checks of rustc10d, in one go, on a machine with an NVIDIA GPU and a
# CUDA build of torch (CI has no GPU: this is run by hand, see README "CUDA").
#
#   bash scripts/gpu_check.sh            # W=2 ranks; on one GPU, and on two where present
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#   CUDA_WAITS=stream bash scripts/gpu_check.sh   # only RUSTC10D_CUDA_WAIT=stream (default: host, then stream)
#
# Builds and installs rustc10d into that Python if it is not importable, then
# runs tests/py/cuda/gpu_job.py under torchrun: all_reduce of every dtype against
# arithmetic, Gloo and NCCL (NCCL only with a GPU per rank), broadcast,
# all_gather_into_tensor, reduce_scatter_tensor, isend/irecv, a stream-ordering
# test, wait() while the inputs are still being produced (timed; under 1 ms with
# RUSTC10D_CUDA_WAIT=stream), an injected failure that must leave the tensor as
# it was, DDP and FSDP2 steps (replicas equal, and equal to Gloo's; FSDP2's step
# time against Gloo's), the mixed-device
# error, and busbw against Gloo's CUDA path; every check with each
# RUSTC10D_CUDA_WAIT.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1

"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'
"$PYTHON" -c 'import rustc10d' 2>/dev/null || "$PYTHON" -m pip install -q --no-build-isolation .
nvidia-smi -L || true
ngpu=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')

status=0
run() {  # run <label> <CUDA_VISIBLE_DEVICES> <RUSTC10D_CUDA_WAIT>
    echo "=== W=2, $1, RUSTC10D_CUDA_WAIT=$3"
    RUSTC10D_CUDA_WAIT=$3 CUDA_VISIBLE_DEVICES=$2 timeout 600 "$PYTHON" -m torch.distributed.run --standalone \
        --nproc-per-node 2 tests/py/cuda/gpu_job.py || status=1
}
for wait in ${CUDA_WAITS:-host stream}; do
    run "both ranks on GPU 0" 0 "$wait"
    if [ "$ngpu" -ge 2 ]; then run "one GPU per rank" 0,1 "$wait"; fi
done
echo "=== gpu_check: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
