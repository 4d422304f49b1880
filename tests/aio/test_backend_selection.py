"""Which backend open_engine gives, and why: probe(), the environment override, the fallback."""

from __future__ import annotations

import errno
import logging
import sys
import types

import pytest

import infinity.aio as aio

KiB = 1 << 10
MiB = 1 << 20
SIMULATED = "io_uring_setup: EPERM (simulated)"


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(aio.ENV_BACKEND, raising=False)


@pytest.fixture
def uring_unavailable(monkeypatch):
    """uring reported unavailable with SIMULATED as the reason, and the fallback log fresh."""
    monkeypatch.setattr(aio, "_uring_status", lambda: aio.BackendStatus(False, SIMULATED))
    monkeypatch.setattr(aio, "_fallback_logged", set())


@pytest.fixture
def uring_available():
    status = aio.probe()["uring"]
    if not status.available:
        pytest.skip(f"aio backend 'uring' unavailable: {status.reason}")


@pytest.fixture
def engines():
    """A list to put opened engines in; all are closed after the test."""
    opened = []
    yield opened
    for engine in opened:
        engine.close()


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "infinity.aio" and r.levelno >= logging.WARNING]


def test_probe_reports_every_backend():
    status = aio.probe()
    assert set(status) == {"uring", "threads"} == set(aio.BACKENDS)
    for s in status.values():
        assert isinstance(s, aio.BackendStatus)
        assert s.available or s.reason  # an unavailable backend says why


def test_threads_is_always_available():
    assert aio.probe()["threads"] == aio.BackendStatus(True)


def test_open_threads(engines):
    engines.append(aio.open_engine("threads"))
    assert engines[0].backend == "threads"


def test_env_forces_threads_over_explicit_uring(monkeypatch, engines):
    monkeypatch.setenv(aio.ENV_BACKEND, "threads")
    engines.append(aio.open_engine("uring"))
    assert engines[0].backend == "threads"


def test_env_forces_threads_over_auto(monkeypatch, engines):
    monkeypatch.setenv(aio.ENV_BACKEND, "threads")
    engines.append(aio.open_engine())
    assert engines[0].backend == "threads"


def test_unknown_env_value_raises_value_error(monkeypatch):
    monkeypatch.setenv(aio.ENV_BACKEND, "spdk")
    with pytest.raises(ValueError, match=aio.ENV_BACKEND):
        aio.open_engine()


def test_unknown_backend_raises_value_error():
    with pytest.raises(ValueError, match="backend='spdk'"):
        aio.open_engine("spdk")


def test_auto_falls_back_to_threads_with_the_reason(uring_unavailable, caplog, engines):
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        engines.append(aio.open_engine())
    assert engines[0].backend == "threads"
    (record,) = _warnings(caplog)
    assert SIMULATED in record.getMessage()


def test_auto_fallback_is_logged_once(uring_unavailable, caplog, engines):
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        engines.append(aio.open_engine())
        engines.append(aio.open_engine("auto"))
    assert [e.backend for e in engines] == ["threads", "threads"]
    assert len(_warnings(caplog)) == 1


def test_explicit_uring_unavailable_raises_with_the_reason(uring_unavailable):
    with pytest.raises(aio.BackendUnavailable, match=SIMULATED.replace("(", r"\(").replace(")", r"\)")):
        aio.open_engine("uring")


def test_threads_request_does_not_consult_uring(monkeypatch, engines):
    def boom():
        raise AssertionError("open_engine('threads') probed io_uring")

    monkeypatch.setattr(aio, "_uring_status", boom)
    engines.append(aio.open_engine("threads"))
    assert engines[0].backend == "threads"


@pytest.fixture
def ring_setup_fails(monkeypatch):
    """An extension that probes fine but whose Ring() fails as io_uring_setup would under seccomp."""
    fake = types.ModuleType("infinity.aio._uring")
    fake.probe = lambda: ""

    def ring(queue_depth, block_size):
        raise OSError(errno.EPERM, "io_uring_setup: Operation not permitted (simulated)")

    def dio_alignment(fd):
        raise OSError(errno.ENOSYS, "statx (simulated)")

    fake.Ring = ring
    fake.dio_alignment = dio_alignment
    monkeypatch.setitem(sys.modules, "infinity.aio._uring", fake)
    monkeypatch.setattr(aio, "_uring", fake, raising=False)
    monkeypatch.setattr(aio, "_fallback_logged", set())


def test_auto_falls_back_when_ring_setup_fails(ring_setup_fails, caplog, engines):
    with caplog.at_level(logging.WARNING, logger="infinity.aio"):
        engines.append(aio.open_engine())
    assert engines[0].backend == "threads"
    (record,) = _warnings(caplog)
    assert "io_uring_setup" in record.getMessage()


def test_explicit_uring_raises_when_ring_setup_fails(ring_setup_fails):
    with pytest.raises(aio.BackendUnavailable, match="io_uring_setup"):
        aio.open_engine("uring")


def test_failed_ring_setup_leaves_no_unraisable_error(ring_setup_fails, monkeypatch):
    import gc

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(aio.BackendUnavailable):
        aio.open_engine("uring")
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []


# -- with io_uring working here ----------------------------------------------------------------


@pytest.mark.uring
def test_auto_picks_uring_where_it_works(uring_available, engines):
    engines.append(aio.open_engine())
    assert engines[0].backend == "uring"


@pytest.mark.uring
def test_uring_reports_setup_flags(uring_available, engines):
    engines.append(aio.open_engine("uring"))
    flags = engines[0].setup_flags
    assert isinstance(flags, str) and flags


@pytest.mark.uring
def test_uring_counters_have_ring_keys(uring_available, engines):
    engines.append(aio.open_engine("uring"))
    counters = engines[0].counters()
    for key in ("requests", "chunks", "bytes_read", "bytes_written", "short", "retries", "errors"):
        assert key in counters
    for key in ("enters", "sqes", "fixed"):
        assert key in counters


@pytest.mark.uring
def test_uring_batches_submissions(uring_available, engines, tmp_path):
    # Buffered reads of cached pages complete inside io_uring_enter, so each enter should
    # reap a full queue and refill it with the next batch: 256 chunks at queue depth 32 need
    # about 9 enters. A factor of 4 leaves room for a slower machine and still fails an
    # engine that enters the kernel once per chunk.
    nbytes, block_size = 16 * MiB, 64 * KiB
    with open(tmp_path / "f", "wb") as fh:
        fh.write(bytes(nbytes))
    engine = aio.open_engine("uring", queue_depth=32, block_size=block_size)
    engines.append(engine)
    buf = aio.empty_aligned(nbytes)
    with aio.open_file(tmp_path / "f", "r", direct=False) as f:
        assert engine.pread(buf, f, 0).result() == nbytes
    c = engine.counters()
    assert c["sqes"] >= nbytes // block_size
    assert c["enters"] * 4 <= c["sqes"], c
