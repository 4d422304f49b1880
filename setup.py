"""Build the native extensions:

- `infinity.aio._uring`, the io_uring engine, when liburing is present. liburing is found
  with pkg-config (Debian: liburing-dev); nothing is downloaded. Without it the package
  installs without the extension and the `threads` backend serves (see infinity.aio.probe()).
  INFINITY_BUILD_URING=0 skips it on purpose.
- `infinity._compact_native`, the int8 codec of compact optimizer states, the one-pass int8
  Adam update and the gradient norms' sum of squares (plain C++, always built; a failed build
  is a warning). INFINITY_BUILD_NATIVE=0 skips it; `infinity._compact` then runs its torch reference.

Everything else is declared in pyproject.toml.
"""

import os
import shlex
import subprocess
import sys

from setuptools import setup


def _pkg_config(*args: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["pkg-config", *args, "liburing"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(out)


def _extensions():
    return _codec() + _uring()


def _codec():
    if os.environ.get("INFINITY_BUILD_NATIVE", "1") == "0":
        print("infinity: INFINITY_BUILD_NATIVE=0, building without the int8 codec extension", file=sys.stderr)
        return []
    from pybind11.setup_helpers import Pybind11Extension

    return [
        Pybind11Extension(
            "infinity._compact_native",
            sources=["infinity/csrc/compact.cpp"],
            depends=["infinity/csrc/codec.h", "infinity/csrc/adam_int8.h", "infinity/csrc/norms.h"],
            # No contraction into FMA: the scalar code must round as the AVX2 code does
            # (infinity/csrc/codec.h), whatever the compiler's default.
            extra_compile_args=["-O3", "-Wall", "-Wextra", "-ffp-contract=off", "-Wno-psabi", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            cxx_std=17,
            optional=True,  # a failed build leaves the torch reference, not a failed install
        )
    ]


def _uring():
    if os.environ.get("INFINITY_BUILD_URING", "1") == "0":
        print("infinity: INFINITY_BUILD_URING=0, building without the io_uring extension", file=sys.stderr)
        return []
    cflags = _pkg_config("--cflags")
    libs = _pkg_config("--libs")
    if cflags is None or libs is None:
        print(
            "infinity: liburing not found by pkg-config; building without the io_uring "
            "extension (the 'threads' backend will be used). Install liburing-dev and "
            "reinstall to enable it.",
            file=sys.stderr,
        )
        return []
    from pybind11.setup_helpers import Pybind11Extension

    return [
        Pybind11Extension(
            "infinity.aio._uring",
            sources=["aio/csrc/uring_engine.cpp", "aio/csrc/bindings.cpp"],
            include_dirs=["aio/csrc"],
            extra_compile_args=[*cflags, "-O2", "-Wall", "-Wextra"],
            extra_link_args=libs,
            cxx_std=20,
        )
    ]


setup(ext_modules=_extensions())
