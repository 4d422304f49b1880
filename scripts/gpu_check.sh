#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a CUDA GPU whose python3 already has torch
# (and pytest, transformers, safetensors, xxhash, pybind11), and no package registry:
#
#   1. build and install this package into that python (with the io_uring extension when
#      liburing is there, or its .deb files were carried in .debs/);
#   2. run the tests marked gpu or multirank;
#   3. run the demo with params on nvme and the optimizer on nvme, the device tier on the GPU;
#   4. write what it saw under $OUT (or ./gpu-check) when that is set.
#
# To carry liburing from a Debian machine: mkdir -p .debs && (cd .debs && apt-get download
# liburing2 liburing-dev), and take .debs along. Without it the threads backend serves.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUTDIR=${OUT:-gpu-check}
mkdir -p "$OUTDIR"
say() { echo "gpu-check: $*" >&2; }

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
"$PY" -c 'from infinity import aio; print({k: v.reason or "ok" for k, v in aio.probe().items()})' | tee "$OUTDIR/backends.txt"

status=0
# --- tests --------------------------------------------------------------------------------------
# From a copy of tests/ so that the installed package, not the checkout, is what runs.
rm -rf /tmp/infinity-gpu-tests && cp -r tests /tmp/infinity-gpu-tests
(cd /tmp && PYTHONUNBUFFERED=1 "$PY" -m pytest -q -m "gpu or multirank" -p no:cacheprovider \
    -o addopts="-ra --import-mode=importlib" /tmp/infinity-gpu-tests) 2>&1 | tee "$OUTDIR/pytest.log"
((PIPESTATUS[0] == 0)) || status=1

# --- the demo: params and optimizer on nvme, the device tier on the GPU -------------------------
swap=$(mktemp -d /tmp/infinity-gpu-swap.XXXXXX)
PYTHONUNBUFFERED=1 "$PY" -m infinity.tools.demo --swap-dir "$swap" --params nvme --grads device \
    --optimizer nvme --steps 50 2>&1 | tee "$OUTDIR/demo.log"
((PIPESTATUS[0] == 0)) || status=1
rm -rf "$swap"

say "done (status $status); logs in $OUTDIR"
exit $status
