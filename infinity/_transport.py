"""Moving a unit's data between host and device, and between ranks.

Owns: the CUDA copy streams (parameters in, gradients out) and the events that say when a
host buffer may be reused or read; the
parameter all-gather (stage 3: each rank read only its own slice from its own drives) and the
gradient reduction (reduce-scatter to this rank's slice, or all-reduce at stage 1). Touches:
the units' shapes, the host pool (buffers for what it gathers or reduces on a CPU device),
`_dist.Dist` for the collectives. It decides nothing about when: the scheduler and the
gradient accumulator call it.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from ._units import ParamUnit


class CopyStream:
    """Host-to-device copies on a side stream: compute waits on an event, not the host.

    A host buffer goes back to the pool only once its copy's event has completed
    (`drain`), never while the DMA may still read it."""

    def __init__(self, device: torch.device, stats=None):
        self.device = device
        self.stats = stats  # `_stats.Stats`: bytes copied and the copy engine's busy seconds
        self._stream = None  # made on first use
        self._copies: list = []  # (start event, end event, bytes, lease) of copies that may still run

    def to_device(self, lease, out: torch.Tensor | None = None) -> torch.Tensor:
        """``lease.tensor`` (host) copied to the device (into ``out``, a device tensor of its
        shape and dtype, when given); ``lease`` is released once the copy is done."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            # Timed on the GPU: stats() gives the copies' own throughput (pinned or not shows).
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            if out is None:
                full = lease.tensor.to(self.device, non_blocking=True)
            else:  # made on the current stream, whose work so far the side stream waited for
                full = out
                full.copy_(lease.tensor, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        current.wait_event(event)
        full.record_stream(current)
        self._copies.append((start, event, lease.tensor.nbytes, lease))
        self.drain(block=False)
        return full

    def drain(self, block: bool) -> None:
        """Give back the host buffers of finished copies (all of them, waiting, when ``block``)."""
        while self._copies and (block or self._copies[0][1].query()):
            start, event, nbytes, lease = self._copies.pop(0)
            event.synchronize()
            lease.release()
            if self.stats is not None:
                seconds = start.elapsed_time(event) / 1e3
                for c in self.stats.both():
                    c.h2d_bytes += nbytes
                    c.h2d_seconds += seconds


class CopyBack:
    """Device-to-host copies (gradients) on their own side stream: the host waits for a copy
    only where it reads the result (`Copy.wait`), never for the backward that made it.

    The source's device memory is kept from reuse until its copy ran (``record_stream``);
    the destination must be pinned for the copy to be asynchronous (pool buffers and the cpu
    tier are)."""

    def __init__(self, device: torch.device, stats=None):
        self.device = device
        self.stats = stats
        self._stream = None  # made on first use

    def start(self, src: torch.Tensor, dst: torch.Tensor) -> "Copy":
        """Copy ``src`` (on the device, written by work queued on the current stream) into
        ``dst`` (host, same shape); returns the copy, to `Copy.wait` on before ``dst`` is read."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the backward that made src
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
        src.record_stream(stream)  # its memory is not handed out again before the copy read it
        return Copy(end, start, src.numel() * src.element_size(), self.stats)


class Copy:
    """One device-to-host copy in flight: `done` polls, `wait` blocks until ``dst`` holds the
    values (and counts the copy in the stats, once)."""

    __slots__ = ("_end", "_start", "_nbytes", "_stats")

    def __init__(self, end, start=None, nbytes: int = 0, stats=None):
        self._end, self._start, self._nbytes, self._stats = end, start, nbytes, stats

    def done(self) -> bool:
        return self._end is None or self._end.query()

    def wait(self) -> None:
        if self._end is None:
            return
        self._end.synchronize()
        if self._stats is not None and self._start is not None:
            seconds = self._start.elapsed_time(self._end) / 1e3
            for c in self._stats.both():
                c.d2h_bytes += self._nbytes
                c.d2h_seconds += seconds
        self._end = None


class Transport:
    """The collectives and copies of one engine (``dist``: `_dist.Dist`, or None at one rank)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, pool, dist=None, stats=None):
        self.device = device
        self.dtype = dtype  # of the parameters
        self.pool = pool
        self.dist = dist
        self.copies = CopyStream(device, stats) if device.type == "cuda" else None
        self.copy_back = CopyBack(device, stats) if device.type == "cuda" else None

    def to_device(self, lease, out: torch.Tensor | None = None) -> torch.Tensor:
        with record_function("infinity::h2d"):
            return self.copies.to_device(lease, out)

    def gather(self, unit: ParamUnit, shard) -> tuple[torch.Tensor, object]:
        """All-gather ``unit`` from every rank's shard (``shard``: a lease of this rank's slice,
        released here). Returns the full 1-D tensor on the compute device, and the pool buffer
        behind it on a CPU device (None on a GPU)."""
        what = f"parameter all-gather of {unit.name}"
        with record_function("infinity::gather"):
            if self.device.type == "cpu":
                full_lease = self.pool.acquire(unit.padded_numel * self.dtype.itemsize)
                full = full_lease.view(self.dtype, (unit.padded_numel,))
                try:
                    self.dist.all_gather(full, shard.tensor, what)
                except BaseException:
                    full_lease.release()
                    raise
                finally:
                    shard.release()
                return full, full_lease
            local = self.to_device(shard) if shard.tensor.device.type == "cpu" else shard.tensor
            full = torch.empty(unit.padded_numel, dtype=self.dtype, device=self.device)
            self.dist.all_gather(full, local, what)
            if local is shard.tensor:
                shard.release()
            return full, None

    def reduce_grad(self, unit: ParamUnit, grad: torch.Tensor, lease, *, keep_full: bool):
        """Average ``grad`` (1-D fp32, the unit's padded length, in pool buffer ``lease`` or
        None) over the ranks: the whole of it (``keep_full``, stage 1) or this rank's slice.
        Returns the result and the pool buffer it is in (``lease`` is then released)."""
        what = f"gradient reduction of {unit.name}"
        with record_function("infinity::grad_reduce"):
            if keep_full:
                self.dist.all_reduce_mean(grad, what)
                return grad, lease
            n = unit.shard_numel
            if grad.device.type == "cpu" and self.pool is not None:
                reduced = self.pool.acquire(n * 4)
                out = reduced.view(torch.float32, (n,))
            else:
                reduced, out = None, torch.empty(n, dtype=torch.float32, device=grad.device)
            try:
                self.dist.reduce_scatter_mean(out, grad, what)
            except BaseException:
                if reduced is not None:
                    reduced.release()
                raise
            finally:
                if lease is not None:
                    lease.release()
            return out, reduced

    def drain(self) -> None:
        if self.copies is not None:
            self.copies.drain(block=True)
