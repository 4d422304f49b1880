"""Moving a unit's data between host and device, and between ranks.

Owns: the CUDA copy streams (parameters in, gradients out) and the events that say when a
host buffer may be reused or read; the optimizer step's copies (`to_host`, `to_device_as`,
`copy`); the parameter all-gather (stage 3: each rank read only its own slice from its own
drives) and the gradient reduction (reduce-scatter to this rank's slice, or all-reduce at
stage 1). Touches: the units' shapes, the host pool (buffers for what it gathers or reduces
on a CPU device, pinned staging for the step's copies), `_dist.Dist` for the collectives. It
decides nothing about when: the scheduler, the gradient accumulator and the update call it.

[Note: every copy counted]
Every copy between host and device goes through here and is counted in `engine.stats()`:
``h2d_bytes`` / ``d2h_bytes`` (the bytes that cross) and ``h2d_seconds`` / ``d2h_seconds``
(their GPU time, CUDA events on the stream that ran them). Those on a side stream (parameters
in, gradients back, the step's pipelined copies) are counted when their event is seen done;
the others (`copy`, on the current stream) when `settle` reads their events, at the end of the
step. On a machine without a GPU the device is the host and nothing crosses: the counts stay
0, and what the optimizer reads and writes in place shows in the tiers' bytes instead
(`_update`).
"""

from __future__ import annotations

import torch
import xxhash
from torch.profiler import record_function

from ._store import InHand, Lease
from ._units import ParamUnit


