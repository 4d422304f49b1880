"""What the command-line tools share: the error for bad input and the progress line.

Every tool of `infinity.tools` (nvme-bench, swap-inspect, the demo) imports these from here,
so there is one copy of each.
"""

from __future__ import annotations

import sys
from typing import TextIO


class BadInput(ValueError):
    """A command-line value that cannot work (an option, a path, a file it names); the tool's
    `main` prints it as one line and exits 2."""


class Progress:
    """A progress line for ``total`` steps, ``done`` of them finished.

    ``live`` (the stream is a terminal): one line redrawn in place with \\r,
    ``[####......] done/total label`` (without the counter when ``counter`` is false, for a
    label that carries its own). Otherwise a plain line every ``log_every`` steps and at the
    last one (a log file should not fill with carriage returns), or nothing when
    ``log_every`` is 0. ``stream`` is stderr unless given.
    """

    def __init__(self, total: int, *, live: bool, log_every: int = 0, stream: TextIO | None = None,
                 width: int = 30, counter: bool = True):  # fmt: skip
        self.total, self.done, self.live, self.log_every = total, 0, live, log_every
        self.stream, self.width, self.counter = stream, width, counter

    def _write(self, text: str) -> None:
        out = self.stream if self.stream is not None else sys.stderr  # looked up late: tests swap it
        out.write(text)
        out.flush()

    def show(self, label: str, done: int | None = None) -> None:
        """Show ``label``, after setting ``done`` when given."""
        if done is not None:
            self.done = done
        count = f"{self.done}/{self.total} " if self.counter else ""
        if self.live:
            bar = "#" * (self.width * self.done // max(self.total, 1))
            self._write(f"\r[{bar:.<{self.width}}] {count}{label}\033[K")
        elif self.log_every and (self.done % self.log_every == 0 or self.done == self.total):
            self._write(f"{count}{label}\n")

    def clear(self) -> None:
        """Erase the live line (before other output, or at the end)."""
        if self.live:
            self._write("\r\033[K")

    def close(self) -> None:
        """End the live line, leaving it on screen."""
        if self.live:
            self._write("\n")
