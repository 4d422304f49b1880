"""The refusal of ``engine.module`` inside torch's DistributedDataParallel.

Owns: the check, at each root forward, that no DDP wrapper is running the engine's module.
Touches: nothing (it reads which DDP module torch says is in its forward).

[Note: no DDP around the engine]
The engine reduces every gradient across ranks itself (`_transport`), and its parameters are
placeholders whose shape changes as units are fetched and released. DDP's reducer keeps each
parameter's gradient accumulator alive from the wrapper's construction on, with the shape the
placeholder had then (empty), so the first backward fails in autograd ("expected shape
compatible with [0]"); and it would reduce what the engine already reduced. accelerate's
``prepare`` wraps a model in DDP whenever it runs at several processes, so the recipes leave
the module unwrapped: InfinityTrainer prepares it with ``evaluation_mode=True`` (autocast and
compilation only, as transformers prepares a model that owns its gradient reduction), and so
does the README's accelerate loop. A wrapper made anyway is refused at its first forward, with
that fix, rather than at backward with autograd's shape error.
"""

from __future__ import annotations

from torch import nn

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except ImportError:  # a torch built without distributed: no DDP to run inside
    _DDP = None


def refuse_wrapped(root: nn.Module) -> None:
    """Raise when a DistributedDataParallel wrapper is running ``root`` (its forward is the
    caller's); see [Note: no DDP around the engine]."""
    # torch records the DDP module in its forward (for its own checks); a torch without that
    # record cannot tell, and DDP's own error at backward is what remains.
    active_of = getattr(_DDP, "_get_active_ddp_module", None)
    active = active_of() if active_of is not None else None
    if active is None or not any(m is root for m in active.module.modules()):
        return
    raise RuntimeError(
        f"engine.module ({type(root).__name__}) is being run by torch.nn.parallel.DistributedDataParallel "
        f"({type(active.module).__name__} wrapped): the engine reduces the gradients across ranks itself, and DDP "
        "cannot hold its parameters (backward would fail on their placeholders' empty shape). Leave the module "
        "unwrapped: with accelerate, `model = accelerator.prepare_model(engine.module, device_placement=False, "
        "evaluation_mode=True)` and `accelerator.prepare(engine.optimizer, loader)` (accelerator.prepare(engine.module"
        ", ...) wraps it in DDP at several processes); with transformers' Trainer, "
        "infinity.integrations.transformers.InfinityTrainer")
