"""A tier: where one kind of state lives (params, grads, master, exp_avg, exp_avg_sq).

Owns: the tensors of one kind under their names, in the tier the config names; the key format
in the swap space; the pool buffers that reads and staged writes move through; the byte
counters of `Stats`. Touches: `infinity.swap` (the space, its pool, `stream`).

Callers never ask which tier they talk to. `get` returns (a future of) a `Lease`: a tensor plus
``release()``. Resident tiers (device, cpu) lend the tier's own tensor, used in place, whose
release does nothing; the nvme tier lends a pool buffer the read filled, whose release gives it
back. `put` stores a tensor and returns a future: resident tiers copy now, nvme writes behind.
A write back into the tensor a lease lent is free on a resident tier and a write on nvme, so
"get, change in place, put" is the same code everywhere.

The cpu tier is host memory, pinned when CUDA is present so its copies to the device are
asynchronous; `held_bytes` reports what the resident tiers hold (in ``Engine.stats()``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from infinity.swap import DTYPES, PoolExhausted, SwapFuture, SwapSpace, stream

from ._param_cache import ParamCache
from ._stats import Stats


class Lease:
    """A tensor of a tier, lent until `release` (idempotent)."""

    __slots__ = ("tensor", "_buffer")

    def __init__(self, tensor: torch.Tensor, buffer=None):
        self.tensor = tensor
        self._buffer = buffer  # the pool buffer behind ``tensor`` (nvme), else None

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.release()
            self._buffer = None


class InHand:
    """A `Pending` whose lease is already here (a tensor held in memory, not read)."""

    __slots__ = ("_lease",)

    def __init__(self, lease: Lease):
        self._lease = lease

    def done(self) -> bool:
        return True

    def result(self) -> Lease:
        return self._lease


class Pending:
    """A store operation: ``result()`` waits and returns its value or raises its error, the
    same on every call; ``done()`` polls. An interrupt (KeyboardInterrupt) while it waits leaves
    it pending, its staged buffer held: the next ``result()`` waits again (see `SwapFuture`)."""

    __slots__ = ("_future", "_span", "_value", "_error", "_done", "_wrap", "_staged")

    def __init__(self, future: SwapFuture | None, span=None, value=None, wrap=None, staged=None):
        self._future = future
        self._span = span  # the I/O span to close when done (stats)
        self._value = value
        self._error: Exception | None = None
        self._wrap = wrap  # turns the future's value into what result() returns
        self._staged = staged  # a pool buffer the write went from, given back when done
        self._done = future is None

    def done(self) -> bool:
        return self._done or self._future.done()

    def result(self):
        if not self._done:
            try:
                value = self._future.result()  # an interrupt propagates with nothing marked
            except Exception as e:  # noqa: BLE001 - the operation's outcome, raised to every caller
                self._error = e
            else:
                self._value = value if self._wrap is None else self._wrap(value)
            self._done = True
            if self._span is not None:
                self._span.done()
            if self._staged is not None:
                self._staged.release()
                self._staged = None
        if self._error is not None:
            raise self._error
        return self._value


class Store:
    """Flat tensors of one ``kind`` ("param", "grad", "master", ...) in ``tier``."""

    def __init__(self, tier: str, kind: str, *, device: torch.device, space: SwapSpace | None, stats: Stats,
                 keep_in_pool: bool = False):  # fmt: skip
        if tier == "nvme" and space is None:
            raise ValueError(f"the {kind} store is on nvme but no swap space was given")
        self.tier = tier
        self.kind = kind
        self._space = space if tier == "nvme" else None
        self._stats = stats
        # device tier: the compute device; cpu tier: host memory (pinned where CUDA is)
        self.device = device if tier == "device" else torch.device("cpu")
        self._pin = tier == "cpu" and torch.cuda.is_available()
        self._resident: dict[str, torch.Tensor] | None = None if tier == "nvme" else {}
        self._adopted: set[str] = set()  # names whose resident tensor a caller gave (`adopt`)
        # nvme, ``keep_in_pool``: buffers kept in the pool between uses ([Note: parameters kept
        # in the pool] in `_param_cache`), lent to `get(..., kept=True)`.
        self._kept = ParamCache(stats) if tier == "nvme" and keep_in_pool else None

    # -- what the tier is like, for the callers' plans ---------------------------------------
    def in_place_on(self, device: torch.device) -> bool:
        """True when `get` lends the tier's own tensor, on ``device``: nothing to fetch or copy."""
        return self._resident is not None and self.device == device

    @property
    def uses_pool(self) -> bool:
        """True when leases and staged writes take host-pool memory (counts against the budget)."""
        return self._resident is None

    @property
    def held_bytes(self) -> int:
        """Bytes the tier holds in memory (device or host); 0 on nvme, whose bytes are on disk."""
        if self._resident is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._resident.values())

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tensors the tier holds in memory (none on nvme). Two stores' may share memory:
        the parameters and the master weights of [Note: one copy of the fp32 weights]."""
        return [] if self._resident is None else list(self._resident.values())

    # -- access -----------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{name}/{self.kind}"

    def put(self, name: str, tensor: torch.Tensor, *, copy: bool = False, dtype: torch.dtype | None = None,
            timeout: float | None = None, kept_copy=None) -> Pending:  # fmt: skip
        """Store ``tensor``'s values under ``name`` (cast to the stored dtype where one exists,
        or to ``dtype`` for a copy under a new name).

        Resident: copied now (nothing when ``tensor`` is the tier's own tensor). nvme: written
        behind from ``tensor``, which must stay unchanged until the result, unless ``copy``,
        or unless it is not a contiguous CPU tensor: then from a pool copy (waiting at most
        ``timeout`` seconds for its pool memory). Where the store keeps buffers in the pool
        ([Note: parameters kept in the pool] in `_param_cache`), a pool copy is kept once
        written; ``kept_copy``: a pool buffer (`spare_buffer`) that holds ``tensor``'s values
        already, to write from and keep (released where the store keeps none)."""
        if self._resident is not None:
            dst = self._resident_for(name, tensor.shape, tensor.dtype, cast=True)
            if dst.data_ptr() != tensor.data_ptr():
                dst.copy_(tensor.detach())
            return Pending(None)
        key = self._key(name)
        if self._kept is not None:
            self._kept.forget(key)  # what it held is the old value: kept again below if written from a copy
        staged = None
        if kept_copy is not None and self._kept is not None and kept_copy.take_back():  # still there
            staged, tensor = kept_copy, kept_copy.view(tensor.dtype, tuple(tensor.shape))  # written from, kept
        elif kept_copy is not None:
            kept_copy.release()
        if staged is None and (copy or tensor.device.type != "cpu" or not tensor.is_contiguous()):
            dtype = DTYPES[self._space.info(key).dtype] if key in self._space else (dtype or tensor.dtype)
            staged = self._space.pool.acquire(max(tensor.numel() * dtype.itemsize, 1), timeout=timeout)
            view = staged.view(dtype, tuple(tensor.shape))
            view.copy_(tensor.detach())
            tensor = view
        nbytes = tensor.numel() * tensor.element_size()
        span = self._stats.io("nvme", True, nbytes, self.kind)
        try:
            future = self._space.put(key, tensor)
        except BaseException:
            span.done()
            if staged is not None:
                staged.release()
            raise
        if staged is not None and self._kept is not None:
            staged = self._kept.after_write(key, staged, future)  # kept once written, not released
        return Pending(future, span, staged=staged)

    def spare_buffer(self, nbytes: int):
        """A pool buffer of ``nbytes`` to fill with a value and `put` as ``kept_copy`` (kept once
        written), where the store keeps buffers in the pool and the pool has room now; else
        None. For copies made off the caller's thread: the early updates' new parameters,
        cast on the optimizer's worker, which sets the buffer aside until the write (`put`
        takes it back, or writes without it where an acquire took its room meanwhile)
        ([Note: parameters kept in the pool] in `_param_cache`)."""
        if self._kept is None:
            return None
        try:
            return self._space.pool.acquire(max(nbytes, 1), timeout=0)
        except PoolExhausted:
            return None

    def _resident_for(self, name: str, shape, dtype: torch.dtype, *, cast: bool) -> torch.Tensor:
        """The resident tier's tensor of ``name``, made (pinned where CUDA is) where there is
        none of this shape yet, or, unless ``cast`` (a value is cast to the dtype stored), none
        of this dtype."""
        dst = self._resident.get(name)
        if dst is None or dst.shape != shape or (not cast and dst.dtype != dtype):
            dst = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self._pin)
            self._resident[name] = dst
            self._adopted.discard(name)
        return dst

    def is_own(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the resident tier's own tensor of ``name`` (a `put` of it
        copies nothing)."""
        own = None if self._resident is None else self._resident.get(name)
        return own is not None and own.data_ptr() == tensor.data_ptr() and own.shape == tensor.shape

    def adopt(self, name: str, tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> bool:
        """Make ``tensor`` itself the resident tier's tensor of ``name`` (the caller gives it
        up, and nothing else holds its storage), where it has ``shape`` and ``dtype``, on the
        tier's device, as the tier's tensor of ``name`` has if there is one: a value produced
        where the tier keeps it is then stored without a copy. False, changing nothing,
        otherwise (and on nvme)."""
        if self._resident is None or tensor.shape != shape or tensor.dtype != dtype or tensor.device != self.device:
            return False
        dst = self._resident.get(name)
        if dst is not None and (dst.shape != shape or dst.dtype != dtype):
            return False
        self._resident[name] = tensor
        self._adopted.add(name)
        return True

    def forget_adopted(self) -> None:
        """Drop the resident tensors `adopt` gave the tier (their memory is freed once nothing
        else holds it): values made afresh each time, as backward makes gradients, need not be
        kept until the next ones come. The tier's own tensors stay, to be filled again."""
        for name in self._adopted:
            self._resident.pop(name, None)
        self._adopted.clear()

    def landing(self, name: str, shape, dtype: torch.dtype, acquire=None) -> tuple[torch.Tensor, object]:
        """Where a copy from the device of ``name``'s new value lands: the tier's own tensor
        (resident; pinned where CUDA is) and None, or a pool buffer's view and the buffer, to
        `put` from once the copy is done (nvme; the buffer from ``acquire(nbytes)``, default the
        pool's own). See [Note: gradients copied back] in `_grads`."""
        if self._resident is not None:
            return self._resident_for(name, shape, dtype, cast=False), None
        buffer = (acquire or self._space.pool.acquire)(max(shape.numel() * dtype.itemsize, 1))
        return buffer.view(dtype, tuple(shape)), buffer

    def get(self, name: str, timeout: float | None = None, urgent: bool = False, kept: bool = False) -> Pending:
        """A `Lease` of ``name``'s tensor. nvme: a read into a pool buffer, waiting at most
        ``timeout`` seconds for pool memory (`infinity.swap.PoolExhausted` after that);
        ``urgent``: a read needed now, ahead of reads that are not (`SwapSpace.get`).
        ``kept``: the caller only reads the lease's tensor, so a buffer kept in the pool with
        the same bytes may be lent instead of a read, and the read's buffer is kept once
        released ([Note: parameters kept in the pool] in `_param_cache`)."""
        if self._resident is not None:
            return Pending(None, value=Lease(self._resident[name]))
        key = self._key(name)
        cache = self._kept if kept else None
        if cache is not None:
            record = self._space.info(key)  # after a write of ``name`` in flight
            loan = cache.lend(key, record)
            if loan is not None:
                return Pending(None, value=Lease(loan.view(DTYPES[record.dtype], record.shape), loan))
        future = self._space.get(key, timeout=timeout, urgent=urgent)  # after a write of ``name`` in flight
        record = self._space.info(key)
        dtype, shape = DTYPES[record.dtype], record.shape
        span = self._stats.io("nvme", False, record.nbytes, self.kind)
        if cache is not None:
            return Pending(future, span, wrap=lambda buffer: Lease(buffer.view(dtype, shape),
                                                                  cache.after_read(key, record, buffer)))  # fmt: skip
        return Pending(future, span, wrap=lambda buffer: Lease(buffer.view(dtype, shape), buffer))

    def stream_member(self, name: str):
        """What `stream_together` reads and writes back for ``name`` (nvme): its key."""
        return self._key(name)

    def streamed_bytes(self, name: str, tensor: torch.Tensor) -> int:
        """The bytes a stream of ``name`` moves each way, ``tensor`` being what it read."""
        return tensor.numel() * tensor.element_size()

    def rename(self, src: str, dst: str) -> None:
        """nvme: ``src``'s tensor becomes ``dst``'s, replacing it, without a copy."""
        if self._resident is not None:
            raise ValueError(f"the {self.kind} store is on the {self.tier} tier: only nvme renames")
        a, b = self._key(src), self._key(dst)
        if self._kept is None:
            self._space.rename(a, b)
            return
        held = self._kept.recorded(a)
        held = held is not None and a in self._space and held is self._space.info(a)  # src's bytes kept
        self._space.rename(a, b)
        if held:
            self._kept.rename(a, b, self._space.info(b))
        else:
            self._kept.forget(a)
            self._kept.forget(b)

    def swap(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Resident: ``tensor`` becomes ``name``'s tensor, without a copy; returns the one it
        replaces (same shape and dtype). Only for tensors nothing else holds a view of (the
        optimizer's states: `_overlap_host`'s commit; the kernels' views that `_algorithms.Cut`
        keeps the caller forgets: `SubGroupStates.forget_views`)."""
        if self._resident is None:
            raise ValueError(f"the {self.kind} store is on nvme: only resident tiers swap tensors")
        old = self._resident[name]
        if old.shape != tensor.shape or old.dtype != tensor.dtype or old.device != tensor.device:
            raise ValueError(f"{name}/{self.kind}: swapping {old.dtype} {tuple(old.shape)} on {old.device} for "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")  # fmt: skip
        self._resident[name] = tensor
        return old

    def discard(self, name: str) -> None:
        """Forget ``name``'s tensor if there is one (its bytes are freed)."""
        if self._resident is not None:
            self._resident.pop(name, None)
            return
        if self._kept is not None:
            self._kept.forget(self._key(name))
        if self._key(name) in self._space:
            self._space.delete(self._key(name))

    def writable(self, name: str) -> Lease:
        """A tensor shaped as ``name``'s to fill and then `put`: the tier's own on a resident
        tier (filling it is the write), a pool buffer on nvme (its contents undefined)."""
        if self._resident is not None:
            return Lease(self._resident[name])
        # (Also a name whose last write failed: a checkpoint's load writes it again, the
        # recovery a failed step asks for.)
        record = self._space.written_as(self._key(name))
        buffer = self._space.pool.acquire(max(record.nbytes, 1))
        return Lease(buffer.view(DTYPES[record.dtype], record.shape), buffer)


def release_unused(pendings) -> None:
    """Wait for reads whose leases will not be used and give them back (a read that failed
    holds nothing: its error is dropped)."""
    for p in pendings:
        try:
            p.result().release()
        except Exception:  # noqa: BLE001
            pass


class _Streamed:
    """One item of `stream_together`: the stores' tensors of one name, updated in place."""

    __slots__ = ("tensors", "write_back")

    def __init__(self, tensors):
        self.tensors = tensors
        self.write_back = True  # False: the item was not changed, nothing to write back


def stream_together(stores: Sequence[Store], names: Sequence[str], *, ahead: int,
                    ahead_bytes: int | None = None) -> Iterator[_Streamed]:  # fmt: skip
    """Each of ``names`` from every store in ``stores`` (one tier, one space), in order, as
    one item whose ``tensors`` the caller updates in place: on nvme, ``ahead`` items are read
    ahead and each is written back behind the caller (`infinity.swap.stream`) unless its
    ``write_back`` was set False; resident tiers lend their own tensors."""
    first = stores[0]
    if not first.uses_pool:  # resident
        for name in names:
            yield _Streamed(tuple(s._resident[name] for s in stores))
        return
    keys = [tuple(s.stream_member(name) for s in stores) for name in names]
    start = time.perf_counter()
    read = [0] * len(stores)  # bytes per store: every item is read, and written back unless told not to
    written = [0] * len(stores)
    items = stream(first._space, keys, ahead=ahead, ahead_bytes=ahead_bytes)
    try:
        # Iterate the stream itself, not a zip (which would not resume it after its last item,
        # and so skip that item's write-back).
        for i, item in enumerate(items):
            out = _Streamed(item.tensors)
            sizes = [s.streamed_bytes(names[i], t) for s, t in zip(stores, item.tensors)]
            read = [a + b for a, b in zip(read, sizes)]
            yield out
            item.write_back = out.write_back
            if out.write_back:
                written = [a + b for a, b in zip(written, sizes)]
    finally:
        items.close()  # also when the caller stops early: what is in flight finishes now
        # The stream overlaps its reads and writes; its wall time is their busy time.
        elapsed = time.perf_counter() - start
        for c in first._stats.both():
            t = c.tiers["nvme"]
            for s, r, w in zip(stores, read, written):
                t.count(s.kind, False, r)
                t.count(s.kind, True, w)
            t.read_busy.seconds += elapsed
            t.write_busy.seconds += elapsed
