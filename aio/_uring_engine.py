"""The `uring` backend: a thin wrapper over the C++ ring in `infinity.aio._uring`.

The ring lives on its own thread (the only thread that touches it, so the kernel can run it
with SINGLE_ISSUER|DEFER_TASKRUN); requests are handed over through a queue and completed one
by one, each with its own handle. See aio/csrc/uring_engine.hpp.
"""

from __future__ import annotations

from ._engine import WRITE, Engine
from ._files import File

_MAX_REGISTERED = 1 << 30


class UringEngine(Engine):
    backend = "uring"

    def __init__(self, queue_depth: int = 32, block_size: int = 1 << 20):
        super().__init__(queue_depth, block_size)
        from . import _uring

        self._files: dict[File, int] = {}  # registered file -> fixed-file slot
        self._closed = True  # until the ring exists, so __del__ of a failed init has nothing to do
        self._ring = _uring.Ring(queue_depth, block_size)
        self._closed = False

    @property
    def setup_flags(self) -> str:
        """The io_uring_setup flags the ring runs with, e.g. 'SINGLE_ISSUER|DEFER_TASKRUN'."""
        return self._ring.setup_flags

    def _start(self, fut, op, arr, address, nbytes, target, offset, urgent=False):
        slot = self._files.get(target.file, -1) if target.file is not None else -1
        # One call: fut and the engine own the request before the ring has it ([Note: request
        # ownership]).
        self._ring.submit(fut, self._own, op == WRITE, target.fd, address, nbytes, offset, target.direct, slot, urgent)

    def _register_buffer(self, address: int, nbytes: int):
        # The kernel takes at most 1 GiB per registered buffer; larger ones go in pieces
        # (a chunk that straddles two pieces simply uses the plain READ/WRITE op).
        slots = []
        try:
            for start in range(0, nbytes, _MAX_REGISTERED):
                slots.append(self._ring.register_buffer(address + start, min(_MAX_REGISTERED, nbytes - start)))
        except OSError:
            for slot in slots:
                self._ring.unregister_buffer(slot)
            raise
        return slots

    def _unregister_buffer(self, slots) -> None:
        for slot in slots:
            self._ring.unregister_buffer(slot)

    def _register_file(self, file: File) -> bool:
        if file not in self._files:
            self._files[file] = self._ring.register_file(file.fileno())
        return True

    def _unregister_file(self, file: File) -> None:
        slot = self._files.pop(file, None)
        if slot is not None and not self._closed:
            self._ring.unregister_file(slot)

    def counters(self) -> dict[str, int]:
        return self._ring.counters()

    def _shutdown(self, cancel: bool) -> None:
        self._ring.close(cancel)
        for file in self._files:
            file._engines.discard(self)
        self._files.clear()
