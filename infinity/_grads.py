"""Gradients: gathered per unit as backward leaves it, reduced, accumulated in fp32 in the grads tier.

Owns: which units have a gradient this step, their write-behinds, the copies from a GPU in
flight, the gradients held and kept in memory. Touches: the grads `Store` (leases), the
transport (reduction across ranks, copies back), `_grad_norms.GradNorms` (told of each
gradient stored: its norm and finiteness).

Accumulation over micro-batches: the first backward of a step writes a unit's gradient, later
ones read, add and write it back. On nvme the write is behind (at most ``max_writes`` in
flight, each from the pool buffer it was gathered in, so nothing is staged twice). The squared
norm and finiteness of each unit's accumulated gradient are kept as it is stored, so the
optimizer knows the global norm (clipping) and an fp16 overflow before it reads any back.

[Note: gradients held]
Backward makes the gradients in the reverse of the units' order, and the step streams the
sub-groups in that order, so the gradients backward makes last are the ones the step needs
first. On nvme, a gradient gathered in a pool buffer is held there, not written, as long as
the held ones together stay within the plan's ``held`` share (what the host budget
leaves beside the larger of the backward's and the step's own buffers); past it the one held
longest (the one the step needs last) is written, and its buffer goes back once written. A
later micro-batch adds into a held gradient in memory; the step first writes what it has no
room for beside its own buffers (`HeldGrads.spill`), then takes the held ones from memory
(`take_held`); `zero` gives them back. So a gradient the step finds held is neither
written nor read: 8 bytes a parameter less on nvme in fp32, all of them when the budget holds
every gradient. Where backward needs pool memory that is not free, every held gradient is
written and given back (`HeldGrads.spill`): backward never waits on them. The values are the ones a
write and a read would give. Where the optimizer runs under backward ([Note: exact overlap]),
an early update borrows a held gradient (`borrow_held`: never written or given back while
borrowed) and returns it once applied; the step gives back those of committed sub-groups
(`HeldGrads.release`) and takes the rest, whose early updates were discarded, from memory: a held
gradient is what such a redo needs, as a written one is. The overlap's room beside backward
is then shared: its sub-groups in hand first, held gradients in the rest.

[Note: gradients copied back]
On a GPU, with the grads tier in host memory or on nvme, a unit's gradient leaves the device
on a side stream (`_transport.Copies.start`), not by a blocking ``copy_``: backward goes on while
the copy runs. The first micro-batch's copy lands in the cpu tier's own (pinned) tensor, or in
a pool buffer on nvme; a later micro-batch's lands in a pool buffer (or a pinned temporary
without a pool) and is added to the sum on the host once there. Until it lands the gradient
is "landing": every reader here waits for it (`flush`, `take_held`, `take_kept`,
`borrow_held`, `get`), `writing` reports it busy so the overlap comes back later rather than
wait, and `zero` waits before giving its buffer back. The end of backward waits for the last
ones (`land`: the step needs the last-made gradients first anyway), so a failed copy fails
the backward whose gradient it carried, which `zero_grad` and a new backward redo. The squared norm of a first micro-batch
is taken on the device when the copy starts, of a sum on the host when it lands: where the
blocking copy took them, so the values are the same.
"""

from __future__ import annotations

import collections

import torch

from infinity.swap import PoolExhausted, WriteBehind

from ._grad_norms import GradNorms
from ._grads_held import HeldGrads
from ._profile import region
from ._store import InHand, Lease, Store
from ._units import ParamUnit


MAX_WRITES = 2  # gradients written behind at once (the memory plan counts their buffers: `_admission`)


