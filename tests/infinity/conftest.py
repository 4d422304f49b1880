"""Fixtures of the engine tests."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import infinity
from infinity import _compact


@pytest.fixture
def engines():
    """Engines a test opens; all closed after it (before any mount under them is undone)."""
    opened: list[infinity.Engine] = []
    yield opened
    for engine in opened:
        engine.close()


@pytest.fixture
def mount(engines):
    """mount(*options, source, target): run mount(8), skipping the test with the reason where
    mounting is not permitted; every mount is undone after the test, engines closed first."""
    mounted: list[str] = []

    def do(*options: str, source: str, target) -> str:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs or a read-only bind mount needs root")
        if shutil.which("mount") is None:
            pytest.skip("no mount(8) on this machine")
        target = str(target)
        os.makedirs(target, exist_ok=True)
        done = subprocess.run(["mount", *options, source, target], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"mount {' '.join(options)} {source} {target} not permitted here: {done.stderr.strip()}")
        if target not in mounted:  # a remount is undone with its mount
            mounted.append(target)
        return target

    yield do
    for engine in engines:
        engine.close()  # an open arena file keeps the mount busy
    for target in reversed(mounted):
        if subprocess.run(["umount", target], capture_output=True).returncode:
            subprocess.run(["umount", "-l", target], check=True)  # detach what still holds it


@pytest.fixture
def tmpfs(mount):
    """tmpfs(target, size): a size-limited tmpfs mounted at ``target`` (a real full drive)."""

    def do(target, size: str) -> str:
        return mount("-t", "tmpfs", "-o", f"size={size},mode=0700", source="tmpfs", target=target)

    return do


@pytest.fixture(params=["scalar", "avx2", "avx512", "avx512vbmi"])
def isa(request):
    """Each of the C++ codec's instruction sets this CPU has, in turn; the best one after."""
    native = _compact.native_module()
    if native is None:
        pytest.skip("infinity._compact_native was not built (no C++ compiler at install, or INFINITY_BUILD_NATIVE=0)")
    best = native.isa()
    if native.set_isa(request.param) != request.param:
        native.set_isa(best)
        pytest.skip(f"this CPU has no {request.param} (the codec runs {best})")
    yield request.param
    native.set_isa(best)
