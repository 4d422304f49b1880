"""One check at an engine's first call: accelerate's mixed precision that will not reach it.

accelerate's mixed precision is an autocast around the forward that ``accelerator.prepare``
installs on each ``nn.Module`` it is given. The engine is no ``nn.Module``: a loop that hands
accelerate the engine itself (``accelerator.prepare(engine, engine.optimizer, ...)``, as with
a DeepSpeed engine) gets it back as it was, and everything else keeps working through it (its
attributes are the module's), so the forward ran in fp32 with ``mixed_precision="bf16"``
asked, silently: other losses than the same loop's without the engine (an audit helper's
repro). The README's recipe prepares ``engine.module``, whose forward then runs under it.

Nothing here imports accelerate: a process that has not imported it has none to miss.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn


def accelerate_precision() -> str | None:
    """The mixed precision of the process's Accelerator ("bf16", "fp16", ...), or None where
    accelerate is not imported, no Accelerator was made, or it has none ("no")."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
    try:
        precision = shared.get("_mixed_precision") if shared else None
    except Exception:  # noqa: BLE001 - another accelerate's internals: no check rather than a failure
        return None
    return precision if isinstance(precision, str) and precision != "no" else None


def warn_unprepared_autocast(module: nn.Module, device: torch.device) -> bool:
    """Warn where the process's Accelerator has a mixed precision that this call of the engine
    runs without: ``module`` was not given to ``accelerator.prepare`` (whose forward would run
    under its autocast) and no autocast is on around the call. Returns whether it warned."""
    precision = accelerate_precision()
    if precision is None or "_original_forward" in vars(module):  # prepared: accelerate keeps the unwrapped one there
        return False
    if torch.is_autocast_enabled(device.type):  # the loop's own ``with accelerator.autocast():``
        return False
    warnings.warn(
        f"accelerate's Accelerator has mixed_precision={precision!r}, but this engine's forward runs without it: "
        f"the engine is no torch.nn.Module, so accelerator.prepare(engine, ...) gives it back as it is, without "
        f"the autocast it puts around a module's forward. Prepare engine.module instead (model = "
        f"accelerator.prepare_model(engine.module, device_placement=False, evaluation_mode=True), the README's "
        f"accelerate recipe), or call it under `with accelerator.autocast():`",
        stacklevel=3,
    )
    return True
