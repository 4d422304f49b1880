"""Activations saved for backward, moved off the compute device: ``[activations] tier``.

Owns: the saved-tensor hooks of the engine's forward (`SavedTensors`, one pair that hands each
saved tensor to the first handler that takes it: the parameter views of `_schedule`, then this
tier), and for tier cpu or nvme the saved tensors it took: their copies in host memory or on
nvme, the order they were saved in, the reads ahead in backward, the bytes moved. Touches: the
host pool (buffers of reads and copies), a swap space of its own (nvme: its own arena, so the
state's disk bound stays the state's: [Note: disk footprint] in `_footprint`), `_transport`
(the copies between device and host on a GPU), `_stats`.

[Note: activations offloaded]
With activation checkpointing, what autograd keeps from forward to backward is, per block, the
block's inputs: torch.utils.checkpoint saves them with ``save_for_backward`` (a custom Function
in both its reentrant and non-reentrant forms) outside the block's own saved-tensor hooks, so
the engine's hooks, active around the whole forward, see them; inside a checkpointed block
torch's own hooks save nothing. Without checkpointing the engine's hooks see every saved tensor.
Each one of ``min_bytes`` or more that lives on the compute device, is dense, and is not a
parameter's memory (those are the parameter views' handler's or stay put) is packed as an
`_Saved`:

- nvme: written behind to the tier's swap space straight from its memory on a CPU device (a
  GPU copies it back into a pool buffer on the copy-back side stream first, and writes from
  that); cpu (a GPU only): copied back into a pool buffer, kept there. On a CPU device the cpu
  tier keeps tensors where they are: in host memory already.
- At most ``MAX_IN_FLIGHT`` are on their way (copied or written); once its bytes are stored the
  `_Saved` lets go of the tensor, whose memory goes as soon as nothing else holds it.
- Autograd does not check a tensor that saved-tensor hooks packed for changes in place: the
  tier does, since it reads the bytes after the pack. The tensor's version is noted at the
  pack and compared once its bytes are stored (and at an unpack that finds it still held); a
  change means the bytes may not be the ones saved, and the unpack raises what autograd
  raises for such a change. A change after the tier let go of it cannot alter what it stored:
  the backward computes with the values saved, as it would have without the change.

Backward unpacks them in about the reverse of the order they were saved in. Each unpack reads
the tensor back (a pool buffer, copied into a fresh tensor of the same size, strides and
dtype: the same bytes, so the backward computes exactly what it would have), keeps it for the
other nodes that saved the same tensor, and issues the reads of the ``depth`` tensors saved
before it, if the pool has room now (a read taken now waits for room; a read ahead never
does). A tensor saved twice (the same memory, size and strides) is packed once. Names on disk
are freed once read, or when the `_Saved` goes (a forward without backward) at the next pass.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref

import torch
from torch.profiler import record_function

from infinity.swap import PoolExhausted, WriteBehind

MAX_IN_FLIGHT = 2  # activations on their way to the tier (each holds its tensor's memory until stored)


class SavedTensors:
    """The engine's one pair of saved-tensor hooks: each saved tensor goes to the first handler
    (a ``pack``, ``unpack`` pair) whose ``pack`` takes it (returns something other than None),
    and back through its ``unpack``; one no handler takes is saved as it is."""

    def __init__(self):
        self.handlers: list[tuple] = []

    def add(self, pack, unpack) -> None:
        self.handlers.append((pack, unpack))

    def pack(self, t: torch.Tensor):
        for pack, unpack in self.handlers:
            packed = pack(t)
            if packed is not None:
                return _Packed(unpack, packed)
        return _Kept(t)

    @staticmethod
    def unpack(saved):
        if isinstance(saved, _Packed):
            return saved.unpack(saved.value)
        if isinstance(saved, _Kept):
            return saved.check()
        return saved


class _Packed:
    __slots__ = ("unpack", "value")

    def __init__(self, unpack, value):
        self.unpack, self.value = unpack, value


class _Kept:
    """A saved tensor kept as it is. Autograd does not check a tensor that went through
    saved-tensor hooks for changes in place, so this does: backward on a tensor changed since
    it was saved raises, as it does without hooks, rather than compute with the new values."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.version = t, t._version

    def check(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a saved {tuple(t.shape)} {t.dtype} tensor is at version {t._version}; expected version "
                f"{self.version} instead (the same error autograd raises without the engine's saved-tensor hooks)"
            )  # fmt: skip
        return t


