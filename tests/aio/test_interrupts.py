"""A Ctrl-C anywhere in a submit never leaves a request running that no one waits for.

The signals are real (signal.raise_signal): once right after the backend has the request
(`sigint_after_submit`), and once at every bytecode of the submit path in turn (a trace
function raises the signal there). The reads come from `held_source`, so they are still
running when the test looks.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

import infinity.aio as aio

NBYTES = 64 << 10
DATA = bytes(range(256)) * (NBYTES // 256)

_AIO_DIR = os.path.dirname(aio.__file__)
# The submit path proper; argument checks (_buffers, _files) run before anything is submitted.
_TRACED = {os.path.join(_AIO_DIR, f) for f in ("_engine.py", "_threads.py", "_uring_engine.py")}


def _zeroed(nbytes: int = NBYTES):
    buf = aio.empty_aligned(nbytes)
    buf.zero_()
    return buf


def test_a_sigint_right_after_submit_leaves_the_read_owned_by_the_engine(
    backend, make_engine, held_source, sigint_after_submit, no_hang
):
    engine = make_engine()
    fd, release = held_source(backend, DATA)
    buf = _zeroed()
    sigint_after_submit(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.pread(buf, fd, 0)
    # The caller never got a future, but the engine knows the read still fills buf.
    assert not engine.wait_range(buf, timeout=0)
    assert engine.inflight(buf)
    release()
    assert engine.wait_range(buf)
    assert not engine.inflight(buf)
    assert bytes(buf.numpy()) == DATA


def test_wait_range_sees_only_requests_on_that_memory(backend, make_engine, held_source, no_hang):
    engine = make_engine()
    fd, release = held_source(backend, DATA)
    slab = _zeroed(3 * NBYTES)
    fut = engine.pread(slab[NBYTES : 2 * NBYTES], fd, 0)
    address = slab.data_ptr()
    assert engine.wait_range(address, NBYTES, timeout=0)  # the bytes before it
    assert engine.wait_range(address + 2 * NBYTES, NBYTES, timeout=0)  # the bytes after it
    assert not engine.wait_range(address + 2 * NBYTES - 1, 2, timeout=0)  # one byte of it
    assert engine.inflight(address, 3 * NBYTES) == [fut]
    release()
    assert engine.wait_range(slab)
    assert fut.result() == NBYTES


def test_wait_range_refuses_a_negative_length(engine):
    with pytest.raises(ValueError, match="nbytes=-1"):
        engine.wait_range(4096, -1)


def _interrupt_at(k: int):
    """A trace function that raises a real SIGINT at the k-th bytecode run in the traced files."""
    count = [0]

    def trace(frame, event, arg):
        if frame.f_code.co_filename not in _TRACED:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
            if count[0] == k:
                sys.settrace(None)
                signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt from here into the frame
        return trace

    return trace, count


def test_an_interrupt_at_any_bytecode_of_a_submit_leaves_no_request_unowned(
    backend, make_engine, held_source, sigint_after_submit, no_hang
):
    # sigint_after_submit is not armed here: it only installs Python's SIGINT handler.
    k, interrupted = 0, 0
    while True:
        k += 1
        engine = make_engine(queue_depth=4, block_size=16 << 10)  # 4 chunks: the chunking runs too
        fd, release = held_source(backend, DATA)
        buf = _zeroed()
        trace, count = _interrupt_at(k)
        sys.settrace(trace)
        try:
            fut = engine.pread(buf, fd, 0)
        except KeyboardInterrupt:
            fut = None
        finally:
            sys.settrace(None)
        if fut is not None and count[0] < k:  # the whole submit ran without reaching k
            release()
            assert fut.result() == NBYTES
            engine.close()
            break
        interrupted += 1
        owned = not engine.wait_range(buf, timeout=0)
        release()
        assert engine.wait_range(buf, timeout=30), f"interrupt at bytecode {k}: the read never ends"
        engine.close()  # whatever the backend was given has ended
        ran = bytes(buf.numpy()) != bytes(NBYTES)
        assert owned or not ran, f"interrupt at bytecode {k}: a read nobody tracked filled the buffer"
        if fut is not None:
            assert fut.done()
    assert interrupted > 10  # the trace did reach the submit path
