"""Gradients: gathered per unit as backward leaves it, reduced, accumulated in fp32 in the grads tier.

Owns: which units have a gradient this step, their write-behinds, and each accumulated
gradient's squared norm and finiteness. Touches: the grads `Store` (leases), the transport
(reduction across ranks).

Accumulation over micro-batches: the first backward of a step writes a unit's gradient, later
ones read, add and write it back. On nvme the write is behind (at most ``max_writes`` in
flight, each from the pool buffer it was gathered in, so nothing is staged twice). The squared
norm and finiteness of each unit's accumulated gradient are kept as it is written, so the
optimizer knows the global norm (clipping) and an fp16 overflow before it reads any back.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from infinity.swap import WriteBehind

from ._store import Store
from ._units import ParamUnit


class GradAccumulator:
    def __init__(self, store: Store, transport=None, grads_full: bool = False, max_writes: int = 2):
        self.store = store
        self.transport = transport  # _transport.Transport; collectives only when it has several ranks
        self.dist = transport.dist if transport is not None else None
        self.grads_full = grads_full  # ZeRO stage 1: every rank keeps the whole (averaged) gradient
        self.max_writes = max_writes
        self.has_grad: set[int] = set()  # units with a gradient this step
        self.norm_sq: dict[int, torch.Tensor] = {}  # 0-d fp64 per unit, read once at the step
        self.finite: dict[int, torch.Tensor] = {}  # 0-d bool per unit
        self.version: dict[int, int] = {}  # unit -> gradients stored for it this step
        # The overlap's: keep(unit, nbytes) says whether to keep a stored gradient's buffer
        # for an early update (which then reads it from memory, not back from nvme).
        self.keep = None
        self._kept: dict[int, tuple[torch.Tensor, object]] = {}  # unit -> (gradient, its buffer)
        self._writes = WriteBehind(max_writes)  # keyed by unit index
        self._norm: float | None = None  # global_norm of the gradients as they are now

    def add(self, unit: ParamUnit, grad: torch.Tensor, lease=None) -> None:
        """Accumulate ``grad`` (1-D fp32, the unit's padded length; in ``lease``, a pool buffer,
        when given) into the unit's shard. Owns ``lease`` from here, failing or not."""
        if self.dist is not None and self.dist.active:
            grad, lease = self.transport.reduce_grad(unit, grad, lease, keep_full=self.grads_full)
        # ``grad`` is now what this rank keeps: its slice (stages 2, 3) or all of it (stage 1)
        with record_function("infinity::grad_write"):
            try:
                self._writes.settle(unit.index)  # its previous write, before reading it back
                self._drop_kept(unit.index)
                acc, hold = self._accumulate(unit, grad, lease)
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            self._store(unit, acc, hold)

    def _accumulate(self, unit: ParamUnit, grad: torch.Tensor, lease):
        """(the accumulated gradient, the buffer it lives in) for this micro-batch."""
        if unit.index not in self.has_grad:
            return grad, lease
        held = self.store.get(unit.name).result()  # the sum so far
        try:
            held.tensor.add_(grad.to(held.tensor.device))
        except BaseException:
            held.release()
            raise
        if lease is not None:
            lease.release()
        return held.tensor, held

    def _store(self, unit: ParamUnit, acc: torch.Tensor, hold) -> None:
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
        self.version[unit.index] = self.version.get(unit.index, 0) + 1
        mine = acc[unit.shard] if self.grads_full else acc  # norms of this rank's slice only
        # Kept as tensors: reading them (a device sync on CUDA) waits for the step, once. The
        # norm in fp32, as torch.nn.utils.clip_grad_norm_ computes it (no fp64 copy of the
        # gradient), squared in fp64. It is finite exactly when every element is, unless the
        # norm itself passes the fp32 range (3.4e38): that counts as an overflow too, as in
        # clip_grad_norm_. So no second pass over the gradient checks finiteness.
        norm_sq = torch.linalg.vector_norm(mine).to(torch.float64) ** 2
        self.norm_sq[unit.index] = norm_sq
        self._norm = None
        self.finite[unit.index] = torch.isfinite(norm_sq)
        if hold is not None and self.keep is not None and self.keep(unit, acc.numel() * acc.element_size()):
            self._kept[unit.index] = (acc, hold)
            hold = None
        self._writes.add(pending, hold, key=unit.index)

    def take_kept(self, index: int):
        """(gradient, buffer) of unit ``index`` kept in memory, its write finished, or None.
        The caller releases the buffer."""
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
        """True while unit ``index``'s gradient write is in flight (finished writes are reaped)."""
        self._writes.poll()
        return index in self._writes

    def flush(self) -> None:
        """Wait for every write-behind (raising its error)."""
        self._writes.drain()

    def drop_kept(self) -> None:
        """Give back every gradient buffer kept for the overlap (their writes finished first)."""
        try:
            self._writes.drain()
        finally:
            for index in list(self._kept):
                self._kept.pop(index)[1].release()

    def global_norm(self) -> float:
        """The L2 norm of every rank's accumulated gradients (an all-reduce with several ranks),
        computed once per accumulation: clipping and the caller that logs it share it."""
        if self._norm is None:
            self._norm = self._global_norm()
        return self._norm

    def _global_norm(self) -> float:
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
        self._writes.discard_errors()
        for index in list(self._kept):
            self._kept.pop(index)[1].release()
        self.has_grad.clear()
        self._norm = None
        self.norm_sq.clear()
        self.finite.clear()
        self.version.clear()
