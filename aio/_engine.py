"""The engine interface shared by every backend, its futures, and backend selection."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from ._buffers import address_of, as_bytes
from ._files import File, fd_info

logger = logging.getLogger("infinity.aio")

READ = 0
WRITE = 1
_OP_NAMES = ("pread", "pwrite")


@dataclass(frozen=True, slots=True)
class _Target:
    """The file side of one request, resolved once at submit time."""

    fd: int
    name: str
    direct: bool
    mem_align: int
    offset_align: int
    file: File | None  # kept alive while the request is in flight


class Future:
    """Completion of one `Engine.pread` or `Engine.pwrite`.

    ``done()`` polls; ``wait(timeout)`` blocks until done (or the timeout) and returns
    ``done()``; ``result(timeout)`` returns the bytes moved (fewer than asked only for a read
    that reached end of file) or raises ``OSError`` with the errno and file name. All three
    may be called any number of times.
    """

    __slots__ = ("_handle", "_keepalive", "_op", "_target_name", "_address", "_nbytes", "_offset", "_outcome")

    def __init__(self, handle, keepalive, op: int, target_name: str, address: int, nbytes: int, offset: int):
        # Backend object with done(), wait(timeout_s) and outcome(); the backend sets it when
        # it takes the request (see [Note: request ownership]).
        self._handle = handle
        self._keepalive = keepalive  # buffer and file, until the completion is reaped
        self._op = op
        self._target_name = target_name
        self._address = address  # of the host memory the request reads or fills
        self._nbytes = nbytes
        self._offset = offset
        self._outcome: tuple[int, int] | None = None  # (bytes, errno)

    @classmethod
    def completed(cls, nbytes: int) -> "Future":
        fut = cls(None, None, READ, "", 0, 0, 0)
        fut._outcome = (nbytes, 0)
        return fut

    # Two threads may wait on one future (the swap layer checks a read's bytes on a thread of
    # its own while the caller's thread reaps what finished): each takes the handle once, and
    # the outcome is set before the handle goes, so one that finds no handle finds the outcome.
    def _reap(self, handle) -> None:
        self._outcome = handle.outcome()
        self._handle = None
        self._keepalive = None

    def done(self) -> bool:
        handle = self._handle
        if self._outcome is None and handle is not None and handle.done():
            self._reap(handle)
        return self._outcome is not None

    def wait(self, timeout: float | None = None) -> bool:
        handle = self._handle
        if self._outcome is None and handle is not None:
            if handle.wait(-1.0 if timeout is None else max(timeout, 0.0)):
                self._reap(handle)
        return self._outcome is not None

    def result(self, timeout: float | None = None) -> int:
        if not self.wait(timeout):
            raise TimeoutError(
                f"{_OP_NAMES[self._op]} of {self._nbytes} bytes at offset {self._offset} "
                f"in {self._target_name} not done after {timeout} s"
            )
        nbytes, err = self._outcome
        if err:
            raise OSError(
                err,
                f"{os.strerror(err)} ({_OP_NAMES[self._op]} of {self._nbytes} bytes at offset "
                f"{self._offset})",
                self._target_name,
            )
        return nbytes

    def __repr__(self) -> str:
        state = "pending" if self._outcome is None else f"outcome={self._outcome}"
        return f"Future({_OP_NAMES[self._op]} {self._nbytes}@{self._offset} {self._target_name}, {state})"


class Engine:
    """Asynchronous positional reads and writes of host buffers; see `open_engine`.

    A request is cut into ``block_size`` chunks of which at most ``queue_depth`` are in flight
    at once. Buffers are CPU tensors or buffer-protocol objects; the engine keeps each one alive
    until its request completes. Under O_DIRECT, buffer address, offset and length must be
    aligned as the file says (`File.mem_align`, `File.offset_align`): see [Note: O_DIRECT
    alignment].
    """

    backend: str = "?"

    def __init__(self, queue_depth: int, block_size: int):
        if not isinstance(queue_depth, int) or not 1 <= queue_depth <= 4096:
            raise ValueError(f"{queue_depth=} must be an int in [1, 4096]")
        if not isinstance(block_size, int) or block_size < 4096 or block_size % 4096:
            raise ValueError(f"{block_size=} must be a positive multiple of 4096")
        if block_size > 1 << 30:
            raise ValueError(f"{block_size=} must be at most 1 GiB")
        self.queue_depth = queue_depth
        self.block_size = block_size
        self._closed = False
        self._pid = os.getpid()
        # Every request from before its backend has it until it is reaped: see [Note: request
        # ownership]. A set, changed only in place, so that ``_own`` (its add, which the
        # backends call without running bytecode) always adds to the live one.
        self._inflight: set[Future] = set()
        self._own = self._inflight.add
        self._prune_at = 64
        self._buffers: dict[tuple[int, int], tuple[object, object]] = {}  # (address, nbytes) -> (buffer, slots)

    # -- requests ---------------------------------------------------------------------------
    def pread(self, buffer, file: File | int, offset: int = 0, *, urgent: bool = False) -> Future:
        """Read ``len(buffer)`` bytes of ``file`` at ``offset`` into ``buffer``. ``urgent``: a
        read needed now, served before the requests waiting that are not urgent (the uring
        backend; the threads backend serves all in order)."""
        return self._submit(READ, buffer, file, offset, urgent)

    def pwrite(self, buffer, file: File | int, offset: int = 0) -> Future:
        """Write all of ``buffer`` to ``file`` at ``offset``."""
        return self._submit(WRITE, buffer, file, offset)

    def _submit(self, op: int, buffer, file, offset: int, urgent: bool = False) -> Future:
        if self._closed:
            raise RuntimeError(f"the {self.backend} aio engine is closed")
        if os.getpid() != self._pid:
            # The engine's threads (ring worker, thread pool) do not survive fork: a request
            # would never complete. Each process opens its own engine.
            raise RuntimeError(
                f"this {self.backend} aio engine was opened in process {self._pid}; "
                f"open a new one in process {os.getpid()} after fork"
            )
        arr = as_bytes(buffer, writable=op == READ)
        target = _resolve(file)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"{offset=} must be a non-negative int")
        nbytes = arr.nbytes
        if nbytes == 0:
            return Future.completed(0)
        address = address_of(arr)
        if target.direct:
            _check_alignment(op, target, address, nbytes, offset)
        fut = Future(None, (arr, buffer, target), op, target.name, address, nbytes, offset)
        self._start(fut, op, arr, address, nbytes, target, offset, urgent)
        if len(self._inflight) >= self._prune_at:
            self._prune()
        return fut

    def _prune(self) -> None:
        # Reaps what finished (dropping its buffer) in amortised O(1) a request; only ever
        # removes finished requests, so an interrupt here loses nothing.
        inflight = self._inflight
        for fut in [f for f in list(inflight) if f.done()]:
            inflight.discard(fut)
        self._prune_at = max(64, 2 * len(inflight))

    # [Note: request ownership]
    # A Ctrl-C (KeyboardInterrupt) can land between any two bytecodes of the caller. Were a
    # request handed to the kernel or the thread pool before anything held it, an interrupt in
    # between would leave it running with no future: the caller's cleanup would give its
    # buffer back to the pool and the next owner's bytes would be overwritten. So
    # `_start` makes the request, gives it to ``fut`` (``fut._handle``) and to the engine
    # (``self._own(fut)``) before handing it over; the uring binding does all three in one
    # call that runs no bytecode, the threads backend see `ThreadEngine._start`. Buffer owners
    # then ask `inflight`/`wait_range` before reusing memory (HostBufferPool does on every
    # release), and `close` waits for every request the engine owns.
    def _start(self, fut, op, arr, address, nbytes, target, offset, urgent=False):  # pragma: no cover - abstract
        raise NotImplementedError

    # -- requests in flight by memory --------------------------------------------------------------
    def inflight(self, buffer, nbytes: int | None = None) -> list[Future]:
        """The requests not yet done whose host memory overlaps ``buffer`` (an object `pread`
        takes) or the ``nbytes`` bytes at address ``buffer`` (an int): those that a caller
        interrupted before it got their future included (see [Note: request ownership])."""
        address, nbytes = _memory_range(buffer, nbytes)
        end = address + nbytes
        return [
            f for f in list(self._inflight)
            if f._address < end and address < f._address + f._nbytes and not f.done()
        ]  # fmt: skip

    def wait_range(self, buffer, nbytes: int | None = None, timeout: float | None = None) -> bool:
        """Wait until no request on that memory (as in `inflight`) is running, at most
        ``timeout`` seconds; returns whether none is. The owner of a buffer calls it before
        the buffer's memory is reused or freed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for fut in self.inflight(buffer, nbytes):
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not fut.wait(left):
                return False
        return True

    # -- registration -----------------------------------------------------------------------
    def register_buffer(self, buffer) -> None:
        """Register a host buffer once so that requests inside it skip per-I/O page pinning.

        The uring backend uses READ_FIXED/WRITE_FIXED for any request that lies inside a
        registered buffer; the threads backend accepts the call and gains nothing. The engine
        holds ``buffer`` until `unregister_buffer` or `close`.
        """
        arr = as_bytes(buffer, writable=True)
        key = (address_of(arr), arr.nbytes)
        if key in self._buffers:
            return
        slot = self._register_buffer(*key)
        self._buffers[key] = (arr, slot)

    def unregister_buffer(self, buffer) -> None:
        arr = as_bytes(buffer, writable=True)
        key = (address_of(arr), arr.nbytes)
        entry = self._buffers.pop(key, None)
        if entry is None:
            raise ValueError(f"buffer at {key[0]:#x} of {key[1]} bytes is not registered with this engine")
        self._unregister_buffer(entry[1])

    def register_file(self, file: File) -> None:
        """Register ``file`` with the ring (fixed file); `File.close` unregisters it."""
        if not isinstance(file, File):
            raise TypeError(f"only infinity.aio.File objects can be registered, got {type(file).__name__}")
        if self._register_file(file):
            file._engines.add(self)

    def unregister_file(self, file: File) -> None:
        self._unregister_file(file)
        file._engines.discard(self)

    def _register_buffer(self, address: int, nbytes: int):
        return None

    def _unregister_buffer(self, slot) -> None:
        pass

    def _register_file(self, file: File) -> bool:
        return False

    def _unregister_file(self, file: File) -> None:
        pass

    # -- lifetime ---------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Cumulative counters of this engine (requests, chunks, bytes, retries...)."""
        return {}

    def close(self, cancel: bool = False) -> None:
        """Finish what is in flight and release the engine.

        With ``cancel=True`` chunks not yet submitted are dropped and their requests fail with
        ECANCELED; chunks already in the kernel always complete (their buffers stay alive).
        """
        if self._closed:
            return
        self._closed = True
        self._shutdown(cancel)
        for fut in list(self._inflight):
            fut.wait()
        self._inflight.clear()
        self._buffers.clear()

    def _shutdown(self, cancel: bool) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Buffers of requests in flight must outlive the kernel's use of them.
        if not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(queue_depth={self.queue_depth}, block_size={self.block_size})"


