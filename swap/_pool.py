"""The host buffer pool: every host buffer the engine uses, under one byte budget.

Every buffer that data passes through on its way between tiers comes from here: swap-in
targets, write-behind staging, optimizer sub-group buffers, gradients copied back from a GPU,
activation chunks and checkpoint streaming all `acquire` from a `HostBufferPool`, so
``memory.host_budget`` bounds them together and running out is a `PoolExhausted` that says
what holds the memory, never an OOM kill. What lives in host memory rather than passing through
is not a buffer and is not taken here: a cpu tier's tensors (pinned where there is a GPU),
activations on the cpu tier, and the early updates' staged copies (infinity/_overlap_host.py,
which the engine's plan fits beside the pool within the same budget).

The pool is three parts: this module's `HostBufferPool` (the budget's policy, its counts and
the wait), `_slabs.Slabs` (where the bytes are: slabs registered with the I/O engine, carved
into aligned extents) and `_aside.Aside` (buffers set aside, and the budget reserved beside
the pool).

Each buffer is counted under a traffic class, a name its taker gives (``acquire(...,
traffic=)``, or `HostBufferPool.traffic` around the code that acquires; "other" otherwise):
`stats` gives each class's bytes held and their peak, so what holds the budget is known by
purpose, not only in total. The pool counts; which class may take how much is its users'
policy (the engine's: infinity/_admission.py).
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections import deque
from contextlib import contextmanager

import torch

from ._aside import Aside
from ._common import human_size, round_up
from ._slabs import Slab, Slabs

__all__ = ["HostBuffer", "HostBufferPool", "PoolExhausted"]

OTHER = "other"  # the traffic class of a buffer whose taker named none


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


class HostBuffer:
    """``nbytes`` of aligned host memory lent by a `HostBufferPool`; give it back with `release`.

    ``tensor`` is a 1-D uint8 CPU tensor of exactly ``nbytes``; ``view(dtype, shape)`` a typed
    view of its start. After `release` (idempotent; also on leaving a ``with`` block) the bytes
    belong to the pool again and ``tensor`` raises; views taken before must not be used.
    A buffer that is never released returns to the pool when it and every tensor viewing its
    memory are garbage (with a ResourceWarning): a safety net, not the API.
    """

    __slots__ = ("_pool", "_slab", "_offset", "_size", "_tensor", "_finalizer", "nbytes", "traffic", "__weakref__")

    def __init__(self, pool: "HostBufferPool", slab: Slab, offset: int, size: int, nbytes: int, traffic: str = OTHER):
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
        pool = self._pool
        if pool._mutex._is_owned():  # see [Note: pool re-entrance]
            if self not in pool._aside:
                self._finalizer.detach()
                self._tensor = None
                pool._give_back(self._slab, self._offset, self._size, False, self.traffic)
            else:  # given up once the lock's owner is done with the buffers aside
                pool._pending.append(self)
            return
        # One locked section: a buffer aside whose room an acquire takes meanwhile is released
        # by that acquire (`Aside.reclaim`), and its extent, the acquirer's now, must not be freed here.
        with pool._locked():
            self._let_go()

    def _let_go(self) -> None:
        """`release` under the pool's lock."""
        if self._tensor is None:  # its room taken while it was aside
            return
        pool = self._pool
        if pool._aside.drop(self):  # aside: its bytes were free already
            return
        self._finalizer.detach()
        self._tensor = None
        pool._free(self._slab, self._offset, self._size, self.traffic)

    def set_aside(self) -> bool:
        """Give the bytes back to the pool but keep what they hold until the pool needs the room
        for an `acquire` ([Note: buffers set aside] in `_aside`): `take_back` then has them again as they
        were. The buffer must be in no I/O now, and nothing may use its tensor or views until
        `take_back` says yes. False: released instead (the pool keeps no more aside)."""
        if self._tensor is None:
            raise RuntimeError(f"this host buffer of {self.nbytes} bytes was released to its pool")
        pool = self._pool
        with pool._locked():
            if pool._aside.set(self):
                return True
        self.release()
        return False

    def take_back(self, traffic: str | None = None) -> bool:
        """Whether the buffer set aside still holds its bytes; if so it is this caller's again
        (counted under ``traffic``, by default the class `HostBufferPool.traffic` names), as
        from `acquire`. False: the pool gave its room to an acquire (the buffer is released)."""
        pool = self._pool
        with pool._locked():
            return pool._aside.take(self, traffic or pool._counts.label())

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
                pool._aside.reserved -= self.nbytes
                pool._cond.notify_all()