def host_value(t: torch.Tensor) -> torch.Tensor:
    """A small tensor's value on the host, where the step consumes it (a flag, a norm): from a
    GPU by a copy into pinned memory on the current stream and a wait on its event, which
    blocks this thread until the work queued before it ran (not a device or stream
    synchronize: `torch.cuda.set_sync_debug_mode` does not count it, and nothing queued later
    is waited for). On the host, ``t`` itself."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return out


class Copies:
    """Copies between the host and one GPU, each way on a side stream of its own, so that
    neither compute nor the host waits for them where it need not:

    - `to_device` (parameters in, the step's new parameters): compute waits on the copy's
      event, not the host; the host buffer goes back to its pool only once that event has
      completed (`drain`), never while the DMA may still read it;
    - `start` (gradients, activations out): the copy runs after the work that made its source
      (the side stream waits for the current one), the host waits only where it reads the
      result (`Copy.wait`); the source's device memory is kept from reuse until the copy ran
      (``record_stream``). The destination must be pinned for the copy to be asynchronous
      (pool buffers, the cpu tier and the overlap's staging are).

    Every copy is timed on its stream and counted in the stats ([Note: every copy counted])."""

    def __init__(self, device: torch.device, stats=None):
        self.device = device
        self.stats = stats  # `_stats.Stats`: bytes copied and the copy engine's busy seconds
        self._in = None  # the streams, made on first use
        self._out = None
        self._copies: list = []  # (start event, end event, bytes, lease) of copies in that may still run

    def to_device(self, lease, out: torch.Tensor | None = None) -> torch.Tensor:
        """``lease.tensor`` (host) copied to the device (into ``out``, a device tensor of its
        shape and dtype, when given); ``lease`` is released once the copy is done."""
        if out is not None and out.shape != lease.tensor.shape:  # copy_ would broadcast a smaller one
            raise ValueError(f"a copy to the device of {tuple(lease.tensor.shape)} into {tuple(out.shape)}")
        if self._in is None:
            self._in = torch.cuda.Stream(self.device)
        stream = self._in
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
        """Give back the host buffers of finished copies in (all of them, waiting, when ``block``)."""
        while self._copies and (block or self._copies[0][1].query()):
            start, event, nbytes, lease = self._copies.pop(0)
            event.synchronize()
            lease.release()
            if self.stats is not None:
                self.stats.add("h2d_bytes", nbytes)
                self.stats.add("h2d_seconds", start.elapsed_time(event) / 1e3)

    def start(self, src: torch.Tensor, dst: torch.Tensor) -> "Copy":
        """Copy ``src`` (on the device, written by work queued on the current stream) into
        ``dst`` (host, same shape); returns the copy, to `Copy.wait` on before ``dst`` is read."""
        if self._out is None:
            self._out = torch.cuda.Stream(self.device)
        stream = self._out
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
        if self._stats is not None and self._start is not None:  # (the optimizer's worker waits too: locked)
            self._stats.add("d2h_bytes", self._nbytes)
            self._stats.add("d2h_seconds", self._start.elapsed_time(self._end) / 1e3)
        self._end = None


class Arriving:
    """A gradient on its way to the host (`Transport.to_host`): a store `Pending`'s interface.
    ``result()`` waits for the copy and returns the lease of its pinned buffer (the same every
    call); ``done()`` polls. Never released before its copy is done: the DMA writes it."""

    __slots__ = ("_copy", "_lease")

    def __init__(self, copy: "Copy", lease: Lease):
        self._copy, self._lease = copy, lease

    def done(self) -> bool:
        return self._copy.done()

    def result(self) -> Lease:
        try:
            self._copy.wait()
        except Exception:  # a failed copy writes nothing more: its buffer goes back, its error is raised
            self._lease.release()
            raise
        return self._lease


class Transport:
    """The collectives and copies of one engine (``dist``: `_dist.Dist`, or None at one rank)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, pool, dist=None, stats=None):
        self.device = device
        self.dtype = dtype  # of the parameters
        self.pool = pool
        self.dist = dist
        self.stats = stats
        # The units this rank gathered and reduced since the last step, in order: see `check_same_units`.
        self._pass = xxhash.xxh3_64()
        self.copies = Copies(device, stats) if device.type == "cuda" else None  # host <-> GPU, both ways
        self._timed: list = []  # (start event, end event, bytes, counter) of `copy`'s copies not yet counted

    # -- the optimizer step's copies: see [Note: every copy counted] --------------------------
    @property
    def pipelined(self) -> bool:
        """Whether copies between the host and the compute device run on side streams into
        pinned pool memory (a CUDA device): `to_host` and `to_device_as` apply."""
        return self.copies is not None and self.pool is not None

    def to_host(self, src: torch.Tensor, timeout: float | None = None) -> "Arriving":
        """Start copying ``src`` (on the device, made by work queued on the current stream)
        into a pinned pool buffer on the copy-back stream; `Arriving.result` waits for it and
        lends the buffer (released by the lease). Waits at most ``timeout`` seconds for pool
        memory (`infinity.swap.PoolExhausted`)."""
        buffer = self.pool.acquire(max(src.numel() * src.element_size(), 1), timeout=timeout)
        try:
            dst = buffer.view(src.dtype, tuple(src.shape))
            copy = self.copies.start(src, dst)
        except BaseException:
            buffer.release()
            raise
        return Arriving(copy, Lease(dst, buffer))

    def to_reader(self, value: torch.Tensor, device: torch.device, timeout: float | None = None):
        """``value`` for a reader on ``device`` (the host optimizer's kernel), as a `Pending` of
        a lease: ``value`` itself where it is there; from a GPU, where copies are pipelined, into
        a pinned pool buffer on the copy-back stream (`to_host`: the reader waits on its event;
        at most ``timeout`` seconds for pool memory); else by a blocking copy, counted (`copy_to`).
        The one place that decides how a gradient reaches the host optimizer: the step's, and
        both overlaps'."""
        if value.device == device:
            return InHand(Lease(value))
        if self.stages(value.device, device):
            return self.to_host(value, timeout=timeout)
        return InHand(Lease(self.copy_to(value, device)))

    def stages(self, src: torch.device, reader: torch.device) -> bool:
        """Whether `to_reader` brings a value from ``src`` to a reader on ``reader`` through a
        pinned pool buffer (what a plan of the pool counts)."""
        return self.pipelined and src.type == "cuda" and reader.type == "cpu"

    def to_device_as(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """``src`` (host) into ``out`` (on the device, its dtype): converted once on the host
        into a pinned pool buffer of ``out``'s dtype, then copied on the side stream, which the
        current stream waits for (an event: the next forward's use of ``out`` is after it, the
        host waits for nothing). The buffer goes back once its copy is done (`drain`)."""
        buffer = self.pool.acquire(max(out.numel() * out.element_size(), 1))
        try:
            staged = buffer.view(out.dtype, tuple(out.shape))
            staged.copy_(src.view(out.shape))
        except BaseException:
            buffer.release()
            raise
        with record_function("infinity::h2d"):
            self.copies.to_device(Lease(staged, buffer), out)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(src)`` on the current stream, counted where it crosses between the host
        and a GPU (the bytes that cross: ``dst``'s going in, ``src``'s coming back, as torch
        converts on the host for both). Returns ``dst``."""
        crossing = src.device.type != dst.device.type and "cuda" in (src.device.type, dst.device.type)
        if not crossing or self.stats is None:
            return dst.copy_(src)
        inward = dst.device.type == "cuda"
        nbytes = (dst if inward else src).numel() * (dst if inward else src).element_size()
        stream = torch.cuda.current_stream((dst if inward else src).device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src)
        end.record(stream)
        self._timed.append((start, end, nbytes, "h2d" if inward else "d2h"))
        return dst

    def copy_to(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``src`` on ``device`` (itself where it is there already), counted as `copy`."""
        if src.device == device:
            return src
        return self.copy(src, torch.empty(src.shape, dtype=src.dtype, device=device))

    def settle(self, block: bool = True) -> None:
        """Count `copy`'s copies whose events are done (all of them, waiting, when ``block``)
        and give back the step's staging buffers whose copies are done (`Copies.drain`)."""
        if self.copies is not None:
            self.copies.drain(block)
        while self._timed and (block or self._timed[0][1].query()):
            start, end, nbytes, way = self._timed.pop(0)
            end.synchronize()
            self.stats.add(f"{way}_bytes", nbytes)
            self.stats.add(f"{way}_seconds", start.elapsed_time(end) / 1e3)

    def check_same_units(self) -> None:
        """Before a step with several ranks: raise on every rank where the ranks gathered or
        reduced other units since the last step. Collectives pair up by order alone, so a rank
        whose forward took another module than the others' (routing by its own data: one
        task's head, an expert) averaged one unit's gradient with another's, of the same size,
        silently ([Note: the same units on every rank] in `_dist`)."""
        digest, self._pass = self._pass.intdigest(), xxhash.xxh3_64()
        if self.dist is not None and not self.dist.same_everywhere(digest, "the check of the units each rank reduced"):
            raise RuntimeError(
                "the ranks gathered or reduced other parameter units since the last step (a forward that ran other "
                "modules on some ranks: a head or expert chosen by each rank's data; or gave gradients to other "
                "parameters of them, so that a unit's gradient was whole at another point of backward: an expert no "
                "token of one rank's batch reached, an output one rank dropped): their collectives paired "
                "different units' gradients, so this step is refused. Every rank must run the same modules in each "
                "pass, as with DeepSpeed's ZeRO and FSDP (a module a rank does not need can run on zeros); call "
                "engine.zero_grad() and run the step again"
            )

    def to_device(self, lease, out: torch.Tensor | None = None) -> torch.Tensor:
        with record_function("infinity::h2d"):
            return self.copies.to_device(lease, out)

    def gather(self, unit: ParamUnit, shard) -> tuple[torch.Tensor, object]:
        """All-gather ``unit`` from every rank's shard (``shard``: a lease of this rank's slice,
        released here). Returns the full 1-D tensor on the compute device, and the pool buffer
        behind it on a CPU device (None on a GPU)."""
        what = f"parameter all-gather of {unit.name}"
        self._pass.update(what.encode())
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
        self._pass.update(what.encode())
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
