"""The `threads` backend: os.preadv/os.pwritev on a thread pool.

The fallback where io_uring cannot run (gVisor, Docker's default seccomp profile,
kernel.io_uring_disabled, or a build without liburing). Same chunking and semantics as the
uring backend: ``block_size`` chunks, at most ``queue_depth`` in flight, short transfers
continued, EOF ends a read with the short count. Requests start in the order they were
submitted; a request's chunks are claimed in order by up to ``queue_depth`` workers.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ._engine import READ, Engine


class _Request:
    """One request: its chunks, claimed by the workers in order, and its completion state."""

    __slots__ = ("op", "view", "fd", "offset", "direct", "block_size", "nchunks", "next", "pending",
                 "nbytes", "error", "eof_at", "started", "handed_over", "lock", "event")  # fmt: skip

    def __init__(self, op: int, view: memoryview, fd: int, offset: int, direct: bool, block_size: int):
        self.op, self.view, self.fd, self.offset, self.direct = op, view, fd, offset, direct
        self.block_size = block_size
        self.nchunks = -(-len(view) // block_size)
        self.next = 0  # first chunk no worker has claimed
        self.pending = self.nchunks
        self.nbytes = 0
        self.error = 0
        self.eof_at = None  # lowest file offset where a chunk found end of file
        self.started = False  # a worker has begun it: it runs to the end
        self.handed_over = False  # its submit returned (see ThreadEngine._start)
        self.lock = threading.Lock()
        self.event = threading.Event()

    def begin(self) -> bool:
        """Called by the first worker: False if it was cancelled before it started."""
        with self.lock:
            if self.event.is_set():
                return False
            self.started = True
            return True

    def claim(self) -> int | None:
        with self.lock:
            if self.next >= self.nchunks:
                return None
            self.next += 1
            return self.next - 1

    def cancel_unstarted(self) -> None:
        """Fail the request with ECANCELED unless a worker has begun it (then it completes)."""
        with self.lock:
            if not self.started and not self.event.is_set():
                self.error = errno.ECANCELED
                self.event.set()

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
        if not self.handed_over:
            # Its submit was interrupted ([Note: request ownership]), maybe before the pool
            # had it: waiting could be for ever. Unless a worker has begun it, it never runs.
            self.cancel_unstarted()
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

    def _start(self, fut, op, arr, address, nbytes, target, offset, urgent=False):  # in order: no lanes
        req = _Request(op, memoryview(arr), target.fd, offset, target.direct, self.block_size)
        fut._handle = req
        self._own(fut)
        # Owned from here ([Note: request ownership]). The pool gets one job, so the request
        # is handed over in one step; the job's worker brings in more workers for the other
        # chunks. An interrupt before ``handed_over`` is set leaves a request that whoever
        # waits for it (close, wait_range) cancels unless a worker has begun it.
        self._pool.submit(self._begin, req)
        req.handed_over = True

    def _begin(self, req: _Request) -> None:
        if not req.begin():
            return
        with self._stats_lock:
            self._stats["requests"] += 1
        for _ in range(min(req.nchunks, self.queue_depth) - 1):
            try:
                self._pool.submit(self._work, req)
            except RuntimeError:  # shutting down: this worker does the rest itself
                break
        self._work(req)

    def _work(self, req: _Request) -> None:
        bs = self.block_size
        while (i := req.claim()) is not None:
            lo = i * bs
            hi = min(lo + bs, len(req.view))
            self._run_chunk(req, req.op, req.view[lo:hi], req.fd, req.offset + lo, req.direct)

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
        # Every request first (their workers still submit helpers to the pool), then the pool.
        for fut in list(self._inflight):
            fut.wait()
        self._pool.shutdown(wait=True)
