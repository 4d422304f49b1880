"""In-place writes to the parameters a module holds, carried into the fp32 master weights.

Owns: the version each managed parameter had when the engine last looked, and the carry of
what changed since into the master weights. Touches: the units (their records and bound
memory), `SubGroupStates.load_master` (``merge=True``).

[Note: in-place writes to bound parameters]
Where the params tier lends its own memory to the module (device or cpu tier below stage 3:
`UnitRuntime.always_ready`), the module's parameters are real tensors, and a write to one is
accepted: ``with torch.no_grad(): p.copy_(w)``, ``nn.init.normal_(p)``, a submodule's own
``load_state_dict`` (torch copies into the parameter). The next forward computes with it, as
in plain PyTorch. But the optimizer updates the fp32 master weights and writes the parameters
from them, and ``state_dict()``, ``export()`` and checkpoints read the masters too: wherever the
parameters are not the masters themselves (bf16 or fp16 parameters; the optimizer on nvme; two
ranks below stage 3, whose parameters are whole and masters sharded; fp32 before the first
step) the write was undone at the next step, or missing from what was saved, with no error.

So every managed parameter's version counter (``p._version``, which every in-place operation
through ``p`` bumps) is noted, and before each forward, step, load and read of the master
weights the parameters whose counter moved are carried into the masters, element by element:
an element whose value is not the master's in the parameter's dtype takes the parameter's
value, the others keep the master's (so a bf16 parameter that was only read costs its master
no precision). Each rank carries its own slice from its own whole parameter, as each DDP rank
keeps its own write. A write into ``p.data`` (``p.data.normal_()``, WGAN's ``p.data.clamp_``)
bumps no counter of ``p``'s (``.data`` is a tensor with a counter of its own), so a bound
parameter's class notes ``p.data`` taken (`_placeholder._Bound`), and such a parameter is
compared the same way (a read only costs the compare); it keeps the ``.data`` tensors taken,
weakly, with their own counters, so that one held across looks and written later (a helper
that keeps them) notes its parameter again. A parameter whose data was replaced
(``p.data = t``) is carried too, and its data put back in the unit's memory; a released one
given data that way is refused (its next fetch would drop it).
Released parameters (nvme, stage 3) are placeholders that refuse writes (`_placeholder`).
"""

from __future__ import annotations

import torch

from . import _placeholder
from ._units import ParamUnit, UnitState
from ._wrap import dtype_refusal


class InPlaceWrites:
    """The managed parameters' versions, and `carry` of the changed ones into the masters.
    ``substates``: what `SubGroupStates.load_master` belongs to (the optimizer's states)."""

    def __init__(self, units: list[ParamUnit], substates):
        # Tiles' parameters are placeholders, bound or not ([Note: tiles]): never written.
        self.params = [(u, i, r.param) for u in units if not u.is_tile for i, r in enumerate(u.records)]
        self.substates = substates
        self.versions = [p._version for _, _, p in self.params]
        self.ids = {id(p) for _, _, p in self.params}

    def changed(self) -> tuple[dict, list]:
        """``(unit index, parameter index) -> the parameter's values`` of each bound parameter
        written in place since the last look (tied weights: under each piece that holds it),
        and the ``(unit, index)`` of those whose data was replaced (``p.data = t``): they no
        longer view the unit's memory. A walk of the version counters: about 0.27 us a
        parameter, 58 us for the 219 of benchmarks/small_layers.py's model on this machine."""
        noted = _placeholder.take_noted(self.ids)
        out, moved = {}, []
        for (u, i, p), version in zip(self.params, self.versions):
            if p._version == version and id(p) not in noted:
                continue
            if u.state is UnitState.RELEASED:
                _refuse_replaced(u, i)
            elif u.state is UnitState.READY:
                r = u.records[i]
                if p.data_ptr() != u.full.data_ptr() + r.offset * u.full.element_size():
                    out[(u.index, i)] = p.detach()
                    moved.append((u, i))
                else:
                    out[(u.index, i)] = u.piece(i)
        return out, moved

    def carry(self) -> int:
        """Carry what `changed` finds into the master weights (a frozen unit's tier holds its
        weights: only replaced data is copied there), and point replaced parameters at their
        unit's memory again; returns how many parameter pieces it carried (0: nothing was
        written, the common case)."""
        values, moved = self.changed()
        if not values:
            return 0
        cast = [(u, i) for u, i in moved if values[(u.index, i)].dtype != u.full.dtype]  # (param_dtype)
        if cast:
            # A cast inside a forward (transformers' Switch router runs self.classifier.to(fp32)
            # at each call), after the check before it: carried, the masters took the
            # parameters' rounded values at every step, silently. Refused as a cast before a
            # forward is, the parameters the engine's again.
            for u in {id(u): u for u, _ in moved}.values():
                u.bind(u.full)
            self.versions = [p._version for _, _, p in self.params]
            u, i = cast[0]
            raise dtype_refusal(u.qualified_name(i), values[(u.index, i)].dtype, u.full.dtype)
        self.substates.load_master(values, merge=True)
        with torch.no_grad():
            for u, i in moved:
                u.piece(i).copy_(values[(u.index, i)])
        for u in {id(u): u for u, _ in moved}.values():
            u.bind(u.full)
        self.versions = [p._version for _, _, p in self.params]
        return len(values)


def _refuse_replaced(unit: ParamUnit, i: int) -> None:
    """A released parameter (an empty placeholder) given data (``p.data = t``: the one write a
    placeholder cannot refuse, since the engine binds it so): the next fetch would replace it,
    unsaid. Refused, naming it; the placeholder is put back."""
    with torch._C.DisableTorchFunctionSubclass():
        t = unit.records[i].param
        # (Not the stand-in a gradient's hand-off puts there, an expanded scalar, which a
        # failed backward leaves: the next fetch binds over it as it should. A 0-d
        # parameter's stand-in cannot be told from data: not checked.)
        if not (t.dim() and t.untyped_storage().nbytes() and 0 not in t.stride()):
            return
        shape = tuple(t.shape)
    unit.unbind()
    raise RuntimeError(
        f"parameter {unit.qualified_name(i)!r} was given new data (p.data = a tensor of shape {shape}) while its "
        "weights live in the engine's tiers (it is an empty placeholder between uses): the next fetch would "
        "replace it with the weights, dropping the new values. Load them with engine.module.load_state_dict "
        "(or the submodule's load_state_dict)"
    )
