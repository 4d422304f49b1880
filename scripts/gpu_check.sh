#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a CUDA GPU whose python3 already has torch
# (and pytest, transformers, safetensors, xxhash, pybind11), and no package registry:
#
#   1. build and install this package into that python (with the io_uring extension when
#      liburing is there, or its .deb files were carried in .debs/);
#   2. run the tests marked gpu (GPU_CHECK_TESTS: another pytest -m expression, "" skips them;
#      "gpu or multirank" adds the multirank ones, which CI runs on the CPU: together they ran
#      past 9 minutes on an H200), at most GPU_CHECK_TEST_LIMIT seconds (300), each test at most
#      120 s where pytest-timeout is there, their 15 slowest named;
#   3. run the demo with params on nvme and the optimizer on nvme, the device tier on the GPU
#      (GPU_CHECK_DEMO="" skips it);
#   4. run the sweep of benchmarks/gpu_step.py that the GPU targets are measured on: the 953M
#      Llama in bf16 against the same model resident on the GPU, device,device,cpu and
#      nvme,cpu,cpu at 16x4096 with checkpointing (host budget 12GiB), then device,device,cpu and nvme,nvme,nvme at
#      16x2048 (GPU_CHECK_BENCH: other arguments for one run instead, "" skips it), its figures as
#      JSON lines, with a profile of one offloaded step per placement and batch.
#
# Everything stops by GPU_CHECK_DEADLINE seconds after the start (560: a device call may take
# 600): each stage gets what is left (pytest and the benchmark are interrupted with SIGINT, so
# they still print what they have), and a stage with under a minute left is skipped, said in
# stages.json. What it writes under $OUT (or ./gpu-check), at most 8 files as a device call
# returns them: env.txt (the device, the I/O backends, the install's log when it failed),
# pytest.log, demo.log, gpu_step.jsonl and gpu_step.log (every run of the benchmark), profiles.txt
# (their busiest operations), stages.json (each stage's seconds, rewritten after each).
#
# Backward with the optimizer under it against without (issue 34's 1.1x): GPU_CHECK_BENCH="--pairs
# 2 --batches 16x2048 --placements device,device,cpu --overlap false", beside the sweep's row.
#
# To carry liburing from a Debian machine: mkdir -p .debs && (cd .debs && apt-get download
# liburing2 liburing-dev), and take .debs along. Without it the threads backend serves.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu-check}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)  # absolute: the benchmark runs from benchmarks/
DEADLINE=${GPU_CHECK_DEADLINE:-560}
WORK=$(mktemp -d /tmp/infinity-gpu-check.XXXXXX)  # what is not returned: profiles, the install log
say() { echo "gpu-check: $*" >&2; }
left() { echo $((DEADLINE - SECONDS)); }
stages=()  # "name": seconds (or "skipped"), written to $OUTDIR/stages.json after each stage
stage_start=$SECONDS
stage() {
    stages+=("\"$1\": ${2:-$((SECONDS - stage_start))}")
    stage_start=$SECONDS
    (IFS=,; echo "{${stages[*]}}") >"$OUTDIR/stages.json"
}
# room NAME: whether a stage has a minute or more left; else it is skipped, and said
room() {
    (($(left) >= 60)) && return 0
    say "$1 skipped: $(left) s left of GPU_CHECK_DEADLINE=$DEADLINE"
    stage "$1" '"skipped"'
    return 1
}
# limited SECONDS CMD...: CMD interrupted (SIGINT) after SECONDS, killed 20 s later if still there
limited() {
    local limit=$1
    shift
    timeout --signal=INT --kill-after=20 "$limit" "$@"
}

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    say "torch sees no CUDA device here; nothing to check"
    exit 2
}
"$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUTDIR/env.txt"

