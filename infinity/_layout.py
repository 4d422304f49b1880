"""What the host budget's plan, the disk footprint and the estimate are computed from.

Owns nothing: `Layout` names the parts of an engine that exist before any tensor is written
(its units, the stores, the gradient accumulator, the optimizer with its sub-groups and state
records, the swap space, the ranks), so that `_admission.make_plan` and `finish`,
`_footprint.plan` and `fit`, `_overlap_host.fit`, `_bytes.state_tensors` and the estimate read
those and nothing else, not an `Engine` still being built. `Engine._setup` makes it once,
after the optimizer, and hands it to `Engine._check_memory`, which the estimate's dry engine
replaces ([Note: estimate from the engine's own plan] in `_estimate`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infinity.swap import SwapSpace

    from ._dist import Dist
    from ._grads import GradAccumulator
    from ._optim import Optimizer
    from ._store import Store
    from ._units import ParamUnit


@dataclasses.dataclass(frozen=True)
class Layout:
    units: list[ParamUnit]
    device: torch.device  # where the model computes
    dtype: torch.dtype  # precision.param_dtype
    param_store: Store
    grads: GradAccumulator
    optimizer: Optimizer
    space: SwapSpace | None  # the swap space, where a tier is on nvme
    dist: Dist
    grads_full: bool  # ZeRO stage 1 over several ranks: each rank keeps the whole gradient
