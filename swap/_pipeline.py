"""Read ahead, compute, write behind: the loop the optimizer and parameter swappers run.

    for item in stream(space, names, ahead=2):
        adam_step(item.tensor)        # in place, on a host buffer from the pool

While the caller computes on item i, items i+1..i+ahead are being read and item i-1 written
back, so the loop runs at the speed of the slower of the disk and the compute. At most
``ahead + 2`` items' pool buffers are held at once (the reads in flight, the item in hand, the write
behind). A write-behind error is raised by the next step of the loop (or by its end), never
lost.

Reading ahead never waits for pool memory: a read ahead that finds no room now (the budget
is spoken for, or free only in pieces too small) is issued later, when the loop comes back
for more. Only the read of the next item, when none is in flight, waits for room (the
write-behinds give theirs back as they finish). So a tight or fragmented pool costs overlap,
never a `PoolExhausted` for what other reads ahead of it hold.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ._manifest import DTYPES
from ._common import ALIGNMENT, round_up
from ._pool import HostBuffer, PoolExhausted
from ._space import SwapFuture, SwapSpace
from ._writes import WriteBehind


@dataclass(frozen=True, slots=True)
class Joined:
    """Several tensors of one dtype read into one buffer and written back from it: ``names[i]``
    lies at element ``starts[i]`` of a flat tensor of ``numel`` elements (the gaps are left as
    they are). An entry of `stream` may hold one in place of a name: its item's tensor is that
    flat tensor. Starts that are multiples of ``ALIGNMENT`` bytes keep the transfers direct."""

    names: tuple[str, ...]
    starts: tuple[int, ...]
    numel: int
    dtype: torch.dtype

    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class JoinedRead:
    """The reads of a `Joined` into one pool buffer: ``result()`` is the buffer once all are done."""

    def __init__(self, space: SwapSpace, joined: Joined, timeout):
        self.buffer = space.pool.acquire(max(round_up(joined.nbytes()), ALIGNMENT), timeout=timeout)
        self.futures = []
        flat = self.buffer.tensor[: joined.nbytes()].view(joined.dtype)
        try:
            for name, start in zip(joined.names, joined.starts):
                shape = space.info(name).shape
                n = math.prod(shape)
                self.futures.append(space.get(name, out=flat[start : start + n].view(shape)))
        except BaseException:
            for fut in self.futures:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - nothing reads it
                    pass
            self.buffer.release()
            raise

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> HostBuffer:
        error = None
        for fut in self.futures:
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - every read finishes before the buffer goes back
                error = error or e
        if error is not None:
            self.buffer.release()
            raise error
        return self.buffer


@dataclass(slots=True)
class Item:
    """One streamed item: a name, or a tuple of names that travel together (an optimizer
    sub-group's master weights and moments). ``tensors`` are typed views of ``buffers`` (pool
    buffers), one per name; ``tensor`` is the first."""

    name: str | tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    buffers: tuple[HostBuffer, ...]
    write_back: bool = True  # set False to skip writing this item back
    # Writes the caller started from these buffers (futures): the buffers go back to the pool
    # only once these are done too, whether or not the item itself is written back.
    after: list = field(default_factory=list)

    @property
    def tensor(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def buffer(self) -> HostBuffer:
        return self.buffers[0]


def stream(
    space: SwapSpace, names: Sequence[str | tuple[str, ...]], *, ahead: int = 1, write_back: bool = True,
    ahead_bytes: int | None = None,
) -> Iterator[Item]:
    """Yield each of ``names`` (a name, or a tuple of names read and written together) from
    ``space`` in order, reading ``ahead`` items ahead (and, with ``ahead_bytes``, only as many
    of those as hold that many bytes together, but always the next one) and writing each item
    back (when ``write_back`` and the item's own flag allow) after the caller is done with it.
    Leaving the loop early still finishes what is in flight."""
    if ahead < 0:
        raise ValueError(f"{ahead=} must be >= 0")
    names = list(names)
    for entry in names:
        for member in _members(entry):
            for name in member.names if isinstance(member, Joined) else (member,):
                space.info(name)  # unknown names fail before any I/O
    reads = _Reads(space, names, ahead_bytes)
    writes = WriteBehind(1)  # item i-1 may still be on its way out while the caller has item i
    item = None
    try:
        reads.more(ahead + 1)  # items 0 .. ahead, as many as have room
        for _ in range(len(names)):
            item = reads.next()
            writes.poll(keep=1)  # i-2 is done before i is handed out
            reads.more(ahead)  # items i+1 .. i+ahead
            yield item
            done, item = item, None
            if write_back and done.write_back:
                _write_back(space, done, writes)
            elif done.after:
                writes.add(done.after, *done.buffers)
            else:
                _release(done.buffers)
    finally:
        # Whatever happened, nothing stays in flight and every buffer goes back to the pool.
        errors = []
        if item is not None:
            if item.after:  # the caller's writes from it still read its buffers
                try:
                    writes.add(item.after, *item.buffers)  # tracked even if this raises
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
            else:
                _release(item.buffers)
        try:
            reads.drop()
        except Exception as e:  # noqa: BLE001 - reported below unless another error is
            errors.append(e)
        try:
            writes.drain()  # every write finishes before its buffer goes back to the pool
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        if errors:
            raise errors[0]


class _Reads:
    """The reads issued ahead of the caller, oldest first."""

    def __init__(self, space: SwapSpace, names: list, limit_bytes: int | None = None):
        self.space, self.names = space, names
        self.queue: collections.deque[tuple[str | tuple, list[SwapFuture]]] = collections.deque()
        self.issued = 0
        self.limit_bytes = limit_bytes
        self.sizes = [sum(_nbytes(space, m) for m in _members(e)) for e in names] if limit_bytes else None

    def more(self, limit: int) -> None:
        """Issue reads until ``limit`` are in flight (or every name is read), and (with
        ``limit_bytes``) while those in flight fit in it, but at least one; while the pool has
        room for them now (see the module's docstring)."""
        while self.issued < len(self.names) and len(self.queue) < limit:
            if self.queue and self.sizes is not None:
                held = sum(self.sizes[self.issued - len(self.queue) : self.issued])
                if held + self.sizes[self.issued] > self.limit_bytes:
                    return
            if not self._issue(wait=False):
                return

    def _issue(self, wait: bool) -> bool:
        """Issue the reads of the next entry; without ``wait``, only if the pool has room for
        all of them now (False, and nothing issued, if not)."""
        entry = self.names[self.issued]
        futures = []
        try:
            for n in _members(entry):
                timeout = None if wait else 0
                futures.append(JoinedRead(self.space, n, timeout) if isinstance(n, Joined)
                               else self.space.get(n, timeout=timeout))  # fmt: skip
        except PoolExhausted:
            _settle_and_release(futures)
            if wait:
                raise
            return False
        except BaseException:
            _settle_and_release(futures)
            raise
        self.queue.append((entry, futures))
        self.issued += 1
        return True

    def next(self) -> Item:
        """The oldest read, waited for, as an item of typed views of its buffers (issued now,
        waiting for pool memory, if none is in flight)."""
        if not self.queue:
            self._issue(wait=True)
        entry, futures = self.queue.popleft()
        buffers = []
        try:
            for fut in futures:
                buffers.append(fut.result())
        except BaseException:
            _release(buffers)
            _settle_and_release(futures[len(buffers) + 1 :])  # the first error is propagating
            raise
        views = tuple(_view(self.space, b, m) for b, m in zip(buffers, _members(entry)))
        return Item(entry, views, tuple(buffers))

    def drop(self) -> None:
        """Wait for the reads still in flight and give their buffers back (first error raised)."""
        error = None
        while self.queue:
            _, futures = self.queue.popleft()
            for fut in futures:
                try:
                    fut.result().release()
                except Exception as e:  # noqa: BLE001
                    error = error or e
        if error is not None:
            raise error


def _write_back(space: SwapSpace, item: Item, writes: WriteBehind) -> None:
    """Write ``item``'s tensors back under their names, behind the caller; its buffers go back
    to the pool once the writes (and ``item.after``) are done."""
    futures = []
    try:
        for tensor, member in zip(item.tensors, _members(item.name)):
            if isinstance(member, Joined):
                for name, start in zip(member.names, member.starts):
                    shape = space.info(name).shape
                    futures.append(space.put(name, tensor[start : start + math.prod(shape)].view(shape)))
            else:
                futures.append(space.put(member, tensor))
    finally:
        # Also when a put could not start: what did start, and the caller's writes, still read
        # the buffers (held until then; the buffers of writes that did not start with them).
        writes.add([*futures, *item.after], *item.buffers)


def _settle_and_release(futures) -> None:
    """Wait for reads that will not be used and give their buffers back (errors dropped: they
    read nothing anyone needs)."""
    for fut in futures:
        try:
            fut.result().release()
        except Exception:  # noqa: BLE001
            pass


def _release(buffers) -> None:
    for buffer in buffers:
        buffer.release()


def _members(entry) -> tuple:
    return (entry,) if isinstance(entry, (str, Joined)) else tuple(entry)


def _nbytes(space: SwapSpace, member) -> int:
    return member.nbytes() if isinstance(member, Joined) else space.info(member).nbytes


def _view(space: SwapSpace, buffer: HostBuffer, member) -> torch.Tensor:
    """The typed tensor of ``member`` in ``buffer``."""
    if isinstance(member, Joined):
        return buffer.tensor[: member.nbytes()].view(member.dtype)
    record = space.info(member)
    return buffer.view(DTYPES[record.dtype], record.shape)