# --- liburing from carried .deb files (unpacked beside, never into /) -----------------------
if ! pkg-config --exists liburing 2>/dev/null && compgen -G ".debs/*.deb" >/dev/null; then
    root=/tmp/infinity-liburing
    for f in .debs/*.deb; do dpkg -x "$f" "$root"; done
    lib=$(dirname "$(find "$root" -name 'liburing.so*' | head -n 1)")
    export PKG_CONFIG_PATH="$lib/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$root"
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LDFLAGS="-Wl,-rpath,$lib${LDFLAGS:+ $LDFLAGS}"  # the extension finds it without LD_LIBRARY_PATH too
    if ! command -v pkg-config >/dev/null; then  # setup.py asks pkg-config: answer for liburing alone
        mkdir -p "$root/bin"
        cat >"$root/bin/pkg-config" <<EOF
#!/bin/sh
for a; do case \$a in
    --cflags) echo "-I$root/usr/include"; exit 0 ;;
    --libs) echo "-L$lib -luring"; exit 0 ;;
esac; done
exit 0
EOF
        chmod +x "$root/bin/pkg-config"
        export PATH="$root/bin:$PATH"
    fi
    say "liburing from .debs/ (unpacked in $root)"
fi

# --- build and install ------------------------------------------------------------------------
if ! "$PY" -m pip install --no-build-isolation --no-deps --no-index -q . >"$WORK/install.log" 2>&1; then
    tail -n 40 "$WORK/install.log" >&2
    cp "$WORK/install.log" "$OUTDIR/install.log"
    say "install failed; the log is $OUTDIR/install.log"
    exit 1
fi
(cd /tmp && "$PY" -c 'from infinity import aio; print({k: v.reason or "ok" for k, v in aio.probe().items()})') 2>&1 |
    tee -a "$OUTDIR/env.txt"
stage install

status=0
# --- tests --------------------------------------------------------------------------------------
# From a copy of tests/ so that the installed package, not the checkout, is what runs.
tests_expr=${GPU_CHECK_TESTS-"gpu"}
if [[ -n $tests_expr ]] && room tests; then
    rm -rf /tmp/infinity-gpu-tests && cp -r tests /tmp/infinity-gpu-tests  # (the engine's GPU tests first)
    limit=${GPU_CHECK_TEST_LIMIT:-300}
    ((limit > $(left) - 30)) && limit=$(($(left) - 30))
    per_test=()
    "$PY" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout=120)
    (cd /tmp && PYTHONUNBUFFERED=1 limited "$limit" "$PY" -m pytest -q -m "$tests_expr" -p no:cacheprovider \
        -o addopts="-ra --import-mode=importlib" -W ignore::pytest.PytestUnknownMarkWarning --durations=15 "${per_test[@]}" \
        /tmp/infinity-gpu-tests/infinity/test_gpu.py /tmp/infinity-gpu-tests) 2>&1 |
        tee "$OUTDIR/pytest.log"
    ((PIPESTATUS[0] == 0)) || status=1
    stage tests
fi

# --- the demo: params and optimizer on nvme, the device tier on the GPU -------------------------
# From /tmp: in the checkout, ./infinity (the source folder) would shadow the installed package.
if [[ -n ${GPU_CHECK_DEMO-1} ]] && room demo; then
    swap=$(mktemp -d /tmp/infinity-gpu-swap.XXXXXX)
    (cd /tmp && PYTHONUNBUFFERED=1 limited "$(($(left) - 10))" "$PY" -m infinity.tools.demo --swap-dir "$swap" \
        --params nvme --grads device --optimizer nvme --steps 20) 2>&1 | tee "$OUTDIR/demo.log"
    ((PIPESTATUS[0] == 0)) || status=1
    rm -rf "$swap"
    stage demo
fi

# --- the billion-parameter step in bf16 against a resident PyTorch run --------------------------
bench() {  # NAME ARGS...: one run of gpu_step.py, its JSON lines appended to $OUTDIR/gpu_step.jsonl
    local name=$1 dir
    shift
    room "gpu_step_$name" || return 0
    dir=$(mktemp -d /tmp/infinity-gpu-bench.XXXXXX)
    echo "== gpu_step_$name: $*" >>"$OUTDIR/gpu_step.log"
    # (expandable segments: the resident side's 15 GB of states and the offloaded side's
    # activations at 16x4096 share one H100; both sides run under it)
    (cd benchmarks && PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        limited "$(($(left) - 10))" "$PY" gpu_step.py --dir "$dir" --json --profile "$WORK/profiles" "$@") \
        2> >(tee -a "$OUTDIR/gpu_step.log" >&2) | tee -a "$OUTDIR/gpu_step.jsonl"
    ((PIPESTATUS[0] == 0)) || status=1
    rm -rf "$dir"
    stage "gpu_step_$name"
}
if [[ -z ${GPU_CHECK_BENCH+set} ]]; then  # the sweep the GPU targets are measured on (README, On a GPU)
    # 12GiB: room for the staged copies of every sub-group under backward and the parameters
    # kept in the pool (memory.keep_params) beside them; the H200 machine has 128 GiB
    bench long --pairs 2 --batches 16x4096 --checkpointing --host-budget 12GiB \
        --placements "device,device,cpu;nvme,cpu,cpu"
    bench short --pairs 2 --batches 16x2048 --placements "device,device,cpu;nvme,nvme,nvme"
elif [[ -n $GPU_CHECK_BENCH ]]; then
    # shellcheck disable=SC2086
    bench custom $GPU_CHECK_BENCH
fi
if compgen -G "$WORK/profiles/*" >/dev/null; then  # one file back, not one per profile
    for f in "$WORK"/profiles/*; do echo "== $(basename "$f")"; cat "$f"; done >"$OUTDIR/profiles.txt"
fi

cat "$OUTDIR/stages.json" 2>/dev/null
say "done (status $status) in ${SECONDS}s; logs in $OUTDIR"
rm -rf "$WORK"
exit $status
