"""The per-unit runtime: a unit's fetch, bind and release, and its gradient gathered in backward.

Owns: each unit's way between its states (`_units.UnitState`: released, fetching, ready): the
read issued (`start_fetch`), waited for and bound (`materialize`), given back (`release`,
`drop_fetch`); the units bound and kept for backward (`Kept`: the prefetcher decides which,
`_prefetch`); which storage belongs to which bound unit, for the saved-tensor hooks
([Note: saved parameter views] in `_schedule`: `pack_view`, `unpack_view`); and the gradient of
each unit in backward: gathered from its parameters (`grad_arrived`) and tiles (`tile_grad`),
counted against its uses, handed to `_grads.GradAccumulator` when its last arrives
([Note: gradient hand-over] in `_schedule`). Touches: the params `Store` (leases),
`_transport.Transport` (copies to the device, the all-gather), the pool (gradient buffers).

The pass hooks (`_schedule.Scheduler`), the prefetcher, a tiled module's forward and backward
(`_tiled`) and ``GatheredParameters`` (`_gather`) all fetch and release through this one
object, so the state of a unit changes in one place.
"""

from __future__ import annotations

import contextlib
import time

import torch

from infinity.swap import PoolExhausted

from ._admission import FETCH, GRAD, OVERLAP, PREFETCH, Admission
from ._grads import GradAccumulator
from ._interrupts import held_interrupts
from ._profile import region
from ._sizes import clear_grads, grad_of, set_grad
from ._stats import Stats
from ._store import Store
from ._transport import Transport
from ._units import ParamUnit, UnitState


def traffic(pool, name: str):
    """Count the pool buffers taken inside under traffic class ``name`` ([Note: traffic classes])."""
    return pool.traffic(name) if pool is not None else contextlib.nullcontext()


def _own_fp32(grad: torch.Tensor, numel: int) -> bool:
    """Whether ``grad`` is fp32 and all of its own memory, ``numel`` elements (not a view of a
    larger tensor): the tensor a grads tier can take in place of its own ([Note: gradient
    hand-over] in `_schedule`)."""
    return (grad.dtype == torch.float32 and grad.is_contiguous() and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == numel * 4)  # fmt: skip


class _UnitView:
    """A saved tensor that is a view of a unit's memory, kept by position, not by memory."""

    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit, offset, size, stride):
        self.unit, self.offset, self.size, self.stride = unit, offset, size, stride


class Kept:
    """The units bound after their forward for backward, the oldest first, and the bytes of
    parameters they hold ([Note: kept for backward] in `_schedule`)."""

    def __init__(self, itemsize: int):
        self._itemsize = itemsize
        self._units: dict[int, ParamUnit] = {}
        self.nbytes = 0

    def __contains__(self, unit: ParamUnit) -> bool:
        return unit.index in self._units

    def __bool__(self) -> bool:
        return bool(self._units)

    def add(self, unit: ParamUnit) -> None:
        """``unit`` kept, as the newest (backward needs it first)."""
        self.discard(unit)
        self._units[unit.index] = unit
        self.nbytes += unit.padded_numel * self._itemsize

    def discard(self, unit: ParamUnit) -> bool:
        """``unit`` no longer kept; whether it was."""
        if self._units.pop(unit.index, None) is None:
            return False
        self.nbytes -= unit.padded_numel * self._itemsize
        return True

    def oldest(self) -> ParamUnit:
        return next(iter(self._units.values()))

    def units(self) -> list[ParamUnit]:
        return list(self._units.values())


