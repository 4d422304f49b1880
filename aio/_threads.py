"""The `threads` backend: os.preadv/os.pwritev on a thread pool.

The fallback where io_uring cannot run (gVisor, Docker's default seccomp profile,
kernel.io_uring_disabled, or a build without liburing). Same chunking and semantics as the
uring backend: ``block_size`` chunks, at most ``queue_depth`` in flight, short transfers
continued, EOF ends a read with the short count.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ._engine import READ, Engine


class _Request:
    """Completion state of one request split over ``pending`` chunks."""

    __slots__ = ("pending", "nbytes", "error", "eof_at", "lock", "event")

    def __init__(self, nchunks: int):
        self.pending = nchunks
        self.nbytes = 0
        self.error = 0
        self.eof_at = None  # lowest file offset where a chunk found end of file
        self.lock = threading.Lock()
        self.event = threading.Event()

    def finish_chunk(self, nbytes: int, error: int = 0, eof_at: int | None = None) -> None:
        with self.lock:
            self.nbytes += nbytes
            if error and not self.error:
                self.error = error
            if eof_at is not None and (self.eof_at is None or eof_at < self.eof_at):
                self.eof_at = eof_at
            self.pending -= 1
            if self.pending == 0:
                self.event.set()

    # The handle protocol of infinity.aio.Future.
    def done(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self.event.wait(None if timeout_s < 0 else timeout_s)

    def outcome(self) -> tuple[int, int]:
        return self.nbytes, self.error


class ThreadEngine(Engine):
    backend = "threads"

    def __init__(self, queue_depth: int = 32, block_size: int = 1 << 20):
        super().__init__(queue_depth, block_size)
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="infinity-aio")
        self._cancelled = False
        self._stats_lock = threading.Lock()
        self._stats = dict(requests=0, chunks=0, bytes_read=0, bytes_written=0, short=0, retries=0, errors=0)

    def _start(self, op, arr, address, nbytes, target, offset, urgent=False):  # in order: no lanes
        bs = self.block_size
        nchunks = -(-nbytes // bs)
        req = _Request(nchunks)
        view = memoryview(arr)
        with self._stats_lock:
            self._stats["requests"] += 1
        for i in range(nchunks):
            lo = i * bs
            hi = min(lo + bs, nbytes)
            self._pool.submit(self._run_chunk, req, op, view[lo:hi], target.fd, offset + lo, target.direct)
        return req

    def _run_chunk(self, req: _Request, op: int, view: memoryview, fd: int, offset: int, direct: bool) -> None:
        if self._cancelled:
            req.finish_chunk(0, errno.ECANCELED)
            return
        eof_at = req.eof_at
        # Chunks run in any order: only those wholly past an EOF already found are moot. One
        # before it must still be read, or the count would cover bytes never read.
        if req.error or (eof_at is not None and offset >= eof_at):
            req.finish_chunk(0)
            return
        done = 0
        retries = short = 0
        want = len(view)
        try:
            while done < want:
                try:
                    if op == READ:
                        n = os.preadv(fd, [view[done:]], offset + done)
                    else:
                        n = os.pwritev(fd, [view[done:]], offset + done)
                except BlockingIOError:
                    retries += 1
                    continue
                if n == 0:
                    if op == READ:
                        break  # end of file
                    raise OSError(errno.EIO, "write transferred 0 bytes")
                done += n
                if done < want:
                    short += 1
                    # Under O_DIRECT a short read only happens at EOF, whose offset may not be
                    # aligned enough to ask again.
                    if op == READ and direct:
                        break
        except OSError as e:
            self._count(op, done, retries, short, error=True)
            req.finish_chunk(done, e.errno or errno.EIO)
            return
        self._count(op, done, retries, short)
        req.finish_chunk(done, eof_at=offset + done if done < want else None)

    def _count(self, op, nbytes, retries, short, error=False) -> None:
        with self._stats_lock:
            s = self._stats
            s["chunks"] += 1
            s["bytes_read" if op == READ else "bytes_written"] += nbytes
            s["retries"] += retries
            s["short"] += short
            s["errors"] += error

    def counters(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    def _shutdown(self, cancel: bool) -> None:
        self._cancelled = cancel
        self._pool.shutdown(wait=True)
