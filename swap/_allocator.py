"""Best-fit allocation of aligned extents inside one growable address space.

An `ExtentAllocator` manages the byte range ``[0, capacity)`` of one arena: a swap file (whose
size is the capacity) or a host-memory slab (which never grows). It knows offsets and lengths
only; the owner does the I/O and sizes the file.

Growth: when no free extent fits a request and growth is allowed, `allocate` raises the
capacity. The allocator does not touch the file: the owner (SwapSpace) compares `capacity`
before and after `allocate`, `reserve` or `grow_to` and extends (fallocates) the file to the new
capacity before it writes into the extent. Shrinking is never done here.

Not thread-safe: the owner holds its own lock around every call.

[Note: a Ctrl-C inside the indexes]
Four indexes describe the free extents (by start, by end, by size, the used ones); a
KeyboardInterrupt between two of their updates (Python raises it between any two bytecodes)
left them out of step: a later call raised KeyError or IndexError, or could hand out an
extent overlapping one in use, two live buffers sharing memory (an audit helper's sweep over
every line of `allocate` and `free`). Each change runs with SIGINT held back (`infinity._interrupts.held_interrupts`)
and delivered at its end.
"""

from __future__ import annotations

import bisect

from infinity._interrupts import held_interrupts

from ._common import round_up

__all__ = ["ExtentAllocator", "OutOfSpace"]


class OutOfSpace(RuntimeError):
    """An extent cannot be placed: growth is disabled (grow_step=0) or max_capacity is reached.

    Attributes say why: ``requested`` (bytes asked, rounded up to the alignment), ``capacity``,
    ``free_bytes`` and ``largest_free`` at the time of the request.
    """

    def __init__(self, message: str, *, requested: int, capacity: int, free_bytes: int, largest_free: int):
        super().__init__(message)
        self.requested = requested
        self.capacity = capacity
        self.free_bytes = free_bytes
        self.largest_free = largest_free