class UnitRuntime:
    """Fetches, binds and releases units, and gathers their gradients in backward."""

    def __init__(self, units: list[ParamUnit], store: Store, grads: GradAccumulator, stats: Stats,
                 transport: Transport, *, gather: bool, admission: Admission, on_unit_final=None,
                 keep_grad=None):  # fmt: skip
        self.units = units
        self.store = store
        self.grads = grads
        self.stats = stats
        self.transport = transport
        self.device = transport.device
        self.pool = transport.pool  # host buffers for gradients gathered on a CPU device
        # What gives way when a fetch finds the pool full: see [Note: traffic classes] in `_admission`.
        self.admission = admission
        # Stage 3 across ranks: the tier holds this rank's shard; materialising gathers the rest.
        self.gather = gather
        # Units always materialised: the tier lends its own tensors on the compute device.
        self.always_ready = store.in_place_on(self.device) and not gather
        # Gradients gathered straight into pool buffers (a CPU device with a pool); else on the
        # device, whence `_grads` copies them back ([Note: gradients copied back]).
        self.grads_in_pool = self.device.type == "cpu" and self.pool is not None
        self.kept = Kept(transport.dtype.itemsize)
        # The engine's overlap (see _overlap): told when a unit's gradient is stored.
        self.on_unit_final = on_unit_final
        # A whole unit's gradient goes straight into the grads tier's tensor on this device (`_took_whole`).
        self._in_place = grads.store.in_place_on(self.device)
        self.keep_grad = keep_grad  # ... and asked whether to keep a gradient in memory for it
        self._by_storage: dict[int, ParamUnit] = {}  # storage address -> READY unit (released-able)
        self._received = 0  # gradients received since `take_received` last asked

    # -- fetch and release ------------------------------------------------------------------
    def start_fetch(self, unit: ParamUnit, wait: bool = True) -> bool:
        """Issue the read of ``unit``. A prefetch (``wait=False``) takes pool memory only if it
        is free now (False when it is not); a fetch that is needed now first gives back what
        prefetches hold."""
        # Urgent: forward and backward wait on these, not on the optimizer's reads ahead (the
        # early updates under backward queue theirs on the same drive).
        if wait:
            with traffic(self.pool, FETCH):
                pending = self.admission.take_now(lambda t: self.store.get(unit.name, timeout=t, urgent=True,
                                                                           kept=True))  # fmt: skip
        else:
            try:
                with traffic(self.pool, PREFETCH):
                    pending = self.store.get(unit.name, timeout=0, urgent=True, kept=True)
            except PoolExhausted:
                return False
        with held_interrupts:  # see [Note: interrupt windows]
            unit.pending = pending
            unit.state = UnitState.FETCHING
        return True

    def prefetch_unit(self, unit: ParamUnit) -> bool:
        """Start reading ``unit`` if it is released and the pool has room now; False where a
        read was due and the pool had no room."""
        if self.always_ready or unit.state is not UnitState.RELEASED:
            return True
        return self.start_fetch(unit, wait=False)

    def acquire(self, nbytes: int):
        """A pool buffer for backward's own use: what waits in the pool for later gives way
        first if the pool has no room (the optimizer's work under backward never makes backward
        wait), but the prefetches, which backward needs next."""
        return self.admission.take_for_backward(nbytes)

    def cancel_prefetches(self) -> None:
        for other in self.units:
            self.drop_fetch(other)

    @staticmethod
    def drop_fetch(unit: ParamUnit) -> None:
        """Wait for a fetch in flight and give its lease back: the unit is not needed now. A
        read that failed is forgotten too (its error raised): nothing used it."""
        if unit.state is not UnitState.FETCHING:
            return
        try:
            lease = unit.pending.result()  # interrupted, the unit is still fetching: waited for again
        except Exception:
            UnitRuntime._forget_fetch(unit, None)
            raise
        UnitRuntime._forget_fetch(unit, lease)

    @staticmethod
    def _forget_fetch(unit: ParamUnit, lease) -> None:
        """The unit's read is spent or not wanted: released, ``lease`` (its buffer) given back."""
        with held_interrupts:  # see [Note: interrupt windows]
            unit.pending = None
            unit.state = UnitState.RELEASED
            if lease is not None:
                lease.release()

    def materialize(self, unit: ParamUnit) -> None:
        if unit.state is UnitState.READY:
            return
        if self.always_ready:
            tensor = self.store.get(unit.name).result().tensor
            with held_interrupts:
                unit.bind(tensor)
            return
        with region("infinity::fetch"):
            counters = self.stats.both()
            if unit.state is UnitState.RELEASED:
                self.start_fetch(unit)
                for c in counters:
                    c.on_demand += 1
            else:
                for c in counters:
                    c.prefetch_hits += 1
            start = time.perf_counter()
            # Interrupted while it waits, the unit stays fetching and the next call waits again;
            # once the read is used, the unit is bound whole or released (see [Note: interrupt
            # windows]): never fetching with its read spent.
            lease = unit.pending.result()
            host = None
            try:
                if self.gather:
                    full, host = self.transport.gather(unit, lease)
                elif self.device.type == "cpu":  # computing on the host: the lease is the parameters
                    full, host = lease.tensor, lease
                else:
                    full = self.transport.to_device(lease)
                with held_interrupts:
                    # Known to the saved-tensor hooks before any module can see it bound.
                    self._by_storage[full.untyped_storage().data_ptr()] = unit
                    unit.lease = host
                    unit.bind(full)
                    unit.pending = None
            except BaseException:
                if unit.state is not UnitState.READY:
                    if host is not None and host is not lease:
                        host.release()
                    self._forget_fetch(unit, lease)
                raise
            waited = time.perf_counter() - start
            for c in counters:
                c.stall_seconds += waited
                c.fetches += 1

    def release(self, unit: ParamUnit, after_forward: bool = False) -> None:
        """Free a unit's full parameters unless a running module or an open GatheredParameters
        still uses them or (in backward) more of its gradients are due; after a forward, pending
        backward uses do not hold it: backward fetches it again."""
        if self.always_ready or unit.active > 0 or unit.gathers > 0 or (unit.uses > 0 and not after_forward):
            return
        if unit.state is UnitState.FETCHING:
            return  # a prefetch for a coming module: keep it
        if unit.state is UnitState.READY:
            with held_interrupts:  # see [Note: interrupt windows]
                self.kept.discard(unit)
                self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
                unit.unbind()
                if unit.lease is not None:
                    unit.lease.release()
                    unit.lease = None

    # -- saved tensors: see [Note: saved parameter views] in `_schedule` ------------------------
    def pack_view(self, t: torch.Tensor):
        """``t`` as a view of a bound unit's memory, or None where it is not one."""
        if self.always_ready or not self._by_storage:
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        unit = self._by_storage.get(ptr)
        # An entry a Ctrl-C left behind may name memory given back since: only a bound unit's counts.
        if unit is None or unit.full is None or unit.full.untyped_storage().data_ptr() != ptr:
            return None
        return _UnitView(unit, t.storage_offset() - unit.full.storage_offset(), t.size(), t.stride())

    def unpack_view(self, saved: _UnitView) -> torch.Tensor:
        self.materialize(saved.unit)
        full = saved.unit.full
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    # -- gradients: see [Note: gradient hand-over] in `_schedule` -------------------------------
    def grad_arrived(self, unit: ParamUnit, i: int, param: torch.Tensor) -> None:
        """Parameter ``i`` of ``unit`` has its gradient (``param.grad``) of this backward. The
        fp32 copy in the unit is the gradient from here; the parameter's goes."""
        self._arrived(unit, i)
        if not self._took_whole(unit, i, param):
            self._receive(unit, i, param=param)

    def _took_whole(self, unit: ParamUnit, i: int, param: torch.Tensor) -> bool:
        """The short way of [Note: gradient hand-over] in `_schedule`: ``param``'s gradient,
        all of ``unit``'s and its last of this backward, on this device where the grads tier
        keeps it, stored by the accumulator in one call (`GradAccumulator.take_whole`: adopted
        as the tier's tensor, cast into it, or added to the sum there) and the unit handed on,
        with nothing gathered. False, changing nothing, where it cannot be: `_receive` then
        takes it."""
        if not self._in_place or unit.grad is not None or unit.uses > 1:
            return False
        grad = grad_of(param)
        if grad is None or unit.records[i].numel != unit.padded_numel or grad.device != self.device:
            return False
        own = _own_fp32(grad, unit.padded_numel)
        flat = grad.view(-1) if own else grad.reshape(-1)  # one view made per gradient, not two
        with held_interrupts:
            if not self.grads.take_whole(unit, flat, flat if own else None):
                return False
            set_grad(param, None)
            unit.uses = 0
        self.release(unit)
        if self.on_unit_final is not None:
            with traffic(self.pool, OVERLAP):  # the optimizer's early updates: see `_overlap`
                self.on_unit_final(unit)
        return True

    def tile_grad(self, unit: ParamUnit, i: int, grad: torch.Tensor) -> None:
        """``grad`` is the gradient of this backward of parameter ``i`` of ``unit`` (of the
        unit's part of it: a tile's rows)."""
        self._arrived(unit, i)
        self._receive(unit, i, grad=grad)

    def _arrived(self, unit: ParamUnit, i: int) -> None:
        unit.arrived |= 1 << i  # see `_units.warn_partial`
        self._received += 1  # see `take_received`

    def _receive(self, unit: ParamUnit, i: int, *, grad: torch.Tensor | None = None, param=None) -> None:
        """``grad``, or ``param``'s ``.grad`` (taken from it), into the unit's gradient; the
        unit handed on when it was its last."""
        lease = self._grad_buffer(unit)
        try:
            with held_interrupts:
                if param is not None:
                    grad = grad_of(param)
                    set_grad(param, None)
                final = self._gather_grad(unit, i, grad, lease)
        except BaseException:
            self._unclaimed(unit, lease)
            raise
        if final:
            self.finish_unit_backward(unit)

    def take_received(self) -> bool:
        """Whether any parameter's gradient came since the last call: a backward that asked
        for other tensors' alone (``torch.autograd.grad(loss, x)``, ``backward(inputs=[x])``)
        gives none, and is no micro-batch of the step."""
        received, self._received = self._received, 0
        return received > 0

    def _grad_buffer(self, unit: ParamUnit):
        """The pool buffer ``unit``'s gradient is gathered in, when it has none yet and one is
        needed (a CPU device with a pool: budgeted, and aligned so its write-behind is
        direct); else None. It may wait for room: taken before anything changes, so that an
        interrupt here leaves the gradient where it was."""
        if unit.grad is None and self.grads_in_pool and self.grads.in_place(unit, self.device) is None:
            return self.acquire(unit.padded_numel * 4)
        return None

    @staticmethod
    def _unclaimed(unit: ParamUnit, lease) -> None:
        """An interrupt came before ``lease`` was the unit's: given back now, not at garbage collection."""
        if lease is not None and unit.grad_lease is not lease:
            lease.release()

    def _gather_grad(self, unit: ParamUnit, i: int, grad: torch.Tensor | None, lease) -> bool:
        """Copy (the first) or add (the next ones) ``grad`` into the unit's gradient and count
        the use; whether it was the unit's last. Runs with interrupts held: it never waits."""
        if unit.grad is None:
            # Not zeroed: each parameter's first gradient is copied in, later ones added,
            # and what none arrived for is zeroed when the unit is handed on.
            if lease is not None:
                unit.grad_lease = lease
                unit.grad = lease.view(torch.float32, (unit.padded_numel,))
            else:  # the tier's own tensor where it can be (then `add` copies nothing), else a new one
                unit.grad = self.grads.in_place(unit, self.device)
                if unit.grad is None:
                    unit.grad = torch.empty(unit.padded_numel, dtype=torch.float32, device=self.device)
            unit.grad_seen = set()
        piece = unit.records[i].in_unit
        if grad is None:
            pass  # a Function that gave this parameter none: as a parameter no gradient reached
        elif i in unit.grad_seen:
            unit.grad[piece].add_(grad.reshape(-1))
        else:
            unit.grad[piece].copy_(grad.reshape(-1))
            unit.grad_seen.add(i)
        unit.uses -= 1
        return unit.uses <= 0

    def finish_unit_backward(self, unit: ParamUnit) -> None:
        """``unit``'s gradient of this backward is whole (or the pass ends): handed on to the
        grads tier and the overlap, and the unit released."""
        with held_interrupts:  # see [Note: gradient hand-over]
            grad, lease = unit.grad, unit.grad_lease
            unit.grad = unit.grad_lease = None  # handed on, or (if that fails) dropped: never twice
            if grad is not None:  # zeros where no gradient arrived: parameters unused, the padding
                if len(unit.grad_seen) < len(unit.records):
                    for i, r in enumerate(unit.records):
                        if i not in unit.grad_seen:
                            grad[r.in_unit].zero_()
                if unit.padded_numel > unit.numel:
                    grad[unit.numel :].zero_()
            unit.uses = 0
        if grad is not None:
            with traffic(self.pool, GRAD):
                self.grads.add(unit, grad, lease, keep=self.keep_grad)  # owns the lease from here, failing or not
        self.release(unit)
        if grad is not None and self.on_unit_final is not None:
            with traffic(self.pool, OVERLAP):  # the optimizer's early updates: see `_overlap`
                self.on_unit_final(unit)

    def drop_grads(self, keep_uses: bool = False) -> None:
        """Forget gradients still being gathered in units (after a failed backward), and any a
        parameter still holds ([Note: gradient hand-over]); with ``keep_uses``, not the uses a
        forward counted for a backward still due (``optimizer.zero_grad()`` between a forward
        and its backward, as plain PyTorch allows)."""
        with held_interrupts:  # one section for all: it never waits
            for unit in self.units:
                if unit.grad_lease is not None:
                    unit.grad_lease.release()
                unit.grad = unit.grad_lease = None
                if not keep_uses:
                    unit.uses = 0
            # A tile's too: a gathered one's gradient passes through it.
            clear_grads(r.param for unit in self.units for r in unit.records)
