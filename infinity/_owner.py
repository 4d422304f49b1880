"""Which thread is inside an engine: one at a time.

An engine is single-threaded, as FSDP is: its units, leases, write-behinds and the aio
engine's completions are kept without locks, and two threads inside at once corrupt them for
good (a completion reaped by one thread under the other). So every entry point (a forward,
``backward``, ``step``, ``zero_grad``, checkpoints, exports, ``state_dict``, ``close``) enters
the engine's `Owner`; a second thread entering while the first is inside gets a RuntimeError
naming both, and the engine is untouched by the refused call.

Any thread may use the engine when no other is inside: ownership lasts a call, not the
engine's life (transformers' Trainer and accelerate call everything from the main thread; a
DataLoader worker never touches the engine; a script may train from a thread of its own, and
the ``atexit`` handler closes from the main thread once the training thread is done). The
hooks autograd runs during backward are not entry points: on a GPU it runs them on its own
device threads, inside the backward that entered.
"""

from __future__ import annotations

import functools
import threading


class Owner:
    """The thread inside the engine and how many entries it has made (entries nest: ``step``
    calls ``zero_grad``, a forward calls the root module again)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._entries = 0
        self._what = ""  # the outermost entry point of the thread inside

    def enter(self, what: str) -> None:
        """Enter for ``what`` (an entry point's name), or raise if another thread is inside."""
        me = threading.current_thread()
        with self._lock:
            if self._thread is not None and not self._thread.is_alive():
                self._thread, self._entries = None, 0  # it died inside: its entries are void
            if self._thread is not None and self._thread is not me:
                raise RuntimeError(
                    f"{what} from thread {me.name!r} while thread {self._thread.name!r} is inside {self._what} of "
                    "the same infinity engine: an engine is used by one thread at a time (as FSDP is); call it "
                    "from one thread, or wait for the other to return"
                )
            if self._entries == 0:
                self._thread, self._what = me, what
            self._entries += 1

    def exit(self, entries: int = 1) -> None:
        """Leave ``entries`` entries of the thread inside."""
        with self._lock:
            self._entries = max(self._entries - entries, 0)
            if self._entries == 0:
                self._thread, self._what = None, ""

    def holds(self) -> bool:
        """Whether the calling thread is inside."""
        return self._thread is threading.current_thread()


def entry(what: str):
    """Decorate an `Engine` method as an entry point named ``what`` (the engine's ``_owner``)."""

    def decorate(method):
        @functools.wraps(method)
        def entered(self, *args, **kwargs):
            owner = self._owner
            owner.enter(what)
            try:
                return method(self, *args, **kwargs)
            finally:
                owner.exit()

        return entered

    return decorate
