"""The norms of the accumulated gradients: clipping's global norm and the overflow check.

Owns: one norm per unit of its gradient as it is now (taken where the gradient is stored, on
the device or the host), and the global norm computed from them once per accumulation.
Touches: `_dist.Dist` (the all-reduces across ranks), `_transport.host_value` (reading a GPU's
values where the step consumes them), `_compact.native_module` (the host's sum of squares).
`_grads.GradAccumulator` notes each gradient it stores here; the step reads `all_finite` and
`global_norm`.

[Note: gradient norms]
A gradient on a GPU keeps its norm as a tensor: torch's fp32 norm, as
torch.nn.utils.clip_grad_norm_ computes it (no fp64 copy of the gradient); reading it waits for
the step, once. A contiguous fp32 gradient on the host, where the native extension is built,
keeps the sum of its squares as a float instead (``infinity/csrc/norms.h``): fp32 lanes summed
in double by chunks, within about 1e-8 of the exact value (torch's fp32 norm of a million
elements, squared, is off by about 1e-5), at about twice the speed of torch's norm in
backward, where it is taken as each unit's gradient is stored. The global norm sums the
squares in fp64.

Either is finite exactly when every element is and the sum of squares stays within the fp32
range (3.4e38), which is when torch's fp32 norm is finite: a sum past it counts as an overflow
too, as in clip_grad_norm_. So no second pass over the gradient checks finiteness.
"""

from __future__ import annotations

import math

import torch

from ._compact import native_module
from ._transport import host_value

FP32_MAX = float(torch.finfo(torch.float32).max)


class GradNorms:
    """The norms of one engine's gradients this step (``dist``: `_dist.Dist`, or None)."""

    def __init__(self, dist=None):
        self.dist = dist
        # unit -> its gradient's (this rank's slice's) sum of squares (a float, host) or its
        # 0-d fp32 norm (a tensor, on the gradient's device): [Note: gradient norms]
        self._norms: dict[int, float | torch.Tensor] = {}
        self._global: float | None = None  # `global_norm` of the gradients as they are now
        native = native_module()
        self._sum_squares = native.sum_squares if native is not None else None

    def note(self, index: int, grad: torch.Tensor) -> None:
        """Unit ``index``'s gradient is ``grad`` now (this rank's slice of it)."""
        self._global = None
        if (self._sum_squares is not None and grad.device.type == "cpu" and grad.dtype == torch.float32
                and grad.is_contiguous()):  # fmt: skip
            self._norms[index] = self._sum_squares(grad.data_ptr(), grad.numel())
        else:
            self._norms[index] = torch.linalg.vector_norm(grad)

    def _parts(self) -> tuple[float, list[torch.Tensor]]:
        """The sums of squares added up, and the norms kept as tensors."""
        squares, tensors = 0.0, []
        for v in self._norms.values():
            if isinstance(v, float):
                squares += v
            else:
                tensors.append(v)
        return squares, tensors

    def clear(self) -> None:
        self._global = None
        self._norms.clear()

    def global_norm(self) -> float:
        """The L2 norm of every rank's accumulated gradients (an all-reduce with several ranks),
        computed once per accumulation: clipping and the caller that logs it share it."""
        if self._global is None:
            squares, tensors = self._parts()
            local = squares
            if tensors:
                local += float(host_value((torch.stack(tensors).to(torch.float64) ** 2).sum()))
            total = torch.tensor([local], dtype=torch.float64)
            if self.dist is not None and self.dist.active:  # each rank holds the norm of its slices
                self.dist.all_reduce_sum(total, "the global gradient norm")
            self._global = float(total) ** 0.5
        return self._global

    def all_finite(self) -> bool:
        """Whether every rank's gradients are finite (an fp16 overflow skips the step everywhere)."""
        squares, tensors = self._parts()
        # (A sum of NaN or inf squares is NaN or inf: one check covers every float.)
        ok = math.isfinite(squares) and squares <= FP32_MAX
        if ok and tensors:
            ok = bool(host_value(torch.isfinite(torch.stack(tensors)).all()))
        bad = torch.tensor([0.0 if ok else 1.0])
        if self.dist is not None and self.dist.active:  # an overflow anywhere skips everywhere
            self.dist.all_reduce_sum(bad, "the overflow check")
        return float(bad) == 0.0
