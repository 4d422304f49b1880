"""Buffers set aside in the host buffer pool, and the budget reserved beside it.

Owns: the buffers set aside (oldest first) and their bytes, and the bytes of the budget its
users hold outside the pool (`_pool.HostBufferPool.reserve`), which bind while any buffer is
aside. Touches: the pool's counts, its buffers' slabs and its condition, always under the pool's lock
(every method here expects it held). `_pool.HostBuffer.set_aside`, ``take_back`` and
``release`` come here; the pool's acquire asks `reserved_now` and `reclaim_oldest`.

[Note: buffers set aside]
A buffer whose bytes may be wanted again (the parameters a read or a write left in it:
infinity/_param_cache.py) can be set aside instead of released. Its bytes count as free (not in
`in_use_bytes` nor in any traffic class), but stay where they are: an `acquire` that finds no
other room takes the room of the buffers set aside, the longest aside first, before it waits;
`take_back` finds a buffer's bytes as they were, or False once its room was taken. So setting
aside never makes an acquire wait, and the budget bounds the slabs as before. Kept buffers sit
where their first use placed them, and buffers taken around them leave the free room in pieces:
near a budget's floor (1.7 MiB, 260 KiB units) an acquire failed with 568 KiB free in pieces
after every buffer aside was given up, where the same run without them trained. So no buffer is
set aside (it is released instead) where the budget less what is reserved holds fewer than
ROOM_BUFFERS of the largest buffer taken so far. (Half the room at most as well kept 0.41 of
the 106M model's 0.75 GB a step in nvme,cpu,cpu at 4GiB, where this alone keeps all, and the
helper's sweep of budgets trained the same without it.) While buffers are aside no slab grows
into the bytes reserved: what is kept gives way first, so keeping what no use needs never takes
the memory the pool's users hold beside it.
"""

from __future__ import annotations

__all__ = ["Aside", "ROOM_BUFFERS"]

ROOM_BUFFERS = 8  # no buffer set aside in a pool with room for fewer of its largest


class Aside:
    """The buffers set aside in a pool of ``budget_bytes`` whose buffers ``counts`` counts;
    ``cond`` is the pool's condition (notified when room comes free)."""

    def __init__(self, budget_bytes: int, counts, cond):
        self.budget_bytes = budget_bytes
        self._counts = counts
        self._cond = cond
        self._buffers: dict[int, object] = {}  # id -> HostBuffer, the longest aside first
        self.bytes = 0  # of the buffers aside
        self.reserved = 0  # bytes of the budget held outside the pool

    def __contains__(self, buffer) -> bool:
        return id(buffer) in self._buffers

    def reserved_now(self) -> int:
        """The bytes no slab may grow into now: those reserved, while any buffer is aside."""
        return self.reserved if self._buffers else 0

    def set(self, buffer) -> bool:
        """Set ``buffer`` (the caller's, in no I/O) aside; False where the pool keeps none."""
        if id(buffer) in self._buffers:
            return True
        if ROOM_BUFFERS * self._counts.largest > self.budget_bytes - self.reserved:
            return False  # none in a pool a few buffers fill
        self._counts.give_back(buffer._size, buffer.traffic)
        self._buffers[id(buffer)] = buffer
        self.bytes += buffer._size
        self._cond.notify_all()  # an acquire that waits may take its room now
        return True

    def take(self, buffer, traffic: str) -> bool:
        """``buffer`` the caller's again, counted under ``traffic``, if its bytes are still
        there; a buffer never set aside is the caller's while it is not released."""
        if self._buffers.pop(id(buffer), None) is None:
            return buffer._tensor is not None
        self.bytes -= buffer._size
        buffer.traffic = traffic
        self._counts.take(buffer._size, traffic)
        return True

    def drop(self, buffer) -> bool:
        """Release ``buffer`` if it is aside (its room taken now); whether it was."""
        if id(buffer) not in self._buffers:
            return False
        self.reclaim(buffer)
        return True

    def reclaim_oldest(self) -> bool:
        """Take the room of the buffer longest aside; False where none is."""
        if not self._buffers:
            return False
        self.reclaim(next(iter(self._buffers.values())))
        return True

    def reclaim_all(self) -> None:
        for buffer in list(self._buffers.values()):
            self.reclaim(buffer)

    def reclaim(self, buffer) -> None:
        del self._buffers[id(buffer)]
        self.bytes -= buffer._size
        buffer._finalizer.detach()
        buffer._tensor = None
        if buffer._slab.alive:  # (in no I/O, as `set` asks: no check for it)
            buffer._slab.allocator.free(buffer._offset, buffer._size)
        self._cond.notify_all()
