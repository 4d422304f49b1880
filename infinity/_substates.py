"""The optimizer's state, per sub-group: where it is stored, under which keys, and how big.

Owns: the sub-groups (consecutive units whose state fits ``optimizer.sub_group_size``), the
record of every sub-group's and unit's keys and byte sizes (`StateRecord`, [Note: state
keys]), the optimizer-state stores, the per-unit step counts, the master weights' first
values and loads (`SubGroupStates.init_state`, `load_master`), and the writes of new
low-precision parameters to the params tier. Touches: the params store (to write the new
parameters), ``dist`` at stages 1 and 2 (to gather them), a torch optimizer run as it is (its
parameters become views of the master weights).

States (the fp32 master weights and the algorithm's own kinds, `_algorithms`) are kept per
sub-group, stored as one flat tensor per kind, so NVMe sees a few large transfers rather than
many small ones.

[Note: state keys]
A sub-group's state of kind ``k`` lies in the swap space under ``<sub-group>/<k>``
(``optimizer.3/exp_avg``), a unit's parameters under ``<unit>/param``, and a checkpoint keeps
each unit's slice of every kind under ``<unit>/<k>``; the overlap's staged copies add ``~next``
to the name (``optimizer.3~next/exp_avg``, [Note: exact overlap]). `state_key` is that format
and `StateRecord.key` the one way to a key; `_store.Store._key` builds the same from the name
a record gives (`StateRecord.name_for`). The names on disk are the formats of
docs/formats.md: checkpoints and swap spaces written before must read the same.
"""

from __future__ import annotations

import logging

import torch
from torch.profiler import record_function

from infinity.swap import WriteBehind

from ._algorithms import Algorithm, Cut
from ._store import Store
from ._units import ParamUnit, holders

STAGED = "~next"  # the suffix of a staged name: see [Note: exact overlap]

logger = logging.getLogger("infinity")


def state_key(name: str, kind: str, staged: bool = False) -> str:
    """The key of ``name``'s (a unit's or sub-group's) tensor of ``kind``: see [Note: state keys]."""
    return f"{name}{STAGED if staged else ''}/{kind}"


class StateRecord:
    """The keys and byte sizes of one unit's or sub-group's state: ``numel`` elements of each
    kind in ``itemsizes`` (kind -> bytes per element), except the kinds in ``numels`` (kind ->
    its elements: an int8 moment's per-block scales, [Note: compact state format])."""

    __slots__ = ("name", "numel", "itemsizes", "numels")

    def __init__(self, name: str, numel: int, itemsizes: dict[str, int], numels: dict[str, int] | None = None):
        self.name = name
        self.numel = numel
        self.itemsizes = itemsizes
        self.numels = numels or {}

    def name_for(self, staged: bool = False) -> str:
        """The name a `Store` takes for this state (the store adds the kind)."""
        return self.name + STAGED if staged else self.name

    def key(self, kind: str, staged: bool = False) -> str:
        """Its tensor of ``kind`` in a swap space or a checkpoint ([Note: state keys])."""
        return state_key(self.name, kind, staged)

    def numel_of(self, kind: str) -> int:
        """Elements of its tensor of ``kind``."""
        return self.numels.get(kind, self.numel)

    def nbytes(self, kind: str) -> int:
        """Bytes of its tensor of ``kind``."""
        try:
            return self.numel_of(kind) * self.itemsizes[kind]
        except KeyError:
            raise ValueError(f"{self.name} has no state {kind!r}; its kinds are {', '.join(self.itemsizes)}") from None

    def state_bytes(self, kinds) -> int:
        """Bytes of its tensors of ``kinds``, together."""
        return sum(self.nbytes(k) for k in kinds)


