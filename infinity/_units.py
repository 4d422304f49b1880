"""Parameter units: the parameters a module owns directly, flattened into one tensor.

Owns: which parameters form each unit, their shapes and offsets in it, this rank's slice, and
the unit's state (released, fetching, ready) with what backs it while ready. Touches only the
module's parameters (binding their data to the unit's memory).

A unit is what moves between tiers. Each distinct Parameter belongs to exactly one unit, the
unit of the first module (in registration order) that holds it; a module that holds a
parameter of another unit (tied weights: GPT-2's lm_head holds wte's weight) uses that unit.

[Note: tiles]
A module too large to hold whole (a vocabulary-sized ``nn.Embedding`` or ``nn.Linear``, whose
fp32 weights exceed ``memory.tile_size``) gets one unit per block of rows of its weight (and
bias): a tile. Each tile is a unit in every respect (stored, fetched, given gradients, updated
and checkpointed on its own), so no pipeline ever holds the whole module. Its parameters stay
placeholders: the module's forward is replaced by one that computes tile by tile (`_tiled`).
A parameter's `ParamRecord` says where its piece lies: ``start`` where it begins in the
flattened parameter, ``full_shape`` the parameter's own shape.

[Note: unit partition]
A unit's flat tensor is padded to a multiple of the world size and rank r keeps slice r of
it (bandwidth-centric partitioning). At world size 1 the slice is the whole; the offsets are
kept rank-aware so that several ranks only add the collectives (`_transport`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging

import torch
from torch import nn

from . import _placeholder
from ._sizes import clear_grads

logger = logging.getLogger("infinity")


class UnitState(enum.Enum):
    """Where a unit's full parameters are."""

    RELEASED = "released"  # module params are empty placeholders; the data is in its tier
    FETCHING = "fetching"  # a read (and copy) is in flight
    READY = "ready"  # module params are views into the unit's full tensor on the device


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ParamRecord:
    """One parameter of a unit: its piece (a tile: its rows) and where that lies in the unit's
    flat tensor. A saved unit (`_consolidate`) has the same records, its parameters placeholders."""

    name: str  # in its module ("weight")
    param: torch.Tensor
    full_shape: tuple[int, ...]  # the whole parameter's
    shape: tuple[int, ...]  # the piece's: the whole parameter's, or a tile's rows of it
    start: int  # where the piece begins in the flattened parameter
    numel: int  # the piece's elements
    offset: int  # where the piece begins in the unit's flat tensor
    requires_grad: bool
    dtype: torch.dtype  # the dtype the model made it in (binding gives it param_dtype)

    @property
    def in_unit(self) -> slice:
        """Where the piece lies in the unit's flat tensor."""
        return slice(self.offset, self.offset + self.numel)

    @property
    def in_param(self) -> slice:
        """Where the piece lies in the flattened parameter."""
        return slice(self.start, self.start + self.numel)


def lay_out(pieces) -> tuple[ParamRecord, ...]:
    """Records of ``pieces`` (name, parameter, the whole parameter's shape, the piece's shape,
    where it begins in the flattened parameter, requires_grad, dtype), laid out one after
    another in a unit's flat tensor."""
    out, offset = [], 0
    for name, p, full, shape, start, requires_grad, dtype in pieces:
        numel = int(torch.Size(shape).numel())
        out.append(ParamRecord(name, p, tuple(full), tuple(shape), start, numel, offset, requires_grad, dtype))
        offset += numel
    return tuple(out)


def records(params: list[tuple[str, torch.Tensor]], rows: tuple[int, int] | None = None) -> tuple[ParamRecord, ...]:
    """The records of ``params`` (name, parameter) laid out one after another, whole or (a
    tile) their rows [start, stop)."""
    pieces = []
    for name, p in params:
        full = tuple(p.shape)  # on the meta device too (`build`)
        shape = full if rows is None else (rows[1] - rows[0], *full[1:])
        start = 0 if rows is None else rows[0] * int(torch.Size(full[1:]).numel())
        pieces.append((name, p, full, shape, start, p.requires_grad, p.dtype))
    return lay_out(pieces)


