"""`WriteBehind`: writes left in flight while the caller goes on, bounded, never lost.

Every place that writes from a host buffer and moves on (gradients, new parameters, optimizer
state streamed back, checkpoint saves and loads) uses one of these:

    writes = WriteBehind(limit=2)
    writes.add(space.put(name, tensor), buffer)   # waits for the oldest beyond ``limit``
    ...
    writes.drain()                                # every write finished; the first error raised

Each write holds the buffers it writes from (anything with ``release()``: a pool buffer, a
store lease) until it has completed; then they go back, whether the write succeeded or not.
An error is raised by the call that finishes its write (the next `add` beyond the limit,
`settle`, `poll` or `drain`), never dropped. `drain` finishes every write, also after an
error, so no buffer is left in flight. An interrupt (KeyboardInterrupt) while a write is waited
for leaves it tracked, its buffers held: the next call that finishes writes finishes it.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from typing import Protocol


class _Future(Protocol):
    def done(self) -> bool: ...
    def result(self): ...


class _Releasable(Protocol):
    def release(self) -> None: ...


class WriteBehind:
    """At most ``limit`` writes in flight (``limit=0``: each `add` waits for its write)."""

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 0:
            raise ValueError(f"{limit=} must be an int >= 0")
        self.limit = limit
        # key -> (futures, buffers), oldest first; a key is given or made up
        self._queue: collections.OrderedDict[Hashable, tuple[list[_Future], list[_Releasable]]] = (
            collections.OrderedDict()
        )
        self._count = 0

    def add(self, futures: _Future | Iterable[_Future], *buffers: _Releasable, key: Hashable | None = None) -> None:
        """Track ``futures`` (one write, or several that travel together) and hold ``buffers``
        until they complete; then finish the writes that are done and the oldest beyond
        ``limit``. A write already in flight under ``key`` is finished first (the new one
        replaces it)."""
        futures = [futures] if hasattr(futures, "result") else list(futures)
        if key is None:
            key = self._new_key()
        elif key in self._queue:
            try:
                self.settle(key)
            except BaseException:
                # The new write is in flight already: tracked (under a key of its own if the old
                # one is still there after an interrupt), its buffers held until it completes.
                self._queue[key if key not in self._queue else self._new_key()] = (futures, list(buffers))
                raise
        self._queue[key] = (futures, list(buffers))
        self.poll(keep=self.limit)

    def _new_key(self) -> Hashable:
        self._count += 1
        return ("#", self._count - 1)

    def settle(self, key: Hashable) -> None:
        """Finish the write under ``key`` if one is in flight (raising its error)."""
        if key in self._queue:
            self._finish(key)

    def poll(self, keep: int | None = None) -> None:
        """Finish, oldest first, the writes that are done; with ``keep``, also wait for the
        oldest until at most ``keep`` remain in flight."""
        while self._queue:
            oldest = next(iter(self._queue))
            futures, _ = self._queue[oldest]
            if (keep is None or len(self._queue) <= keep) and not all(f.done() for f in futures):
                return
            self._finish(oldest)

    def drain(self) -> None:
        """Finish every write; raise the first error once all have finished (an interrupt at
        once, the writes not yet finished still tracked)."""
        error = None
        while self._queue:
            try:
                self._finish(next(iter(self._queue)))
            except Exception as e:  # noqa: BLE001 - every buffer goes back; the first error is raised
                error = error or e
        if error is not None:
            raise error

    def discard_errors(self) -> None:
        """Finish every write and forget their errors (what failed is being thrown away)."""
        while self._queue:
            try:
                self._finish(next(iter(self._queue)))
            except OSError:  # the caller drops what those writes held
                pass

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._queue

    def keys(self) -> list:
        """The keys of the writes in flight, oldest first (finished ones stay until reaped)."""
        return list(self._queue)

    def _finish(self, key: Hashable) -> None:
        futures, buffers = self._queue[key]
        error = None
        for fut in futures:  # every future of the write is waited for, even after one failed
            try:
                fut.result()  # an interrupt propagates: the write stays queued, its buffers held
            except Exception as e:  # noqa: BLE001 - raised below
                error = error or e
        del self._queue[key]
        _release(buffers)
        if error is not None:
            raise error


def _release(buffers) -> None:
    for b in buffers:
        if b is not None:
            b.release()
