"""Gradients held in pool buffers, not written: see [Note: gradients held] in `_grads`.

Owns: the held gradients (unit -> its gradient and pool buffer, the one held longest first),
their bytes against the plan's ``held`` share, and the ones an early update is reading
(borrowed: neither written nor given back until returned). Touches: the grads `Store` (a
gradient written when the share is passed), the accumulator's write-behinds (the buffer goes
back once written) and its set of units with a gradient (a write that fails leaves its unit
without one). `_grads.GradAccumulator` holds and takes them; the step and the overlap borrow,
release and spill them through it.
"""

from __future__ import annotations

import collections

import torch

from ._store import Lease
from ._units import ParamUnit


class HeldGrads:
    """``store``: the grads store; ``writes``: the accumulator's `WriteBehind`; ``plan``: the
    engine's `_admission.Plan` (its ``held``; None: nothing held); ``has_grad``: the
    accumulator's set of units with a gradient this step."""

    def __init__(self, store, writes, plan, has_grad: set[int]):
        self.store = store
        self.plan = plan
        self._writes = writes
        self._has_grad = has_grad
        self._held: collections.OrderedDict[int, tuple[ParamUnit, torch.Tensor, object]] = collections.OrderedDict()
        self._bytes = 0
        self._borrowed: set[int] = set()  # held ones an early update is reading: see `borrow`

    @property
    def limit(self) -> int:
        """Bytes of gradients held, not written, at most: the plan's ``held``."""
        return self.plan.held if self.plan is not None else 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __contains__(self, index: int) -> bool:
        return index in self._held

    def hold(self, unit: ParamUnit, acc: torch.Tensor, buffer) -> None:
        """Hold ``acc`` (in pool ``buffer``) as ``unit``'s gradient; the held ones past the limit
        are written, the one held longest first."""
        self._held[unit.index] = (unit, acc, buffer)
        self._bytes += acc.numel() * acc.element_size()
        self.write_down_to(self.limit)

    def take(self, index: int):
        """(gradient, buffer) of unit ``index`` if held, no longer held (the caller owns the
        buffer from here); else None."""
        held = self._held.pop(index, None)
        if held is None:
            return None
        _, acc, buffer = held
        self._bytes -= acc.numel() * acc.element_size()
        return acc, buffer

    def borrow(self, index: int) -> Lease:
        """Unit ``index``'s held gradient for an early update: it stays held, and is neither
        written nor given back until the lease is released."""
        self._borrowed.add(index)
        return Lease(self._held[index][1], _Return(self._borrowed, index))

    def release(self, indices) -> None:
        """Give back the held gradients of ``indices`` (their sub-groups' early updates were
        committed: nothing reads them again this step)."""
        for index in indices:
            held = self.take(index)
            if held is not None:
                held[1].release()

    def write_down_to(self, keep: int) -> None:
        """Write held gradients, the one held longest first (not one borrowed), until at most
        ``keep`` bytes stay held."""
        while self._bytes > keep:
            victim = next((i for i in self._held if i not in self._borrowed), None)
            if victim is None:
                return  # the rest are being read by early updates: they come back soon
            self._write(victim)

    def spill(self, keep: int = 0) -> None:
        """Write held gradients, the one held longest first, until at most ``keep`` bytes
        stay held, and wait for the writes: their buffers are free after."""
        if self._bytes <= keep:
            return
        self.write_down_to(keep)
        self._writes.drain()

    def clear(self) -> None:
        """Give every held gradient's buffer back (the step's gradients are forgotten)."""
        while self._held:
            self.take(next(iter(self._held)))[1].release()
        self._borrowed.clear()

    def _write(self, index: int) -> None:
        """Write unit ``index``'s held gradient; its buffer goes back once written."""
        unit, acc, buffer = self._held[index]
        try:
            pending = self.store.put(unit.name, acc)
        except BaseException:
            # Not stored (a full drive, say): this unit has no gradient this step now.
            self.take(index)
            buffer.release()
            self._has_grad.discard(index)
            raise
        self.take(index)
        self._writes.add(pending, buffer, key=index)


class _Return:
    """Releasing a borrowed held gradient's lease returns it (`HeldGrads.borrow`)."""

    __slots__ = ("_borrowed", "_index")

    def __init__(self, borrowed: set, index: int):
        self._borrowed, self._index = borrowed, index

    def release(self) -> None:
        self._borrowed.discard(self._index)
