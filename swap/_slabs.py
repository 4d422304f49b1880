"""The host buffer pool's memory: slabs under a byte budget, carved into aligned extents.

Owns: the slabs alive (each one `infinity.aio.empty_aligned` allocation, anonymous and
huge-page advised, registered once with the I/O engine as a fixed buffer and with CUDA where
there is a GPU), the `ExtentAllocator` that carves each, and the extents freed while the
engine still runs I/O on them ([Note: buffers under I/O]).
Touches: the I/O engine (``register_buffer``, ``unregister_buffer``, ``inflight``).
`_pool.HostBufferPool` owns one `Slabs` and calls it under its lock; it counts what its
buffers hold, this knows only where the bytes are. Not thread-safe on its own.

Slabs are kept when their extents are freed, so a steady acquire/release costs no mmap, no page
faults and no re-registration; an empty slab is dropped only to make room for a size that no
slab holds, or on `drop_empty` and `close`.
"""

from __future__ import annotations

import logging

from infinity.aio import empty_aligned

from ._allocator import ExtentAllocator
from ._common import human_size

__all__ = ["Slab", "Slabs"]

logger = logging.getLogger("infinity.swap")


class Slab:
    """One empty_aligned allocation and the allocator that carves it."""

    __slots__ = ("tensor", "array", "address", "allocator", "registered", "alive")

    def __init__(self, nbytes: int, alignment: int):
        self.tensor = empty_aligned(nbytes, alignment)  # 1-D uint8, the whole slab
        self.array = self.tensor.numpy()  # per-buffer views are cut from this
        self.address = self.tensor.data_ptr()
        self.allocator = ExtentAllocator(alignment, grow_step=0, capacity=nbytes)
        self.registered = False
        self.alive = True

    @property
    def nbytes(self) -> int:
        return self.allocator.capacity


class Slabs:
    """Slabs of ``slab_size`` bytes (or the request when larger), their bytes together at most
    ``budget_bytes``, registered with ``engine`` (None: no I/O engine), carved at ``alignment``."""

    def __init__(self, budget_bytes: int, alignment: int, slab_size: int, engine=None):
        self.budget_bytes = budget_bytes
        self.alignment = alignment
        self.slab_size = slab_size
        self.engine = engine
        self._slabs: list[Slab] = []  # oldest first: extents pack into old slabs, new ones empty out
        self.allocated = 0  # bytes of live slabs: what the budget bounds
        # [Note: buffers under I/O] An extent freed while the engine still runs a request on
        # its memory (its buffer's caller was interrupted before it held the future, or gave
        # up waiting for it) is held here, still taken, until those requests end: handed out
        # before, the request would overwrite the next owner's bytes.
        self._busy: list[tuple[Slab, int, int, list]] = []  # (slab, offset, size, requests)
        self._register_warned = False

    def place(self, size: int, reserved: int = 0) -> tuple[Slab, int] | None:
        """An extent of ``size`` bytes (a multiple of the alignment): in the oldest slab with
        room, else in a new slab within the budget less ``reserved`` (empty slabs too small
        for it dropped to make room); None when neither can hold it."""
        for slab in self._slabs:
            if slab.allocator.largest_free >= size:
                return slab, slab.allocator.allocate(size)
        headroom = self.headroom(reserved)
        if headroom < size:
            # Empty slabs here are all too small for ``size``; dropping them (largest first)
            # may make room for a slab that is not.
            empty = sorted((s for s in self._slabs if s.allocator.used_bytes == 0), key=lambda s: -s.nbytes)
            if headroom + sum(s.nbytes for s in empty) < size:
                return None
            for slab in empty:
                if self.headroom(reserved) >= size:
                    break
                self._drop(slab)
        slab = self._new(min(max(self.slab_size, size), self.headroom(reserved)))
        return slab, slab.allocator.allocate(size)

    def headroom(self, reserved: int = 0) -> int:
        """Bytes of the budget less ``reserved`` that no slab holds (a multiple of the alignment)."""
        return max(0, self.budget_bytes - reserved - self.allocated) // self.alignment * self.alignment

    def free(self, slab: Slab, offset: int, size: int) -> bool:
        """Give an extent back to its slab: True, or False where I/O still runs on it (it comes
        back from `reap` once that ends). A dropped slab's extent is gone with it (True)."""
        if not slab.alive:
            return True
        if self.engine is not None:
            running = self.engine.inflight(slab.address + offset, size)
            if running:  # see [Note: buffers under I/O]
                self._busy.append((slab, offset, size, running))
                return False
        slab.allocator.free(offset, size)
        return True

    def reap(self) -> list[int]:
        """Give back the extents whose I/O has ended; their sizes (of those in live slabs)."""
        if not self._busy:
            return []
        busy, self._busy, freed = self._busy, [], []
        for slab, offset, size, running in busy:
            if not slab.alive:
                continue
            running = [r for r in running if not r.done()]
            if running:
                self._busy.append((slab, offset, size, running))
            else:
                slab.allocator.free(offset, size)
                freed.append(size)
        return freed

    @property
    def busy(self) -> int:
        """Extents freed whose I/O has not ended yet."""
        return len(self._busy)

    def drop_empty(self) -> int:
        """Drop the slabs that hold no extent; the bytes given back."""
        empty = [s for s in self._slabs if s.allocator.used_bytes == 0]
        for slab in empty:
            self._drop(slab)
        return sum(s.nbytes for s in empty)

    def close(self) -> None:
        """Drop every slab. The memory of extents still in use stays mapped while a tensor over
        it lives; that of extents under I/O while the engine holds their requests."""
        for slab in list(self._slabs):
            self._drop(slab)
        self._busy.clear()

    def stats(self) -> dict:
        return {
            "slabs": len(self._slabs),
            "registered_slabs": sum(s.registered for s in self._slabs),
            "largest_free": max((s.allocator.largest_free for s in self._slabs), default=0),
        }

    def __len__(self) -> int:
        return len(self._slabs)

    def _new(self, nbytes: int) -> Slab:
        slab = Slab(nbytes, self.alignment)
        if self.engine is not None:
            try:
                self.engine.register_buffer(slab.tensor)
                slab.registered = True
            except OSError as e:
                # Registration saves per-I/O page pinning; without it I/O still works. The usual
                # cause is RLIMIT_MEMLOCK for an unprivileged user.
                if not self._register_warned:
                    self._register_warned = True
                    logger.warning(
                        "cannot register a %s host buffer slab with the %s aio engine (%s); its I/O "
                        "runs without fixed buffers (raise `ulimit -l` to allow it)",
                        human_size(nbytes), getattr(self.engine, "backend", "?"), e,
                    )
        self._slabs.append(slab)
        self.allocated += nbytes
        logger.debug(
            "host buffer pool: new slab of %s (%s of %s budget)",
            human_size(nbytes), human_size(self.allocated), human_size(self.budget_bytes),
        )
        return slab

    def _drop(self, slab: Slab) -> None:
        self._slabs.remove(slab)
        self.allocated -= slab.nbytes
        slab.alive = False
        if slab.registered and self.engine is not None and not self.engine.closed:
            self.engine.unregister_buffer(slab.tensor)
        slab.registered = False
        # Memory is unmapped when the last tensor over it dies: at once for an empty slab, later
        # for one dropped by close() while a buffer is still held.
        slab.tensor = slab.array = None