def _memory_range(buffer, nbytes: int | None) -> tuple[int, int]:
    if isinstance(buffer, int) and not isinstance(buffer, bool):
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"{nbytes=} must be a non-negative int with an address")
        return buffer, nbytes
    if nbytes is not None:
        raise TypeError(f"{nbytes=} goes with an int address, not with a {type(buffer).__name__}")
    arr = as_bytes(buffer, writable=False)
    return address_of(arr), arr.nbytes


def _resolve(file) -> _Target:
    if isinstance(file, File):
        return _Target(file.fileno(), file.path, file.direct, file.mem_align, file.offset_align, file)
    if isinstance(file, int) and not isinstance(file, bool):
        name, direct, mem, off = fd_info(file)
        return _Target(file, name, direct, mem, off, None)
    raise TypeError(f"file must be an infinity.aio.File or an int fd, got {type(file).__name__}")


# [Note: O_DIRECT alignment]
# O_DIRECT transfers go straight between the device and the buffer, so the kernel requires the
# buffer address to be a multiple of the device's DMA alignment and the offset and length to be
# multiples of its logical block size (statx STATX_DIOALIGN reports both; 4096 is used where it
# is unknown, which satisfies every common device). The kernel's answer to a violation is a
# bare EINVAL; the engines check first and say which value is wrong.
def _check_alignment(op: int, target: _Target, address: int, nbytes: int, offset: int) -> None:
    bad = []
    if address % target.mem_align:
        bad.append(f"buffer address={address:#x} is not a multiple of mem_align={target.mem_align}")
    if offset % target.offset_align:
        bad.append(f"{offset=} is not a multiple of offset_align={target.offset_align}")
    if nbytes % target.offset_align:
        bad.append(f"{nbytes=} is not a multiple of offset_align={target.offset_align}")
    if bad:
        raise ValueError(
            f"{_OP_NAMES[op]} on O_DIRECT file {target.name}: " + "; ".join(bad)
            + " (allocate buffers with infinity.aio.empty_aligned)"
        )

