"""The module's own ``state_dict()`` and ``load_state_dict()`` while its parameters live in tiers.

Owns: the hooks on the user's module that make the two calls mean what they mean in plain
PyTorch. ``load_state_dict(sd)`` takes each managed parameter's value out of ``sd`` and writes
it into the tiers (the fp32 master weights and the low-precision parameters; optimizer states
are left as they are, as torch leaves an optimizer's); the rest loads as usual, and a missing,
unexpected or mis-shaped key is reported as torch reports it. ``state_dict()`` gives every
managed parameter's weights (the fp32 masters in the parameter's own dtype) instead of its
empty placeholder. Touches: the units, `Engine.unit_weights`, `engine.optimizer.load_master`.
"""

from __future__ import annotations

import torch
from torch import nn

from ._units import holders


class StateDictHooks:
    def __init__(self, engine, module: nn.Module):
        self.engine = engine
        where = holders(engine.units)
        # Every name of every managed parameter (tied weights: several names, one parameter),
        # with the (unit, index) pieces that hold it (a tiled one: one per tile, in row order).
        self.names = [(name, where[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)
                      if id(p) in where]  # fmt: skip
        self._consumed: set[str] = set()
        self.handles = [
            module.register_load_state_dict_pre_hook(self._before_load),
            module.register_load_state_dict_post_hook(self._after_load),
            module.register_state_dict_post_hook(self._state_dict_hook()),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- load_state_dict --------------------------------------------------------------------
    def _before_load(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                     error_msgs) -> None:  # fmt: skip
        values, consumed, bad = {}, set(), False
        for name, pieces in self.names:
            key = prefix + name
            if key not in state_dict:
                continue
            value = state_dict.pop(key)
            consumed.add(key)
            unit, i = pieces[0]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != unit.full_shapes[i]:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                                  f"the shape in current model is {torch.Size(unit.full_shapes[i])}.")  # fmt: skip
                bad = True
                continue
            for unit, i in pieces:
                values.setdefault((unit.index, i), value)
        self._consumed = consumed
        if values and not bad:
            self.engine.load_weights(values)

    def _after_load(self, module, incompatible_keys) -> None:
        # The keys taken above were loaded into the tiers: they are not missing.
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in self._consumed]
        self._consumed = set()

    # -- state_dict -------------------------------------------------------------------------
    def _state_dict_hook(self):
        def hook(module, state_dict, prefix, local_metadata) -> None:
            keys = [(prefix + name, pieces) for name, pieces in self.names if prefix + name in state_dict]
            if not keys or isinstance(state_dict[keys[0][0]], nn.Parameter):  # keep_vars=True: the parameters
                return
            engine = self.engine
            if engine.world_size > 1:
                raise RuntimeError(
                    "state_dict() of a module whose parameters are sharded over several ranks would gather "
                    "every weight on each rank; use engine.gathered_weights() or engine.export(path), "
                    "called on every rank"
                )
            wanted = {unit.index for _, pieces in keys for unit, _ in pieces}
            weights = {unit.index: full for unit, full in engine.unit_weights() if unit.index in wanted}
            for key, pieces in keys:
                state_dict[key] = assemble(pieces, weights)

        return hook


def assemble(pieces, weights: dict) -> torch.Tensor:
    """One parameter, whole, in the dtype the model was made in, from its ``pieces`` ((unit,
    index) as `holders` gives them) and ``weights`` (unit index -> the unit's flat fp32 weights)."""
    unit, i = pieces[0]
    parts = [u.view(weights[u.index], j) for u, j in pieces]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts)
    return whole.to(unit.dtypes[i])