def dense_span(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill a contiguous stretch of its storage exactly once (any
    order of dimensions): it can be saved and restored as that stretch, strides and all."""
    if t.numel() == 0:
        return False
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.size(), t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Saved:
    """One saved tensor in the activation tier (see [Note: activations offloaded])."""

    __slots__ = ("tensor", "version", "name", "size", "stride", "dtype", "numel", "host", "read", "loaded",
                 "changed", "__weakref__")  # fmt: skip

    def __init__(self, t: torch.Tensor):
        self.tensor = t  # the original, until its bytes are stored
        self.version = t._version
        self.name: str | None = None  # nvme: its name in the swap space, until read back
        self.size, self.stride, self.dtype, self.numel = t.size(), t.stride(), t.dtype, t.numel()
        self.host = None  # cpu tier on a GPU: the pool buffer holding it
        self.read = None  # a read ahead in flight (a SwapFuture of a pool buffer)
        self.loaded: torch.Tensor | None = None  # read back, for every node that saved it
        self.changed = False  # changed in place before its bytes were stored

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def stored(self) -> None:
        """Its bytes are in the tier: let go of the tensor, noting a change in place."""
        t, self.tensor = self.tensor, None
        if t is not None and t._version != self.version:
            self.changed = True


class _InFlight:
    """A `_Saved` on its way: ``done``/``wait`` on what carries it (a copy or a write)."""

    __slots__ = ("saved", "carrier", "buffer")

    def __init__(self, saved: _Saved, carrier, buffer=None):
        self.saved, self.carrier, self.buffer = saved, carrier, buffer

    def done(self) -> bool:
        return self.carrier.done()


class ActivationTier:
    """Saved tensors of ``min_bytes`` or more moved to ``tier`` ("cpu" or "nvme") and back."""

    def __init__(self, tier: str, device: torch.device, *, pool, space, stats, copy_back=None, to_device=None,
                 min_bytes: int = 1 << 20, depth: int = 2, params=(), relieve=None):  # fmt: skip
        self.tier = tier
        self.device = device
        self.pool = pool
        self.space = space  # nvme: a swap space of the tier's own
        self.stats = stats
        self.copy_back = copy_back  # `_transport.CopyBack` on a GPU
        self.to_device = to_device  # `_transport.Transport.to_device` on a GPU
        self.min_bytes = min_bytes
        self.depth = depth
        self._params = params  # callable: the module's parameters (their memory is never saved here)
        self._relieve = relieve  # callable: the engine gives back pool memory that waits for later
        self._param_ptrs: set[int] = set()
        self._order: list[weakref.ref] = []  # this pass's `_Saved`, in the order saved
        self._index: dict[int, int] = {}  # id(_Saved) -> position in ``_order``
        self._dedup: dict[tuple, weakref.ref] = {}
        self._flight: collections.deque[_InFlight] = collections.deque()
        self._names = itertools.count()
        self._dead: collections.deque[str] = collections.deque()  # names whose `_Saved` went unread
        self._lock = threading.RLock()  # unpack may run on autograd's device threads
        self.active = tier == "nvme" or (tier == "cpu" and device.type != "cpu")

    # -- the pass ---------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A forward begins: names left by tensors never read back go; the parameters' memory
        is noted (it moves as units are fetched, so at each pass)."""
        with self._lock:
            self._drop_reads()
            self._forget_dead()
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in self._params()}
            self._order, self._index, self._dedup = [], {}, {}

    def end_forward(self) -> None:
        """Forward is done: start reading the last saved (backward needs them first)."""
        with self._lock:
            self._dedup = {}
            self._read_ahead(len(self._order))

    def end_backward(self) -> None:
        """Backward is done: every transfer finished, reads ahead nothing used given back."""
        with self._lock:
            try:
                self._settle(0)
            finally:
                self._drop_reads()
                self._forget_dead()

    def close(self) -> None:
        """Finish what is on its way, give back every buffer, close the swap space (its files go)."""
        with self._lock:
            try:
                while self._flight:
                    item = self._flight.popleft()
                    try:
                        item.carrier.result() if hasattr(item.carrier, "result") else item.carrier.wait()
                    except Exception:  # noqa: BLE001 - closing: what it carried is dropped
                        pass
                    if item.buffer is not None:
                        item.buffer.release()
                self._drop_reads()
            finally:
                self._order, self._index, self._dedup = [], {}, {}
                if self.space is not None:
                    self.space.close()

    # -- pack -------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if not self.active or t.device != self.device or t.numel() * t.element_size() < self.min_bytes:
            return None
        if t.layout != torch.strided or not dense_span(t):
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        if ptr in self._param_ptrs:
            return None
        key = (ptr, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype)
        with self._lock:
            known = self._dedup.get(key)
            saved = known() if known is not None else None
            if saved is not None and saved.tensor is not None and saved.version == t._version:
                return saved  # the same tensor, saved again by another node
            saved = _Saved(t)
            with record_function("infinity::activation_out"):
                self._settle(MAX_IN_FLIGHT - 1)
                self._send(saved, _span(t))
            self._index[id(saved)] = len(self._order)
            self._order.append(weakref.ref(saved))
            self._dedup[key] = weakref.ref(saved)
            if saved.name is not None:
                weakref.finalize(saved, self._dead.append, saved.name)  # freed at the next pass
            for c in self.stats.both():
                c.activation_out_bytes += saved.nbytes
            return saved

    def _send(self, saved: _Saved, flat: torch.Tensor) -> None:
        if self.device.type == "cpu":  # nvme, from the tensor's own memory
            saved.name = f"act/{next(self._names)}"
            self._flight.append(_InFlight(saved, self.space.put(saved.name, flat)))
            return
        buffer = self.pool.acquire(saved.nbytes)  # a GPU: back to a pool buffer on the side stream
        try:
            copy = self.copy_back.start(flat, buffer.view(flat.dtype, (flat.numel(),)))
        except BaseException:
            buffer.release()
            raise
        self._flight.append(_InFlight(saved, copy, buffer))

    def _settle(self, keep: int) -> None:
        """Finish, oldest first, the transfers that are done, and wait for the oldest until at
        most ``keep`` are on their way."""
        while self._flight and (len(self._flight) > keep or self._flight[0].done()):
            self._finish(self._flight.popleft())

    def _finish(self, item: _InFlight) -> None:
        saved, buffer = item.saved, item.buffer
        try:
            if buffer is None:  # a write from the tensor's memory
                item.carrier.result()
                saved.stored()
                return
            item.carrier.wait()  # a copy back from the GPU into ``buffer``
            saved.stored()
            if self.tier == "cpu":
                saved.host, buffer = buffer, None
                return
            saved.name = f"act/{next(self._names)}"
            future = self.space.put(saved.name, buffer.view(saved.dtype, (saved.numel,)))
            weakref.finalize(saved, self._dead.append, saved.name)
            self._flight.append(_InFlight(saved, future, buffer))  # the buffer goes once written
            buffer = None
        finally:
            if buffer is not None:
                buffer.release()

    # -- unpack -----------------------------------------------------------------------------
    def unpack(self, saved: _Saved) -> torch.Tensor:
        with self._lock:
            if saved.loaded is None:
                t = saved.tensor
                if t is not None and t._version == saved.version:
                    return t  # not stored yet: the original is still here, unchanged
                if t is not None or saved.changed:
                    raise RuntimeError(
                        "one of the variables needed for gradient computation has been modified by an inplace "
                        f"operation: a saved {tuple(saved.size)} {saved.dtype} tensor changed (version "
                        f"{saved.version} when saved) before the activation tier ([activations] tier = "
                        f"{self.tier!r}) stored it; autograd raises this without the tier too"
                    )  # fmt: skip
                with record_function("infinity::activation_in"):
                    saved.loaded = self._load(saved)
                for c in self.stats.both():
                    c.activation_in_bytes += saved.nbytes
                position = self._index.get(id(saved))
                if position is not None:
                    self._read_ahead(position)
            return saved.loaded

    def _load(self, saved: _Saved) -> torch.Tensor:
        if saved.host is not None:  # cpu tier on a GPU
            buffer, saved.host = saved.host, None
            return self.to_device(_Lease(buffer, saved)).as_strided(saved.size, saved.stride, 0)
        while saved.name is None:  # still on its way (a GPU copies, then writes)
            if not self._flight:
                raise RuntimeError(f"a saved {tuple(saved.size)} {saved.dtype} activation is in no tier (an earlier "
                                   "transfer of it failed): run the step's micro-batches again after zero_grad()")  # fmt: skip
            self._finish(self._flight.popleft())
        if saved.read is None:
            saved.read = self._read(saved.name)
        future, saved.read = saved.read, None
        name, saved.name = saved.name, None
        try:
            buffer = future.result()
        finally:
            self.space.delete(name)  # read (or failed): the tier has no use for it any more
        try:
            if self.device.type == "cpu":
                flat = torch.empty(saved.numel, dtype=saved.dtype)
                flat.copy_(buffer.view(saved.dtype, (saved.numel,)))
                buffer.release()
            else:
                flat = self.to_device(_Lease(buffer, saved))
        except BaseException:
            buffer.release()
            raise
        return flat.as_strided(saved.size, saved.stride, 0)

    def _read(self, name: str):
        """A read needed now: reads ahead and what waits in the pool for later give way first."""
        try:
            return self.space.get(name, timeout=0, urgent=True)
        except PoolExhausted:
            self._drop_reads()
            if self._relieve is not None:
                self._relieve()
            return self.space.get(name, urgent=True)

    def _read_ahead(self, position: int) -> None:
        """Issue the reads of up to ``depth`` tensors saved before ``position`` (the next ones
        backward needs) while the pool has room now."""
        if self.space is None:
            return
        issued = 0
        for i in range(position - 1, -1, -1):
            if issued >= self.depth:
                return
            saved = self._order[i]()
            if saved is None or saved.loaded is not None or saved.name is None or saved.tensor is not None:
                continue
            if saved.read is None:
                try:
                    saved.read = self.space.get(saved.name, timeout=0)
                except PoolExhausted:
                    return
            issued += 1

    def _drop_reads(self) -> None:
        """Give back the buffers of reads ahead that nothing used (a backward that stopped)."""
        for ref in self._order:
            saved = ref()
            if saved is not None and saved.read is not None:
                future, saved.read = saved.read, None
                try:
                    future.result().release()
                except Exception:  # noqa: BLE001 - the read was for later; a later read says why
                    pass

    def _forget_dead(self) -> None:
        while self._dead:
            name = self._dead.popleft()
            if self.space is not None and name in self.space:
                self.space.delete(name)


