"""Moving one tensor's bytes between host memory and its extents.

[Note: swap alignment]
Every extent starts on an ``alignment`` (4096) boundary of its arena file and owns
``round_up(nbytes)`` bytes there; every extent of a tensor but the last holds a whole number of
alignment units, so the tensor's bytes laid end to end are exactly its extents' bytes. O_DIRECT
moves whole units from aligned memory, so:
- a tensor whose memory is aligned goes straight to and from its extents, except the tail
  past its last whole unit, which goes through a one-unit staging buffer (zero-padded on the
  way out): the tail is never lost and never read into memory past the tensor's end;
- a tensor whose memory is not aligned goes through a staging buffer the size of the tensor.
Staging buffers come from the caller's allocator (the host buffer pool in a SwapSpace).
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Sequence

import torch

from infinity import aio

from ._common import ALIGNMENT, round_up
from ._manifest import Extent

# alloc(nbytes) -> (uint8 tensor of at least nbytes, aligned; release callback)
Allocator = Callable[[int], tuple[torch.Tensor, Callable[[], None]]]


def plain_alloc(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """Staging memory for tools that have no pool (not pinned, freed with the tensor)."""
    return aio.empty_aligned(nbytes, pin=False), lambda: None


def as_uint8(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a 1-D uint8 view (0-d and empty included)."""
    if tensor.device.type != "cpu":
        raise TypeError(f"swap tensors move through host memory: got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"swap tensors must be contiguous, got shape={tuple(tensor.shape)} stride={tensor.stride()}")
    return tensor.detach().reshape(-1).view(torch.uint8)


class Transfer:
    """The requests that move ``data`` (1-D uint8) to (``write``) or from its extents.

    ``wait()`` waits for every request, copies staged bytes home (reads), releases staging
    and raises the first error (an OSError naming ``name``, the tensor, and the file); it is
    idempotent, and one interrupted (KeyboardInterrupt) may be called again: it then finishes.
    """

    def __init__(
        self,
        engine: aio.Engine,
        files: Sequence[aio.File] | dict[int, aio.File],
        extents: Sequence[Extent],
        data: torch.Tensor,
        *,
        write: bool,
        alloc: Allocator,
        name: str = "",
        urgent: bool = False,
    ):
        self._name = name  # the tensor, for error messages
        self._data = data
        self._write = write
        self._staged: list[tuple[torch.Tensor, int, int, Callable[[], None]]] = []  # (buf, lo, hi, release)
        self._requests: list[tuple[aio.Future, int, aio.File, int]] = []  # (future, length, file, offset)
        self._done = False
        self._error: OSError | None = None
        nbytes = data.numel()
        padded = round_up(nbytes)
        used = [files[e.file] for e in extents]  # ``files`` may hold only the ones used
        mem_align = max([f.mem_align for f in used if f.direct], default=1)
        try:
            if nbytes and data.data_ptr() % mem_align == 0:
                region, direct_end = data, nbytes - nbytes % ALIGNMENT
                if direct_end < nbytes:  # the tail unit, staged
                    self._stage(alloc, direct_end, padded)
            else:  # misaligned memory: stage all of it
                region, direct_end = None, 0
                if nbytes:
                    self._stage(alloc, 0, padded)
            submit = engine.pwrite if write else functools.partial(engine.pread, urgent=urgent)
            pos = 0
            for extent in extents:
                length = round_up(extent.nbytes)
                file = files[extent.file]
                for lo, hi, buf, base in self._pieces(pos, pos + length, region, direct_end):
                    fut = submit(buf[lo - base : hi - base], file, extent.offset + lo - pos)
                    self._requests.append((fut, hi - lo, file, extent.offset + lo - pos))
                pos += length
        except BaseException:
            # A submit interrupted after the engine had its request leaves one running that
            # self._requests lacks ([Note: request ownership] in infinity.aio): wait for all on
            # this transfer's memory, so that neither the caller's tensor nor a staging buffer
            # is reused, nor (for a put) its extents freed, while a request still moves them.
            engine.wait_range(data)
            for buf, *_ in self._staged:
                engine.wait_range(buf)
            self._drain()
            raise

    def _stage(self, alloc: Allocator, lo: int, hi: int) -> None:
        buf, release = alloc(hi - lo)
        buf = buf[: hi - lo]
        if self._write:
            n = min(hi, self._data.numel()) - lo
            buf[:n].copy_(self._data[lo : lo + n])
            buf[n:].zero_()
        self._staged.append((buf, lo, hi, release))

    def _pieces(self, lo: int, hi: int, region, direct_end: int):
        """(lo, hi, buffer, buffer's start) covering [lo, hi) of the padded byte space."""
        if region is not None and lo < direct_end:
            yield lo, min(hi, direct_end), region, 0
            lo = min(hi, direct_end)
        for buf, s_lo, s_hi, _ in self._staged:
            if lo < hi and s_lo <= lo < s_hi:
                yield lo, min(hi, s_hi), buf, s_lo
                lo = min(hi, s_hi)
        if lo < hi:  # cannot happen while extents and staging cover the padded size
            raise ValueError(f"extents cover more than the tensor's {self._data.numel()} bytes")

    def done(self) -> bool:
        return self._done or all(fut.done() for fut, *_ in self._requests)

    def _drain(self) -> OSError | None:
        # Every step can run again after an interrupt: waiting on a future and copying staged
        # bytes are idempotent, and a staging buffer leaves the list only once it is released.
        error = None
        what = f"tensor {self._name!r}: " if self._name else ""
        for fut, length, file, offset in self._requests:
            try:
                moved = fut.result()
            except OSError as e:
                error = error or OSError(e.errno, f"{what}{e.strerror}", e.filename)
                continue
            if moved != length and error is None:
                try:
                    ends = f", the file ends at byte {os.fstat(file.fileno()).st_size}"
                except OSError:
                    ends = ""
                error = OSError(
                    errno.EIO,
                    f"{what}{'write' if self._write else 'read'} of {length} bytes at offset {offset} (to "
                    f"{offset + length}) moved {moved}{ends}: the arena file is shorter than its manifest says",
                    file.path,
                )
        if error is None and not self._write:
            nbytes = self._data.numel()
            for buf, lo, _, _ in self._staged:
                n = min(nbytes - lo, buf.numel())
                self._data[lo : lo + n].copy_(buf[:n])
        while self._staged:
            self._staged[-1][3]()  # release (idempotent), then forget
            self._staged.pop()
        return error

    def wait(self) -> None:
        if not self._done:
            self._error = self._drain()
            self._done = True
        if self._error is not None:
            raise self._error