class GradAccumulator:
    def __init__(self, store: Store, transport=None, grads_full: bool = False, max_writes: int = MAX_WRITES, copier=None,
                 plan=None, admission=None):  # fmt: skip
        self.store = store
        self.transport = transport  # _transport.Transport; collectives only when it has several ranks
        self.dist = transport.dist if transport is not None else None
        self.grads_full = grads_full  # ZeRO stage 1: every rank keeps the whole (averaged) gradient
        self.max_writes = max_writes
        self.has_grad: set[int] = set()  # units with a gradient this step
        self.norms = GradNorms(self.dist)  # of each unit's gradient as it is now: clipping, the overflow check
        self.version: dict[int, int] = {}  # unit -> gradients stored for it this step
        self._kept: dict[int, tuple[torch.Tensor, object]] = {}  # unit -> (gradient, its buffer)
        self._writes = WriteBehind(max_writes)  # keyed by unit index
        # Gradients held in memory, not written: see [Note: gradients held]. ``plan``: the
        # engine's `_admission.Plan`, whose ``held`` bounds them.
        self.held = HeldGrads(store, self._writes, plan, self.has_grad)
        # Copies from the device in flight: see [Note: gradients copied back]. Oldest first.
        self.copier = copier  # `_transport.Copies` on a GPU (its `start`)
        # Pool buffers for the copies, taken as backward's own (`_admission.Admission.take_for_backward`)
        self._take = admission.take_for_backward if admission is not None else None
        self._landing: collections.OrderedDict[int, _Landing] = collections.OrderedDict()

    def add(self, unit: ParamUnit, grad: torch.Tensor, lease=None, keep=None) -> None:
        """Accumulate ``grad`` (1-D fp32, the unit's padded length; in ``lease``, a pool buffer,
        when given) into the unit's shard. Owns ``lease`` from here, failing or not. ``keep``:
        the overlap's ``keep(unit, nbytes)``, whether to keep the stored gradient's buffer for
        an early update (which then reads it from memory, not back from nvme), or None."""
        if self.dist is not None and self.dist.active:
            grad, lease = self.transport.reduce_grad(unit, grad, lease, keep_full=self.grads_full)
        elif lease is None and unit.index not in self.has_grad and self.store.is_own(unit.name, grad):
            self._note(unit, grad)  # gathered in the tier's own tensor (`in_place`): stored, nothing in flight
            return
        # ``grad`` is now what this rank keeps: its slice (stages 2, 3) or all of it (stage 1)
        with region("infinity::grad_write"):
            try:
                self._land(unit.index)  # its previous micro-batch's, before adding to it
                self._land_finished()
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            if self.copier is not None and lease is None and not self.store.in_place_on(grad.device):
                self._copy_back(unit, grad, keep)
                return
            try:
                self._writes.settle(unit.index)  # its previous write, before reading it back
                self._drop_kept(unit.index)
                acc, hold = self._accumulate(unit, grad, lease)
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            self._store(unit, acc, hold, keep=keep)

    def take_whole(self, unit: ParamUnit, grad: torch.Tensor, whole: torch.Tensor | None = None) -> bool:
        """Store ``grad`` (1-D, the unit's padded length, any float dtype) as ``unit``'s
        gradient where the tier keeps gradients in memory on ``grad``'s device and one rank
        keeps them whole: the step's first becomes the tier's tensor where it is ``whole`` (fp32
        in memory the caller gives up: `Store.adopt`), or is cast into it; a later one is added
        to the sum there (the values a gathered copy's `add` gives). Nothing is in flight for a
        resident tier (no write, landing, hold or keep). False, changing nothing, otherwise."""
        if (self.dist is not None and self.dist.active) or not self.store.in_place_on(grad.device):
            return False
        if unit.index in self.has_grad:
            acc = self.store.get(unit.name).result().tensor  # resident: the tier's own tensor
            acc.add_(grad)
        else:  # ``whole`` as the tier's tensor, or the tier's tensor (made where there is none) cast into
            shape = torch.Size((unit.padded_numel,))
            if whole is not None and self.store.adopt(unit.name, whole, shape, torch.float32):
                acc = whole
            else:
                acc, _ = self.store.landing(unit.name, shape, torch.float32)
                acc.copy_(grad)
        self._note(unit, acc)
        return True

    def in_place(self, unit: ParamUnit, device: torch.device) -> torch.Tensor | None:
        """The tier's own tensor for ``unit``'s gradient, for backward to gather it in on
        ``device`` (`add` then copies nothing): where the tier keeps it there, one rank keeps
        it whole, and this is the step's first gradient of ``unit`` (a later one is added to
        the sum there); else None."""
        if (self.dist is not None and self.dist.active) or unit.index in self.has_grad:
            return None
        if not self.store.in_place_on(device):
            return None
        dst, _ = self.store.landing(unit.name, torch.Size((unit.padded_numel,)), torch.float32)
        return dst

    # -- copies from the device: see [Note: gradients copied back] ----------------------------
    def _copy_back(self, unit: ParamUnit, grad: torch.Tensor, keep) -> None:
        """Start copying ``grad`` (on the device) to the host; the rest of `add` runs when it lands."""
        first = unit.index not in self.has_grad
        pool = self.transport.pool if self.transport is not None else None
        if self.store.uses_pool or (not first and pool is not None):
            self._make_room()
        take = self._take or (pool.acquire if pool is not None else None)
        if first:
            dst, buffer = self.store.landing(unit.name, grad.shape, grad.dtype, acquire=take)
        else:
            if take is not None:
                buffer = take(grad.numel() * grad.element_size())
                dst = buffer.view(grad.dtype, tuple(grad.shape))
            else:  # no pool (no tier on nvme): a pinned temporary, dropped once added
                buffer, dst = None, torch.empty(grad.shape, dtype=grad.dtype, pin_memory=torch.cuda.is_available())
        try:
            copy = self.copier.start(grad, dst)
        except BaseException:
            if buffer is not None:
                buffer.release()
            raise
        if first:
            self._note(unit, grad)  # on the device, as a blocking copy's caller took it
        self._landing[unit.index] = _Landing(unit, copy, dst, buffer, first, keep)

    def _make_room(self) -> None:
        """Before a copy into a pool buffer: at most ``max_writes`` gradients in pool buffers
        on their way (landing, or being written) beside it, what the engine's plan gives
        backward (as a blocking copy into a staged write had it)."""
        self._writes.poll()
        while True:
            pooled = [i for i, landing in self._landing.items() if landing.buffer is not None]
            if not pooled or len(pooled) + len(self._writes) <= self.max_writes:
                return
            self._land(pooled[0])

    def _land(self, index: int) -> None:
        """Wait for unit ``index``'s copy from the device, if one is in flight, and store it."""
        landing = self._landing.pop(index, None)
        if landing is None:
            return
        try:
            landing.copy.wait()
        except BaseException:
            if landing.buffer is not None:
                landing.buffer.release()
            self.has_grad.discard(index)
            raise
        unit, dst, buffer = landing.unit, landing.dst, landing.buffer
        if landing.first:
            if buffer is None:
                return  # in the tier's own tensor: stored
            self._store(unit, dst, buffer, noted=True, keep=landing.keep)  # (a pool buffer: the tier is nvme)
            return
        try:
            self._writes.settle(index)
            acc, hold = self._accumulate(unit, dst, buffer)
        except BaseException:
            if buffer is not None:
                buffer.release()
            self.has_grad.discard(index)
            raise
        self._store(unit, acc, hold, keep=landing.keep)

    def _land_finished(self) -> None:
        """Store the gradients whose copies have finished, oldest first (never waits)."""
        while self._landing:
            index, landing = next(iter(self._landing.items()))
            if not landing.copy.done():
                return
            self._land(index)

    def land(self) -> None:
        """Wait for every copy from the device and store what it brought (the end of a backward:
        a failed copy fails the backward that made the gradient)."""
        while self._landing:
            self._land(next(iter(self._landing)))

    def get(self, unit: ParamUnit, timeout: float | None = None):
        """The store's `Pending` of ``unit``'s accumulated gradient (landed first)."""
        self._land(unit.index)
        return self.store.get(unit.name, timeout=timeout)

    def lend(self, unit: ParamUnit, timeout: float | None = None):
        """A `Pending` of ``unit``'s gradient for the optimizer's early update: a held one
        borrowed (`borrow_held`), a kept one taken from memory (`take_kept`), else a read
        (`get`, waiting at most ``timeout`` for pool memory)."""
        if self.is_held(unit.index):  # never written: see [Note: gradients held]
            return InHand(self.borrow_held(unit.index))
        kept = self.take_kept(unit.index)
        if kept is not None:  # still in memory: nothing to read
            return InHand(Lease(*kept))
        return self.get(unit, timeout=timeout)

    def _accumulate(self, unit: ParamUnit, grad: torch.Tensor, lease):
        """(the accumulated gradient, the buffer it lives in) for this micro-batch."""
        if unit.index not in self.has_grad:
            return grad, lease
        held = self.held.take(unit.index)
        if held is not None:  # the sum so far is in memory: nothing to read
            acc, hold = held
            try:
                acc.add_(grad.to(acc.device))
            except BaseException:
                hold.release()
                raise
            if lease is not None:
                lease.release()
            return acc, hold
        try:
            pending = self.store.get(unit.name, timeout=0)  # the sum so far
        except PoolExhausted:  # the pool is full of held gradients: they make room
            self.held.spill()
            pending = self.store.get(unit.name)
        held = pending.result()
        try:
            held.tensor.add_(grad.to(held.tensor.device))
        except BaseException:
            held.release()
            raise
        if lease is not None:
            lease.release()
        return held.tensor, held

    def _store(self, unit: ParamUnit, acc: torch.Tensor, hold, noted: bool = False, keep=None) -> None:
        """``acc`` is the unit's gradient now: held in ``hold`` (its pool buffer), or written
        from it; ``noted``: its norm was taken already (a first micro-batch's, on the device)."""
        nbytes = acc.numel() * acc.element_size()
        if hold is not None and self.store.uses_pool and nbytes <= self.held.limit:
            if not noted:
                self._note(unit, acc)
            self.held.hold(unit, acc, hold)
            return
        try:
            pending = self.store.put(unit.name, acc)
        except BaseException:
            # Not stored (a full drive, say): this unit has no gradient this step, and the
            # buffer goes back. The caller's error says why; `zero` then starts the step over.
            if hold is not None:
                hold.release()
            self.has_grad.discard(unit.index)
            raise
        if not noted:
            self._note(unit, acc)
        self._behind(unit, acc, hold, pending, keep)

    def _behind(self, unit: ParamUnit, acc: torch.Tensor, hold, pending, keep=None) -> None:
        """``acc``'s write ``pending`` is in flight from ``hold`` (or from its own copy)."""
        nbytes = acc.numel() * acc.element_size()
        if hold is not None and keep is not None and keep(unit, nbytes):
            self._kept[unit.index] = (acc, hold)
            hold = None
        if hold is None and not self.store.uses_pool:
            return  # stored in the tier's own tensor already: nothing in flight
        self._writes.add(pending, hold, key=unit.index)

    def _note(self, unit: ParamUnit, acc: torch.Tensor) -> None:
        """``unit`` has ``acc`` as its gradient now: its version and its norm (which also says
        whether it is finite)."""
        self.has_grad.add(unit.index)
        self.version[unit.index] = self.version.get(unit.index, 0) + 1
        self.norms.note(unit.index, acc[unit.shard] if self.grads_full else acc)  # this rank's slice

    # -- held gradients: see [Note: gradients held] in `_grads_held` -----------------------------
    def is_held(self, index: int) -> bool:
        self._land(index)
        return index in self.held

    def take_held(self, index: int):
        """(gradient, buffer) of unit ``index`` held in memory, or None; the caller releases
        the buffer. The gradient is the step's from here (`zero` follows the step)."""
        self._land(index)
        return self.held.take(index)

    def borrow_held(self, index: int) -> Lease:
        """Unit ``index``'s held gradient for an early update (`HeldGrads.borrow`), landed first."""
        self._land(index)
        return self.held.borrow(index)

    def take_kept(self, index: int):
        """(gradient, buffer) of unit ``index`` kept in memory, its write finished, or None.
        The caller releases the buffer."""
        self._land(index)
        if index not in self._kept:
            return None
        self._writes.settle(index)  # written before anyone may change it (or give it back)
        return self._kept.pop(index)

    @property
    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self._kept.values())

    def _drop_kept(self, index: int) -> None:
        kept = self._kept.pop(index, None)
        if kept is not None:
            self._writes.settle(index)
            kept[1].release()

    def writing(self, index: int) -> bool:
        """True while unit ``index``'s gradient is being copied from the device or written
        (finished ones are stored and reaped): a reader comes back later rather than wait."""
        self._land_finished()
        self._writes.poll()
        return index in self._landing or index in self._writes

    def flush(self) -> None:
        """Wait for every copy from the device and every write-behind (raising its error)."""
        self.land()
        self._writes.drain()

    def drop_kept(self) -> None:
        """Give back every gradient buffer kept for the overlap (their writes finished first)."""
        try:
            self._writes.drain()
        finally:
            for index in list(self._kept):
                self._kept.pop(index)[1].release()

    def zero(self) -> None:
        """Forget this step's gradients (the next backward writes afresh; nothing is read).
        Copies and write-behinds are finished first; one that failed does not matter: it is forgotten."""
        while self._landing:  # their buffers go back only once the copy no longer writes them
            index, landing = next(iter(self._landing.items()))
            try:
                landing.copy.wait()
            except Exception:  # noqa: BLE001 - a failed copy is forgotten with its gradient
                pass
            del self._landing[index]  # (an interrupt above leaves it: the next zero waits again)
            if landing.buffer is not None:
                landing.buffer.release()
        self._writes.discard_errors()
        for index in list(self._kept):
            self._kept.pop(index)[1].release()
        self.held.clear()
        self.has_grad.clear()
        self.norms.clear()
        self.version.clear()
        if self.store.device.type != "cpu":
            # On a GPU, as zero_grad(set_to_none=True): the gradients backward made (`take_whole`
            # adopted them) are not kept through the next forward beside its activations; the
            # caching allocator hands their memory to it. On the host they stay until backward
            # adopts the next ones, one by one: glibc then serves each new gradient from the
            # block just freed, where dropping them all at the step cost 3.5% of a small
            # model's step in page faults (benchmarks/small_layers.py's model, 1x32 tokens).
            self.store.forget_adopted()


class _Landing:
    """A gradient on its way from the device: see [Note: gradients copied back]."""

    __slots__ = ("unit", "copy", "dst", "buffer", "first", "keep")

    def __init__(self, unit: ParamUnit, copy, dst: torch.Tensor, buffer, first: bool, keep=None):
        self.unit = unit
        self.copy = copy  # `_transport.Copy`
        self.dst = dst  # host tensor it lands in
        self.buffer = buffer  # pool buffer behind ``dst``, or None (the tier's own tensor, a temporary)
        self.first = first  # the step's first gradient of the unit (else added to the sum on landing)
        self.keep = keep  # the overlap's keep, as `GradAccumulator.add` was given it
