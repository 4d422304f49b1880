"""A swap space's operations in flight: the unfinished puts and gets by name, and the names
whose last write failed.

Owns: the futures `SwapSpace.put` and `SwapSpace.get` hand out until each finishes, the one
unfinished write of a name (a read of that name reads after it), and the error of each name's
failed write with the record it was for (kept until the name is written again, renamed over or deleted, so `info` can say
why the name has no bytes). Touches: `SwapFuture.result` only. `SwapSpace` calls it; a future's
own ``finish`` reports back through `done`.
"""

from __future__ import annotations

from collections.abc import Iterable


def settle(futures: Iterable) -> None:
    """Finish ``futures`` (their errors stay with them, for their owners to see)."""
    for fut in list(futures):
        try:
            fut.result()
        except Exception:  # noqa: BLE001, S110 - an interrupt propagates; errors stay with the future
            pass


class InFlight:
    """The unfinished operations of one swap space, and its names' failed writes."""

    def __init__(self):
        self._pending: dict[str, list] = {}  # every unfinished put/get, by name
        self._writes: dict[str, object] = {}  # the unfinished put of a name, if any
        self.failed: dict[str, tuple] = {}  # names whose last write failed: (its error, the record it was for)

    def add(self, name: str, fut, *, write: bool = False) -> None:
        """``fut`` is an operation on ``name`` now under way (``write``: a put)."""
        self._pending.setdefault(name, []).append(fut)
        if write:
            self._writes[name] = fut

    def done(self, name: str, fut) -> None:
        """``fut`` finished (each call may come again after an interrupt: idempotent)."""
        if self._writes.get(name) is fut:
            del self._writes[name]
        futures = self._pending.get(name)
        if futures is not None:
            try:
                futures.remove(fut)
            except ValueError:
                pass
            if not futures:
                del self._pending[name]

    def settle(self, name: str) -> None:
        """Finish every operation on ``name`` (no read or write of its bytes in flight after)."""
        settle(self._pending.get(name, ()))

    def settle_write(self, name: str) -> None:
        """Finish ``name``'s write in flight, if any."""
        if name in self._writes:
            settle([self._writes[name]])

    def settle_all(self) -> BaseException | None:
        """Finish every operation; the first error, if any (an interrupt propagates)."""
        first = None
        for name in list(self._pending):
            for fut in list(self._pending.get(name, ())):
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - an interrupt propagates, the rest finish
                    first = first or e
        return first