class _Counts:
    """What a pool's buffers hold: bytes and buffers taken, their peak, the largest buffer, and
    each traffic class's bytes and peak; the traffic class each thread names (`label`)."""

    def __init__(self):
        self.in_use = 0  # bytes taken by live buffers (rounded up to the alignment)
        self.buffers = 0
        self.peak = 0
        self.largest = 0  # the largest buffer taken so far (see [Note: buffers set aside] in `_aside`)
        self.by_traffic: dict[str, list[int]] = {}  # class -> [bytes held, peak]
        self._label = threading.local()  # the traffic class `HostBufferPool.traffic` names for this thread

    def label(self) -> str:
        return getattr(self._label, "name", OTHER)

    def take(self, size: int, traffic: str) -> None:
        self.in_use += size
        self.buffers += 1
        self.peak = max(self.peak, self.in_use)
        self.largest = max(self.largest, size)
        counts = self.by_traffic.setdefault(traffic, [0, 0])
        counts[0] += size
        counts[1] = max(counts[1], counts[0])

    def let_go(self, size: int, traffic: str) -> None:
        """Its taker let go of a buffer (which may stay in use while I/O runs on it: `freed`)."""
        counts = self.by_traffic.get(traffic)
        if counts is not None:
            counts[0] -= size

    def freed(self, size: int) -> None:
        self.in_use -= size
        self.buffers -= 1

    def give_back(self, size: int, traffic: str) -> None:
        self.let_go(size, traffic)
        self.freed(size)

    def clear(self) -> None:
        self.in_use = self.buffers = 0
        for counts in self.by_traffic.values():
            counts[0] = 0


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
        self._slabs = Slabs(budget_bytes, alignment, self.slab_size, engine)
        self._counts = _Counts()
        self._closed = False
        # Taken through the lock itself (`_locked`), not the condition: Condition.__enter__ is
        # Python, and a Ctrl-C as its acquire returned left the lock held for good, every later
        # release and acquire (a read's verify threads) waiting on it (an audit helper's hang).
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        # Buffers set aside, and the budget reserved beside the pool: [Note: buffers set aside] in `_aside`.
        self._aside = Aside(budget_bytes, self._counts, self._cond)
        # [Note: pool re-entrance] A forgotten buffer's finaliser can run in any thread at any
        # allocation, including in a thread that holds the pool lock (cyclic GC inside acquire).
        # That thread must not change the allocators mid-operation, so it queues the extent in
        # _pending, which the next locked section drains first (a section's end is the lock's
        # own: no Python runs there for a Ctrl-C to cut off), and a wait looks again often.
        self._pending: deque[tuple[Slab, int, int, str] | HostBuffer] = deque()

    @contextmanager
    def traffic(self, name: str):
        """Count the buffers this thread acquires inside the block under traffic class ``name``
        (unless an `acquire` names its own)."""
        label = self._counts._label
        before = getattr(label, "name", OTHER)
        label.name = name
        try:
            yield
        finally:
            label.name = before

    def in_use_by(self, traffic: str) -> int:
        """Bytes held now by buffers counted under ``traffic``."""
        counts = self._counts.by_traffic.get(traffic)
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
                **self._figures(nbytes),
            )
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._locked():
            while True:
                self._check_open()
                placed = self._place(size)
                if placed is not None:
                    slab, offset = placed
                    name = traffic or self._counts.label()
                    self._counts.take(size, name)
                    return HostBuffer(self, slab, offset, size, nbytes, name)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    figures = self._figures(nbytes)
                    how = "free but fragmented" if figures["free"] >= size else "free"
                    raise PoolExhausted(
                        f"host buffer pool exhausted: asked for {human_size(nbytes)}, budget "
                        f"{human_size(self.budget_bytes)}, {human_size(figures['held'])} held by {figures['buffers']} "
                        f"buffers, {human_size(figures['free'])} {how} (waited {timeout:g} s for a release); raise "
                        "memory.host_budget or lower prefetch",
                        **figures,
                    )
                # A buffer under I/O comes back when its request ends, which no release
                # signals: look again every few milliseconds while there are any.
                self._wait(min(remaining, 0.005) if self._slabs.busy else remaining)

    def _place(self, size: int) -> tuple[Slab, int] | None:
        self._reap()
        while True:
            # While buffers are set aside, no slab grows into the bytes reserved: what is kept
            # gives way first (an acquire with none aside may, as before any was reserved).
            placed = self._slabs.place(size, self._aside.reserved_now())
            if placed is not None or not self._aside.reclaim_oldest():  # the longest aside gives way first
                return placed

    def reserve(self, nbytes: int) -> "Reservation":
        """Mark ``nbytes`` of the budget as host memory its taker holds outside the pool (the
        overlap's staged copies, which the engine's plan fits beside the pool): while buffers
        are set aside, no slab grows into them (what is kept gives way first), so keeping
        what no use needs never takes them. Acquires with nothing aside may still use the whole
        budget, as the plan's needs were checked against it. ``release()`` gives the mark back."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= self.budget_bytes:
            raise ValueError(f"{nbytes=} must be an int from 0 to the budget ({self.budget_bytes})")
        with self._locked():
            self._aside.reserved += nbytes
        return Reservation(self, nbytes)

    def _give_back(self, slab: Slab, offset: int, size: int, forgotten: bool, traffic: str = OTHER) -> None:
        if forgotten:
            warnings.warn(
                f"a host buffer of {human_size(size)} was never released; it returned to the pool when garbage collected",
                ResourceWarning,
                stacklevel=2,
            )
        if self._mutex._is_owned():  # see [Note: pool re-entrance]
            self._pending.append((slab, offset, size, traffic))
            return
        with self._locked():
            self._free(slab, offset, size, traffic)

    def _free(self, slab: Slab, offset: int, size: int, traffic: str = OTHER) -> None:
        if not slab.alive:  # dropped by close(): nothing to return to
            return
        self._counts.let_go(size, traffic)  # (a buffer still under I/O stays in in_use_bytes)
        if self._slabs.free(slab, offset, size):
            self._counts.freed(size)
            self._cond.notify_all()

    def _reap(self) -> None:
        """Count the buffers back whose I/O has ended ([Note: buffers under I/O] in `_slabs`)."""
        for size in self._slabs.reap():
            self._counts.freed(size)
            self._cond.notify_all()

    @property
    def aside_bytes(self) -> int:
        """Bytes of the buffers set aside now (free to any acquire that needs them)."""
        return self._aside.bytes

    def _locked(self) -> threading.RLock:
        """The pool's lock, for a ``with``: its own enter and exit are C, so a Ctrl-C lands
        before the lock is taken or inside the block, never between (a generator's section, or
        threading.Condition's Python enter, left it held when one landed as the acquire
        returned, and the next release, a read's verify thread, waited for good: an audit
        helper's hang). What a section left in `_pending` is drained first ([Note: pool
        re-entrance])."""
        if self._pending and not self._mutex._is_owned():
            with self._mutex:
                self._drain()
        return self._mutex

    def _drain(self) -> None:
        while self._pending:
            entry = self._pending.popleft()
            if isinstance(entry, HostBuffer):  # a buffer aside released inside the lock
                entry._let_go()
            else:
                self._free(*entry)

    def _wait(self, timeout: float) -> None:
        self._drain()
        # (A finaliser this thread runs inside the wait before the lock is let go finds it owned
        # and queues.) Extents another section left queued wake no one: look again within 50 ms.
        self._cond.wait(min(timeout, 0.05))
        self._drain()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the host buffer pool is closed")

    def _figures(self, nbytes: int) -> dict:
        c = self._counts
        free = self._slabs.allocated - c.in_use + self._slabs.headroom()
        return dict(asked=nbytes, budget=self.budget_bytes, held=c.in_use, buffers=c.buffers, free=free)

    # -- statistics and lifetime ------------------------------------------------------------------
    @property
    def in_use_bytes(self) -> int:
        """Bytes taken by buffers not yet released (each rounded up to the alignment)."""
        self._locked()  # releases a section queued: counted now
        return self._counts.in_use

    @property
    def peak_bytes(self) -> int:
        """The most `in_use_bytes` has been since the pool was made."""
        return self._counts.peak

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the slabs alive: what the budget bounds."""
        return self._slabs.allocated

    def stats(self) -> dict:
        with self._locked():
            self._reap()
            c = self._counts
            return {
                "budget_bytes": self.budget_bytes,
                "allocated_bytes": self._slabs.allocated,
                "in_use_bytes": c.in_use,
                "peak_bytes": c.peak,
                "buffers": c.buffers,
                **self._slabs.stats(),  # slabs, registered_slabs, largest_free
                "busy_buffers": self._slabs.busy,  # released, waiting for I/O on them to end
                "aside_bytes": self._aside.bytes,  # set aside: free, their bytes kept while no acquire needs them
                "reserved_bytes": self._aside.reserved,  # the budget held outside the pool (`reserve`)
                "by_traffic": {k: {"in_use_bytes": v[0], "peak_bytes": v[1]} for k, v in sorted(c.by_traffic.items())},
            }

    def trim(self) -> int:
        """Drop the slabs that hold no buffer (the buffers set aside give their room up first);
        returns the bytes given back."""
        with self._locked():
            self._aside.reclaim_all()
            return self._slabs.drop_empty()

    def close(self) -> None:
        """Drop every slab and unregister it from the engine; later acquires raise.

        Buffers still held stay valid memory until they are released or collected (their
        tensors keep the mapping alive), but no longer count against anything.
        """
        with self._locked():
            if self._closed:
                return
            self._closed = True
            self._slabs.close()
            self._aside.reclaim_all()
            self._counts.clear()
            self._cond.notify_all()  # waiting acquires wake and raise

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "HostBufferPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self._counts
        return (
            f"HostBufferPool(budget={human_size(self.budget_bytes)}, allocated={human_size(self._slabs.allocated)}, "
            f"in_use={human_size(c.in_use)} in {c.buffers} buffers, slabs={len(self._slabs)})"
        )