class ParamUnit:
    def __init__(self, index: int, name: str, params: list[tuple[str, nn.Parameter]], world_size: int = 1,
                 rank: int = 0, *, rows: tuple[int, int] | None = None, path: str | None = None):  # fmt: skip
        self.index = index
        # Stable across runs: the module path ("transformer.h.0.attn.c_attn"), "<root>", or for
        # a tile the module path and its first row ("lm_head#4096"; see [Note: tiles]).
        self.name = name
        self.path = name if path is None else path  # the module's path
        self.rows = rows  # a tile's rows [start, stop) of every parameter, or None: whole
        self.records = records(params, rows)
        self.numel = sum(r.numel for r in self.records)
        self.padded_numel = -(-self.numel // world_size) * world_size
        shard = self.padded_numel // world_size
        self.shard = slice(rank * shard, (rank + 1) * shard)  # see [Note: unit partition]
        self.trainable = any(r.requires_grad for r in self.records)
        # Bit i: record i's gradient arrived since the last step (`warn_partial`); all: every one's.
        self.arrived = 0
        self.expected = sum(1 << i for i, r in enumerate(self.records) if r.requires_grad)
        self.state = UnitState.RELEASED
        self.full: torch.Tensor | None = None  # 1-D, param dtype, device; while READY
        self.pending = None  # the fetch in flight (store Pending), while FETCHING
        self.lease = None  # the host buffer backing ``full`` (nvme tier on a CPU device)
        self.active = 0  # forwards (or backwards) running that use the unit
        # Open GatheredParameters contexts holding the unit: passes ending inside leave it bound.
        self.gathers = 0
        self.uses = 0  # gradient accumulations still expected in this backward
        self.grad: torch.Tensor | None = None  # 1-D fp32, this backward's gradient, being gathered
        self.grad_lease = None  # the pool buffer holding ``grad`` (CPU device)
        self.grad_seen: set[int] = set()  # parameters whose gradient ``grad`` holds
        # What a released parameter reports: the dtype and device it has when fetched, so that
        # a model reading ``weight.dtype`` before the module runs (T5, ViT) sees the truth.
        self.placeholder_dtype: torch.dtype | None = None
        self.placeholder_device: torch.device | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        """The unit's parameters, in the order of its records."""
        return [r.param for r in self.records]

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's slice (the whole padded unit at world size 1)."""
        return self.shard.stop - self.shard.start

    @property
    def is_tile(self) -> bool:
        return self.rows is not None

    @property
    def last_tile(self) -> bool:
        """A whole unit, or the tile holding its module's last rows."""
        return self.rows is None or self.rows[1] == self.records[0].full_shape[0]

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        """The parameters' current values (a tile: its rows) as one padded 1-D tensor of
        ``dtype`` (on the CPU)."""
        out = torch.zeros(self.padded_numel, dtype=dtype)
        for r in self.records:
            out[r.in_unit].copy_(r.param.detach().reshape(-1)[r.in_param])
        return out

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s part (a tile: its rows) of ``flat``, a 1-D tensor laid out as the
        unit is, in the shape of that part."""
        r = self.records[i]
        return flat[r.in_unit].view(r.shape)

    def piece(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of ``full`` (while READY)."""
        return self.view(self.full, i)

    def bind(self, full: torch.Tensor) -> None:
        """Point every parameter at its slice of ``full`` (1-D). A tile's parameters stay
        placeholders: its module's forward reads ``full`` (see [Note: tiles])."""
        self.full = full
        if self.rows is None:
            for r in self.records:
                r.param.data = full[r.in_unit].view(r.shape)
                _placeholder.bind_param(r.param)
        self.state = UnitState.READY

    def unbind(self) -> None:
        """Replace every parameter's data by an empty placeholder (the shard stays in its tier),
        whose reads are refused (see [Note: reads outside a module] in `_gather`)."""
        # A bound tile's parameters are placeholders already (`bind` leaves them), or hold the
        # whole weight for a gather of it (`_gather`), which puts the placeholder back itself.
        if self.rows is None or self.full is None:
            for i, p in enumerate(self.params):
                empty = torch.empty(0, dtype=self.placeholder_dtype or p.dtype, device=self.placeholder_device or p.device)
                if p.is_meta:  # `build`'s: ``.data`` cannot move a tensor off the meta device
                    swap_contents(p, empty)
                else:
                    p.data = empty
                _placeholder.release_param(p, self.qualified_name(i))
        self.full = None
        self.state = UnitState.RELEASED

    def qualified_name(self, i: int) -> str:
        """Parameter ``i``'s name in the model (``"lm_head.weight"``)."""
        name = self.records[i].name
        return name if self.path == "<root>" else f"{self.path}.{name}"

    def __repr__(self) -> str:
        return f"ParamUnit({self.name!r}, {len(self.records)} params, {self.numel} elements, {self.state.value})"


def swap_contents(p: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``p`` the contents of ``value`` in place, where ``.data`` cannot (off the meta
    device). ``torch.utils.swap_tensors`` exchanges the Python attributes too: ``p`` keeps its
    own, or the engine's mark (``_infinity_managed``, what refuses a foreign optimizer and a
    second initialize) would leave with the discarded tensor. An RNN (GRU, LSTM) keeps weak
    references to its weights, which swap_tensors refuses: `build` marks its parameters
    (``_infinity_rnn``), whose references are dropped for the swap and made again, as the RNN's
    own ``_apply`` does around a swap (a built GRU failed with "Cannot swap t1 because it has
    weakref associated with it"; an audit helper's repro)."""
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    rnn = p.__dict__.get("_infinity_rnn")
    rnn = rnn() if rnn is not None else None
    if rnn is None:
        torch.utils.swap_tensors(p, new)
        return
    rnn._flat_weight_refs = []
    try:
        torch.utils.swap_tensors(p, new)
    finally:
        rnn._init_flat_weights()


def build_units(model: nn.Module, world_size: int = 1, rank: int = 0, tile_bytes: int | None = None):
    """Units in module registration order, for each module the units it uses, and the tiled
    modules (module -> its tiles in row order; see [Note: tiles]): those of ``tileable``
    whose fp32 parameters exceed ``tile_bytes`` (None: no tiles)."""
    users: dict[int, int] = {}  # id(param) -> modules holding it
    for module in model.modules():  # once per module object
        for p in module._parameters.values():
            if p is not None:
                users[id(p)] = users.get(id(p), 0) + 1
    owner: dict[int, list[int]] = {}  # id(param) -> unit indices (a tiled one's every tile)
    units: list[ParamUnit] = []
    module_units: dict[nn.Module, list[ParamUnit]] = {}
    tiled: dict[nn.Module, list[ParamUnit]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        own = []
        for p_name, p in module._parameters.items():
            if p is not None and id(p) not in owner:
                own.append((p_name, p))
        path = mod_name or "<root>"
        row_blocks = _tile_rows(module, own, users, tile_bytes) if module not in module_units else None
        first = len(units)
        if row_blocks:
            for lo, hi in row_blocks:
                units.append(ParamUnit(len(units), f"{path}#{lo}", own, world_size, rank, rows=(lo, hi), path=path))
        elif own:
            units.append(ParamUnit(len(units), path, own, world_size, rank))
        for _, p in own:
            owner[id(p)] = list(range(first, len(units)))
        used = []
        for p in module._parameters.values():
            if p is not None:
                used += [units[i] for i in owner[id(p)] if units[i] not in used]
        if used and module not in module_units:
            module_units[module] = used
            if row_blocks:
                tiled[module] = used
    return units, _containers_to_parents(model, module_units), tiled


CONTAINERS = (nn.ParameterDict, nn.ParameterList)
# Children whose parameters their parent's forward reads itself, never calling them:
# nn.MultiheadAttention's out_proj, whose weight and bias F.multi_head_attention_forward takes
# (so nn.Transformer's layers): with parameters on nvme its first forward was refused as "read
# outside the forward of the module that holds it" (an audit helper's repro).
READ_BY_PARENT: dict[type, tuple[str, ...]] = {nn.MultiheadAttention: ("out_proj",)}


def _held_children(module: nn.Module):
    """The children whose parameters ``module`` reads in its own forward: parameter
    containers, and `READ_BY_PARENT`'s."""
    if isinstance(module, CONTAINERS):
        return
    read = next((names for cls, names in READ_BY_PARENT.items() if isinstance(module, cls)), ())
    for name, child in module.named_children():
        if isinstance(child, CONTAINERS) or name in read:
            yield child


def _containers_to_parents(model: nn.Module, module_units: dict[nn.Module, list[ParamUnit]]) -> dict:
    """[Note: parameter containers]
    An ``nn.ParameterDict`` or ``nn.ParameterList`` has no forward: the module holding it reads
    its parameters in its own (peft's ``lora_embedding_A``, ``lora_magnitude_vector``, IA3's
    vectors), and so does nn.MultiheadAttention its ``out_proj``'s (`READ_BY_PARENT`). Their
    units are that module's too, fetched around that module's calls and counted in its gradient
    uses (`held_params`); a parameter released between uses was refused there as "read outside
    the forward of the module that holds it" (an audit helper's repro). Returned in
    registration order (the first pass's predicted order)."""
    out: dict[nn.Module, list[ParamUnit]] = {}
    for module in model.modules():
        mine = list(module_units.get(module, ()))
        for child in _held_children(module):
            for held in child.modules():  # (a container of containers too)
                mine += [u for u in module_units.get(held, ()) if u not in mine]
        if mine:
            out[module] = mine
    return out


def held_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters ``module`` computes with itself: its own, and those of the children it
    reads them of ([Note: parameter containers])."""
    out = [p for p in module._parameters.values() if p is not None]
    for child in _held_children(module):
        out += [p for m in child.modules() for p in m._parameters.values() if p is not None]
    return out


def holders(units: list[ParamUnit]) -> dict[int, list[tuple[ParamUnit, int]]]:
    """id(parameter) -> the (unit, index in the unit) pieces that hold it: one, or a tiled
    parameter's tiles in row order (see [Note: tiles])."""
    where: dict[int, list] = {}
    for u in units:
        for i, p in enumerate(u.params):
            where.setdefault(id(p), []).append((u, i))
    return where


def tileable(module: nn.Module) -> bool:
    """Modules whose forward `_tiled` computes tile by tile: plain ``nn.Linear`` and
    ``nn.Embedding`` (not subclasses, whose forward may differ), without the embedding options
    that read or change the whole weight (``max_norm``, ``scale_grad_by_freq``, ``sparse``), and
    whose forward is the class's: one set on the instance (accelerate's ``add_hook_to_module``, a
    user's wrapper) does more than the class's, and the tiled forward would replace it; and
    whose parameters carry no hook of the user's (``p.register_hook``): a tile's gradient is
    made by its Function and never passes through the parameter, so the hook would not run; nor
    a forward pre-hook, which may read the whole weight (hook-based weight_norm)."""
    if "forward" in module.__dict__:
        return False
    if any(p._backward_hooks or p._post_accumulate_grad_hooks for p in module.parameters(recurse=False)):
        return False
    if module._forward_pre_hooks:  # (torch.nn.utils' hook-based weight_norm computes the weight in one)
        return False
    if type(module) is nn.Linear:
        return True
    if type(module) is nn.Embedding:
        return module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
    return False


def _tile_rows(module, own, users, tile_bytes) -> list[tuple[int, int]] | None:
    """The row blocks of a module split into tiles, or None to keep it whole: tiles need a
    tileable module owning all its parameters, held by no other module (tied weights are used
    whole elsewhere), whose fp32 parameters exceed ``tile_bytes``."""
    if tile_bytes is None or not own or not tileable(module):
        return None
    params = [p for p in module._parameters.values() if p is not None]
    if len(own) != len(params) or any(users[id(p)] > 1 for p in params):
        return None
    rows = params[0].shape[0]
    per_row = sum(int(p[0].numel()) if p.dim() > 1 else 1 for p in params)  # elements of one row, all params
    if rows * per_row * 4 <= tile_bytes:
        return None
    step = max(1, tile_bytes // (4 * per_row))
    if step >= TILE_ROW_ALIGN:  # see TILE_ROW_ALIGN
        step -= step % TILE_ROW_ALIGN
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


# A tile's rows begin at a multiple of this many (where a tile holds as many): the slices of a
# tiled Linear's output and of its output's gradient then begin 128-byte aligned in bf16, as
# cuBLAS's tensor-core kernels want their matrices (16 bytes at least). Cut at the byte budget
# alone, the 953M Llama's down_proj (2048 rows of 5632) had tiles of 1489 and 559 rows, whose
# second slices began 2978 bytes in.
TILE_ROW_ALIGN = 64


def warn_partial(units, say: bool) -> bool:
    """Where a unit's gradients of this step came for some of its parameters and not others (a
    parameter its module used on some steps only), say so when ``say``, and return whether it
    was said: the engine steps a module's parameters together, so the others are updated on a
    zero gradient, where torch.optim skips a parameter whose ``.grad`` is None. Then every
    unit's count starts over."""
    said = False
    for unit in units:
        got, unit.arrived = unit.arrived, 0
        if got and got != unit.expected and say and not said:
            said = True
            missing = [r.name for i, r in enumerate(unit.records) if unit.expected >> i & 1 and not got >> i & 1]
            logger.warning(
                "parameter %r of module %r got no gradient this step while others of its module did: the engine "
                "steps a module's parameters together (as DeepSpeed's ZeRO and FSDP's flat parameters do), so it "
                "was updated on a zero gradient (weight decay and momentum act on it), where torch.optim skips a "
                "parameter whose .grad is None. Put a parameter used on some steps only in a module of its own to "
                "keep it still. (Said once.)", missing[0], unit.path)  # fmt: skip
    return said


def forget_gradients(units) -> None:
    """The gradients of this step were dropped (zero_grad): nothing arrived, and a ``.grad``
    set by hand or left by an interrupted backward goes, as torch's ``set_to_none`` drops it."""
    for unit in units:
        unit.arrived = 0
    clear_grads(r.param for unit in units for r in unit.records)
