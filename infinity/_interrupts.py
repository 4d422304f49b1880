"""Ctrl-C held back over a few lines of bookkeeping, so that it lands between two states of the
engine, never inside one.

[Note: interrupt windows]
Python raises KeyboardInterrupt in the main thread between any two bytecodes. Bookkeeping that
changes several fields together (a unit bound to its memory, known to the saved-tensor hooks
and holding its lease; a read given back and forgotten; a gradient taken from its parameter
into its unit and counted) interrupted half-way leaves a state no later call understands: a
unit "fetching" with no read, memory given back that parameters still point at, a gradient
left on a parameter for the next backward to add to ([Note: gradient hand-over] in
`_schedule`). `held_interrupts` runs such a section with SIGINT recorded instead of raised,
and delivers it again at the end of the section, to whatever handler was installed.

A section never waits (no I/O, no pool wait, no collective), so a Ctrl-C is late by
microseconds at most; one exception: the step's bookkeeping once its update is done
(`Engine._step`: counted whole, or a redone step would update twice) waits there, on a GPU, for
the gradients' copies still landing, milliseconds. The waits stay interruptible and are
written so that an interrupt there changes nothing: a `_store.Pending` interrupted while it
waits waits again on the next call.
"""

from __future__ import annotations

import _signal  # the C functions `signal` wraps: no enum made per call (a section costs ~1 us, not ~25)
import os
import signal
import threading

_MAIN = threading.main_thread().ident  # the thread signal handlers run in (a forked child's: its own)


def _forked() -> None:
    global _MAIN
    _MAIN = threading.main_thread().ident  # threading's own fork handler, registered first, has run


os.register_at_fork(after_in_child=_forked)


class _Held:
    """The context manager; reentrant (an inner section leaves the holding to the outer one)."""

    __slots__ = ("_caught", "_previous", "_depth")

    def __init__(self):
        self._caught = False
        self._previous = None
        self._depth = 0

    def _record(self, signum, frame) -> None:
        self._caught = True

    def __enter__(self):
        # Python runs signal handlers only in the main thread: elsewhere nothing can land here.
        if threading.get_ident() != _MAIN:
            return self
        self._depth += 1
        if self._depth == 1:
            previous = _signal.getsignal(_signal.SIGINT)
            if previous is None:  # a handler installed outside Python: it cannot be put back
                return self
            self._caught = False
            self._previous = previous
            _signal.signal(_signal.SIGINT, self._record)
        return self

    def __exit__(self, *exc) -> None:
        if threading.get_ident() != _MAIN:
            return
        self._depth -= 1
        if self._depth or self._previous is None:
            return
        previous, self._previous = self._previous, None
        _signal.signal(_signal.SIGINT, previous)
        if self._caught:
            self._caught = False
            signal.raise_signal(signal.SIGINT)  # to the handler that was there: KeyboardInterrupt by default


held_interrupts = _Held()
"""``with held_interrupts: ...``: SIGINT during the block is delivered at its end."""
