"""Read ahead, compute, write behind: the loop the optimizer and parameter swappers run.

    for item in stream(space, names, ahead=2):
        adam_step(item.tensor)        # in place, on a host buffer from the pool

While the caller computes on item i, items i+1..i+ahead are being read and item i-1 written
back, so the loop runs at the speed of the slower of the disk and the compute. At most
``ahead + 2`` items' pool buffers are held at once (the reads in flight, the item in hand, the write
behind). A write-behind error is raised by the next step of the loop (or by its end), never
lost.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ._manifest import DTYPES
from ._pool import HostBuffer
from ._space import SwapFuture, SwapSpace


@dataclass(slots=True)
class Item:
    """One streamed item: a name, or a tuple of names that travel together (an optimizer
    sub-group's master weights and moments). ``tensors`` are typed views of ``buffers`` (pool
    buffers), one per name; ``tensor`` is the first."""

    name: str | tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    buffers: tuple[HostBuffer, ...]
    write_back: bool = True  # set False to skip writing this item back

    @property
    def tensor(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def buffer(self) -> HostBuffer:
        return self.buffers[0]


def stream(
    space: SwapSpace, names: Sequence[str | tuple[str, ...]], *, ahead: int = 1, write_back: bool = True
) -> Iterator[Item]:
    """Yield each of ``names`` (a name, or a tuple of names read and written together) from
    ``space`` in order, reading ``ahead`` items ahead and
    writing each item back (when ``write_back`` and the item's own flag allow) after the
    caller is done with it. Leaving the loop early still finishes what is in flight."""
    if ahead < 0:
        raise ValueError(f"{ahead=} must be >= 0")
    names = list(names)
    for entry in names:
        for name in _members(entry):
            space.info(name)  # unknown names fail before any I/O
    reads: collections.deque[tuple[str | tuple, list[SwapFuture]]] = collections.deque()
    writes: collections.deque[list[tuple[HostBuffer, SwapFuture]]] = collections.deque()
    next_read = 0
    in_hand: list[HostBuffer] = []  # the item the caller holds, if the loop stops there

    def read_more(limit: int) -> None:
        nonlocal next_read
        while next_read < len(names) and len(reads) < limit:
            entry = names[next_read]
            reads.append((entry, [space.get(n) for n in _members(entry)]))
            next_read += 1

    def finish_writes(keep: int) -> None:
        """Finish the writes that are done, and wait for the oldest until ``keep`` remain."""
        while writes and (len(writes) > keep or all(f.done() for _, f in writes[0])):
            group = writes.popleft()
            try:
                for _, fut in group:
                    fut.result()  # a write-behind error surfaces here, one step later at most
            finally:
                for buffer, _ in group:
                    buffer.release()

    try:
        read_more(ahead + 1)  # items 0 .. ahead
        for _ in range(len(names)):
            entry, futures = reads.popleft()
            in_hand = []
            for fut in futures:
                in_hand.append(fut.result())
            records = [space.info(n) for n in _members(entry)]
            views = tuple(b.view(DTYPES[r.dtype], r.shape) for b, r in zip(in_hand, records))
            item = Item(entry, views, tuple(in_hand))
            finish_writes(keep=1)  # item i-1 may still be on its way out; i-2 is done first
            read_more(ahead)  # items i+1 .. i+ahead
            yield item
            buffers, in_hand = in_hand, []
            if write_back and item.write_back:
                group = []
                try:
                    for buffer, record, tensor in zip(buffers, records, views):
                        checksum = record.checksum is not None or None
                        group.append((buffer, space.put(record.name, tensor, checksum=checksum)))
                except BaseException:
                    for buffer in buffers[len(group) :]:
                        buffer.release()
                    raise
                finally:
                    if group:
                        writes.append(group)
            else:
                for buffer in buffers:
                    buffer.release()
    finally:
        # Whatever happened, nothing stays in flight and every buffer goes back to the pool.
        errors = []
        for buffer in in_hand:
            buffer.release()
        while reads:
            _, futures = reads.popleft()
            for fut in futures:
                try:
                    fut.result().release()
                except Exception as e:  # noqa: BLE001 - reported below unless another error is
                    errors.append(e)
        while writes:  # every write finishes before its buffer goes back to the pool
            try:
                finish_writes(keep=0)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]


def _members(entry: str | tuple[str, ...]) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry)
