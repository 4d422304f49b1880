"""The optimizer: a `torch.optim.Optimizer` whose update runs where the optimizer states live.

Owns: the parameter groups (the user's parameters and hyperparameters, which LR schedulers
change between steps), the sub-groups, the optimizer-state stores, the per-unit step counts,
the read-ahead, and the write-behind of the new low-precision parameters. Touches: the grads
(to read them and their norm), the params store (to write the new parameters), ``dist`` at
stages 1 and 2 (to gather them).

States (fp32 master weights and the optimizer's own kinds: AdamW's and Adam's exp_avg and
exp_avg_sq, SGD's momentum_buffer, Adagrad's sum) are kept per sub-group: consecutive units
whose fp32 state fits ``optimizer.sub_group_size`` bytes, stored as one flat tensor per kind,
so NVMe sees a few large transfers rather than many small ones. The step streams the
sub-groups (`_store.stream_together`): on nvme group i+1 is read and i-1 written back while
the update runs on i, with torch's fused CPU kernels (``torch._fused_adamw_``,
``_fused_adam_``, ``_fused_sgd_``, ``_fused_adagrad_``), one call per parameter group with
that group's hyperparameters, and each unit's new low-precision parameters are written to the
params tier as they are made.

Semantics follow the matching ``torch.optim`` class: only parameters in a group are updated
(frozen ones are left alone), a unit without a gradient this step is left alone (no decay, no
state update), and each unit keeps its own step count.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.profiler import record_function

from infinity.swap import PoolExhausted, WriteBehind, round_up

from ._grads import GradAccumulator
from ._store import Store, release_unused, stream_together
from ._units import ParamUnit, holders

READ_AHEAD = 3  # sub-groups; see Optimizer.fit_read_ahead
POOL_SLACK = 0.15  # of the host budget the read-ahead does not plan for; see fit_read_ahead

# Per optimizer: its state kinds besides the fp32 master weights, and the hyperparameters a
# parameter group holds (with torch's defaults where the config has no key).
KINDS = {
    "adamw": ("exp_avg", "exp_avg_sq"),
    "adam": ("exp_avg", "exp_avg_sq"),
    "sgd": ("momentum_buffer",),
    "adagrad": ("sum",),
    "torch": (),  # any other torch optimizer, every tier on the device: its state is its own
}
HYPERPARAMETERS = {
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value"),
}
TORCH_CLASSES = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd",
                 torch.optim.Adagrad: "adagrad"}  # fmt: skip
# Options of the torch classes the fused kernels here do not run: refused when set.
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


def config_defaults(cfg) -> dict:
    """The hyperparameters ``[optimizer]`` gives every group of its ``type``."""
    every = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
             "momentum": cfg.momentum, "dampening": 0.0, "nesterov": cfg.nesterov, "lr_decay": 0.0,
             "initial_accumulator_value": 0.0}  # fmt: skip
    return {k: every[k] for k in HYPERPARAMETERS[cfg.type]}


def resolve(spec, model_params: list, cfg, *, all_device: bool = False):
    """(optimizer type, parameter groups, defaults, the torch optimizer to run as it is or
    None) from what `initialize` was given.

    ``spec``: None (``[optimizer]`` over every trainable parameter), parameters or parameter
    groups (``[{"params": [...], "weight_decay": 0.0}, ...]``: ``[optimizer]`` fills in the
    rest), a ``torch.optim`` optimizer, its class, ``(class, kwargs)``, or a callable that
    builds one from the parameters (``functools.partial(torch.optim.SGD, lr=0.1)``)."""
    trainable = [p for p in model_params if p.requires_grad]
    if spec is None:
        return cfg.type, [{"params": trainable}], config_defaults(cfg), None
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], type) and isinstance(spec[1], dict):
        spec = functools.partial(spec[0], **spec[1])
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer) or (
        callable(spec) and not isinstance(spec, (torch.optim.Optimizer, list, tuple))
    ):
        built = spec(trainable)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"optimizer={spec!r} built a {type(built).__name__}, not a torch.optim.Optimizer")
        spec = built
    if isinstance(spec, torch.optim.Optimizer):
        kind = TORCH_CLASSES.get(type(spec))
        if kind is None or any(g.get(k, v) != v for g in spec.param_groups for k, v in _UNSUPPORTED.items()):
            if all_device:  # nothing offloaded: the optimizer runs as it is, on fp32 master weights
                groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                          for g in spec.param_groups]  # fmt: skip
                return "torch", groups, dict(spec.defaults), spec
        if kind is None:
            raise ValueError(
                f"optimizer {type(spec).__name__} cannot run on offloaded state: the engine runs "
                f"{', '.join(c.__name__ for c in TORCH_CLASSES)} (torch.optim), or [optimizer] type = "
                f"{' | '.join(repr(k) for k in KINDS if k != 'torch')}; with every tier on the device, "
                "any torch optimizer runs"
            )
        for group in spec.param_groups:
            for key, allowed in _UNSUPPORTED.items():
                if group.get(key, allowed) != allowed:
                    raise ValueError(f"{type(spec).__name__}({key}={group[key]!r}) is not supported on offloaded "
                                     f"state; use {key}={allowed!r} (with every tier on the device, it runs)")  # fmt: skip
        keys = HYPERPARAMETERS[kind]
        groups = [{"params": list(g["params"]), **{k: g[k] for k in keys}} for g in spec.param_groups]
        return kind, groups, {k: spec.defaults[k] for k in keys}, None
    groups = list(spec)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    defaults = config_defaults(cfg)
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"optimizer parameter group {i} must be a dict with 'params', got {type(g).__name__}")
        unknown = set(g) - {"params", *defaults}
        if unknown:
            raise ValueError(f"optimizer parameter group {i}: {sorted(unknown)} are not hyperparameters of "
                             f"{cfg.type!r} ({', '.join(defaults)})")  # fmt: skip
    return cfg.type, [dict(g, params=list(g["params"])) for g in groups], defaults, None


class SubGroup:
    def __init__(self, index: int, units: list[ParamUnit]):
        self.index = index
        self.name = f"optimizer.{index}"
        self.units = units
        self.slices: dict[int, slice] = {}
        pos = 0
        for u in units:
            n = u.shard_numel
            self.slices[u.index] = slice(pos, pos + n)
            pos += n
        self.numel = pos


def make_groups(units: list[ParamUnit], sub_group_bytes: int, kinds: int = 3) -> list[SubGroup]:
    """Consecutive units whose fp32 state (``kinds`` tensors a parameter) fits ``sub_group_bytes``."""
    groups, current, size = [], [], 0
    for u in units:
        nbytes = kinds * 4 * u.shard_numel
        if current and size + nbytes > sub_group_bytes:
            groups.append(SubGroup(len(groups), current))
            current, size = [], 0
        current.append(u)
        size += nbytes
    if current:
        groups.append(SubGroup(len(groups), current))
    return groups


class Optimizer(torch.optim.Optimizer):
    """The engine's optimizer, ``engine.optimizer``: a `torch.optim.Optimizer` whose
    ``param_groups`` hold the user's parameters and hyperparameters, so LR schedulers work on
    it unmodified; ``step()`` is ``engine.step()`` and ``zero_grad()`` is ``engine.zero_grad()``.
    Its state lives in the optimizer tier, not in ``state``."""

    _infinity_engine_optimizer = True  # its step is the engine's (see engine._refuse_foreign_step)

    def __init__(self, kind: str, param_groups: list[dict], defaults: dict, *, units, groups,
                 states: dict[str, Store], param_store: Store, grads: GradAccumulator, max_grad_norm,
                 param_dtype: torch.dtype, dist=None, params_sharded: bool = True, foreign=None):  # fmt: skip
        self._ready = False
        if foreign is not None and dist is not None and dist.active:
            raise ValueError(f"optimizer {type(foreign).__name__}: the engine runs a torch optimizer it does not "
                             "implement itself only with one rank (every tier on the device)")  # fmt: skip
        super().__init__(param_groups, defaults)
        self.kind = kind
        self.units = units
        self.groups = groups  # SubGroups of the trainable units
        grouped = {u.index for g in groups for u in g.units}
        self.frozen = [u for u in units if u.index not in grouped]  # no optimizer state, never written
        self.states = states  # kind -> Store, all in the optimizer tier: "master" and KINDS[kind]
        self.param_store = param_store
        self.grads = grads
        self.max_grad_norm = max_grad_norm  # clip every step to this (the config's)
        self.clip_next: float | None = None  # clip the next step to this (Engine.clip_grad_norm_)
        self.param_dtype = param_dtype
        self.device = states["master"].device
        self.dist = dist
        # ZeRO stages 1 and 2 keep whole parameters on every rank: new shards are gathered.
        self.gather_params = not params_sharded and dist is not None and dist.active
        self.steps = {u.index: torch.zeros((), dtype=torch.float32, device=self.device) for u in units}
        self._never_stepped = {u.index for u in units}  # SGD's first step starts a momentum buffer; no device read
        self.ahead = READ_AHEAD
        self.ahead_bytes: int | None = None  # read-ahead by bytes too (see fit_read_ahead)
        self._param_writes = WriteBehind(2)  # new parameters from their own pool copies (see _write_params)
        self._engine_step = None  # set by the engine: what step() runs
        self._engine_zero_grad = None
        # Per sub-group, per parameter group: (unit, slice of the sub-group's state, slice of
        # the unit's gradient shard, index of the parameter in the unit) of every parameter in
        # that group, cut to this rank's shard.
        self._slices = self._map_slices()
        self.foreign = foreign  # kind "torch": the user's optimizer, stepped on views of the masters
        self._shadows: dict[tuple[int, int], torch.nn.Parameter] = {}
        self.overlap = None  # _overlap.Overlap, set by the engine where it applies
        self.clipped_last = False  # the last step clipped (early updates would be discarded)
        self._ready = True

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
                for i, (off, n) in enumerate(zip(u.offsets, u.numels)):
                    gi = owner.get((u.index, i))
                    a, b = max(off, lo), min(off + n, hi)
                    if gi is None or a >= b:
                        continue
                    per_group.setdefault(gi, []).append((u, slice(base + a - lo, base + b - lo), slice(a - lo, b - lo), i))
            out.append(per_group)
        return out

    # -- torch.optim.Optimizer --------------------------------------------------------------
    def step(self, closure=None):
        """The engine's step (``engine.step()``): returns False when it was skipped (an fp16
        overflow or a non-finite gradient)."""
        if closure is not None:
            raise ValueError("engine.optimizer.step(closure) is not supported: run forward and backward, then step()")
        return self._engine_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``engine.zero_grad()``: forget the gradients accumulated since the last step."""
        self._engine_zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise ValueError("the engine's parameter groups are fixed at initialize: pass every group there")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        """The groups' hyperparameters (JSON-able, parameters as indices as torch does) and each
        unit's step count. The master weights and states live in ``states`` and are streamed by
        checkpoints, not here."""
        out = {
            "type": self.kind,
            "param_groups": [_json_group(g) for g in self.param_groups],
            "unit_steps": torch.stack([self.steps[u.index].detach().to("cpu", torch.float32) for u in self.units]),
        }
        if self.foreign is not None:  # its per-parameter state: tensors by name (see foreign_tensors), the rest as is
            out["torch_state"] = {
                str(idx): {key: ({"tensor": f"torch_optimizer/{idx}/{key}", "shape": list(v.shape),
                                  "dtype": str(v.dtype).removeprefix("torch.")}
                                 if isinstance(v, torch.Tensor) else v) for key, v in st.items()}
                for idx, st in self.foreign.state_dict()["state"].items()
            }  # fmt: skip
        return out

    def foreign_tensors(self):
        """(name, tensor) of every tensor in the state of a torch optimizer run as it is."""
        if self.foreign is None:
            return
        for idx, st in self.foreign.state_dict()["state"].items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    yield f"torch_optimizer/{idx}/{key}", v

    def load_foreign_state(self, state: dict) -> None:
        """The per-parameter state of a torch optimizer run as it is (index -> key -> value)."""
        groups = self.foreign.state_dict()["param_groups"]
        self.foreign.load_state_dict({"state": {int(k): v for k, v in state.items()}, "param_groups": groups})

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` gave (any part of it may be missing)."""
        if "unit_steps" in state:
            steps = state["unit_steps"]
            if steps.numel() != len(self.units):
                raise ValueError(f"optimizer state has {steps.numel()} step counts, this model has {len(self.units)} units")
            for u in self.units:
                self.steps[u.index].fill_(float(steps[u.index]))
            self._never_stepped = {u.index for u in self.units if float(steps[u.index]) == 0}
        if "param_groups" in state:
            self.load_hyperparameters(state.get("type", self.kind), state["param_groups"])

    def load_hyperparameters(self, kind: str, groups: list[dict]) -> None:
        if kind != self.kind or len(groups) != len(self.param_groups):
            raise ValueError(f"saved optimizer {kind!r} with {len(groups)} parameter group(s); this engine's is "
                             f"{self.kind!r} with {len(self.param_groups)}")  # fmt: skip
        for mine, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params":
                    mine[key] = tuple(value) if key == "betas" else value

    # -- state ------------------------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        """The state kinds stored per sub-group: "master" and this optimizer's own."""
        return ("master", *KINDS[self.kind])

    def init_state(self, prepare=None, done=None) -> None:
        """Master weights from the parameters' values as the user made them, the optimizer's
        states as torch starts them; and each unit's low-precision parameters into the params
        tier. One sub-group is in memory at a time; ``prepare(unit)`` runs before a unit's
        values are read and ``done(unit)`` after (`build`'s models get their values there).
        Frozen units (no parameter requires grad) have no optimizer state: only their
        parameters are stored."""

        def values(u):
            if prepare is not None:
                prepare(u)
            try:
                return u.flat(torch.float32)
            finally:
                if done is not None:
                    done(u)

        for u in self.frozen:
            whole = values(u)
            kept = whole[u.shard] if not self.gather_params else whole
            self.param_store.put(u.name, kept.to(self.param_dtype)).result()
        for sg, per_group in zip(self.groups, self._slices):
            flats = []
            for u in sg.units:
                whole = values(u)
                flat = whole[u.shard]
                kept = flat if not self.gather_params else whole  # see [Note: unit partition]
                self.param_store.put(u.name, kept.to(self.param_dtype, copy=True)).result()
                flats.append(flat)
            master = torch.cat(flats)
            del flats
            self.states["master"].put(sg.name, master).result()
            for kind in KINDS[self.kind]:
                value = torch.zeros_like(master)
                if kind == "sum":  # Adagrad starts each parameter's sum at its group's value
                    for gi, entries in per_group.items():
                        for _, s, _, _ in entries:
                            value[s] = self.param_groups[gi]["initial_accumulator_value"]
                self.states[kind].put(sg.name, value).result()
        if self.foreign is not None:
            self._bind_foreign()

    def _bind_foreign(self) -> None:
        """Point the user's optimizer at fp32 Parameters that are views of the master weights
        (on the device, resident: they stay put), one per parameter of its groups."""
        by_param = {}
        for sg, per_group in zip(self.groups, self._slices):
            master = self.states["master"].get(sg.name).result().tensor
            for entries in per_group.values():
                for u, s, _, i in entries:
                    shadow = torch.nn.Parameter(master[s].view(u.shapes[i]))
                    self._shadows[(u.index, i)] = shadow
                    by_param[id(u.params[i])] = shadow
        old_state = dict(self.foreign.state)
        for group in self.foreign.param_groups:
            group["params"] = [by_param[id(p)] for p in group["params"] if id(p) in by_param]
        self.foreign.state.clear()
        for p, st in old_state.items():  # state it had already (a loaded one, say) follows its parameter
            if id(p) in by_param:
                self.foreign.state[by_param[id(p)]] = st

    def load_master(self, values: dict) -> None:
        """Write new weights (``(unit index, parameter index) -> tensor``: the whole parameter,
        or a `Piece` of it holding at least this rank's slice of the unit's part) into the master
        weights and the params tier; the optimizer states stay as they are."""
        for u in self.frozen:
            if any((u.index, i) in values for i in range(len(u.params))):
                self._load_frozen(u, values)
        for sg in self.groups:
            units = [u for u in sg.units if any((u.index, i) in values for i in range(len(u.params)))]
            if not units:
                continue
            lease = self.states["master"].get(sg.name).result()
            try:
                master = lease.tensor
                for u in units:
                    base, lo, hi = sg.slices[u.index].start, u.shard.start, u.shard.stop
                    for i, (off, n, start) in enumerate(zip(u.offsets, u.numels, u.starts)):
                        value = values.get((u.index, i))
                        a, b = max(off, lo), min(off + n, hi)
                        if value is not None and a < b:
                            master[base + a - lo : base + b - lo].copy_(_elements(value, start + a - off, start + b - off))
                self.states["master"].put(sg.name, master).result()
                self._write_params(sg, units, master)
                self._param_writes.drain()
            except BaseException:
                self._param_writes.discard_errors()
                raise
            finally:
                lease.release()

    def _load_frozen(self, u: ParamUnit, values: dict) -> None:
        lease = self.param_store.get(u.name).result()
        try:
            flat = lease.tensor.reshape(-1)
            lo = 0 if flat.numel() == u.padded_numel else u.shard.start  # stages 1, 2 keep all of it
            for i, (off, n, start) in enumerate(zip(u.offsets, u.numels, u.starts)):
                value = values.get((u.index, i))
                a, b = max(off, lo), min(off + n, lo + flat.numel())
                if value is not None and a < b:
                    flat[a - lo : b - lo].copy_(_elements(value, start + a - off, start + b - off))
            self.param_store.put(u.name, lease.tensor).result()
        finally:
            lease.release()

    # -- the update -------------------------------------------------------------------------
    def hyperparameters(self) -> list[dict]:
        """Every parameter group's hyperparameters as they are now (comparable with ``==``)."""
        return [_json_group(g) for g in self.param_groups]

    def update(self, loss_scale: float = 1.0) -> bool:
        """One update of every parameter with a gradient; False when skipped (non-finite).
        Sub-groups updated early under backward are committed where valid, see
        [Note: exact overlap] in `_overlap`."""
        self.grads.flush()
        if not self.grads.all_finite():
            if self.overlap is not None:
                self.overlap.discard()
            return False
        divide = loss_scale  # gradients are stored multiplied by the loss scale
        clip, self.clip_next = (self.clip_next if self.clip_next is not None else self.max_grad_norm), None
        self.clipped_last = False
        if clip is not None:
            norm = self.grads.global_norm() / loss_scale
            coef = min(1.0, clip / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
            divide = loss_scale / coef
            self.clipped_last = coef < 1.0
        committed = self.overlap.commit(divide) if self.overlap is not None else set()
        groups = [g for g in self.groups if g.index not in committed]
        grad_scale = None if divide == 1.0 else torch.tensor(divide, dtype=torch.float32, device=self.device)
        grads_now = grads_next = None
        try:
            # The next sub-group's gradients are read while this one is updated.
            grads_next = self._read_grads(groups[0]) if groups else None
            stores = [self.states[k] for k in self.kinds]
            items = stream_together(stores, [g.name for g in groups], ahead=self.ahead, ahead_bytes=self.ahead_bytes)
            # Iterate the stream itself (not a zip with the groups, which would stop without
            # resuming the generator after its last item, and so skip that item's write-back).
            for i, item in enumerate(items):
                # Read ahead only where the pool has room now, else now that they are needed
                # (waiting then only for this step's write-behinds, not for reads ahead that
                # this loop itself would release).
                grads_now = grads_next if grads_next is not None else self._read_grads(groups[i])
                grads_next = None  # held as grads_now now: released once on failure, not twice
                grads_next = self._read_grads(groups[i + 1], wait=False) if i + 1 < len(groups) else None
                with record_function("infinity::optimizer.subgroup"):
                    item.write_back = self._update(groups[i].index, item.tensors, grad_scale, grads_now, item.after)
        except BaseException:
            # Every buffer goes back; the first error is the one raised.
            release_unused((*(grads_now or {}).values(), *(grads_next or {}).values()))
            self._param_writes.discard_errors()
            raise
        self._param_writes.drain()
        return True

    def _read_grads(self, group: SubGroup, wait: bool = True) -> dict | None:
        """Issue the reads of ``group``'s gradients (unit index -> store Pending of a lease);
        without ``wait``, only if the pool has room for all of them now (None if not)."""
        pending = {}
        try:
            for u in group.units:
                if u.index in self.grads.has_grad:
                    pending[u.index] = self.grads.store.get(u.name, timeout=None if wait else 0)
        except BaseException as e:
            release_unused(pending.values())
            if wait or not isinstance(e, PoolExhausted):
                raise
            return None
        return pending

    def _update(self, index: int, tensors, grad_scale, pending: dict, after: list | None = None) -> bool:
        """Update sub-group ``index``'s parameters that have a gradient; False when none has.
        ``after``: see `_write_params`."""
        group = self.groups[index]
        have = [u for u in group.units if u.index in pending]
        if not have:
            return False
        master, states = tensors[0], tensors[1:]
        grads, leases = {}, []
        try:
            for u in have:
                lease = pending[u.index].result()
                leases.append(lease)
                value = lease.tensor
                if value.numel() != u.shard_numel:  # stage 1 keeps the whole gradient
                    value = value[u.shard]
                grads[u.index] = value if value.device == master.device else value.to(master.device)
            stepped = {u.index for u in have}
            if self.foreign is not None:
                self._step_foreign(index, grads, grad_scale)
                return self._write_params(group, have, master, after)
            first = stepped & self._never_stepped
            self._never_stepped -= stepped
            torch._foreach_add_([self.steps[i] for i in stepped], 1.0)
            self._apply_kernels(index, master, states, grads, grad_scale, self.steps, first)
        finally:
            for lease in leases:
                lease.release()
        return self._write_params(group, have, master, after)

    def apply(self, index: int, master, states, grads: dict, divide: float, steps: dict, first: set) -> None:
        """Sub-group ``index``'s update in place on ``master`` and ``states`` from ``grads``
        (unit -> its gradient shard, divided by ``divide``), with the step counts ``steps``
        (unit -> the count this update makes) and ``first`` the units stepping for the first time."""
        grad_scale = None if divide == 1.0 else torch.tensor(divide, dtype=torch.float32, device=self.device)
        self._apply_kernels(index, master, states, grads, grad_scale, steps, first)

    def _apply_kernels(self, index, master, states, grads, grad_scale, steps, first) -> None:
        for gi, entries in self._slices[index].items():
            entries = [e for e in entries if e[0].index in grads]
            if entries:
                self._run_kernel(self.param_groups[gi], entries, master, states, grads, grad_scale, first, steps)

    def _write_params(self, group: SubGroup, have: list, master: torch.Tensor, after: list | None = None) -> bool:
        """The new low-precision parameters of ``have`` (units of ``group``) from ``master``.

        ``after``: the stream's list of writes that hold ``master``'s buffer (`stream_together`).
        Given, and the parameters fp32 on nvme, each is written straight from ``master``, the
        buffer held until the write is done: no copy (3.8 GB a step on the 953M model; CPU
        work beside the stream slows this machine's drive, a copy loop on one core to 0.4-0.45
        of its idle throughput, benchmarks/io_under_compute.py). Otherwise each write goes from
        its own pool copy (or cast): ``master`` may be reused before the write is done."""
        direct = after is not None and self._params_direct()
        for u in have:
            s = group.slices[u.index]
            if self.gather_params:
                self._gather_new_params(u, master[s])
            elif direct:
                after.append(self.param_store.put(u.name, master[s]))
            else:
                self._param_writes.add(self.param_store.put(u.name, master[s], copy=True))
        return True

    def _params_direct(self) -> bool:
        """Whether the update writes new parameters straight from the streamed master weights
        (`_write_params`): fp32 parameters, both on nvme, each rank writing its own."""
        return (self.param_dtype == torch.float32 and self.param_store.uses_pool
                and self.states["master"].uses_pool and not self.gather_params)  # fmt: skip

    def _step_foreign(self, index: int, grads: dict, grad_scale) -> None:
        """The user's torch optimizer on sub-group ``index``: gradients as ``.grad`` of the
        master views (unscaled and clipped first), hyperparameters as ours are now."""
        used = []
        for entries in self._slices[index].values():
            for u, _, gs, i in entries:
                if u.index in grads:
                    shadow = self._shadows[(u.index, i)]
                    g = grads[u.index][gs].view(u.shapes[i])
                    shadow.grad = g if grad_scale is None else g / grad_scale
                    used.append(shadow)
        for mine, theirs in zip(self.param_groups, self.foreign.param_groups):
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        try:
            self.foreign.step()
        finally:
            for shadow in used:
                shadow.grad = None

    def _run_kernel(self, hp: dict, entries, master, states, grads, grad_scale, first: set, step_of: dict) -> None:
        """torch's fused kernel of this optimizer over ``entries`` with one group's hyperparameters."""
        params = [master[s] for _, s, _, _ in entries]
        g = [grads[u.index][gs] for u, _, gs, _ in entries]
        steps = [step_of[u.index] for u, _, _, _ in entries]
        lr = float(hp["lr"])
        if self.kind in ("adamw", "adam"):
            fused = torch._fused_adamw_ if self.kind == "adamw" else torch._fused_adam_
            beta1, beta2 = hp["betas"]
            fused(params, g, [states[0][s] for _, s, _, _ in entries], [states[1][s] for _, s, _, _ in entries], [], steps,
                  lr=lr, beta1=float(beta1), beta2=float(beta2), weight_decay=float(hp["weight_decay"]),
                  eps=float(hp["eps"]), amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None)  # fmt: skip
        elif self.kind == "sgd":
            momentum = float(hp["momentum"])
            for is_first in (True, False):  # the kernel starts a momentum buffer at a unit's first step
                part = [i for i, (u, _, _, _) in enumerate(entries) if (u.index in first) == is_first]
                if not part:
                    continue
                bufs = [] if momentum == 0 else [states[0][entries[i][1]] for i in part]
                torch._fused_sgd_([params[i] for i in part], [g[i] for i in part], bufs,
                                  weight_decay=float(hp["weight_decay"]), momentum=momentum, lr=lr,
                                  dampening=float(hp["dampening"]), nesterov=bool(hp["nesterov"]), maximize=False,
                                  is_first_step=is_first and momentum != 0, grad_scale=grad_scale, found_inf=None)  # fmt: skip
        else:  # adagrad
            torch._fused_adagrad_(params, g, [states[0][s] for _, s, _, _ in entries], steps, lr=lr,
                                  lr_decay=float(hp["lr_decay"]), weight_decay=float(hp["weight_decay"]),
                                  eps=float(hp["eps"]), maximize=False, grad_scale=grad_scale, found_inf=None)  # fmt: skip

    def _gather_new_params(self, unit: ParamUnit, master: torch.Tensor) -> None:
        """Stages 1 and 2: every rank updated its slice; all gather the whole parameters."""
        shard = master.to(self.param_dtype, copy=True)
        lease = self.param_store.writable(unit.name)
        full = lease.tensor
        with record_function("infinity::gather"):
            try:
                self.dist.all_gather(full, shard.to(full.device), f"parameter gather of {unit.name}")
                pending = self.param_store.put(unit.name, full)
            except BaseException:
                lease.release()
                raise
        self._param_writes.add(pending, lease)

    # -- host memory ------------------------------------------------------------------------
    def host_bytes_needed(self, ahead: int | None = None) -> int:
        """Pool bytes the update holds at most: the stream's sub-groups (read ahead: ``ahead``
        of the largest, the one given or else this optimizer's, or ``ahead_bytes``; one in hand,
        one written behind), the gradients of one sub-group and the next one's, and three
        parameter write-behinds (copies; none where they are written from the master weights,
        `_params_direct`); each only where its store uses the pool."""
        if not self.groups:
            return 0
        # Each buffer takes whole pages of the pool: counted so, small units are not free.
        largest = max(g.numel for g in self.groups)
        need = 0
        if self.states["master"].uses_pool:
            state = len(self.kinds) * round_up(4 * largest)
            if ahead is None and self.ahead_bytes is not None:
                need += 2 * state + self.ahead_bytes
            else:
                need += (2 + (self.ahead if ahead is None else ahead)) * state
        if self.grads.store.uses_pool:  # one buffer per unit
            need += 2 * max(sum(round_up(4 * u.shard_numel) for u in g.units) for g in self.groups)
        if self.param_store.uses_pool and not self._params_direct():
            need += 3 * max(round_up(self.param_dtype.itemsize * u.shard_numel) for u in self.units)
        return need

    def fit_read_ahead(self, budget: int) -> int:
        """Read as many sub-groups ahead as ``budget`` allows, up to `READ_AHEAD` (3 measured
        best here: step time over the I/O floor 1.3 at 1, 1.2 at 2, 1.0-1.1 at 3;
        benchmarks/engine_bench.py), counted in bytes when the sub-groups differ in size: one
        vocabulary-sized sub-group (an embedding alone) then holds back only itself, not the
        read-ahead of every other. At least one ahead; returns the pool bytes the update then
        needs."""
        # The read-ahead leaves POOL_SLACK of the budget unplanned: the pool places buffers
        # first-fit in slabs, and a stream planned to the last byte found no contiguous room
        # for its next read once other users had cut the slabs (the 25M demo at 46MiB, planned
        # at 45.1MiB, waited out the pool's timeout). At least one ahead whatever the slack.
        usable = int(budget * (1 - POOL_SLACK))
        self.ahead, self.ahead_bytes = READ_AHEAD, None
        if self.host_bytes_needed() <= usable or not self.groups:
            return self.host_bytes_needed()
        largest_state = len(self.kinds) * 4 * max(g.numel for g in self.groups)
        self.ahead_bytes = largest_state  # one of the largest ahead, at least
        spare = usable - self.host_bytes_needed()
        if spare > 0:
            self.ahead_bytes += min(spare, (READ_AHEAD - 1) * largest_state)
        # The slack is part of what the budget must hold: planned to the last byte, the pool
        # ran out of contiguous room (a step at exactly this figure without it waited out the
        # pool's timeout: tests/infinity/test_resources.py).
        return math.ceil(self.host_bytes_needed() / (1 - POOL_SLACK))


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


def _json_group(group: dict) -> dict:
    """A parameter group's hyperparameters as JSON holds them (tuples as lists, tensors as floats)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out
