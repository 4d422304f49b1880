"""Helpers the swap tests share."""

from __future__ import annotations

import contextlib
import signal
import sys


@contextlib.contextmanager
def sigint_at_line(k: int, traced):
    """Raise a real SIGINT (as a Ctrl-C lands, between two bytecodes) at the ``k``-th line run
    inside the frames ``traced(code)`` says yes to, within the block; yields the count of such
    lines run (a list of one int: fewer than ``k`` when the block ended first)."""
    seen = [0]

    def tracer(frame, event, arg):
        if not traced(frame.f_code):
            return None

        def line(frame, event, arg):
            if event == "line":
                seen[0] += 1
                if seen[0] == k:
                    signal.raise_signal(signal.SIGINT)
            return line

        return line

    sys.settrace(tracer)
    try:
        yield seen
    finally:
        sys.settrace(None)
