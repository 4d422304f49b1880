"""Gradients: gathered per unit as backward leaves it, reduced, accumulated in fp32 in the grads tier.

Accumulation over micro-batches: the first backward of a step writes a unit's gradient, later
ones read, add and write it back. On nvme the write is behind (at most ``max_writes`` in
flight, each from the pool buffer it was gathered in, so nothing is staged twice). The squared
norm and finiteness of each unit's accumulated gradient are kept as it is written, so the
optimizer knows the global norm (clipping) and an fp16 overflow before it reads any back.
"""

from __future__ import annotations

import collections

import torch

from ._store import Pending, Store
from ._units import ParamUnit


class GradAccumulator:
    def __init__(self, store: Store, dist=None, grads_full: bool = False, pool=None, max_writes: int = 2):
        self.store = store
        self.dist = dist  # infinity._dist.Dist; collectives only when it has several ranks
        self.grads_full = grads_full  # ZeRO stage 1: every rank keeps the whole (averaged) gradient
        self.pool = pool
        self.max_writes = max_writes
        self.has_grad: set[int] = set()  # units with a gradient this step
        self.norm_sq: dict[int, torch.Tensor] = {}  # 0-d fp64 per unit, read once at the step
        self.finite: dict[int, torch.Tensor] = {}  # 0-d bool per unit
        self._writes: collections.OrderedDict[int, tuple[Pending, object]] = collections.OrderedDict()

    def add(self, unit: ParamUnit, grad: torch.Tensor, lease=None) -> None:
        """Accumulate ``grad`` (1-D fp32, the unit's padded length; in ``lease``, a pool buffer,
        when given) into the unit's shard."""
        if self.dist is not None and self.dist.active:
            what = f"gradient reduction of {unit.name}"
            if self.grads_full:
                self.dist.all_reduce_mean(grad, what)
            else:
                n = unit.shard_numel
                if grad.device.type == "cpu" and self.pool is not None:
                    reduced = self.pool.acquire(n * 4)
                    out = reduced.view(torch.float32, (n,))
                else:
                    reduced, out = None, torch.empty(n, dtype=torch.float32, device=grad.device)
                self.dist.reduce_scatter_mean(out, grad, what)
                if lease is not None:
                    lease.release()
                grad, lease = out, reduced
        shard = grad  # what this rank keeps: its slice (stages 2, 3) or all of it (stage 1)
        self._settle(unit.index)
        hold = lease  # the pool buffer the write goes from, released when it is done
        if unit.index in self.has_grad:
            if self.store.resident:
                acc = self.store.tensor(unit.name)
                acc.add_(shard.to(acc.device))
            else:
                hold = self.store.get(unit.name).result()
                acc = hold.view(torch.float32, shard.shape)
                acc.add_(shard)
                if lease is not None:
                    lease.release()
        else:
            acc = shard
        if not self.store.resident and acc.device.type != "cpu":
            # Gathered on the GPU: nvme is reached through host memory (a pool buffer).
            staged = self.store.space.pool.acquire(acc.numel() * 4)
            staged.view(torch.float32, acc.shape).copy_(acc)
            if hold is not None:
                hold.release()
            hold, acc = staged, staged.view(torch.float32, acc.shape)
        try:
            pending = self.store.put(unit.name, acc)
        except BaseException:
            # Not stored (a full drive, say): this unit has no gradient this step, and the
            # buffer goes back. The caller's error says why; `zero` then starts the step over.
            if hold is not None:
                hold.release()
            self.has_grad.discard(unit.index)
            raise
        self.has_grad.add(unit.index)
        mine = acc[unit.shard] if self.grads_full else acc  # norms of this rank's slice only
        # Kept as tensors: reading them (a device sync on CUDA) waits for the step, once.
        self.norm_sq[unit.index] = torch.linalg.vector_norm(mine, dtype=torch.float64) ** 2
        self.finite[unit.index] = torch.isfinite(mine).all()
        if self.store.resident:
            if hold is not None:
                hold.release()
            return
        self._writes[unit.index] = (pending, hold)
        while len(self._writes) > self.max_writes:
            self._settle(next(iter(self._writes)))

    def _settle(self, index: int) -> None:
        entry = self._writes.pop(index, None)
        if entry is not None:
            pending, hold = entry
            try:
                pending.result()
            finally:
                if hold is not None:
                    hold.release()

    def flush(self) -> None:
        """Wait for every write-behind (raising its error)."""
        for index in list(self._writes):
            self._settle(index)

    def global_norm(self) -> float:
        local = torch.stack(list(self.norm_sq.values())).sum().cpu() if self.norm_sq else torch.zeros((), dtype=torch.float64)
        total = local.reshape(1).to(torch.float64)
        if self.dist is not None and self.dist.active:  # each rank holds the norm of its slices
            self.dist.all_reduce_sum(total, "the global gradient norm")
        return float(total) ** 0.5

    def all_finite(self) -> bool:
        ok = bool(torch.stack(list(self.finite.values())).all()) if self.finite else True
        bad = torch.tensor([0.0 if ok else 1.0])
        if self.dist is not None and self.dist.active:  # an overflow anywhere skips everywhere
            self.dist.all_reduce_sum(bad, "the overflow check")
        return float(bad) == 0.0

    def zero(self) -> None:
        """Forget this step's gradients (the next backward writes afresh; nothing is read).
        Write-behinds are finished first; one that failed does not matter: it is forgotten."""
        for index in list(self._writes):
            try:
                self._settle(index)
            except OSError:
                pass
        self.has_grad.clear()
        self.norm_sq.clear()
        self.finite.clear()
