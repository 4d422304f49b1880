"""The norms of the accumulated gradients: clipping's global norm and the overflow check.

Owns: one fp32 norm per unit of its gradient as it is now (taken where the gradient is
stored, on the device or the host), and the global norm computed from them once per
accumulation. Touches: `_dist.Dist` (the all-reduces across ranks), `_transport.host_value`
(reading a GPU's values where the step consumes them). `_grads.GradAccumulator` notes each
gradient it stores here; the step reads `all_finite` and `global_norm`.

A norm is kept as a tensor: reading it waits for the step, once. It is the fp32 norm, as
torch.nn.utils.clip_grad_norm_ computes it (no fp64 copy of the gradient), squared and summed
in fp64 at the step. It is finite exactly when every element is, unless the norm itself
passes the fp32 range (3.4e38): that counts as an overflow too, as in clip_grad_norm_. So no
second pass over the gradient checks finiteness.
"""

from __future__ import annotations

import torch

from ._transport import host_value


class GradNorms:
    """The norms of one engine's gradients this step (``dist``: `_dist.Dist`, or None)."""

    def __init__(self, dist=None):
        self.dist = dist
        self._norms: dict[int, torch.Tensor] = {}  # unit -> 0-d fp32 norm of its gradient (this rank's slice)
        self._global: float | None = None  # `global_norm` of the gradients as they are now

    def note(self, index: int, grad: torch.Tensor) -> None:
        """Unit ``index``'s gradient is ``grad`` now (this rank's slice of it)."""
        self._global = None
        self._norms[index] = torch.linalg.vector_norm(grad)

    def clear(self) -> None:
        self._global = None
        self._norms.clear()

    def global_norm(self) -> float:
        """The L2 norm of every rank's accumulated gradients (an all-reduce with several ranks),
        computed once per accumulation: clipping and the caller that logs it share it."""
        if self._global is None:
            norms = list(self._norms.values())
            if norms:
                local = host_value((torch.stack(norms).to(torch.float64) ** 2).sum())
            else:
                local = torch.zeros((), dtype=torch.float64)
            total = local.reshape(1).to(torch.float64)
            if self.dist is not None and self.dist.active:  # each rank holds the norm of its slices
                self.dist.all_reduce_sum(total, "the global gradient norm")
            self._global = float(total) ** 0.5
        return self._global

    def all_finite(self) -> bool:
        """Whether every rank's gradients are finite (an fp16 overflow skips the step everywhere)."""
        norms = list(self._norms.values())
        ok = bool(host_value(torch.isfinite(torch.stack(norms)).all())) if norms else True
        bad = torch.tensor([0.0 if ok else 1.0])
        if self.dist is not None and self.dist.active:  # an overflow anywhere skips everywhere
            self.dist.all_reduce_sum(bad, "the overflow check")
        return float(bad) == 0.0
