#!/usr/bin/env bash
# Builds rustc10d against each supported torch, one version at a time, imports it and runs one
# real job of every op on it (tests/py/packaging/every_op_job.py, 2 ranks under torchrun, plain and once more
# staged the way CUDA tensors are), tries init_process_group("rustc10d") without importing
# rustc10d (tests/py/groups/reinit_job.py --no-import: whether this torch finds backends by their entry
# point), then prints a table. CI runs it for the versions it does not
# run the whole suite on; run it by hand after touching the shim or the build.
#
#   bash scripts/torch_matrix.sh                            # every row of scripts/torch-versions.txt
#   bash scripts/torch_matrix.sh 2.13.0:3.13 2.11.0:3.12    # TORCH:PYTHON pairs
#   RUSTC10D_WHEELS=dist bash scripts/torch_matrix.sh       # and the wheels there, installed as a
#                                                           # user does (scripts/check_wheel.sh)
#
# Each pair gets an environment of its own under $RUSTC10D_ENVS (default ~/.cache/rustc10d/envs),
# kept for the next run unless less than RUSTC10D_MIN_FREE_GB (default 20) of disk is then left.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

[ $# -gt 0 ] || set -- $(awk '!/^#/ && NF {print $1 ":" $2}' scripts/torch-versions.txt)
logs=$(mktemp -d -t rustc10d-matrix.XXXXXX)
min_free_gb=${RUSTC10D_MIN_FREE_GB:-20}
rows=()
status=0

for spec in "$@"; do
    torch=${spec%%:*} py=${spec#*:}
    dir=$(env_dir "$torch" "$py") log="$logs/torch-$torch-py$py.log"
    echo "=== torch $torch, Python $py (log: $log)"
    t0=$SECONDS
    build=FAILED imported=- plain=- staged=- lacks=- entry=- wheel=-
    if { ensure_env "$dir" "$torch" "$py" && build_rustc10d "$dir"; } >>"$log" 2>&1; then
        build=ok
        if lacks=$("$dir/bin/python" -c '
import rustc10d as n
print(", ".join(f for f, has in n.TORCH_FEATURES.items() if not has) or "nothing")' 2>>"$log"); then
            imported=ok
            for mode in plain staged; do
                result=FAILED
                RUSTC10D_TEST_STAGING=$([ $mode = staged ] && echo 1 || echo 0) OMP_NUM_THREADS=1 timeout 300 \
                    "$dir/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2 \
                    tests/py/packaging/every_op_job.py >>"$log" 2>&1 && result=ok
                printf -v "$mode" %s "$result"
            done
            entry="needs import"
            OMP_NUM_THREADS=1 timeout 120 "$dir/bin/python" -m torch.distributed.run --standalone \
                --nproc-per-node 2 tests/py/groups/reinit_job.py rustc10d --no-import >>"$log" 2>&1 && entry=works
        else
            imported=FAILED lacks=-
        fi
    fi
    if [ -n "${RUSTC10D_WHEELS:-}" ]; then
        wheel=FAILED
        bash scripts/check_wheel.sh "$RUSTC10D_WHEELS" "$torch" "$py" >>"$log" 2>&1 && wheel=ok
    fi
    [ "$build/$imported/$plain/$staged" = ok/ok/ok/ok ] && [ "$wheel" != FAILED ] || { status=1; tail -30 "$log"; }
    grep -h "ops checked" "$log" | tail -1
    free_gb=$(df -Pk "$ENVS" | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ "$free_gb" -lt "$min_free_gb" ]; then
        echo "only $free_gb GB free: removing $dir"
        rm -rf "$dir"
    fi
    rows+=("| $torch | $py | $build | $imported | $plain | $staged | $entry | $wheel | $lacks | $((SECONDS - t0)) s |")
done

echo
echo "| torch | Python | build | import | every op | staged | init without import | wheel | torch APIs it lacks | time |"
echo "|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
