"""Checksums of swapped bytes: xxh3-64, which runs at about 30 GB/s on one core here.

A checksum is stored as "xxh3-64:<16 hex digits>" so the algorithm can change with the
manifest's version without ambiguity.

[Note: reads checked off the caller's thread]
A read that checks its checksum (`SwapSpace.get` under ``verify="always"``, the default) is
handed to a `Checker`: one of its threads waits for the read to land and hashes the bytes
there (xxhash lets go of the GIL while it hashes), so the hash of one read runs while the
caller computes and the next reads are in flight, not after each read on the caller's thread.
The caller's ``result()`` returns only once the check passed, so no byte is used (copied to
a device, computed on) before it is known good. A caller that wants a read whose check has not
begun (its thread is busy waiting for an older read still on its way: a read needed now that
went ahead of reads for later) does it itself rather than wait behind the older one. Reads
smaller than ``INLINE_BYTES`` are checked on the caller's thread: handing them over costs more
than hashing them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

PREFIX = "xxh3-64:"

INLINE_BYTES = 256 << 10  # reads smaller than this are hashed on the caller's thread


class SwapCorruption(OSError):
    """Bytes read back do not match the checksum written with them.

    ``tensor`` names the tensor; ``filename`` and ``offset`` the first extent of it (the
    checksum covers the whole tensor, so the bad byte may be in any of its extents);
    ``context``, what the tensor holds, for a name that does not say (an activation's chunk).
    """

    def __init__(self, tensor: str, filename: str, offset: int, expected: str, actual: str, *,
                 context: str | None = None):  # fmt: skip
        what = f"{context}; " if context else ""
        super().__init__(
            f"checksum mismatch in tensor {tensor!r} ({what}first extent at offset {offset}): "
            f"manifest has {expected}, the bytes read give {actual}"
        )
        self.tensor = tensor
        self.filename = filename
        self.offset = offset
        self.expected = expected
        self.actual = actual

    def __str__(self) -> str:
        return f"{self.args[0]}: {self.filename!r}"


def checksum(data) -> str:
    """xxh3-64 of a buffer (a uint8 numpy array or anything with the buffer protocol)."""
    return f"{PREFIX}{xxhash.xxh3_64_hexdigest(data)}"


def checksum_parts(parts) -> str:
    """xxh3-64 of the concatenation of ``parts``, without concatenating them."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return f"{PREFIX}{h.hexdigest()}"


class Checker:
    """Threads that wait for reads to land and check their bytes ([Note: reads checked off the
    caller's thread]). Started on the first read that needs one; `close` waits for them."""

    def __init__(self, threads: int = 2):
        if threads < 1:
            raise ValueError(f"{threads=} must be at least 1")
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def check(self, transfer, data, expected: str, corrupt: Callable[[str], Exception]) -> "CheckedRead":
        """``transfer`` (a read, with ``done()`` and ``wait()``) whose bytes, ``data`` (a 1-D
        uint8 tensor, or what `checksum` takes), must hash to ``expected``; ``corrupt(actual)``
        makes the error of a mismatch."""
        read = CheckedRead(transfer, data, expected, corrupt)
        if getattr(data, "nbytes", 0) >= INLINE_BYTES:
            read._job = self._pool().submit(read._run)
        return read

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="infinity-verify")
            return self._executor

    def close(self) -> None:
        """Wait for the checks in progress and stop the threads (idempotent; a later `check`
        starts them again)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


class CheckedRead:
    """A read and the check of its bytes, as one transfer: ``done()`` once both are;
    ``wait()`` raises the read's OSError or a mismatch's error, or returns once the bytes are
    known good. Idempotent; an interrupt (KeyboardInterrupt) in ``wait`` leaves it to be waited
    for again."""

    __slots__ = ("_transfer", "_data", "_expected", "_corrupt", "_job", "_ours", "_error", "_checked")

    def __init__(self, transfer, data, expected: str, corrupt: Callable[[str], Exception]):
        self._transfer = transfer
        self._data = data
        self._expected = expected
        self._corrupt = corrupt
        self._job = None  # the checker thread's, when one checks it
        self._ours = False  # the caller's thread checks it (small, or taken back from the checker)
        self._error: BaseException | None = None
        self._checked = False

    def _run(self) -> None:
        self._transfer.wait()  # raises the read's OSError
        data = self._data.numpy() if hasattr(self._data, "numpy") else self._data
        actual = checksum(data)
        if actual != self._expected:
            raise self._corrupt(actual)

    def done(self) -> bool:
        if self._checked:
            return True
        if self._job is not None and not self._ours:
            return self._job.done()
        return self._transfer.done()

    def wait(self) -> None:
        if not self._checked:
            if self._job is not None and not self._ours and self._job.cancel():
                self._ours = True  # not begun: no reason to wait behind what the thread waits for
            try:
                if self._job is not None and not self._ours:
                    self._job.result()
                else:
                    self._run()
            except Exception as e:  # noqa: BLE001 - kept and raised to every caller
                self._error = e
            self._checked = True
            self._data = self._transfer = self._corrupt = None
        if self._error is not None:
            raise self._error
