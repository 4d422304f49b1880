"""A caught Ctrl-C loses nothing: an interrupted wait leaves the operation unfinished, and the
next result(), flush or close finishes it.

The interrupt is injected (the transfer's wait raises KeyboardInterrupt once), not timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading

import pytest
import torch

import infinity.aio as aio
from infinity.swap import HostBufferPool, WriteBehind

NBYTES = 64 << 10


def _manifest_names(path: str) -> list[str]:
    return sorted(json.load(open(os.path.join(path, "rank0", "manifest.json")))["tensors"])


def test_an_interrupted_put_is_finished_by_the_next_result(open_space, dirs, interrupt_once):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    t = torch.arange(10_000, dtype=torch.float32)
    fut = space.put("0/param", t)
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    assert fut.result() is space.info("0/param")  # waits again and finishes: the name's new record
    assert torch.equal(space.get("0/param", torch.empty_like(t)).result(), t)
    space.flush()
    assert _manifest_names(path) == ["0/param"]


def test_an_interrupted_put_is_finished_by_flush(open_space, dirs, interrupt_once):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    t = torch.ones(5000)
    fut = space.put("0/param", t)
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    space.flush()  # the caller never waited again: flush finishes it
    assert _manifest_names(path) == ["0/param"]
    assert torch.equal(space.get("0/param", torch.empty_like(t)).result(), t)
    fut.result()  # and the future agrees


def test_a_put_over_an_interrupted_one_lands_after_it(open_space, interrupt_once):
    space = open_space()
    fut = space.put("x", torch.zeros(4096))
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    space.put("x", torch.ones(4096)).result()
    assert torch.equal(space.get("x", torch.empty(4096)).result(), torch.ones(4096))
    assert space.info("x").generation == 2


def test_an_interrupted_get_keeps_its_buffer_and_finishes(open_space, interrupt_once):
    space = open_space()
    t = torch.arange(3000, dtype=torch.int64)
    space.put("x", t).result()
    fut = space.get("x")  # into a pool buffer
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    buf = fut.result()
    assert torch.equal(buf.view(torch.int64, t.shape), t)
    buf.release()
    assert space.pool.in_use_bytes == 0


def test_an_interrupted_close_leaves_the_space_open_and_a_second_close_finishes(open_space, dirs, interrupt_once):
    (path,) = dirs(1)
    space = open_space(paths=[path])
    space.put("0/param", torch.ones(100))
    interrupt_once()
    with pytest.raises(KeyboardInterrupt):
        space.close()
    space.close()
    assert _manifest_names(path) == ["0/param"]


class _Future:
    """A write whose first result() is interrupted."""

    def __init__(self):
        self.waits = 0

    def done(self):
        return False

    def result(self):
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt


class _Buffer:
    released = False

    def release(self):
        self.released = True


@pytest.mark.parametrize("how", ["drain", "settle", "poll"])
def test_an_interrupted_write_behind_keeps_its_buffer_until_it_completes(how):
    writes = WriteBehind(2)
    fut, buf = _Future(), _Buffer()
    writes.add(fut, buf, key="k")
    finish = {"drain": writes.drain, "settle": lambda: writes.settle("k"), "poll": lambda: writes.poll(keep=0)}[how]
    with pytest.raises(KeyboardInterrupt):
        finish()
    assert not buf.released and "k" in writes  # the write may still be reading the buffer
    finish()
    assert buf.released and len(writes) == 0 and fut.waits == 2


def test_a_write_added_over_an_interrupted_one_under_its_key_is_tracked():
    writes = WriteBehind(2)
    old, new = _Future(), _Future()
    old_buf, new_buf = _Buffer(), _Buffer()
    writes.add(old, old_buf, key="k")
    with pytest.raises(KeyboardInterrupt):
        writes.add(new, new_buf, key="k")  # settling the old one is interrupted
    assert len(writes) == 2 and not new_buf.released
    with pytest.raises(KeyboardInterrupt):
        writes.drain()  # the new one's first wait is interrupted too
    writes.drain()
    assert old_buf.released and new_buf.released


@pytest.fixture(params=[pytest.param("uring", marks=pytest.mark.uring), "threads"])
def engine(request):
    """An aio engine of each backend that runs here (the others skipped with the reason)."""
    status = aio.probe()[request.param]
    if not status.available:
        pytest.skip(f"aio backend {request.param!r} unavailable: {status.reason}")
    engine = aio.open_engine(request.param)
    yield engine
    engine.close()


def test_a_buffer_released_while_an_orphaned_read_fills_it_is_not_handed_out(
    engine, held_source, sigint_after_submit, no_hang
):
    # The caller's Ctrl-C lands after the backend has the read and before pread returns, so
    # nothing the caller holds waits for it; its cleanup gives the buffer back at once.
    pool = HostBufferPool(1 << 20, engine=engine, slab_size=1 << 20)
    fd, release = held_source(engine.backend, b"\xab" * NBYTES)
    lease = pool.acquire(NBYTES)
    sigint_after_submit(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.pread(lease.tensor, fd, 0)
    lease.release()
    mine = pool.acquire(NBYTES)  # the next owner
    mine.tensor.fill_(0x11)
    release()
    engine.close()  # every request the backend was given has ended
    assert int((mine.tensor != 0x11).sum()) == 0, "the orphaned read overwrote the next owner's buffer"
    mine.release()
    assert pool.stats()["in_use_bytes"] == 0  # the read's buffer came back once it ended
    pool.close()


def test_a_sigint_in_a_get_never_lets_the_pool_hand_out_the_buffer_being_read(
    open_space, monkeypatch, sigint_after_submit, no_hang
):
    engine = aio.open_engine("threads")  # os.preadv is where the read can be held
    gate, real = threading.Event(), os.preadv

    def held(*args):
        gate.wait(timeout=60)
        return real(*args)

    try:
        space = open_space(engine=engine)
        space.put("x", torch.arange(NBYTES // 4, dtype=torch.float32)).result()
        monkeypatch.setattr(os, "preadv", held)
        sigint_after_submit(engine)
        threading.Timer(0.2, gate.set).start()  # the read ends a little after the interrupt
        with pytest.raises(KeyboardInterrupt):
            space.get("x")  # into a pool buffer, which get's cleanup releases
        mine = space.pool.acquire(NBYTES)
        mine.tensor.fill_(0x11)
        engine.close()  # every request the backend was given has ended
        assert int((mine.tensor != 0x11).sum()) == 0, "the orphaned read overwrote the next owner's buffer"
        mine.release()
        space.close()
    finally:
        gate.set()
        engine.close()


def test_a_get_into_the_callers_tensor_interrupted_after_submit_returns_only_once_the_read_ended(
    open_space, monkeypatch, sigint_after_submit, no_hang
):
    # The caller may reuse ``out`` as soon as the KeyboardInterrupt reaches it: no read into
    # it may still be running then, future or not.
    engine = aio.open_engine("threads")
    gate, real = threading.Event(), os.preadv

    def held(*args):
        gate.wait(timeout=60)
        return real(*args)

    try:
        space = open_space(engine=engine)
        t = torch.arange(NBYTES // 4, dtype=torch.float32)
        space.put("x", t).result()
        out = aio.empty_aligned(NBYTES).view(torch.float32)  # aligned: read into directly, not staged
        monkeypatch.setattr(os, "preadv", held)
        sigint_after_submit(engine)
        threading.Timer(0.2, gate.set).start()  # the read ends a little after the interrupt
        with pytest.raises(KeyboardInterrupt):
            space.get("x", out)
        out.fill_(-1.0)  # the caller's own use of it
        engine.close()  # every request the backend was given has ended
        assert bool((out == -1.0).all()), "a read into the caller's tensor ran on after get raised"
        space.close()
    finally:
        gate.set()
        engine.close()


def test_a_buffer_released_after_a_wait_was_interrupted_is_held_until_its_read_ends(
    held_source, sigint_after_submit, no_hang
):
    # The threads backend's wait is where a Ctrl-C can cut in while the read runs (the uring
    # wait does not return until the request is done). A careless caller releases anyway.
    engine = aio.open_engine("threads")
    try:
        pool = HostBufferPool(1 << 20, engine=engine, slab_size=1 << 20)
        fd, release = held_source("threads", b"\xab" * NBYTES)
        lease = pool.acquire(NBYTES)
        fut = engine.pread(lease.tensor, fd, 0)
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            fut.result()
        lease.release()
        mine = pool.acquire(NBYTES)
        mine.tensor.fill_(0x11)
        release()
        assert fut.result() == NBYTES
        assert int((mine.tensor != 0x11).sum()) == 0, "the read overwrote the next owner's buffer"
        mine.release()
        assert pool.stats()["in_use_bytes"] == 0 and pool.stats()["busy_buffers"] == 0
        pool.close()
    finally:
        engine.close()


def test_a_sigint_anywhere_in_an_acquire_or_release_leaves_the_pool_lock_free(no_hang):
    """A real SIGINT where Python delivers one (as a function of the pool's, of threading's or
    of contextlib's begins or returns: a trace function raises it there), at each such point of
    an acquire and a release in turn: whatever the KeyboardInterrupt left, the pool's lock is
    free afterwards. Taken through threading.Condition's Python __enter__, a Ctrl-C as its
    acquire returned left the lock held for good, and the next release (a read's verify
    thread) waited on it forever (an audit helper's hang)."""
    pool = HostBufferPool(1 << 20, slab_size=1 << 20)
    files = {HostBufferPool.acquire.__code__.co_filename, threading.__file__, contextlib.__file__}
    hit = {"at": -1, "seen": 0}

    def trace(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None
        if event in ("call", "return"):
            hit["seen"] += 1
            if hit["seen"] == hit["at"]:
                signal.raise_signal(signal.SIGINT)
        return trace

    at = 1
    while True:
        hit["at"], hit["seen"] = at, 0
        lease = None
        try:
            sys.settrace(trace)
            try:
                lease = pool.acquire(NBYTES)
                lease.release()
            finally:
                sys.settrace(None)
        except KeyboardInterrupt:
            pass
        if lease is not None:
            lease.release()  # (a second release does nothing)
        lock = pool._cond._lock  # the pool's lock, however its sections take it
        assert lock.acquire(timeout=2), f"the pool lock was left held by a SIGINT at point {at}"
        lock.release()
        if hit["seen"] < at:  # the acquire and the release ran whole without reaching point ``at``
            break
        at += 1
    assert at > 10
    pool.close()
