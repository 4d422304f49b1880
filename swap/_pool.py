"""The host buffer pool: every host buffer the engine uses, under one byte budget.

Every buffer that data passes through on its way between tiers comes from here: swap-in
targets, write-behind staging, optimizer sub-group buffers, gradients copied back from a GPU,
activation chunks and checkpoint streaming all `acquire` from a `HostBufferPool`, so
``memory.host_budget`` bounds them together and running out is a `PoolExhausted` that says
what holds the memory, never an OOM kill. What lives in host memory rather than passing through
is not a buffer and is not taken here: a cpu tier's tensors (pinned where there is a GPU),
activations on the cpu tier, and the early updates' staged copies (infinity/_overlap_host.py,
which the engine's plan fits beside the pool within the same budget).

Memory comes in slabs from `infinity.aio.empty_aligned` (anonymous, huge-page advised, and
registered with CUDA where there is a GPU), each registered once with the I/O engine as a fixed
buffer, and carved into aligned buffers by an `ExtentAllocator` per slab. Slabs are kept when
their buffers are released, so steady-state acquire/release costs no mmap, no page faults and
no re-registration; empty slabs are dropped only to make room for a size that no slab holds
(or on `trim`/`close`).

Each buffer is counted under a traffic class, a name its taker gives (``acquire(...,
traffic=)``, or `HostBufferPool.traffic` around the code that acquires; "other" otherwise):
`stats` gives each class's bytes held and their peak, so what holds the budget is known by
purpose, not only in total. The pool counts; which class may take how much is its users'
policy (the engine's: infinity/_admission.py).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from collections import deque
from contextlib import contextmanager

import torch

from infinity.aio import empty_aligned

from ._allocator import ExtentAllocator
from ._common import human_size, round_up

__all__ = ["HostBuffer", "HostBufferPool", "PoolExhausted"]

OTHER = "other"  # the traffic class of a buffer whose taker named none
ASIDE_ROOM_BUFFERS = 8  # no buffer set aside in a pool with room for fewer of its largest: [Note: buffers set aside]

logger = logging.getLogger("infinity.swap")


class PoolExhausted(MemoryError):
    """The host buffer pool cannot give the bytes asked for within the budget and timeout.

    Attributes (bytes): ``asked``, ``budget``, ``held`` (by ``buffers`` buffers) and ``free``
    (inside slabs plus budget not yet allocated; fragmented when it is ``>= asked``).
    """

    def __init__(self, message: str, *, asked: int, budget: int, held: int, buffers: int, free: int):
        super().__init__(message)
        self.asked = asked
        self.budget = budget
        self.held = held
        self.buffers = buffers
        self.free = free


class _Slab:
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


class HostBuffer:
    """``nbytes`` of aligned host memory lent by a `HostBufferPool`; give it back with `release`.

    ``tensor`` is a 1-D uint8 CPU tensor of exactly ``nbytes``; ``view(dtype, shape)`` a typed
    view of its start. After `release` (idempotent; also on leaving a ``with`` block) the bytes
    belong to the pool again and ``tensor`` raises; views taken before must not be used.
    A buffer that is never released returns to the pool when it and every tensor viewing its
    memory are garbage (with a ResourceWarning): a safety net, not the API.
    """

    __slots__ = ("_pool", "_slab", "_offset", "_size", "_tensor", "_finalizer", "nbytes", "traffic", "__weakref__")

    def __init__(self, pool: "HostBufferPool", slab: _Slab, offset: int, size: int, nbytes: int, traffic: str = OTHER):
        self._pool = pool
        self._slab = slab
        self._offset = offset
        self._size = size  # bytes taken from the slab: nbytes rounded up to the alignment
        self.nbytes = nbytes
        self.traffic = traffic  # the class it is counted under
        # The tensor gets its own storage over a numpy view of the slab, so the finaliser on
        # that view runs only once no tensor (ours, the caller's views) reaches the memory:
        # a forgotten buffer can never be handed out again while something still uses it.
        view = slab.array[offset : offset + nbytes]
        self._tensor = torch.from_numpy(view)  # 1-D uint8, cpu
        self._finalizer = weakref.finalize(view, pool._give_back, slab, offset, size, True, traffic)
        self._finalizer.atexit = False

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError(f"this host buffer of {self.nbytes} bytes was released to its pool")
        return self._tensor

    @property
    def released(self) -> bool:
        return self._tensor is None

    def view(self, dtype: torch.dtype, shape) -> torch.Tensor:
        """The first ``numel * itemsize`` bytes as a ``dtype`` tensor of ``shape``."""
        shape = torch.Size((shape,) if isinstance(shape, int) else shape)
        need = shape.numel() * dtype.itemsize
        if need > self.nbytes:
            raise ValueError(f"a {dtype} view of shape={tuple(shape)} needs {need} bytes; the buffer has {self.nbytes}")
        return self.tensor[:need].view(dtype).view(shape)

    def release(self) -> None:
        """Give the bytes back to the pool (waking acquires that wait); a second call does nothing."""
        if self._tensor is None:
            return
        if id(self) in self._pool._aside and self._pool._drop_aside(self):  # aside: its bytes were free already
            return
        self._finalizer.detach()
        self._tensor = None
        self._pool._give_back(self._slab, self._offset, self._size, False, self.traffic)

    def set_aside(self) -> bool:
        """Give the bytes back to the pool but keep what they hold until the pool needs the room
        for an `acquire` ([Note: buffers set aside]): `take_back` then has them again as they
        were. The buffer must be in no I/O now, and nothing may use its tensor or views until
        `take_back` says yes. False: released instead (the pool keeps no more aside)."""
        if self._tensor is None:
            raise RuntimeError(f"this host buffer of {self.nbytes} bytes was released to its pool")
        if self._pool._set_aside(self):
            return True
        self.release()
        return False

    def take_back(self, traffic: str | None = None) -> bool:
        """Whether the buffer set aside still holds its bytes; if so it is this caller's again
        (counted under ``traffic``, by default the class `HostBufferPool.traffic` names), as
        from `acquire`. False: the pool gave its room to an acquire (the buffer is released)."""
        return self._pool._take_back(self, traffic)

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._tensor is None else f"at {self._tensor.data_ptr():#x}"
        return f"HostBuffer({self.nbytes} bytes, {state})"


class Reservation:
    """Bytes of a pool's budget held outside the pool (`HostBufferPool.reserve`) until `release`
    (idempotent)."""

    __slots__ = ("_pool", "nbytes")

    def __init__(self, pool: "HostBufferPool", nbytes: int):
        self._pool, self.nbytes = pool, nbytes

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with pool._locked():
                pool._reserved -= self.nbytes
                pool._cond.notify_all()


class HostBufferPool:
    """Aligned host buffers under a byte budget, from slabs registered with ``engine``.

    ``budget_bytes`` bounds the bytes of all slabs alive. A slab is ``slab_size`` bytes, or the
    request when larger, never past the budget. ``alignment`` (a power of two, at least the
    O_DIRECT alignment) applies to every buffer's address and to the bytes it takes. An
    `acquire` that finds no room waits up to ``timeout`` seconds for a release, then raises
    `PoolExhausted`. Thread-safe.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        engine=None,
        slab_size: int = 256 << 20,
        alignment: int = 4096,
        timeout: float = 60.0,
    ):
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"{budget_bytes=} must be a positive int")
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{alignment=} must be a positive power of two")
        if not isinstance(slab_size, int) or slab_size <= 0:
            raise ValueError(f"{slab_size=} must be a positive int")
        if timeout < 0:
            raise ValueError(f"{timeout=} must be >= 0")
        self.budget_bytes = budget_bytes
        self.engine = engine
        self.alignment = alignment
        self.slab_size = round_up(slab_size, alignment)
        self.timeout = float(timeout)
        self._slabs: list[_Slab] = []  # oldest first: buffers pack into old slabs, new ones empty out
        self._allocated = 0  # bytes of live slabs
        self._in_use = 0  # bytes taken by live buffers (rounded up to the alignment)
        self._buffers = 0
        self._peak = 0
        self._closed = False
        self._register_warned = False
        self._cond = threading.Condition(threading.Lock())
        # [Note: pool re-entrance] A forgotten buffer's finaliser can run in any thread at any
        # allocation, including in a thread that holds the pool lock (cyclic GC inside acquire).
        # That thread must not block on its own lock nor change the allocators mid-operation,
        # so it queues the extent in _pending, which the owner drains before it lets go.
        self._owner: int | None = None
        self._pending: deque[tuple[_Slab, int, int, str]] = deque()
        # [Note: buffers under I/O] A buffer released while the engine still runs a request on
        # its memory (one whose caller was interrupted before it held the future, or one it
        # gave up waiting for) is held here, still counted as in use, until those requests
        # end: handed out before, the request would overwrite the next owner's bytes.
        self._busy: list[tuple[_Slab, int, int, list]] = []  # (slab, offset, size, requests)
        self._label = threading.local()  # the traffic class `traffic` names for this thread
        self._by_traffic: dict[str, list[int]] = {}  # class -> [bytes held, peak]
        # Buffers set aside, the longest aside first: see [Note: buffers set aside].
        self._aside: dict[int, HostBuffer] = {}
        self._aside_bytes = 0
        self._reserved = 0  # bytes of the budget its users hold outside the pool (`reserve`)
        self._largest = 0  # the largest buffer taken so far (see [Note: buffers set aside])

    @contextmanager
    def traffic(self, name: str):
        """Count the buffers this thread acquires inside the block under traffic class ``name``
        (unless an `acquire` names its own)."""
        before = getattr(self._label, "name", OTHER)
        self._label.name = name
        try:
            yield
        finally:
            self._label.name = before

    def in_use_by(self, traffic: str) -> int:
        """Bytes held now by buffers counted under ``traffic``."""
        counts = self._by_traffic.get(traffic)
        return counts[0] if counts else 0

    # -- acquire / release --------------------------------------------------------------------
    def acquire(self, nbytes: int, timeout: float | None = None, *, traffic: str | None = None) -> HostBuffer:
        """A `HostBuffer` of ``nbytes`` (> 0), waiting up to ``timeout`` (default: the pool's),
        counted under ``traffic`` (default: the class `traffic` set for this thread, or "other")."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"{nbytes=} must be a positive int")
        self._check_open()
        size = round_up(nbytes, self.alignment)
        if size > self.budget_bytes:
            raise PoolExhausted(
                f"host buffer pool exhausted: asked for {human_size(nbytes)}, more than the whole budget of "
                f"{human_size(self.budget_bytes)}; raise memory.host_budget or use smaller buffers",
                **self._exhausted_figures(nbytes),
            )
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._locked():
            while True:
                self._check_open()
                placed = self._place(size)
                if placed is not None:
                    slab, offset = placed
                    self._in_use += size
                    self._buffers += 1
                    self._peak = max(self._peak, self._in_use)
                    self._largest = max(self._largest, size)
                    name = traffic or getattr(self._label, "name", OTHER)
                    counts = self._by_traffic.setdefault(name, [0, 0])
                    counts[0] += size
                    counts[1] = max(counts[1], counts[0])
                    return HostBuffer(self, slab, offset, size, nbytes, name)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._exhausted(nbytes, size, timeout)
                # A buffer under I/O comes back when its request ends, which no release
                # signals: look again every few milliseconds while there are any.
                self._wait(min(remaining, 0.005) if self._busy else remaining)

    def _place(self, size: int) -> tuple[_Slab, int] | None:
        while True:
            # While buffers are set aside, no slab grows into the bytes reserved: what is kept
            # gives way first (an acquire with none aside may, as before any was reserved).
            placed = self._place_free(size, self._reserved if self._aside else 0)
            if placed is not None or not self._aside:
                return placed
            self._reclaim(next(iter(self._aside.values())))  # the longest aside gives way first

    def _place_free(self, size: int, reserved: int = 0) -> tuple[_Slab, int] | None:
        if self._busy:
            self._reap_busy()
        for slab in self._slabs:
            if slab.allocator.largest_free >= size:
                return slab, slab.allocator.allocate(size)
        headroom = self._headroom(reserved)
        if headroom < size:
            # Empty slabs here are all too small for ``size``; dropping them (largest first)
            # may make room for a slab that is not.
            empty = sorted((s for s in self._slabs if s.allocator.used_bytes == 0), key=lambda s: -s.nbytes)
            if headroom + sum(s.nbytes for s in empty) < size:
                return None
            for slab in empty:
                if self._headroom(reserved) >= size:
                    break
                self._drop(slab)
        slab = self._new_slab(min(max(self.slab_size, size), self._headroom(reserved)))
        return slab, slab.allocator.allocate(size)

    def _headroom(self, reserved: int = 0) -> int:
        return max(0, self.budget_bytes - reserved - self._allocated) // self.alignment * self.alignment

    def reserve(self, nbytes: int) -> "Reservation":
        """Mark ``nbytes`` of the budget as host memory its taker holds outside the pool (the
        overlap's staged copies, which the engine's plan fits beside the pool): while buffers
        are set aside, no slab grows into them (what is kept gives way first), so keeping
        what no use needs never takes them. Acquires with nothing aside may still use the whole
        budget, as the plan's needs were checked against it. ``release()`` gives the mark back."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= self.budget_bytes:
            raise ValueError(f"{nbytes=} must be an int from 0 to the budget ({self.budget_bytes})")
        with self._locked():
            self._reserved += nbytes
        return Reservation(self, nbytes)

    def _new_slab(self, nbytes: int) -> _Slab:
        slab = _Slab(nbytes, self.alignment)
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
        self._allocated += nbytes
        logger.debug(
            "host buffer pool: new slab of %s (%s of %s budget)",
            human_size(nbytes), human_size(self._allocated), human_size(self.budget_bytes),
        )
        return slab

    def _drop(self, slab: _Slab) -> None:
        self._slabs.remove(slab)
        self._allocated -= slab.nbytes
        slab.alive = False
        if slab.registered and self.engine is not None and not self.engine.closed:
            self.engine.unregister_buffer(slab.tensor)
        slab.registered = False
        # Memory is unmapped when the last tensor over it dies: at once for an empty slab, later
        # for one dropped by close() while a buffer is still held.
        slab.tensor = slab.array = None

    def _give_back(self, slab: _Slab, offset: int, size: int, forgotten: bool, traffic: str = OTHER) -> None:
        if forgotten:
            warnings.warn(
                f"a host buffer of {human_size(size)} was never released; it returned to the pool when garbage collected",
                ResourceWarning,
                stacklevel=2,
            )
        if self._owner == threading.get_ident():  # see [Note: pool re-entrance]
            self._pending.append((slab, offset, size, traffic))
            return
        with self._locked():
            self._free(slab, offset, size, traffic)

    def _free(self, slab: _Slab, offset: int, size: int, traffic: str = OTHER) -> None:
        if not slab.alive:  # dropped by close(): nothing to return to
            return
        counts = self._by_traffic.get(traffic)
        if counts is not None:  # its taker let go (a buffer still under I/O stays in in_use_bytes)
            counts[0] -= size
        if self.engine is not None:
            running = self.engine.inflight(slab.address + offset, size)
            if running:  # see [Note: buffers under I/O]
                self._busy.append((slab, offset, size, running))
                return
        self._free_now(slab, offset, size)

    def _reap_busy(self) -> None:
        busy, self._busy = self._busy, []
        for slab, offset, size, running in busy:
            if not slab.alive:
                continue
            running = [r for r in running if not r.done()]
            if running:
                self._busy.append((slab, offset, size, running))
            else:
                self._free_now(slab, offset, size)

    def _free_now(self, slab: _Slab, offset: int, size: int) -> None:
        slab.allocator.free(offset, size)
        self._in_use -= size
        self._buffers -= 1
        self._cond.notify_all()

    # -- buffers set aside: see [Note: buffers set aside] --------------------------------------
    # [Note: buffers set aside]
    # A buffer whose bytes may be wanted again (the parameters a read or a write left in it:
    # infinity/_param_cache.py) can be set aside instead of released. Its bytes count as free
    # (not in `in_use_bytes` nor in any traffic class), but stay where they are: an `acquire`
    # that finds no other room takes the room of the buffers set aside, the longest aside
    # first, before it waits; `take_back` finds a buffer's bytes as they were, or False once
    # its room was taken. So setting aside never makes an acquire wait, and the budget bounds
    # the slabs as before. Kept buffers sit where their first use placed them, and buffers
    # taken around them leave the free room in pieces: near a budget's floor (1.7 MiB, 260 KiB
    # units) an acquire failed with 568 KiB free in pieces after every buffer aside was given
    # up, where the same run without them trained. So no buffer is set aside (it is released
    # instead) where the budget less what is reserved (`reserve`) holds fewer than
    # ASIDE_ROOM_BUFFERS of the largest buffer taken so far. (Half the room at most as well
    # kept 0.41 of the 106M model's 0.75 GB a step in nvme,cpu,cpu at 4GiB, where this alone
    # keeps all, and the helper's sweep of budgets trained the same without it.)
    def _set_aside(self, buffer: HostBuffer) -> bool:
        with self._locked():
            if id(buffer) in self._aside:
                return True
            if ASIDE_ROOM_BUFFERS * self._largest > self.budget_bytes - self._reserved:
                return False  # none in a pool a few buffers fill
            counts = self._by_traffic.get(buffer.traffic)
            if counts is not None:
                counts[0] -= buffer._size
            self._in_use -= buffer._size
            self._buffers -= 1
            self._aside[id(buffer)] = buffer
            self._aside_bytes += buffer._size
            self._cond.notify_all()  # an acquire that waits may take its room now
            return True

    def _take_back(self, buffer: HostBuffer, traffic: str | None) -> bool:
        with self._locked():
            if self._aside.pop(id(buffer), None) is None:
                return buffer._tensor is not None  # never set aside: it is the caller's still
            self._aside_bytes -= buffer._size
            self._in_use += buffer._size
            self._buffers += 1
            self._peak = max(self._peak, self._in_use)
            buffer.traffic = traffic or getattr(self._label, "name", OTHER)
            counts = self._by_traffic.setdefault(buffer.traffic, [0, 0])
            counts[0] += buffer._size
            counts[1] = max(counts[1], counts[0])
            return True

    def _drop_aside(self, buffer: HostBuffer) -> bool:
        """Release a buffer set aside (its room taken now); whether it was aside."""
        with self._locked():
            if id(buffer) not in self._aside:
                return False
            self._reclaim(buffer)
            return True

    def _reclaim(self, buffer: HostBuffer) -> None:
        del self._aside[id(buffer)]
        self._aside_bytes -= buffer._size
        buffer._finalizer.detach()
        buffer._tensor = None
        if buffer._slab.alive:
            buffer._slab.allocator.free(buffer._offset, buffer._size)
        self._cond.notify_all()

    @property
    def aside_bytes(self) -> int:
        """Bytes of the buffers set aside now (free to any acquire that needs them)."""
        return self._aside_bytes

    @contextmanager
    def _locked(self):
        with self._cond:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._drain()
                self._owner = None

    def _drain(self) -> None:
        while self._pending:
            self._free(*self._pending.popleft())

    def _wait(self, timeout: float) -> None:
        self._drain()
        # _owner stays set into the wait (a finaliser run by this thread before the lock is let
        # go must not block on it) and is set again after: another thread owned it meanwhile.
        self._cond.wait(timeout)
        self._owner = threading.get_ident()
        self._drain()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the host buffer pool is closed")

    def _exhausted_figures(self, nbytes: int) -> dict:
        free = self._allocated - self._in_use + self._headroom()
        return dict(asked=nbytes, budget=self.budget_bytes, held=self._in_use, buffers=self._buffers, free=free)

    def _exhausted(self, nbytes: int, size: int, timeout: float) -> PoolExhausted:
        figures = self._exhausted_figures(nbytes)
        how = "free but fragmented" if figures["free"] >= size else "free"
        return PoolExhausted(
            f"host buffer pool exhausted: asked for {human_size(nbytes)}, budget {human_size(self.budget_bytes)}, "
            f"{human_size(self._in_use)} held by {self._buffers} buffers, {human_size(figures['free'])} {how} "
            f"(waited {timeout:g} s for a release); raise memory.host_budget or lower prefetch",
            **figures,
        )

    # -- statistics and lifetime ------------------------------------------------------------------
    @property
    def in_use_bytes(self) -> int:
        """Bytes taken by buffers not yet released (each rounded up to the alignment)."""
        return self._in_use

    @property
    def peak_bytes(self) -> int:
        """The most `in_use_bytes` has been since the pool was made."""
        return self._peak

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the slabs alive: what the budget bounds."""
        return self._allocated

    def stats(self) -> dict:
        with self._locked():
            if self._busy:
                self._reap_busy()
            return {
                "budget_bytes": self.budget_bytes,
                "allocated_bytes": self._allocated,
                "in_use_bytes": self._in_use,
                "peak_bytes": self._peak,
                "buffers": self._buffers,
                "slabs": len(self._slabs),
                "registered_slabs": sum(s.registered for s in self._slabs),
                "largest_free": max((s.allocator.largest_free for s in self._slabs), default=0),
                "busy_buffers": len(self._busy),  # released, waiting for I/O on them to end
                "aside_bytes": self._aside_bytes,  # set aside: free, their bytes kept while no acquire needs them
                "reserved_bytes": self._reserved,  # the budget held outside the pool (`reserve`)
                "by_traffic": {k: {"in_use_bytes": v[0], "peak_bytes": v[1]} for k, v in sorted(self._by_traffic.items())},
            }

    def trim(self) -> int:
        """Drop the slabs that hold no buffer (the buffers set aside give their room up first);
        returns the bytes given back."""
        with self._locked():
            for buffer in list(self._aside.values()):
                self._reclaim(buffer)
            empty = [s for s in self._slabs if s.allocator.used_bytes == 0]
            for slab in empty:
                self._drop(slab)
            return sum(s.nbytes for s in empty)

    def close(self) -> None:
        """Drop every slab and unregister it from the engine; later acquires raise.

        Buffers still held stay valid memory until they are released or collected (their
        tensors keep the mapping alive), but no longer count against anything.
        """
        with self._locked():
            if self._closed:
                return
            self._closed = True
            for slab in list(self._slabs):
                self._drop(slab)
            # The memory of buffers under I/O stays mapped while the engine holds their
            # requests (each keeps its buffer alive until it is reaped).
            self._busy.clear()
            for buffer in list(self._aside.values()):
                self._reclaim(buffer)
            self._in_use = self._buffers = 0
            for counts in self._by_traffic.values():
                counts[0] = 0
            self._cond.notify_all()  # waiting acquires wake and raise

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "HostBufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostBufferPool(budget={human_size(self.budget_bytes)}, allocated={human_size(self._allocated)}, "
            f"in_use={human_size(self._in_use)} in {self._buffers} buffers, slabs={len(self._slabs)})"
        )
