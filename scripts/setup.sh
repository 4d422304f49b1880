#!/usr/bin/env bash
# Idempotent setup for `make demo` and `make test`: system packages (liburing-dev, fio),
# a virtual environment in .venv, torch pinned to the local CPU build, then this package.
# Each step is skipped when it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

say() { echo "setup: $*" >&2; }

# --- system packages ------------------------------------------------------------------------
need=()
pkg-config --exists liburing 2>/dev/null || need+=(liburing-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v fio >/dev/null || need+=(fio)
if ((${#need[@]})); then
    if [[ $(id -u) -eq 0 ]]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(none); fi
    if command -v apt-get >/dev/null && [[ ${sudo[0]:-} != none ]]; then
        say "installing ${need[*]} with apt-get"
        "${sudo[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
    else
        say "missing ${need[*]} and cannot install them (needs apt-get as root or passwordless sudo)."
        say "without liburing-dev the io_uring backend is not built and the threads backend is used;"
        say "without fio, nvme-bench --fio and the fio tests are skipped."
    fi
fi

# --- virtual environment --------------------------------------------------------------------
if [[ ! -x $VENV/bin/python ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first, pinned: an unpinned torch pulls several GB of CUDA wheels on these machines.
if [[ $("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) != "$TORCH_VERSION" ]]; then
    say "installing torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION"
fi

# Build requirements in the venv, so the editable install can skip build isolation (which
# would fetch them again on every install).
"$PY" -c 'import setuptools, wheel, pybind11' 2>/dev/null || pip_install "setuptools>=64" wheel "pybind11>=2.10"

# The package itself: reinstalled when its build inputs change (stamp is newer otherwise).
stamp=$VENV/.infinity-installed
inputs=(pyproject.toml setup.py aio/csrc/* infinity/csrc/*)
stale=0
[[ -f $stamp ]] || stale=1
for f in "${inputs[@]}"; do [[ $f -nt $stamp ]] && stale=1; done
"$PY" -c 'import infinity.aio' 2>/dev/null || stale=1
# A C++ compiler and no int8 codec: build it now (without one, _compact runs its torch reference).
if [[ ${INFINITY_BUILD_NATIVE:-1} != 0 ]] && command -v c++ >/dev/null && ! "$PY" -c 'import infinity._compact_native' 2>/dev/null; then stale=1; fi
# liburing appeared since the last install: build the extension now.
if pkg-config --exists liburing 2>/dev/null && ! "$PY" -c 'import infinity.aio._uring' 2>/dev/null; then stale=1; fi
if ((stale)); then
    say "installing infinity (editable, with the dev and hf extras)"
    log=$VENV/install.log
    if ! pip_install --no-build-isolation -e '.[dev,hf]' >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        say "install failed; the whole log is in $log"
        exit 1
    fi
    touch "$stamp"
    # pip hides a successful build's output, so the missing extension is told here, once.
    if ! "$PY" -c 'import infinity.aio._uring' 2>/dev/null; then
        say "built WITHOUT the io_uring extension (pkg-config found no liburing); the threads"
        say "backend will serve. Install liburing-dev and rerun to build it."
    fi
fi
