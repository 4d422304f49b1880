"""Gradients: gathered per unit as backward leaves it, reduced, accumulated in fp32 in the grads tier.

Accumulation over micro-batches: the first backward of a step writes a unit's gradient, later
ones read, add and write it back (write-behind on nvme). The squared norm and finiteness of
each unit's accumulated gradient are kept as it is written, so the optimizer knows the global
norm (clipping) and an fp16 overflow before it reads any gradient back.
"""

from __future__ import annotations

import torch

from ._store import Pending, Store
from ._units import ParamUnit


class GradAccumulator:
    def __init__(self, store: Store, reduce=None):
        self.store = store
        self.reduce = reduce  # reduce-scatter across ranks; None at world size 1
        self.has_grad: set[int] = set()  # units with a gradient this step
        self.norm_sq: dict[int, float] = {}
        self.finite: dict[int, bool] = {}
        self._writes: dict[int, Pending] = {}  # write-behind per unit

    def add(self, unit: ParamUnit, grad: torch.Tensor) -> None:
        """Accumulate ``grad`` (1-D fp32, the unit's full padded length) into the unit's shard."""
        if self.reduce is not None:
            grad = self.reduce(grad)
        shard = grad[unit.shard] if grad.numel() != unit.shard.stop - unit.shard.start else grad
        self._settle(unit.index)
        if unit.index in self.has_grad:
            if self.store.resident:
                acc = self.store.tensor(unit.name)
                acc.add_(shard)
            else:
                with self.store.get(unit.name).result() as lease:
                    acc = lease.view(torch.float32, shard.shape).clone()
                acc.add_(shard)
        else:
            acc = shard
        self.has_grad.add(unit.index)
        self.norm_sq[unit.index] = float(acc.double().pow(2).sum())
        self.finite[unit.index] = bool(torch.isfinite(acc).all())
        pending = self.store.put(unit.name, acc)
        if not self.store.resident:
            self._writes[unit.index] = pending

    def _settle(self, index: int) -> None:
        pending = self._writes.pop(index, None)
        if pending is not None:
            pending.result()

    def flush(self) -> None:
        """Wait for every write-behind (raising its error)."""
        for index in list(self._writes):
            self._settle(index)

    def global_norm(self) -> float:
        return sum(self.norm_sq.values()) ** 0.5

    def all_finite(self) -> bool:
        return all(self.finite.values())

    def zero(self) -> None:
        """Forget this step's gradients (the next backward writes afresh; nothing is read)."""
        self.flush()
        self.has_grad.clear()
        self.norm_sq.clear()
        self.finite.clear()
