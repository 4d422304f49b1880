"""Fixtures for the infinity.aio conformance suite.

Every engine test takes the ``backend`` fixture (directly or through ``engine`` /
``make_engine``) and so runs once per backend; a backend that `infinity.aio.probe` says cannot
run here is skipped with its reason, never failed. Helpers are fixtures because test modules
are imported with --import-mode=importlib and cannot import this file.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import infinity.aio as aio

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture(
    params=[pytest.param("uring", marks=pytest.mark.uring, id="uring"), pytest.param("threads", id="threads")]
)
def backend(request, monkeypatch) -> str:
    """A backend name, skipped with probe()'s reason where it cannot run."""
    status = aio.probe()[request.param]
    if not status.available:
        pytest.skip(f"aio backend {request.param!r} unavailable: {status.reason}")
    # The parameter, not the environment, decides which backend a test exercises.
    monkeypatch.delenv(aio.ENV_BACKEND, raising=False)
    return request.param


@pytest.fixture
def make_engine(backend):
    """open_engine(backend, queue_depth=..., block_size=...); every engine is closed after the test."""
    engines = []

    def make(queue_depth: int = 32, block_size: int = 1 * MiB) -> aio.Engine:
        engine = aio.open_engine(backend, queue_depth=queue_depth, block_size=block_size)
        engines.append(engine)
        assert engine.backend == backend
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def engine(make_engine) -> aio.Engine:
    """An engine with the default queue_depth and block_size."""
    return make_engine()


def _random_bytes(nbytes: int, seed: int = 0, alignment: int = 4096) -> torch.Tensor:
    buf = aio.empty_aligned(nbytes, alignment)
    if nbytes:
        rng = np.random.default_rng(seed)
        buf.copy_(torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)))
    return buf


@pytest.fixture
def random_bytes():
    """random_bytes(nbytes, seed=0, alignment=4096): an empty_aligned uint8 tensor of seeded random bytes."""
    return _random_bytes


@pytest.fixture
def file_bytes():
    """file_bytes(path, offset, nbytes): the file's bytes read with plain buffered os.pread.

    An oracle independent of the engine, so that a round trip cannot pass by a bug that is
    symmetric in pread and pwrite (a wrong offset used both ways, say).
    """

    def read(path, offset: int, nbytes: int) -> torch.Tensor:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    return read


@pytest.fixture
def write_file():
    """write_file(path, data): create ``path`` holding ``data`` (bytes or uint8 tensor), plainly."""

    def write(path, data) -> None:
        if isinstance(data, torch.Tensor):
            data = data.numpy().tobytes()
        with open(path, "wb") as fh:
            fh.write(data)

    return write


@pytest.fixture
def round_trip(file_bytes):
    """round_trip(engine, file, data, offset=0): pwrite ``data``, check the file, pread it back and compare."""

    def run(engine: aio.Engine, file: aio.File, data: torch.Tensor, offset: int = 0) -> None:
        nbytes = data.numel()
        assert engine.pwrite(data, file, offset).result() == nbytes
        assert torch.equal(file_bytes(file.path, offset, nbytes), data)
        back = aio.empty_aligned(nbytes)
        back.fill_(0)
        assert engine.pread(back, file, offset).result() == nbytes
        assert torch.equal(back, data)

    return run


@pytest.fixture
def hold_preadv(monkeypatch):
    """Make os.preadv block until released: the threads backend's reads then stay pending.

    Returns release(); teardown releases too, so that engines can close. The uring backend
    does not call os.preadv and is unaffected.
    """
    gate = threading.Event()
    real = os.preadv

    def held(*args, **kwargs):
        gate.wait(timeout=60)
        return real(*args, **kwargs)

    monkeypatch.setattr(os, "preadv", held)
    yield gate.set
    gate.set()
