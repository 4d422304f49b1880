#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a CUDA GPU whose python3 already has torch
# (and pytest, transformers, safetensors, xxhash, pybind11), and no package registry:
#
#   1. build and install this package into that python (with the io_uring extension when
#      liburing is there, or its .deb files were carried in .debs/);
#   2. run the tests marked gpu, their 15 slowest named (the multirank ones run in CI on the
#      CPU; GPU_CHECK_TESTS="gpu or multirank" adds them: together the tests alone ran past 9
#      minutes on an H200, longer than a device call may take);
#   3. run the demo with params on nvme and the optimizer on nvme, the device tier on the GPU;
#   4. run the sweep of benchmarks/gpu_step.py that the GPU targets are measured on: the 953M
#      Llama in bf16 against the same model resident on the GPU, device,device,cpu and
#      nvme,cpu,cpu at 16x4096 with checkpointing, device,device,cpu and nvme,nvme,nvme at
#      16x2048 (GPU_CHECK_BENCH: other arguments, one run), its figures as JSON lines;
#   5. write what it saw under $OUT (or ./gpu-check) when that is set, with a profile of one
#      offloaded step per placement and batch (profiles/: its busiest operations).
#
# GPU_CHECK_TESTS="" skips step 2; other text replaces the pytest -m expression. The whole runs
# past one device call's 10 minutes where the tests are slow: then GPU_CHECK_BENCH="" GPU_CHECK_DEMO=""
# for the tests, and GPU_CHECK_TESTS="" for the rest, in two calls. Backward with the optimizer
# under it against without (issue 34's 1.1x): GPU_CHECK_BENCH="--pairs 2 --batches 16x2048
# --placements device,device,cpu --overlap false", beside the sweep's row.
#
# To carry liburing from a Debian machine: mkdir -p .debs && (cd .debs && apt-get download
# liburing2 liburing-dev), and take .debs along. Without it the threads backend serves.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu-check}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)  # absolute: the benchmark runs from benchmarks/
say() { echo "gpu-check: $*" >&2; }
stages=()  # "name seconds" of each stage, written to $OUTDIR/stages.json at the end
stage_start=$SECONDS
stage() { stages+=("\"$1\": $((SECONDS - stage_start))"); stage_start=$SECONDS; }

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    say "torch sees no CUDA device here; nothing to check"
    exit 2
}
"$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUTDIR/device.txt"

# --- liburing from carried .deb files (unpacked beside, never into /) -----------------------
if ! pkg-config --exists liburing 2>/dev/null && compgen -G ".debs/*.deb" >/dev/null; then
    root=/tmp/infinity-liburing
    for f in .debs/*.deb; do dpkg -x "$f" "$root"; done
    lib=$(dirname "$(find "$root" -name 'liburing.so*' | head -n 1)")
    export PKG_CONFIG_PATH="$lib/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$root"
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "liburing from .debs/ (unpacked in $root)"
fi

# --- build and install ------------------------------------------------------------------------
if ! "$PY" -m pip install --no-build-isolation --no-deps --no-index -q . >"$OUTDIR/install.log" 2>&1; then
    tail -n 40 "$OUTDIR/install.log" >&2
    say "install failed; the log is $OUTDIR/install.log"
    exit 1
fi
(cd /tmp && "$PY" -c 'from infinity import aio; print({k: v.reason or "ok" for k, v in aio.probe().items()})') 2>&1 |
    tee "$OUTDIR/backends.txt"
stage install

status=0
# --- tests --------------------------------------------------------------------------------------
# From a copy of tests/ so that the installed package, not the checkout, is what runs.
tests_expr=${GPU_CHECK_TESTS-"gpu"}
if [[ -n $tests_expr ]]; then
    rm -rf /tmp/infinity-gpu-tests && cp -r tests /tmp/infinity-gpu-tests
    # At most GPU_CHECK_TEST_LIMIT seconds (300): then pytest is interrupted (SIGINT), and still
    # prints what failed so far and the slowest tests, and the rest of the check runs.
    (cd /tmp && PYTHONUNBUFFERED=1 timeout --signal=INT "${GPU_CHECK_TEST_LIMIT:-300}" "$PY" -m pytest -q \
        -m "$tests_expr" -p no:cacheprovider -o addopts="-ra --import-mode=importlib" --durations=15 \
        /tmp/infinity-gpu-tests) 2>&1 | tee "$OUTDIR/pytest.log"
    ((PIPESTATUS[0] == 0)) || status=1
    stage tests
fi

# --- the demo: params and optimizer on nvme, the device tier on the GPU -------------------------
# From /tmp: in the checkout, ./infinity (the source folder) would shadow the installed package.
# GPU_CHECK_DEMO="" skips it.
if [[ -n ${GPU_CHECK_DEMO-1} ]]; then
    swap=$(mktemp -d /tmp/infinity-gpu-swap.XXXXXX)
    (cd /tmp && PYTHONUNBUFFERED=1 "$PY" -m infinity.tools.demo --swap-dir "$swap" --params nvme --grads device \
        --optimizer nvme --steps 20) 2>&1 | tee "$OUTDIR/demo.log"
    ((PIPESTATUS[0] == 0)) || status=1
    rm -rf "$swap"
    stage demo
fi

# --- the billion-parameter step in bf16 against a resident PyTorch run --------------------------
# GPU_CHECK_BENCH="" skips it; other text replaces its arguments (benchmarks/gpu_step.py --help).
bench() {  # NAME ARGS...: one run of gpu_step.py, its JSON lines in $OUTDIR/gpu_step_NAME.jsonl
    local name=$1 dir
    shift
    dir=$(mktemp -d /tmp/infinity-gpu-bench.XXXXXX)
    (cd benchmarks && PYTHONUNBUFFERED=1 "$PY" gpu_step.py --dir "$dir" --json --profile "$OUTDIR/profiles" "$@") \
        2> >(tee "$OUTDIR/gpu_step_$name.log" >&2) | tee "$OUTDIR/gpu_step_$name.jsonl"
    ((PIPESTATUS[0] == 0)) || status=1
    rm -rf "$dir"
    stage "gpu_step_$name"
}
if [[ -z ${GPU_CHECK_BENCH+set} ]]; then  # the sweep the GPU targets are measured on (README, On a GPU)
    bench long --pairs 2 --batches 16x4096 --checkpointing --placements "device,device,cpu;nvme,cpu,cpu"
    bench short --pairs 2 --batches 16x2048 --placements "device,device,cpu;nvme,nvme,nvme"
elif [[ -n $GPU_CHECK_BENCH ]]; then
    # shellcheck disable=SC2086
    bench custom $GPU_CHECK_BENCH
fi

(IFS=,; echo "{${stages[*]}}") | tee "$OUTDIR/stages.json"
say "done (status $status) in ${SECONDS}s; logs in $OUTDIR"
exit $status
