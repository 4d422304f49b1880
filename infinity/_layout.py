"""What the host budget's plan, the disk footprint and the estimate are computed from.

Owns nothing: `Layout` names the parts of an engine that exist before any tensor is written
and before the components that run with the plan are made: its units, the stores, the
sub-groups and their state records (`_substates.SubGroupStates`), the transport, the swap
space, the ranks. `_admission.make_plan` and `finish`, `_footprint.plan` and `fit`,
`_overlap_host.fit`, `_update.step_bytes`, `_bytes.state_tensors` and the estimate read those
and nothing else. `_assembly.lay_out` makes it once, for `Engine._setup` (which hands it to
`_assembly.plan_memory`, then makes the gradient accumulator and the optimizer with the plan
it returns) and for the estimate ([Note: estimate from the engine's own plan] in `_estimate`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infinity.swap import SwapSpace

    from ._dist import Dist
    from ._store import Store
    from ._substates import SubGroupStates
    from ._transport import Transport
    from ._units import ParamUnit


@dataclasses.dataclass(frozen=True)
class Layout:
    units: list[ParamUnit]
    device: torch.device  # where the model computes
    dtype: torch.dtype  # precision.param_dtype
    param_store: Store
    grad_store: Store
    states: SubGroupStates  # the optimizer's sub-groups, state stores and records
    transport: Transport  # what says whether the step stages its copies (`_update.step_bytes`)
    space: SwapSpace | None  # the swap space, where a tier is on nvme
    dist: Dist
    grads_full: bool  # ZeRO stage 1 over several ranks: each rank keeps the whole gradient
