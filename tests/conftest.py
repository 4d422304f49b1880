"""Fixtures more than one package's tests use."""

from __future__ import annotations

import errno
import importlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import pytest

_files = importlib.import_module("infinity.aio._files")

_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:  # setup, call or teardown: what it left is kept to be looked at
        item.stash[_FAILED] = True
    return report


@pytest.fixture(autouse=True)
def _remove_tmp_path(request):
    """A test's tmp_path is removed after it unless it failed: pytest keeps the directories of
    its last three runs, and some tests write arenas of gigabytes (sparse files of 64 GiB,
    2.5 GB of swap) that would stay under /tmp. Set up before the test's other fixtures, so it
    runs after their teardown (engines closed, mounts undone)."""
    if "tmp_path" not in request.fixturenames:
        yield
        return
    path = request.getfixturevalue("tmp_path")
    yield
    if request.node.stash.get(_FAILED, False):
        return
    errors = []

    def record(fn, where, exc):  # exc: the exception (onexc), or sys.exc_info() (onerror, < 3.12)
        errors.append(f"{where}: {exc[1] if isinstance(exc, tuple) else exc}")

    shutil.rmtree(path, **({"onexc": record} if sys.version_info >= (3, 12) else {"onerror": record}))
    if errors:  # a directory a test made unwritable, a mount left behind
        pytest.fail(f"could not remove {path} after the test: " + "; ".join(errors[:3]), pytrace=False)


@pytest.fixture
def shm_dir():
    """A fresh directory on the tmpfs /dev/shm, removed after the test."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm (a tmpfs) on this machine")
    path = tempfile.mkdtemp(prefix="infinity-test-", dir="/dev/shm")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def o_direct_refused(monkeypatch):
    """Make every O_DIRECT open fail with EINVAL as Linux does where a filesystem has no direct I/O.

    Like the kernel (do_dentry_open checks O_DIRECT after the inode is created), an O_CREAT
    open creates the file before it fails; ramfs shows this on any kernel.
    """
    real_open = os.open

    def open_(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_DIRECT:
            if flags & os.O_CREAT:
                os.close(real_open(path, flags & ~os.O_DIRECT, mode, dir_fd=dir_fd))
            raise OSError(errno.EINVAL, "Invalid argument (simulated)", os.fspath(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(_files.os, "open", open_)
    monkeypatch.setattr(_files, "_warned_buffered", set())


class Hung(BaseException):
    """Raised by `no_hang` (a BaseException, so that no ``except Exception`` in the code
    under test can take it for the error the test expects)."""


@pytest.fixture
def no_hang():
    """A test that would block forever without its fix (an open or a read waiting on a FIFO
    for a writer) fails after 30 s instead: SIGALRM interrupts the blocked call. Nothing is
    timed otherwise."""

    def alarm(signum, frame):
        raise Hung("still blocked after 30 s (a FIFO opened or read?)")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(30)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def interrupt_once(monkeypatch):
    """interrupt_once(): the next swap transfer's wait raises KeyboardInterrupt before waiting
    (a Ctrl-C caught by the caller, injected rather than timed)."""
    transfer = importlib.import_module("infinity.swap._io").Transfer
    real = transfer.wait
    armed = []

    def wait(self):
        if armed:
            armed.pop()
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(transfer, "wait", wait)
    return lambda: armed.append(True)


@pytest.fixture
def sigint_after_submit():
    """sigint_after_submit(engine): the engine's next hand-over of a request to its backend
    (``engine._start``) is followed at once by a real SIGINT, so the KeyboardInterrupt lands
    after the kernel or thread pool has the request and before `pread`/`pwrite` returns."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)

    def arm(engine) -> None:
        real = engine._start

        def start(*args, **kwargs):
            del engine._start  # one shot
            out = real(*args, **kwargs)
            signal.raise_signal(signal.SIGINT)
            return out

        engine._start = start

    yield arm
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def held_source(monkeypatch, tmp_path):
    """held_source(backend, data) -> (fd, release): a file descriptor whose read by ``backend``
    does not complete until ``release()``: a pipe written at release for uring (io_uring reads
    a pipe whenever it has data), a plain file whose os.preadv waits for release for threads."""
    gates: dict[int, threading.Event] = {}
    real = os.preadv
    fds = []

    def held(fd, buffers, offset, *args):
        gate = gates.get(fd)
        if gate is not None:
            gate.wait(timeout=60)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", held)

    def make(backend: str, data: bytes):
        if backend == "uring":
            r, w = os.pipe()
            fds.extend((r, w))
            return r, lambda: os.write(w, data)
        path = tmp_path / f"held{len(gates)}"
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        fds.append(fd)
        gates[fd] = threading.Event()
        return fd, gates[fd].set

    yield make
    for gate in gates.values():
        gate.set()
    for fd in fds:  # a pipe's write end closing ends a read still waiting on it (EOF)
        os.close(fd)