def _span(t: torch.Tensor) -> torch.Tensor:
    """The contiguous stretch of storage ``t`` covers (`dense_span`), as a 1-D tensor."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class _Lease:
    """A pool buffer as `_transport.CopyStream.to_device` takes it (``tensor``, ``release``)."""

    __slots__ = ("tensor", "_buffer")

    def __init__(self, buffer, saved: _Saved):
        self._buffer = buffer
        self.tensor = buffer.view(saved.dtype, (saved.numel,))

    def release(self) -> None:
        self._buffer.release()


def attach(scheduler, cfg, *, rank: int, local_rank: int, aio, pool, transport, stats, params):
    """The activation tier of ``cfg`` plugged into ``scheduler``'s saved-tensor hooks and
    passes; None where activations stay on the device (or a CPU device's host memory)."""
    from ._resources import open_activation_space

    tier, device = cfg.activations.tier, transport.device
    if tier == "device" or (tier == "cpu" and device.type == "cpu"):
        return None
    space = open_activation_space(cfg, rank, local_rank, aio, pool) if tier == "nvme" else None
    act = ActivationTier(tier, device, pool=pool, space=space, stats=stats, copy_back=transport.copy_back,
                         to_device=transport.to_device, min_bytes=cfg.activations.min_bytes,
                         depth=cfg.activations.depth, params=params, relieve=scheduler._relieve_pool)  # fmt: skip
    scheduler.saved.add(act.pack, act.unpack)
    scheduler.activations = act
    return act
