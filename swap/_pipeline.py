"""Read ahead, compute, write behind: the loop the optimizer and parameter swappers run.

    for item in stream(space, names, ahead=2):
        adam_step(item.tensor)        # in place, on a host buffer from the pool

While the caller computes on item i, items i+1..i+ahead are being read and item i-1 written
back, so the loop runs at the speed of the slower of the disk and the compute. At most
``ahead + 2`` pool buffers are held at once (the reads in flight, the item in hand, the write
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
    """One streamed tensor: ``tensor`` is a typed view of ``buffer`` (a pool buffer)."""

    name: str
    tensor: torch.Tensor
    buffer: HostBuffer
    write_back: bool = True  # set False to skip writing this item back


def stream(
    space: SwapSpace, names: Sequence[str], *, ahead: int = 1, write_back: bool = True
) -> Iterator[Item]:
    """Yield each of ``names`` from ``space`` in order, reading ``ahead`` items ahead and
    writing each item back (when ``write_back`` and the item's own flag allow) after the
    caller is done with it. Leaving the loop early still finishes what is in flight."""
    if ahead < 0:
        raise ValueError(f"{ahead=} must be >= 0")
    names = list(names)
    for name in names:
        space.info(name)  # unknown names fail before any I/O
    reads: collections.deque[tuple[str, SwapFuture]] = collections.deque()
    writes: collections.deque[tuple[HostBuffer, SwapFuture]] = collections.deque()
    next_read = 0
    in_hand: HostBuffer | None = None  # the item the caller holds, if the loop stops there

    def read_more(limit: int) -> None:
        nonlocal next_read
        while next_read < len(names) and len(reads) < limit:
            reads.append((names[next_read], space.get(names[next_read])))
            next_read += 1

    def finish_writes(keep: int) -> None:
        """Finish the writes that are done, and wait for the oldest until ``keep`` remain."""
        while writes and (len(writes) > keep or writes[0][1].done()):
            buffer, fut = writes.popleft()
            try:
                fut.result()  # a write-behind error surfaces here, one step later at most
            finally:
                buffer.release()

    try:
        read_more(ahead + 1)  # items 0 .. ahead
        for _ in range(len(names)):
            name, fut = reads.popleft()
            buffer = in_hand = fut.result()
            record = space.info(name)
            item = Item(name, buffer.view(DTYPES[record.dtype], record.shape), buffer)
            finish_writes(keep=1)  # item i-1 may still be on its way out; i-2 is done first
            read_more(ahead)  # items i+1 .. i+ahead
            yield item
            in_hand = None
            if write_back and item.write_back:
                try:
                    writes.append((buffer, space.put(name, item.tensor, checksum=record.checksum is not None or None)))
                except BaseException:
                    buffer.release()
                    raise
            else:
                buffer.release()
    finally:
        # Whatever happened, nothing stays in flight and every buffer goes back to the pool.
        errors = []
        if in_hand is not None:
            in_hand.release()
        while reads:
            _, fut = reads.popleft()
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