def _check_int(name: str, value, *, minimum: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


class ExtentAllocator:
    """Aligned extents in ``[0, capacity)``, placed best-fit, freed with coalescing.

    ``alignment`` (a power of two) applies to every offset and length: requests are rounded up
    to it. ``grow_step`` (a multiple of the alignment; 0 = never grow) is the least amount by
    which the capacity grows when a request does not fit; with ``grow_floor`` the step is
    instead the capacity itself (doubling), at least ``grow_floor`` and at most ``grow_step``, so
    a small arena stays small. ``max_capacity`` (None = unbounded) caps growth. Best fit takes the smallest free extent that holds the request, the lowest
    offset among equals, and places the request at that extent's start, so that what is freed
    and asked for again in the same sizes lands where it was and the space does not creep.
    """

    def __init__(
        self,
        alignment: int = 4096,
        grow_step: int = 1 << 30,
        capacity: int = 0,
        max_capacity: int | None = None,
        grow_floor: int | None = None,
    ):
        _check_int("alignment", alignment, minimum=1)
        if alignment & (alignment - 1):
            raise ValueError(f"{alignment=} must be a power of two")
        _check_int("grow_step", grow_step)
        _check_int("capacity", capacity)
        for name, value in (("grow_step", grow_step), ("capacity", capacity)):
            if value % alignment:
                raise ValueError(f"{name}={value} is not a multiple of {alignment=}")
        if max_capacity is not None:
            _check_int("max_capacity", max_capacity)
            if max_capacity % alignment:
                raise ValueError(f"{max_capacity=} is not a multiple of {alignment=}")
            if max_capacity < capacity:
                raise ValueError(f"{max_capacity=} is below {capacity=}")
        if grow_floor is not None:
            _check_int("grow_floor", grow_floor, minimum=1)
            if grow_floor % alignment:
                raise ValueError(f"{grow_floor=} is not a multiple of {alignment=}")
        self.alignment = alignment
        self.grow_step = grow_step
        self.grow_floor = grow_floor
        self.max_capacity = max_capacity
        self._capacity = 0
        # Free extents four ways: by start and by end (O(1) neighbour lookup when coalescing),
        # sorted starts (bisect for the extent holding an offset) and sorted (size, start) pairs
        # (bisect for best fit). List inserts and deletes are memmoves: fast at any size here.
        self._free_start: dict[int, int] = {}  # start -> end
        self._free_end: dict[int, int] = {}  # end -> start
        self._starts: list[int] = []  # sorted keys of _free_start
        self._by_size: list[tuple[int, int]] = []  # sorted (size, start)
        self._free_total = 0
        self._used: dict[int, int] = {}  # start -> size, of every allocated or reserved extent
        self._used_total = 0
        if capacity:
            self.grow_to(capacity)

    # -- queries ------------------------------------------------------------------------------
    def round_up(self, nbytes: int) -> int:
        """``nbytes`` rounded up to this allocator's alignment: the length an extent takes."""
        return round_up(nbytes, self.alignment)

    @property
    def capacity(self) -> int:
        """Bytes managed: the arena's size. Grows by `allocate`, `reserve` and `grow_to`."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used_total

    @property
    def free_bytes(self) -> int:
        return self._free_total

    @property
    def largest_free(self) -> int:
        """Length of the largest free extent (0 when there is none)."""
        return self._by_size[-1][0] if self._by_size else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """Free extents as sorted ``(offset, nbytes)`` pairs."""
        return sorted((start, end - start) for start, end in self._free_start.items())

    def used_extents(self) -> list[tuple[int, int]]:
        """Allocated and reserved extents as sorted ``(offset, nbytes)`` pairs."""
        return sorted(self._used.items())

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(capacity={self._capacity}, used={self._used_total} in {len(self._used)} extents, "
            f"free={self._free_total} in {len(self._free_start)} extents, alignment={self.alignment}, "
            f"grow_step={self.grow_step}, max_capacity={self.max_capacity})"
        )

    # -- operations -----------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> int:
        """Place ``round_up(nbytes)`` bytes and return their offset; may grow the capacity.

        Raises `OutOfSpace` when nothing fits and the capacity cannot grow enough, and
        ``ValueError`` for ``nbytes <= 0`` (an empty tensor needs no extent).
        """
        _check_int("nbytes", nbytes, minimum=1)
        size = self.round_up(nbytes)
        with held_interrupts:  # see [Note: a Ctrl-C inside the indexes]
            i = bisect.bisect_left(self._by_size, (size, -1))
            if i == len(self._by_size):
                self._grow_for(size)
                i = bisect.bisect_left(self._by_size, (size, -1))
            _, start = self._by_size[i]
            self._take(start, start + size)
        return start

    def _grow_for(self, size: int) -> None:
        # The free extent touching the end, if any, is extended rather than left behind, so a
        # growth is never more than the request's shortfall + grow_step.
        tail = self._free_end.get(self._capacity, self._capacity)
        needed = tail + size
        step = self.grow_step
        if self.grow_floor is not None:
            step = min(step, max(self.grow_floor, self._capacity))
        new = max(self._capacity + step, needed)
        if self.max_capacity is not None:
            new = min(new, self.max_capacity)
        if self.grow_step == 0 or new < needed:
            why = (
                "growth is disabled (grow_step=0)"
                if self.grow_step == 0
                else f"growing past max_capacity={self.max_capacity} is not allowed (needs {needed})"
            )
            raise OutOfSpace(
                f"cannot allocate {size} bytes: capacity {self._capacity}, {self._free_total} bytes free, "
                f"largest free extent {self.largest_free} bytes; {why}",
                requested=size,
                capacity=self._capacity,
                free_bytes=self._free_total,
                largest_free=self.largest_free,
            )
        self.grow_to(new)

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent at ``offset`` that was allocated (or reserved) with ``nbytes``.

        The extent must be exactly one that is in use: a double free, a free of part of an
        extent, one out of range or misaligned raises ``ValueError`` and changes nothing.
        """
        _check_int("offset", offset)
        _check_int("nbytes", nbytes, minimum=1)
        size = self.round_up(nbytes)
        where = f"free({offset=}, {nbytes=})"
        if offset % self.alignment:
            raise ValueError(f"{where}: offset is not a multiple of alignment={self.alignment}")
        if offset + size > self._capacity:
            raise ValueError(f"{where}: extent ends at {offset + size}, past capacity={self._capacity}")
        used = self._used.get(offset)
        if used is None:
            hit = self._free_containing(offset)
            if hit is not None:
                raise ValueError(f"{where}: offset lies in free extent [{hit[0]}, {hit[1]}) (double free?)")
            inside = self._used_overlapping(offset, offset + 1)
            raise ValueError(
                f"{where}: no extent in use starts at this offset"
                + (f"; it lies inside the extent in use {inside}" if inside else "")
            )
        if used != size:
            raise ValueError(f"{where}: the extent in use at this offset is {used} bytes, not {size}")
        with held_interrupts:
            del self._used[offset]
            self._used_total -= size
            self._add_free(offset, offset + size)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark ``[offset, offset + round_up(nbytes))`` in use, e.g. an extent a manifest records.

        Grows the capacity to cover the extent when it lies past the end (regardless of
        grow_step, within max_capacity). Overlap with an extent in use raises ``ValueError``.
        """
        _check_int("offset", offset)
        _check_int("nbytes", nbytes, minimum=1)
        size = self.round_up(nbytes)
        end = offset + size
        where = f"reserve({offset=}, {nbytes=})"
        if offset % self.alignment:
            raise ValueError(f"{where}: offset is not a multiple of alignment={self.alignment}")
        if offset < self._capacity:
            # Inside the arena, the extent must lie in one free extent (the tail one, when it
            # runs past the end).
            hit = self._free_containing(offset)
            if hit is None or hit[1] < min(end, self._capacity):
                    raise ValueError(f"{where}: overlaps the extent in use {self._used_overlapping(offset, end)}")
        with held_interrupts:
            if end > self._capacity:
                self.grow_to(end)
            self._take(offset, end)

    def grow_to(self, capacity: int) -> None:
        """Raise the capacity to ``capacity`` (a multiple of the alignment); the new space is free."""
        _check_int("capacity", capacity)
        if capacity % self.alignment:
            raise ValueError(f"{capacity=} is not a multiple of alignment={self.alignment}")
        if capacity < self._capacity:
            raise ValueError(f"{capacity=} is below the current capacity {self._capacity}; extents never shrink it")
        if self.max_capacity is not None and capacity > self.max_capacity:
            raise OutOfSpace(
                f"cannot grow to capacity {capacity}: max_capacity is {self.max_capacity} "
                f"({self._free_total} bytes free, largest free extent {self.largest_free} bytes)",
                requested=capacity - self._capacity,
                capacity=self._capacity,
                free_bytes=self._free_total,
                largest_free=self.largest_free,
            )
        if capacity == self._capacity:
            return
        with held_interrupts:
            old, self._capacity = self._capacity, capacity
            self._add_free(old, capacity)

    # -- free-extent bookkeeping ------------------------------------------------------------------
    def _insert_free(self, start: int, end: int) -> None:
        self._free_start[start] = end
        self._free_end[end] = start
        bisect.insort(self._by_size, (end - start, start))
        bisect.insort(self._starts, start)
        self._free_total += end - start

    def _remove_free(self, start: int) -> int:
        end = self._free_start.pop(start)
        del self._free_end[end]
        entry = (end - start, start)
        i = bisect.bisect_left(self._by_size, entry)
        del self._by_size[i]
        del self._starts[bisect.bisect_left(self._starts, start)]
        self._free_total -= end - start
        return end

    def _add_free(self, start: int, end: int) -> None:
        """Insert ``[start, end)`` as free, merged with the free extents on either side."""
        if end in self._free_start:
            end = self._remove_free(end)
        left = self._free_end.get(start)
        if left is not None:
            self._remove_free(left)
            start = left
        self._insert_free(start, end)

    def _take(self, start: int, end: int) -> None:
        """Mark ``[start, end)``, which lies inside one free extent, as used."""
        fstart, fend = self._free_containing(start)
        self._remove_free(fstart)
        if fstart < start:
            self._insert_free(fstart, start)
        if end < fend:
            self._insert_free(end, fend)
        self._used[start] = end - start
        self._used_total += end - start

    def _free_containing(self, offset: int) -> tuple[int, int] | None:
        """The free extent ``(start, end)`` holding ``offset``, or None."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return None
        start = self._starts[i]
        end = self._free_start[start]
        return (start, end) if offset < end else None

    def _used_overlapping(self, start: int, end: int) -> tuple[int, int] | None:
        # O(#used); error messages only.
        for ustart, usize in sorted(self._used.items()):
            if ustart < end and start < ustart + usize:
                return ustart, usize
        return None
