"""The hooks a scheduler puts on a model, and their handles.

Owns: the handles of every hook the engine registers on the model's modules and parameters
(removed together at close), each module's gradient uses per grad-enabled call
(`ModuleHooks.uses_per_call`), and the units whose parameters carry a gradient hook with
their count (`ModuleHooks.hooked_grads`: [Note: always-ready units' uses] in `_schedule`).
Touches: the modules and parameters (hooks registered on them), `_tiled` (a tiled module's
forward replaced and given back). `_schedule.Scheduler` builds one, giving it its hook
functions (`PassHooks`): what the hooks do is the scheduler's; where they go is decided here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch import nn

from . import _tiled
from ._compile import eager
from ._units import ParamUnit, held_params


@dataclasses.dataclass(frozen=True)
class PassHooks:
    """The scheduler's hook functions, as `ModuleHooks.install` registers them."""

    root_pre: Callable  # the root's forward pre-hook: a pass begins
    root_post: Callable  # the root's forward hook, also when its forward raised: the pass ends
    container_pre: Callable  # a module holding no unit but containing some: its call may be a pass
    sub_root_post: Callable  # the end of such a call (and of a unit module's, called on its own)
    pre_forward: Callable  # a unit module's forward pre-hook: its units fetched
    call_over: Callable  # its first forward hook, also when its forward raised: its call is over
    post_forward: Callable  # its forward hook: its units released, their uses counted
    grad: Callable[[ParamUnit, int], Callable]  # the post-accumulate hook of a unit's parameter i


class ModuleHooks:
    """The hooks on one model for ``units`` (their modules ``module_units``, the tiled ones
    ``tiled``, whose forwards read tiles through ``scheduler``): none on the modules where every
    unit is ``always_ready`` (but a tiled module's post-hook and the root's)."""

    def __init__(self, units: list[ParamUnit], module_units: dict[nn.Module, list[ParamUnit]],
                 tiled: dict[nn.Module, list[ParamUnit]], *, always_ready: bool, fns: PassHooks, scheduler):  # fmt: skip
        self.units, self.module_units, self.tiled = units, module_units, tiled
        self.always_ready, self.fns, self.scheduler = always_ready, fns, scheduler
        self.handles: list = []
        # Per module, for each unit, how many of its gradients one grad-enabled call brings (the
        # parameters the module holds itself that require grad): counted once, at install.
        self.uses_per_call: dict[nn.Module, list[tuple[ParamUnit, int]]] = {}
        self.hooked_grads: list[tuple[ParamUnit, int]] = []  # (unit, gradient hooks on its parameters)

    def add(self, handle) -> None:
        """A hook registered elsewhere (`_gather`'s on a gathered parameter), removed with these."""
        self.handles.append(handle)

    def install(self, root: nn.Module) -> None:
        """Hook ``root`` and every module that uses a unit. Calling ``root`` itself (what
        ``engine(...)``, transformers' Trainer and accelerate do alike) runs a whole pass."""
        fns, add = self.fns, self.handles.append
        # Every hook on a module runs eagerly under torch.compile: [Note: hooks under torch.compile].
        self._install_modules()
        # After the modules' own: prepended, the root's runs before every other (its units' fetch too).
        add(root.register_forward_pre_hook(eager(fns.root_pre), prepend=True))
        if not self.always_ready:
            # Modules that hold none of a unit's parameters but contain some (a backbone, a
            # tower): called outside the root, their call is the pass, not each leaf's inside it.
            for module in root.modules():
                if module is not root and module not in self.module_units and any(
                        m in self.module_units for m in module.modules()):  # fmt: skip
                    add(module.register_forward_pre_hook(eager(fns.container_pre)))
                    add(module.register_forward_hook(eager(fns.sub_root_post), always_call=True))
        for module, tiles in self.tiled.items():
            _tiled.install(module, self.scheduler, tiles)
            module.forward = eager(module.forward)  # it reads tiles from the tiers
        add(root.register_forward_hook(eager(fns.root_post), always_call=True))

    def _install_modules(self) -> None:
        fns, add, ready = self.fns, self.handles.append, self.always_ready
        self.uses_per_call = {
            module: [(u, sum(1 for r in u.records if r.requires_grad and any(q is r.param for q in held)))
                     for u in units]
            for module, units in self.module_units.items()
            for held in (held_params(module),)
        }  # fmt: skip
        for module in self.module_units:
            if not ready:  # see [Note: always-ready units' uses]
                # First of the module's pre-hooks: one of the model's own may read the parameters
                # (torch.nn.utils' hook-based weight_norm and spectral_norm compute the weight).
                add(module.register_forward_pre_hook(eager(fns.pre_forward), prepend=True))
            if not ready:  # first of its forward hooks, and also when the forward raised
                add(module.register_forward_hook(eager(fns.call_over), always_call=True))
            if not ready or module in self.tiled:  # (a tile's uses: counted per call)
                add(module.register_forward_hook(eager(fns.post_forward)))
            if not ready:  # after the one above; also when the forward raised
                add(module.register_forward_hook(eager(fns.sub_root_post), always_call=True))
        self.hooked_grads = []
        for unit in self.units:
            hooked = 0
            for i, r in enumerate(unit.records):
                if r.requires_grad and not unit.is_tile:  # a tile's gradients come from its Function (tile_grad)
                    add(r.param.register_post_accumulate_grad_hook(fns.grad(unit, i)))
                    hooked += 1
            if hooked:
                self.hooked_grads.append((unit, hooked))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for module in self.tiled:
            _tiled.remove(module)
