"""Fixtures more than one package's tests use."""

from __future__ import annotations

import errno
import importlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

_files = importlib.import_module("infinity.aio._files")


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
