"""Activations saved for backward, moved off the compute device: ``[activations] tier``.

Owns: the saved-tensor hooks of the engine's forward (`SavedTensors`, one pair that hands each
saved tensor to the first handler that takes it: the parameter views of `_schedule`, then this
tier), and for tier cpu or nvme the saved tensors it took: their copies in host memory or on
nvme, the order they were saved in, the reads ahead in backward, the bytes moved. Touches: the
host pool through `_admission` (the "activation" traffic class and its share), a swap space of
its own (nvme: its own arena, so the state's disk bound stays the state's: [Note: disk
footprint] in `_footprint`), `_transport` (the copies between device and host on a GPU),
`_stats`.

[Note: activations offloaded]
With activation checkpointing, what autograd keeps from forward to backward is, per block, the
block's inputs: torch.utils.checkpoint saves them with ``save_for_backward`` (a custom Function
in both its reentrant and non-reentrant forms) outside the block's own saved-tensor hooks, so
the engine's hooks, active around the whole forward, see them; inside a checkpointed block
torch's own hooks save nothing. Without checkpointing the engine's hooks see every saved tensor.
Each one of ``min_bytes`` or more that lives on the compute device, is dense, and is not a
parameter's memory (those are the parameter views' handler's or stay put) is packed as an
`_Saved`:

- nvme: moved in chunks of at most the plan's ``activation_chunk`` bytes, each through a pool
  buffer of the "activation" traffic class ([Note: traffic classes] in `_admission`) and
  written behind under a name of its own. On a CPU device the chunk is copied into its buffer
  at once, so the tensor is let go as soon as it is packed; a GPU copies it back on the
  copy-back side stream and holds the tensor until every chunk has landed. The chunks in the
  pool stay within the tier's share (`Plan.activations`): a chunk that finds it full first
  finishes the tier's own oldest transfer, so a tensor of any size moves through a budget of
  any size, and forward runs at most a share ahead of the drive.
- cpu (a GPU only): copied back into a pinned host tensor of its own (not the pool: held from
  forward to backward, as the cpu tier's state is), on the copy-back side stream. On a CPU
  device the cpu tier keeps tensors where they are: in host memory already.
- Autograd does not check a tensor that saved-tensor hooks packed for changes in place: the
  tier does. A CPU device copies the bytes at the pack, so no later change can alter them. On a
  GPU the tensor's version is noted at the pack and compared once its copies have landed (and
  at an unpack that finds it still held); a change means the bytes may not be the ones saved,
  and the unpack raises what autograd raises for such a change.

Backward unpacks them in about the reverse of the order they were saved in. Each unpack reads
the tensor back (the same bytes into a fresh tensor of the same size, strides and dtype, so the
backward computes exactly what it would have), keeps it for the other nodes that saved the same
tensor, and issues the reads of the ``depth`` tensors saved before it whose writes are done. On
a CPU device a read lands in the new tensor's own page-aligned memory (no pool buffer, no copy:
that memory is the compute's, as on the device tier); on a GPU each chunk is read into a pool
buffer and copied to the device on the side stream, and a read ahead takes only room that its
share has free now. Reads ahead give way, right after prefetches, when a transfer needed now
finds the pool full. A tensor saved twice (the same memory, size and strides) is packed once.
Names on disk are freed once read, or when the `_Saved` goes (a forward without backward) at
the next pass. Under ``nvme.verify = "always"`` (the default) every chunk read back is checked
against the checksum its write recorded before its bytes become the tensor or go to the device
([Note: reads checked off the caller's thread] in `infinity.swap._checksum`): a byte the drive
changed raises `SwapCorruption` naming the file, the chunk, its offset and the saved tensor.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref

import torch

from infinity.aio import empty_aligned
from infinity.swap import DTYPES, PoolExhausted, SwapCorruption

from ._admission import ACTIVATION
from ._pass import PassListener
from ._profile import region
from ._resources import open_activation_space, remove_made_dirs

_SWAPPABLE = frozenset(DTYPES.values())  # what the nvme tier can store; other dtypes stay where they are

MAX_IN_FLIGHT = 2  # tensors whose copies back to the host may be on their way at once (a GPU)


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


def _changed_error(shape, dtype, now, then, where: str) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a saved {tuple(shape)} {dtype} tensor is at version {now}; expected version {then} instead ({where})"
    )


class _Kept:
    """A saved tensor kept as it is. Autograd does not check a tensor that went through
    saved-tensor hooks for changes in place, so this does: backward on a tensor changed since
    it was saved raises, as it does without hooks, rather than compute with the new values."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        # Detached (its storage and version counter, no grad_fn; autograd puts its own back
        # on unpack): an output its own op saves (sigmoid's, exp's) held its node, which holds
        # this, a cycle through C++ the collector cannot see, so a forward with no backward
        # kept its graph for good (20 of 20 in an audit helper's repro; plain PyTorch frees them).
        self.tensor, self.version = t.detach(), t._version

    def check(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise _changed_error(t.shape, t.dtype, t._version, self.version,
                                 "the same error autograd raises without the engine's saved-tensor hooks")  # fmt: skip
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

    __slots__ = ("tensor", "source", "version", "names", "size", "stride", "dtype", "numel", "host", "read", "loaded",
                 "copying", "writing", "changed", "error", "__weakref__")  # fmt: skip

    def __init__(self, t: torch.Tensor):
        self.tensor = t  # the original, until its bytes are in host memory
        self.source = weakref.ref(t)  # the original while anything holds it (what another save of it finds)
        self.version = t._version
        self.names: list[str] = []  # nvme: its chunks' names in the swap space, until read back
        self.size, self.stride, self.dtype, self.numel = t.size(), t.stride(), t.dtype, t.numel()
        self.host = None  # cpu tier on a GPU: its pinned host copy
        self.read: _Read | None = None  # a read ahead in flight
        self.loaded: torch.Tensor | None = None  # read back, for every node that saved it
        self.copying = 0  # chunks (or the whole, cpu tier) being copied back from the GPU
        self.writing = 0  # chunks on their way to nvme
        self.changed = False  # changed in place before its bytes were in host memory
        self.error: BaseException | None = None  # a transfer of it failed

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def landed(self) -> None:
        """Its bytes are in host memory: let go of the tensor, noting a change in place."""
        t, self.tensor = self.tensor, None
        if t is not None and t._version != self.version:
            self.changed = True


class _InFlight:
    """A chunk (or a whole tensor) of a `_Saved` on its way: a copy back from the GPU into
    ``buffer`` (``is_copy``: a `_transport.Copy`; then written under ``name`` on nvme), or a
    write of ``buffer`` (a `SwapFuture`)."""

    __slots__ = ("saved", "carrier", "buffer", "name", "is_copy")

    def __init__(self, saved: _Saved, carrier, buffer=None, name: str | None = None, *, is_copy: bool = False):
        self.saved, self.carrier, self.buffer, self.name, self.is_copy = saved, carrier, buffer, name, is_copy

    def done(self) -> bool:
        return self.carrier.done()


class _Read:
    """The reads of a `_Saved`'s chunks: on a CPU device into ``out`` (page-aligned memory that
    becomes the tensor), on a GPU into pool buffers (``futures`` in chunk order; None for a
    chunk not issued yet: a read ahead that found its share full)."""

    __slots__ = ("out", "futures")

    def __init__(self, out, futures):
        self.out, self.futures = out, futures

    def drop(self) -> None:
        """Wait for what was issued and give its memory back (a read ahead nothing used)."""
        for future in self.futures:
            if future is None:
                continue
            try:
                result = future.result()
            except Exception:  # noqa: BLE001 - the read was for later; a later read says why
                continue
            if self.out is None:
                result.release()
        self.futures, self.out = [], None


class ActivationTier(PassListener):
    """Saved tensors of ``min_bytes`` or more moved to ``tier`` ("cpu" or "nvme") and back."""

    def __init__(self, tier: str, device: torch.device, *, pool, space, stats, admission,
                 copy_back=None, to_device=None, drain_copies=None, min_bytes: int = 1 << 20, depth: int = 2,
                 params=()):  # fmt: skip
        self.tier = tier
        self.device = device
        self.pool = pool
        self.space = space  # nvme: a swap space of the tier's own
        self.stats = stats
        self.admission = admission  # `_admission.Admission`: what gives way when the pool is full
        self.share = admission.plan.activations  # its chunks in the pool at most (nvme)
        self.chunk = admission.plan.activation_chunk  # bytes of a chunk through the pool (nvme)
        self.copy_back = copy_back  # `_transport.Copies` on a GPU (its `start`)
        self.to_device = to_device  # `_transport.Transport.to_device` on a GPU
        self.drain_copies = drain_copies or (lambda: None)  # wait for those copies, their buffers back
        self.min_bytes = min_bytes
        self.depth = depth
        self._params = params  # callable: the module's parameters (their memory is never saved here)
        self._param_ptrs: set[int] = set()
        self._order: list[weakref.ref] = []  # this pass's `_Saved`, in the order saved
        self._index: dict[int, int] = {}  # id(_Saved) -> position in ``_order``
        self._dedup: dict[tuple, weakref.ref] = {}
        self._flight: collections.deque[_InFlight] = collections.deque()
        self._names = itertools.count()
        self._dead: collections.deque[str] = collections.deque()  # names whose `_Saved` went unread
        self._lock = threading.RLock()  # unpack may run on autograd's device threads
        self.active = tier == "nvme" or (tier == "cpu" and device.type != "cpu")
        self.made_dirs: list[str] = []  # nvme.paths made for the tier's space, removed at close
        if tier == "nvme" and self.chunk <= 0:
            raise ValueError("the activation tier on nvme needs a chunk size (the plan's activation_chunk)")

    # -- the pass ---------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A forward begins: names left by tensors never read back go; the parameters' memory
        is noted (it moves as units are fetched, so at each pass)."""
        with self._lock:
            self.drop_reads()
            self._settle()  # a forward without backward before: its writes done, their names known
            self._forget_dead()
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in self._params()}
            self._order, self._index, self._dedup = [], {}, {}

    def end_forward(self, expected=None) -> None:
        """Forward is done: start reading the last saved (backward needs them first)."""
        with self._lock:
            self._dedup = {}
            self._settle(done_only=True)
            self._read_ahead(len(self._order))

    def end_backward(self) -> None:
        """Backward is done: every transfer finished, reads ahead nothing used given back."""
        with self._lock:
            try:
                self._settle()
            finally:
                self.drop_reads()
                self._forget_dead()

    def close(self) -> None:
        """Finish what is on its way, give back every buffer, close the swap space (its files go)."""
        with self._lock:
            try:
                while self._flight:
                    item = self._flight.popleft()
                    try:
                        item.carrier.wait() if item.is_copy else item.carrier.result()
                    except Exception:  # noqa: BLE001 - closing: what it carried is dropped
                        pass
                    if item.buffer is not None and hasattr(item.buffer, "release"):
                        item.buffer.release()
                self.drop_reads()
            finally:
                self._order, self._index, self._dedup = [], {}, {}
                if self.space is not None:
                    self.space.close()
                    remove_made_dirs(self.made_dirs)

    # -- pack -------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        if not self.active or t.device != self.device or t.numel() * t.element_size() < self.min_bytes:
            return None
        if t.layout != torch.strided or not dense_span(t):
            return None
        if self.tier == "nvme" and t.dtype not in _SWAPPABLE:
            return None  # a dtype the swap space has no name for (uint16, say): left with autograd
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
            if saved is not None and saved.source() is t and saved.version == t._version:
                return saved  # the same tensor, saved again by another node (its memory is not another's yet)
            saved = _Saved(t)
            with region("infinity::activation_out"):
                self._settle(done_only=True)
                if self.tier == "cpu":
                    self._send_host(saved, _span(t))
                else:
                    self._send_chunks(saved, _span(t))
            self._index[id(saved)] = len(self._order)
            self._order.append(weakref.ref(saved))
            self._dedup[key] = weakref.ref(saved)
            if saved.names:
                weakref.finalize(saved, self._dead.extend, list(saved.names))  # freed at the next pass
            for c in self.stats.both():
                c.activation_out_bytes += saved.nbytes
            return saved

    def _send_host(self, saved: _Saved, flat: torch.Tensor) -> None:
        """cpu tier on a GPU: back into a pinned tensor of its own, on the side stream."""
        while sum(1 for item in self._flight if item.is_copy) >= MAX_IN_FLIGHT:
            self._finish(self._flight.popleft())
        host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
        self._flight.append(_InFlight(saved, self.copy_back.start(flat, host), host, is_copy=True))
        saved.copying = 1

    def _send_chunks(self, saved: _Saved, flat: torch.Tensor) -> None:
        """nvme: each chunk through a pool buffer, written behind under a name of its own."""
        per = self.chunk // flat.element_size()
        if self.device.type != "cpu":
            # Every chunk counts from the start: the tensor is let go (and checked for changes in
            # place) only once the last one has landed, not when the first ones have while the
            # rest are still to be copied (`_take` finishes earlier transfers, these among them).
            saved.copying = -(-flat.numel() // per)
        for lo in range(0, flat.numel(), per):
            piece = flat[lo : lo + per]
            buffer = self._take(piece.numel() * piece.element_size())
            name = f"act/{next(self._names)}"
            saved.names.append(name)
            try:
                view = buffer.view(piece.dtype, (piece.numel(),))
                if self.device.type == "cpu":
                    view.copy_(piece)
                    with self.pool.traffic(ACTIVATION):  # (a staged tail, where the chunk ends mid-block)
                        carrier, name_after = self.space.put(name, view), None
                else:
                    carrier, name_after = self.copy_back.start(piece, view), name
            except BaseException:
                buffer.release()
                raise
            self._flight.append(_InFlight(saved, carrier, buffer, name_after, is_copy=name_after is not None))
            if name_after is None:
                saved.writing += 1
        if self.device.type == "cpu":
            saved.landed()  # every byte copied: nothing done to the tensor from now alters them

    def _take(self, nbytes: int):
        """A pool buffer for a chunk on its way out: within the tier's share, finishing its own
        oldest transfer while the share or the pool is full; with none of its own left, what
        waits in the pool for later gives way ([Note: traffic classes] in `_admission`)."""
        while True:
            if self.pool.in_use_by(ACTIVATION) + nbytes <= self.share:
                try:
                    return self.pool.acquire(nbytes, timeout=0, traffic=ACTIVATION)
                except PoolExhausted:
                    pass
            if self._flight:
                self._finish(self._flight.popleft())
                continue
            return self.admission.take_now(lambda t: self.pool.acquire(nbytes, timeout=t, traffic=ACTIVATION))

    def _settle(self, done_only: bool = False) -> None:
        """Finish, oldest first, the transfers that are done (``done_only``), or all of them."""
        while self._flight and (not done_only or self._flight[0].done()):
            self._finish(self._flight.popleft())

    def _finish(self, item: _InFlight) -> None:
        saved, buffer = item.saved, item.buffer
        try:
            if not item.is_copy:  # a chunk's write
                saved.writing -= 1
                item.carrier.result()
                return
            saved.copying -= 1
            item.carrier.wait()  # a copy back from the GPU into ``buffer``
            if saved.copying == 0:
                saved.landed()
            if self.tier == "cpu":
                saved.host, buffer = buffer, None
                return
            future = self.space.put(item.name, buffer.view(saved.dtype, (buffer.nbytes // saved.dtype.itemsize,)))
            saved.writing += 1
            self._flight.append(_InFlight(saved, future, buffer))  # the buffer goes once written
            buffer = None
        except BaseException as e:
            saved.error = e
            raise
        finally:
            if buffer is not None and hasattr(buffer, "release"):
                buffer.release()

    # -- unpack -----------------------------------------------------------------------------
    def unpack(self, saved: _Saved) -> torch.Tensor:
        with self._lock:
            if saved.loaded is None:
                t = saved.tensor
                if t is not None and t._version == saved.version:
                    return t  # not in host memory yet: the original is still here, unchanged
                if t is not None or saved.changed:
                    raise _changed_error(saved.size, saved.dtype, "a later one", saved.version,
                                         f"changed before the activation tier ([activations] tier = {self.tier!r}) "
                                         "stored it; autograd raises this without the tier too")  # fmt: skip
                with region("infinity::activation_in"):
                    saved.loaded = self._load(saved)
                for c in self.stats.both():
                    c.activation_in_bytes += saved.nbytes
                position = self._index.get(id(saved))
                if position is not None:
                    self._read_ahead(position)
            return saved.loaded

    def _load(self, saved: _Saved) -> torch.Tensor:
        while saved.copying or saved.writing:  # still on its way: finish up to its transfers
            if not self._flight:
                break
            self._finish(self._flight.popleft())
        if saved.error is not None or saved.copying or saved.writing or (saved.host is None and not saved.names):
            raise RuntimeError(f"a saved {tuple(saved.size)} {saved.dtype} activation is in no tier (a transfer of "
                               f"it failed: {saved.error!r}): run the step's micro-batches again after zero_grad()")  # fmt: skip
        if saved.host is not None:  # cpu tier on a GPU
            host, saved.host = saved.host, None
            return self.to_device(_Pinned(host)).as_strided(saved.size, saved.stride)
        read, saved.read = saved.read, None
        names = saved.names
        try:
            if read is None:
                read = self._start_read(saved, ahead=False)
            flat = self._finish_read(saved, read, names)
        except SwapCorruption as e:  # its chunk's name alone would not tell the user what it held
            raise SwapCorruption(e.tensor, e.filename, e.offset, e.expected, e.actual,
                                 context=f"a chunk of a saved {tuple(saved.size)} {saved.dtype} activation") from e
        finally:
            saved.names = []
            for name in names:  # read (or failed): the tier has no use for them any more
                if name in self.space:
                    self.space.delete(name)
        return flat.as_strided(saved.size, saved.stride, flat.storage_offset())  # (aligned memory starts inside its mapping)

    def _start_read(self, saved: _Saved, *, ahead: bool) -> _Read:
        """Issue the reads of ``saved``'s chunks. A CPU device reads all of them into the
        tensor's own new memory. A GPU reads into pool buffers: ahead, what the tier's share has
        room for now, in order; needed now, none yet (`_finish_read` reads them one by one)."""
        if self.device.type == "cpu":
            out = empty_aligned(saved.nbytes, pin=False).view(saved.dtype)
            per = self.chunk // saved.dtype.itemsize
            with self.pool.traffic(ACTIVATION):  # (a staged tail, where a chunk ends mid-block)
                futures = [self.space.get(name, out=out[i * per : (i + 1) * per], urgent=not ahead)  # needed now: first
                           for i, name in enumerate(saved.names)]  # fmt: skip
            return _Read(out, futures)
        futures = [None] * len(saved.names)
        if ahead:
            for i, name in enumerate(saved.names):
                futures[i] = self._read_if_room(name)
                if futures[i] is None:
                    break
        return _Read(None, futures)

    def _read_if_room(self, name: str):
        """A chunk's read into a pool buffer if the tier's share and the pool have room now (a
        GPU), else None."""
        if self.pool.in_use_by(ACTIVATION) + self.space.info(name).nbytes > self.share:
            return None
        try:
            with self.pool.traffic(ACTIVATION):
                return self.space.get(name, timeout=0)
        except PoolExhausted:
            return None

    def _read_now(self, name: str):
        """A chunk's read needed now (a GPU): the copies to the device done give their buffers
        back first, then what waits in the pool for later gives way."""
        if self.pool.in_use_by(ACTIVATION) + self.space.info(name).nbytes > self.share:
            self.drain_copies()
        with self.pool.traffic(ACTIVATION):
            return self.admission.take_now(lambda t: self.space.get(name, timeout=t, urgent=True))

    def _finish_read(self, saved: _Saved, read: _Read, names: list[str]) -> torch.Tensor:
        futures, read.futures = read.futures, []
        if read.out is not None:  # a CPU device: the reads land in the tensor itself
            for future in futures:
                future.result()
            return read.out[: saved.numel]
        flat = torch.empty(saved.numel, dtype=saved.dtype, device=self.device)
        per = self.chunk // saved.dtype.itemsize
        try:
            for i, name in enumerate(names):  # each chunk to the device on the side stream
                future, futures[i] = futures[i], None
                if future is None:
                    future = self._read_now(name)
                if i + 1 < len(names) and futures[i + 1] is None:  # the next on its way meanwhile
                    futures[i + 1] = self._read_if_room(names[i + 1])
                buffer = future.result()
                try:
                    out = flat[i * per : (i + 1) * per]
                    self.to_device(_Lease(buffer, saved.dtype, out.numel()), out=out)
                except BaseException:
                    buffer.release()
                    raise
        finally:
            _Read(None, futures).drop()  # the chunks an error left unread: their buffers back
        return flat

    def _read_ahead(self, position: int) -> None:
        """Issue the reads of up to ``depth`` tensors saved before ``position`` (the next ones
        backward needs) whose writes are done."""
        if self.space is None:
            return
        issued = 0
        for i in range(position - 1, -1, -1):
            if issued >= self.depth:
                return
            saved = self._order[i]()
            if saved is None or saved.loaded is not None or not saved.names or saved.tensor is not None:
                continue
            if saved.writing or saved.copying:
                return  # still on its way: read when needed (the drive is busy with it anyway)
            if saved.read is None:
                saved.read = self._start_read(saved, ahead=True)
                if self.device.type != "cpu" and saved.read.futures and saved.read.futures[-1] is None:
                    return  # the share is full: the rest when needed
            issued += 1

    def drop_reads(self) -> None:
        """Give back what reads ahead hold that nothing used yet (a backward that stopped, or a
        transfer needed now that finds the pool full)."""
        with self._lock:
            for ref in self._order:
                saved = ref()
                if saved is not None and saved.read is not None:
                    read, saved.read = saved.read, None
                    read.drop()

    def _forget_dead(self) -> None:
        while self._dead:
            name = self._dead.popleft()
            if self.space is not None and name in self.space:
                self.space.delete(name)


def _span(t: torch.Tensor) -> torch.Tensor:
    """The contiguous stretch of storage ``t`` covers (`dense_span`), as a 1-D tensor."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class _Lease:
    """A pool buffer's bytes as ``dtype``, as `_transport.Copies.to_device` takes it
    (``tensor``, ``release``): released once copied."""

    __slots__ = ("tensor", "_buffer")

    def __init__(self, buffer, dtype: torch.dtype, numel: int | None = None):
        self._buffer = buffer
        # ``numel``: the chunk's own elements; a pool buffer is rounded up to whole pages, so a
        # tensor's last, shorter chunk holds fewer than the buffer does.
        self.tensor = buffer.view(dtype, (buffer.nbytes // dtype.itemsize if numel is None else numel,))

    def release(self) -> None:
        self._buffer.release()


class _Pinned:
    """A pinned host tensor as `_transport.Copies.to_device` takes it: let go once copied."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def release(self) -> None:
        self.tensor = None


def in_pool(cfg) -> bool:
    """Whether ``cfg``'s activation tier moves tensors through the host pool (its share is in
    the plan: [Note: traffic classes] in `_admission`): on nvme, whatever the device."""
    return cfg.activations.tier == "nvme"


def build(cfg, *, rank: int, local_rank: int, aio, pool, transport, stats, params, admission):
    """The activation tier of ``cfg``, for the scheduler's saved-tensor hooks and passes
    (`_schedule.Scheduler` takes it); None where activations stay on the device (or a CPU
    device's host memory)."""
    tier, device = cfg.activations.tier, transport.device
    if tier == "device" or (tier == "cpu" and device.type == "cpu"):
        return None
    space, made = open_activation_space(cfg, rank, local_rank, aio, pool) if tier == "nvme" else (None, [])
    act = ActivationTier(tier, device, pool=pool, space=space, stats=stats, admission=admission,
                         copy_back=transport.copies, to_device=transport.to_device,
                         drain_copies=(lambda: transport.copies.drain(block=True)) if transport.copies else None,
                         min_bytes=cfg.activations.min_bytes, depth=cfg.activations.depth, params=params)  # fmt: skip
    act.made_dirs = made
    return act