class SubGroup:
    """Consecutive units whose optimizer state is stored and updated as one flat tensor per kind."""

    def __init__(self, index: int, units: list[ParamUnit], itemsizes: dict[str, int], numels: dict[str, int],
                 align: int = 1):  # fmt: skip
        self.index = index
        self.name = f"optimizer.{index}"
        self.units = units
        # unit index -> its part of every flat state; a unit of 8 ``align`` or more starts at a
        # multiple of ``align`` elements ([Note: one copy of the fp32 weights] in `_onecopy`);
        # the gaps are unused.
        self.slices: dict[int, slice] = {}
        pos = 0
        for u in units:
            n = u.shard_numel
            if n >= 8 * align:  # a small unit is not worth a gap: its few bytes bounce instead
                pos = -(-pos // align) * align
            self.slices[u.index] = slice(pos, pos + n)
            pos += n
        self.numel = pos
        self.record = StateRecord(self.name, self.numel, itemsizes, numels)


def make_groups(units: list[ParamUnit], sub_group_bytes: int, algorithm: Algorithm, align: int = 1) -> list[SubGroup]:
    """Consecutive units whose state (every kind of ``algorithm``) fits ``sub_group_bytes``;
    each unit's slice starts at a multiple of ``align`` elements (unless it is small)."""
    itemsizes = algorithm.itemsizes()

    def group(members):
        return SubGroup(len(groups), members, itemsizes, algorithm.numels([u.shard_numel for u in members]), align)

    groups, current, size = [], [], 0
    for u in units:
        nbytes = algorithm.state_bytes(u.shard_numel)
        if current and size + nbytes > sub_group_bytes:
            groups.append(group(current))
            current, size = [], 0
        current.append(u)
        size += nbytes
    if current:
        groups.append(group(current))
    return groups


class SubGroupStates:
    """Every sub-group's state in the optimizer tier and every unit's step count; the writes of
    new parameters made from the master weights. ``param_groups`` is the optimizer's own list
    (read as it is now: LR schedulers change it)."""

    def __init__(self, algorithm: Algorithm, param_groups: list[dict], *, units, groups, stores: dict[str, Store],
                 param_store: Store, param_dtype: torch.dtype, dist=None, params_sharded: bool = True,
                 foreign=None, one_copy: bool = False):  # fmt: skip
        if foreign is not None and dist is not None and dist.active:
            raise ValueError(f"optimizer {type(foreign).__name__}: the engine runs a torch optimizer it does not "
                             "implement itself only with one rank (every tier on the device)")  # fmt: skip
        self.algorithm = algorithm
        self.param_groups = param_groups
        self.units = units
        self.groups = groups  # SubGroups of the trainable units
        grouped = {u.index for g in groups for u in g.units}
        self.frozen = [u for u in units if u.index not in grouped]  # no optimizer state, never written
        self.stores = stores  # kind -> Store, all in the optimizer tier: algorithm.kind_names
        self.param_store = param_store
        self.param_dtype = param_dtype
        self.device = stores["master"].device
        self.dist = dist
        # ZeRO stages 1 and 2 keep whole parameters on every rank: new shards are gathered.
        self.gather_params = not params_sharded and dist is not None and dist.active
        # The parameters are the master weights ([Note: one copy of the fp32 weights] in
        # `_onecopy`): ``stores["master"]`` reads and writes them; nothing writes them twice.
        self.one_copy = one_copy
        unit_sizes = {**algorithm.itemsizes(), "param": param_dtype.itemsize}
        self.records = {u.index: StateRecord(u.name, u.shard_numel, unit_sizes, algorithm.numels([u.shard_numel]))
                        for u in units}  # fmt: skip
        self.steps = {u.index: torch.zeros((), dtype=torch.float32, device=self.device) for u in units}
        self.never_stepped = {u.index for u in units}  # SGD's first step starts a momentum buffer; no device read
        self.param_writes = WriteBehind(2)  # new parameters from their own pool copies (see write_params)
        # Per sub-group, per parameter group: (unit, slice of the sub-group's state, slice of
        # the unit's gradient shard, index of the parameter in the unit) of every parameter in
        # that group, cut to this rank's shard.
        self.slices = self._map_slices()
        self.cuts = [Cut.of(per_group, sg.numel) for sg, per_group in zip(self.groups, self.slices)]
        self.foreign = foreign  # algorithm "torch": the user's optimizer, stepped on views of the masters
        self.shadows: dict[tuple[int, int], torch.nn.Parameter] = {}
        # Resident fp32 parameters beside resident master weights on the same device: each
        # sub-group's parameters in one flat tensor (1-D, fp32, laid out as its master
        # weights), which the master weights become at the first step without the overlap
        # (``shared`` -> ``sharing``): [Note: one copy of the fp32 weights] in `_onecopy`.
        self.shared: dict[int, torch.Tensor] = {}
        self.sharing: set[int] = set()  # sub-groups whose master weights are their ``shared`` tensor
        self._shares_checked = False

    @property
    def kinds(self) -> tuple[str, ...]:
        """The state kinds stored per sub-group: "master" and the algorithm's own."""
        return self.algorithm.kind_names

    def record(self, unit) -> StateRecord:
        """``unit``'s state record: its keys and byte sizes ([Note: state keys])."""
        return self.records[unit.index]

    def _map_slices(self) -> list[dict[int, list]]:
        where = holders(self.units)  # id(param) -> [(unit, index in the unit)]: a tiled one's every tile
        owner = {}  # (unit index, param index) -> parameter group index
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) not in where:
                    raise ValueError(f"optimizer parameter group {gi} holds a tensor of shape {tuple(p.shape)} that "
                                     "is not a parameter of the model given to initialize")  # fmt: skip
                for u, i in where[id(p)]:
                    owner[(u.index, i)] = gi
        out = []
        for sg in self.groups:
            per_group: dict[int, list] = {}
            for u in sg.units:
                lo, hi = u.shard.start, u.shard.stop
                base = sg.slices[u.index].start
                for i, r in enumerate(u.records):
                    gi = owner.get((u.index, i))
                    a, b = max(r.offset, lo), min(r.in_unit.stop, hi)
                    # A frozen parameter beside trainable ones in its unit (a frozen weight under
                    # a trained bias) has a zero gradient there: stepped, weight decay and
                    # momentum would move it, where torch skips a parameter without a gradient.
                    if gi is None or a >= b or not r.requires_grad:
                        continue
                    per_group.setdefault(gi, []).append((u, slice(base + a - lo, base + b - lo), slice(a - lo, b - lo), i))
            out.append(per_group)
        return out

    # -- step counts ------------------------------------------------------------------------
    def mark_stepped(self, units) -> set[int]:
        """``units`` (indices) take a step now; returns those for which it is the first."""
        first = set(units) & self.never_stepped
        self.never_stepped -= set(units)
        return first

    def load_steps(self, steps: torch.Tensor) -> None:
        """Every unit's step count from ``steps`` (one per unit, in order)."""
        if steps.numel() != len(self.units):
            raise ValueError(f"optimizer state has {steps.numel()} step counts, this model has {len(self.units)} units")
        for u in self.units:
            self.steps[u.index].fill_(float(steps[u.index]))
        self.never_stepped = {u.index for u in self.units if float(steps[u.index]) == 0}

    # -- first values and loads -------------------------------------------------------------
    def init_state(self, prepare=None, done=None) -> None:
        """Master weights from the parameters' values as the user made them, the algorithm's
        states as it starts them; and each unit's low-precision parameters into the params
        tier. One sub-group is in memory at a time; ``prepare(unit)`` runs before a unit's
        values are read and ``done(unit)`` after (`build`'s models get their values there).
        Frozen units (no parameter requires grad) have no optimizer state: only their
        parameters are stored."""

        differ = []

        def values(u):
            if prepare is not None:
                prepare(u)
            try:
                whole = u.flat(torch.float32)
            finally:
                if done is not None:
                    done(u)
            # Every rank keeps its slice of the same weights: rank 0's where the ranks built the
            # model from other RNG states (a seed set per rank before it), as DDP broadcasts them.
            if self.dist is not None and self.dist.active and self.dist.same_from_rank0(
                    whole, f"the initial values of {u.name}"):  # fmt: skip
                differ.append(u.name)
            return whole

        for u in self.frozen:
            whole = values(u)
            kept = whole[u.shard] if not self.gather_params else whole
            self.param_store.put(u.name, kept.to(self.param_dtype)).result()
        share = self.may_share()
        for sg, per_group in zip(self.groups, self.slices):
            master = torch.zeros(sg.numel, dtype=torch.float32)
            shared = None
            for u in sg.units:
                whole = values(u)
                if self.param_dtype != torch.float32:
                    # A frozen parameter beside trainable ones is held, computed and exported as its
                    # rounding, as a frozen unit is: its master held the value before it (exported
                    # 6e-4 off what trained, an audit helper's repro), and nothing updates it.
                    for r in u.records:
                        if not r.requires_grad:
                            whole[r.in_unit] = whole[r.in_unit].to(self.param_dtype).float()
                flat = whole[u.shard]
                kept = flat if not self.gather_params else whole  # see [Note: unit partition]
                self.param_store.put(u.name, kept.to(self.param_dtype, copy=True)).result()
                master[sg.slices[u.index]] = flat
                if share:
                    shared = self._share_param(sg, u, shared)
            if shared is not None:
                self.shared[sg.index] = shared
            if not self.one_copy:  # else the parameters just written are the master weights
                self.stores["master"].put(sg.record.name_for(), master).result()
            for kind, value in self.algorithm.initial_states(master, per_group, self.param_groups, sg.slices):
                self.stores[kind].put(sg.record.name_for(), value).result()
        if differ:
            logger.warning("the ranks built other initial values of %d unit(s) (%s): every rank takes rank 0's, as "
                           "DistributedDataParallel does; seed the RNG alike on every rank before building the model "
                           "to make this unneeded", len(differ), ", ".join(differ[:3]))  # fmt: skip
        if self.foreign is not None:
            self._bind_foreign()

    def _bind_foreign(self) -> None:
        """Point the user's optimizer at fp32 Parameters that are views of the master weights
        (on the device, resident: they stay put), one per parameter of its groups."""
        by_param = {}
        for sg, per_group in zip(self.groups, self.slices):
            master = self.stores["master"].get(sg.record.name_for()).result().tensor
            for entries in per_group.values():
                for u, s, _, i in entries:
                    shadow = torch.nn.Parameter(master[s].view(u.records[i].shape))
                    self.shadows[(u.index, i)] = shadow
                    by_param[id(u.records[i].param)] = shadow
        old_state = dict(self.foreign.state)
        for group in self.foreign.param_groups:
            group["params"] = [by_param[id(p)] for p in group["params"] if id(p) in by_param]
        self.foreign.state.clear()
        for p, st in old_state.items():  # state it had already (a loaded one, say) follows its parameter
            if id(p) in by_param:
                self.foreign.state[by_param[id(p)]] = st

    def load_master(self, values: dict, merge: bool = False) -> None:
        """Write new weights (``(unit index, parameter index) -> tensor``: the whole parameter,
        or a `Piece` of it holding at least this rank's slice of the unit's part) into the master
        weights and the params tier; the optimizer states stay as they are. ``merge``: the
        values are the parameters' own, written in place ([Note: in-place writes to bound
        parameters] in `_inplace`): only the elements that differ from the master in their
        dtype are taken, and the params tier, which holds them already, is not written."""
        for u in self.frozen if not merge else ():
            if any((u.index, i) in values for i in range(len(u.records))):
                self._load_frozen(u, values)
        for sg in self.groups:
            units = [u for u in sg.units if any((u.index, i) in values for i in range(len(u.records)))]
            if not units:
                continue
            lease = self.stores["master"].get(sg.record.name_for()).result()
            wrote = False
            try:
                master = lease.tensor
                for u in units:
                    base, lo, hi = sg.slices[u.index].start, u.shard.start, u.shard.stop
                    for i, r in enumerate(u.records):
                        value = values.get((u.index, i))
                        a, b = max(r.offset, lo), min(r.in_unit.stop, hi)
                        if value is not None and a < b:
                            piece = _elements(value, r.start + a - r.offset, r.start + b - r.offset)
                            if not r.requires_grad and self.param_dtype != torch.float32:
                                # A frozen parameter's master holds its rounding, as `init_state` makes
                                # it: a load_state_dict or from_pretrained kept the fp32 value, exported
                                # 1.4e-3 off what the model then computed with (an audit helper's repro).
                                piece = piece.to(self.param_dtype)
                            dst = master[base + a - lo : base + b - lo]
                            if merge:  # only the elements written (a read of p.data writes none)
                                piece = piece.to(dst.device)
                                differ = piece != dst.to(piece.dtype)
                                if not differ.any():
                                    continue
                                piece = torch.where(differ, piece.to(dst.dtype), dst)
                            dst.copy_(piece)
                            wrote = True
                if merge and not wrote:  # (a load writes the params whatever: stages 1, 2 gather them)
                    continue
                self.stores["master"].put(sg.record.name_for(), master).result()
                if not merge:
                    self.write_params(sg, units, master)
                    self.param_writes.drain()
            except BaseException:
                self.param_writes.discard_errors()
                raise
            finally:
                lease.release()

    def _load_frozen(self, u: ParamUnit, values: dict) -> None:
        lease = self.param_store.get(u.name).result()
        try:
            flat = lease.tensor.reshape(-1)
            lo = 0 if flat.numel() == u.padded_numel else u.shard.start  # stages 1, 2 keep all of it
            for i, r in enumerate(u.records):
                value = values.get((u.index, i))
                a, b = max(r.offset, lo), min(r.in_unit.stop, lo + flat.numel())
                if value is not None and a < b:
                    flat[a - lo : b - lo].copy_(_elements(value, r.start + a - r.offset, r.start + b - r.offset))
            self.param_store.put(u.name, lease.tensor).result()
        finally:
            lease.release()

    def may_share(self) -> bool:
        """Whether the parameters may become the master weights in memory ([Note: one copy of
        the fp32 weights] in `_onecopy`): fp32, each rank keeping its slice, both tiers resident
        on one device, the engine's own algorithm."""
        master, params = self.stores["master"], self.param_store
        return (self.param_dtype == torch.float32 and not self.gather_params and self.foreign is None
                and not self.one_copy and not master.uses_pool and not params.uses_pool
                and master.device == params.device)  # fmt: skip

    def _share_param(self, sg: SubGroup, unit: ParamUnit, shared: torch.Tensor | None) -> torch.Tensor:
        """Unit ``unit``'s parameters (just put) moved into sub-group ``sg``'s flat tensor
        ``shared`` (made on the first unit: where the params tier keeps them, pinned as it does),
        at its slice of the master weights; returns ``shared``. Nothing holds a view of them yet:
        the scheduler binds the units after initialize writes them."""
        own = self.param_store.get(unit.name).result().tensor
        if shared is None:
            shared = torch.empty(sg.numel, dtype=torch.float32, device=own.device, pin_memory=own.is_pinned())
        part = shared[sg.slices[unit.index]]
        part.copy_(own.reshape(-1))
        self.param_store.swap(unit.name, part.view(own.shape))
        return shared

    def share_masters(self) -> None:
        """Once, at the first step that runs without the overlap: each sub-group's master
        weights become its ``shared`` parameters, so the update writes the parameters in place
        ([Note: one copy of the fp32 weights] in `_onecopy`). The two hold the same values
        unless the user wrote the parameters since initialize (a re-initialised layer, a zeroed
        head): then the parameters' values are the weights, as in plain PyTorch, whose optimizer
        steps the parameter itself (they were dropped for the master weights' before)."""
        if self._shares_checked:
            return
        self._shares_checked = True
        for index, shared in self.shared.items():
            self.stores["master"].swap(self.groups[index].record.name_for(), shared)
            self.forget_views(index)
            self.sharing.add(index)

    def forget_views(self, index: int) -> None:
        """Sub-group ``index``'s tensors were swapped for others: the kernels' views kept of the
        ones replaced (`_algorithms.Cut`) go, and with them the last hold on their memory."""
        if self.cuts[index] is not None:
            self.cuts[index].forget()

    # -- new parameters ---------------------------------------------------------------------
    def stages_params(self, transport) -> bool:
        """Whether new parameters go to a GPU from the host's master weights through pinned pool
        buffers (`_transport.Transport.to_device_as`; [Note: the host step on a GPU] in `_update`)."""
        store = self.param_store
        return (transport is not None and transport.pipelined and not store.uses_pool and not self.gather_params
                and store.device.type == "cuda" and self.device.type == "cpu")  # fmt: skip

    def write_params(self, group: SubGroup, have: list, master: torch.Tensor, transport=None) -> bool:
        """The new low-precision parameters of ``have`` (units of ``group``) from ``master``,
        each from its own pool copy (or cast): ``master`` may be reused before the write is
        done. Nothing with one copy of the fp32 weights: the master weights' own write is the
        parameters' ([Note: one copy of the fp32 weights] in `_onecopy`; no copy either, 3.8 GB
        a step on the 953M model: CPU work beside the stream slows this machine's drive, a copy
        loop on one core to 0.4-0.45 of its idle throughput, benchmarks/io_under_compute.py).
        ``transport`` (`_transport.Transport`) makes and counts the copies between the host and
        a GPU; where resident, the bytes written count in the params tier."""
        if self.one_copy or group.index in self.sharing:
            return True
        staged = self.stages_params(transport)
        if staged:  # the previous sub-group's copies are done (the kernel ran since): their buffers go back
            transport.settle()
        stats = getattr(transport, "stats", None)
        store = self.param_store
        written = 0  # bytes written to the resident tier, counted once: the counter takes a lock
        for u in have:
            s = group.slices[u.index]
            if self.gather_params:
                self._gather_new_params(u, master[s], transport)
                continue
            if store.uses_pool:
                self.param_writes.add(store.put(u.name, master[s], copy=True))
                continue
            dst = store.writable(u.name).tensor  # resident: the tier's own tensor, written in place
            if staged:
                transport.to_device_as(master[s], dst)
            elif transport is not None:
                transport.copy(master[s], dst)
            else:
                dst.copy_(master[s])
            written += dst.numel() * dst.element_size()
        if stats is not None and written:
            stats.count(store.tier, "param", True, written)
        return True

    def _gather_new_params(self, unit: ParamUnit, master: torch.Tensor, transport=None) -> None:
        """Stages 1 and 2: every rank updated its slice; all gather the whole parameters."""
        shard = master.to(self.param_dtype, copy=True)
        lease = self.param_store.writable(unit.name)
        full = lease.tensor
        if shard.device != full.device:
            shard = transport.copy_to(shard, full.device) if transport is not None else shard.to(full.device)
        with record_function("infinity::gather"):
            try:
                self.dist.all_gather(full, shard, f"parameter gather of {unit.name}")
                pending = self.param_store.put(unit.name, full)
            except BaseException:
                lease.release()
                raise
        self.param_writes.add(pending, lease)


class Piece:
    """Elements ``[start, start + tensor.numel())`` of a parameter, flattened."""

    __slots__ = ("start", "tensor")

    def __init__(self, start: int, tensor: torch.Tensor):
        self.start, self.tensor = start, tensor


def _elements(value, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of a flattened parameter given whole or as a `Piece`."""
    if isinstance(value, Piece):
        flat = value.tensor.detach().reshape(-1)
        if a < value.start or b > value.start + flat.numel():
            raise ValueError(f"elements [{a}, {b}) are not in the piece [{value.start}, {value.start + flat.numel()})")
        return flat[a - value.start : b - value.start]
    return value.detach().reshape(-1)[a:b]
