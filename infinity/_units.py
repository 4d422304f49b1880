"""Parameter units: the parameters a module owns directly, flattened into one tensor.

Owns: which parameters form each unit, their shapes and offsets in it, this rank's slice, and
the unit's state (released, fetching, ready) with what backs it while ready. Touches only the
module's parameters (binding their data to the unit's memory).

A unit is what moves between tiers. Each distinct Parameter belongs to exactly one unit, the
unit of the first module (in registration order) that holds it; a module that holds a
parameter of another unit (tied weights: GPT-2's lm_head holds wte's weight) uses that unit.

[Note: unit partition]
A unit's flat tensor is padded to a multiple of the world size and rank r keeps slice r of
it (bandwidth-centric partitioning). At world size 1 the slice is the whole; the offsets are
kept rank-aware so that several ranks only add the collectives (`_transport`).
"""

from __future__ import annotations

import enum

import torch
from torch import nn


class UnitState(enum.Enum):
    """Where a unit's full parameters are."""

    RELEASED = "released"  # module params are empty placeholders; the data is in its tier
    FETCHING = "fetching"  # a read (and copy) is in flight
    READY = "ready"  # module params are views into the unit's full tensor on the device


class ParamUnit:
    def __init__(self, index: int, name: str, params: list[tuple[str, nn.Parameter]], world_size: int = 1, rank: int = 0):
        self.index = index
        self.name = name  # module path, e.g. "transformer.h.0.attn.c_attn"; stable across runs
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [tuple(p.shape) for p in self.params]  # on the meta device too (`build`)
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.padded_numel = -(-self.numel // world_size) * world_size
        shard = self.padded_numel // world_size
        self.shard = slice(rank * shard, (rank + 1) * shard)  # see [Note: unit partition]
        self.requires_grad = [p.requires_grad for p in self.params]
        # The dtypes the model was made in (binding gives the parameters param_dtype): what
        # export writes and the unwrapped model expects.
        self.dtypes = [p.dtype for p in self.params]
        self.state = UnitState.RELEASED
        self.full: torch.Tensor | None = None  # 1-D, param dtype, device; while READY
        self.pending = None  # the fetch in flight (store Pending), while FETCHING
        self.lease = None  # the host buffer backing ``full`` (nvme tier on a CPU device)
        self.active = 0  # forwards (or backwards) running that use the unit
        self.uses = 0  # gradient accumulations still expected in this backward
        self.grad: torch.Tensor | None = None  # 1-D fp32, this backward's gradient, being gathered
        self.grad_lease = None  # the pool buffer holding ``grad`` (CPU device)
        self.grad_seen: set[int] = set()  # parameters whose gradient ``grad`` holds
        # What a released parameter reports: the dtype and device it has when fetched, so that
        # a model reading ``weight.dtype`` before the module runs (T5, ViT) sees the truth.
        self.placeholder_dtype: torch.dtype | None = None
        self.placeholder_device: torch.device | None = None

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's slice (the whole padded unit at world size 1)."""
        return self.shard.stop - self.shard.start

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        """The parameters' current values as one padded 1-D tensor of ``dtype`` (on the CPU)."""
        out = torch.zeros(self.padded_numel, dtype=dtype)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            out[off : off + n].copy_(p.detach().reshape(-1))
        return out

    def bind(self, full: torch.Tensor) -> None:
        """Point every parameter at its slice of ``full`` (1-D)."""
        self.full = full
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = full[off : off + n].view(shape)
        self.state = UnitState.READY

    def unbind(self) -> None:
        """Replace every parameter's data by an empty placeholder (the shard stays in its tier)."""
        for p in self.params:
            empty = torch.empty(0, dtype=self.placeholder_dtype or p.dtype, device=self.placeholder_device or p.device)
            if p.is_meta:  # `build`'s: ``.data`` cannot move a tensor off the meta device
                torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))
            else:
                p.data = empty
        self.full = None
        self.state = UnitState.RELEASED

    def __repr__(self) -> str:
        return f"ParamUnit({self.name!r}, {len(self.params)} params, {self.numel} elements, {self.state.value})"


def build_units(model: nn.Module, world_size: int = 1, rank: int = 0):
    """Units in module registration order, and for each module the units it uses."""
    owner: dict[int, int] = {}  # id(param) -> unit index
    units: list[ParamUnit] = []
    module_units: dict[nn.Module, list[ParamUnit]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        own = []
        for p_name, p in module._parameters.items():
            if p is not None and id(p) not in owner:
                owner[id(p)] = len(units)
                own.append((p_name, p))
        if own:
            units.append(ParamUnit(len(units), mod_name or "<root>", own, world_size, rank))
        used = []
        for p in module._parameters.values():
            if p is not None and units[owner[id(p)]] not in used:
                used.append(units[owner[id(p)]])
        if used and module not in module_units:
            module_units[module] = used
    return units, module_units
