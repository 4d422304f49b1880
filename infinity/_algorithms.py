"""The optimizer algorithms: one object per algorithm owns what is particular to it.

Owns: per algorithm (AdamW, Adam, SGD, Adagrad, and "torch": a torch optimizer the engine runs
as it is), the state kinds it keeps beside the fp32 master weights (each a `StateKind`: its
dtype, its bytes per element, how it starts), the hyperparameters a parameter group holds and
their defaults from ``[optimizer]``, the ``torch.optim`` class it stands for, and its kernel
(torch's fused CPU kernels: ``torch._fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``,
``_fused_adagrad_``); and `resolve`, which picks the algorithm and the parameter groups from
what `initialize` was given. Touches: nothing but the tensors its kernel is handed.

Code that is not about one algorithm (the stores, checkpoints, the memory plan, the overlap)
asks the algorithm for its kinds and their sizes (through `_substates.StateRecord`) and never
names a kind: a compact state (``[optimizer] state_dtype``: a bf16 moment, an 8-bit one with
per-block scales) is a set of `StateKind`s here, made by an `Algorithm` built for that
state dtype from its fp32 kinds, with `_compact`'s codec ([Note: compact state format]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import ClassVar

import torch

from . import _adam_int8, _compact

logger = logging.getLogger("infinity")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StateKind:
    """One tensor an algorithm keeps per parameter element, stored flat per sub-group."""

    name: str
    """The kind's name: its store's, and the last part of its keys (``optimizer.3/exp_avg``)."""
    dtype: torch.dtype = torch.float32
    """What it is stored and updated in."""
    init: str | None = None
    """The hyperparameter of its parameter group it starts at (Adagrad's ``sum`` starts at
    ``initial_accumulator_value``); None: zeros."""
    first_step: bool = False
    """The kernel starts it at a unit's first step (SGD's momentum buffer takes the first
    gradient) instead of updating it: the kernel is told which units step for the first time."""
    signed: bool = True
    """Whether it may be negative (int8 states pick their code map by it)."""
    block: int = 0
    """0: one element per parameter element. B > 0: one per block of B elements of each unit's
    part (an int8 moment's scales, [Note: compact state format])."""

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    def initial(self, master: torch.Tensor, per_group: dict[int, list], param_groups: list[dict],
                start: dict | None = None) -> torch.Tensor:  # fmt: skip
        """Its value before the first step for a sub-group whose master weights are ``master``
        (``per_group``: parameter group -> entries whose second item is the slice of the
        sub-group's state it holds); ``start``: hyperparameter -> the value every group starts
        at, whatever the group holds (`Algorithm.start`)."""
        value = torch.zeros_like(master, dtype=self.dtype)
        if self.init is not None:
            for gi, entries in per_group.items():
                v = start[self.init] if start and self.init in start else param_groups[gi][self.init]
                for _, s, _, _ in entries:
                    value[s] = v
        return value


MASTER = StateKind(name="master")  # the fp32 master weights: every algorithm's first kind


def _config_values(cfg) -> dict:
    """Every hyperparameter an algorithm here takes, from ``[optimizer]`` (torch's defaults
    where the config has no key)."""
    return {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
            "momentum": cfg.momentum, "dampening": 0.0, "nesterov": cfg.nesterov, "lr_decay": 0.0,
            "initial_accumulator_value": 0.0}  # fmt: skip


def _part(grad: torch.Tensor, part: slice) -> torch.Tensor:
    """``grad[part]``, or ``grad`` itself where the part is all of it (no view made)."""
    return grad if part.start == 0 and part.stop == grad.numel() else grad[part]


class Cut:
    """Where one sub-group's entries (``per_group``: group index -> entries (unit, slice of the
    sub-group, ...)) lie in its flat tensors of ``numel`` elements: `pieces` cuts a tensor at
    every entry's ends in one `torch.split` (about half the time of one indexing a view), and
    ``at[gi][k]`` is the piece of entry ``k`` of group ``gi``. The entries are disjoint, so each
    is one piece. The pieces of a tensor that lives on (a resident tier's) are kept for the next
    update of the same tensor: the split of the master weights and two moments of every sub-group
    each step was 8% of the step of benchmarks/small_layers.py's model (about 0.9 ms of 11)."""

    __slots__ = ("at", "numel", "sizes", "_kept")

    def __init__(self, per_group: dict[int, list], numel: int):
        bounds = sorted({0, numel, *(b for entries in per_group.values() for _, s, _, _ in entries
                                     for b in (s.start, s.stop))})  # fmt: skip
        piece = {b: k for k, b in enumerate(bounds[:-1])}
        self.numel = numel
        self.sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        self.at = {gi: [piece[s.start] for _, s, _, _ in entries] for gi, entries in per_group.items()}
        self._kept: dict[int, tuple] = {}  # slot -> (tensor, its data_ptr, its pieces)

    @classmethod
    def of(cls, per_group: dict[int, list], numel: int) -> Cut | None:
        """The cut of ``per_group``, or None where entries overlap (then no piece is one entry,
        and `Algorithm.update` indexes each view)."""
        cut = cls(per_group, numel)
        for gi, entries in per_group.items():
            if any(cut.sizes[k] != s.stop - s.start for (_, s, _, _), k in zip(entries, cut.at[gi])):
                return None
        return cut

    def pieces(self, t: torch.Tensor, slot: int | None = None) -> tuple[torch.Tensor, ...] | None:
        """``t`` (flat, ``numel`` elements) cut into the pieces; None for a tensor of another
        length. ``slot``: the pieces are kept under it, and a later call with ``t`` itself there,
        over the same memory, makes none (for a tensor that outlives the update: the views keep
        its memory alive until another takes the slot)."""
        if t.dim() != 1 or t.numel() != self.numel:
            return None
        if slot is None:
            return t.split(self.sizes)
        kept = self._kept.get(slot)
        if kept is not None and kept[0] is t and kept[1] == t.data_ptr():
            return kept[2]
        pieces = t.split(self.sizes)
        self._kept[slot] = (t, t.data_ptr(), pieces)
        return pieces

    def forget(self) -> None:
        """Drop the pieces kept: the tensors they view are no longer the tier's (`Store.swap`,
        whose callers call this), and their memory goes once nothing else holds it."""
        self._kept.clear()


class Algorithm:
    """What one optimizer algorithm keeps and runs. Subclasses set the class attributes and
    `step`; the instances in `ALGORITHMS` are the fp32 ones, `with_state_dtype` makes the others."""

    name: ClassVar[str]  # [optimizer] type, and "type" in the optimizer's state_dict
    torch_class: ClassVar[type[torch.optim.Optimizer] | None] = None
    states: ClassVar[tuple[StateKind, ...]] = ()  # its own kinds, besides the master weights, in fp32
    hyperparameters: ClassVar[tuple[str, ...]] = ()  # what a parameter group holds

    def __init__(self, state_dtype: str = "fp32", start: dict | None = None):
        self.state_dtype = state_dtype  # how its own kinds are stored: fp32, bf16 or int8
        # Hyperparameter -> the value each state starting at it starts at, whatever a group holds:
        # torch's Adagrad starts every sum at its constructor's initial_accumulator_value.
        self.start = dict(start or {})
        moments = tuple((k.name, k.signed) for k in self.states)
        self.codec = None if state_dtype == "fp32" else _compact.Codec(state_dtype, moments)  # fp32: none

    @property
    def kinds(self) -> tuple[StateKind, ...]:
        """Every kind stored per sub-group, the master weights first."""
        return (MASTER, *self.stored)

    @property
    def kind_names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kinds)

    def kind(self, name: str) -> StateKind:
        for k in (*self.kinds, *self.states):
            if k.name == name:
                return k
        raise ValueError(f"{self.name} keeps no state {name!r}; its kinds are {', '.join(self.kind_names)}")

    def itemsizes(self) -> dict[str, int]:
        """Bytes per element of each kind (what `_substates.StateRecord` sizes keys by)."""
        return {k.name: k.itemsize for k in self.kinds}

    def numels(self, parts) -> dict[str, int]:
        """Elements of each kind that is not one per parameter element, for a unit or sub-group
        whose units' parts hold ``parts`` elements each (what `_substates.StateRecord` takes)."""
        return {k.name: sum(-(-n // k.block) for n in parts) for k in self.kinds if k.block}

    @property
    def bytes_per_parameter(self) -> int:
        """Bytes of state every trained parameter element takes, master weights included (the
        per-block scales of int8 states aside: `state_bytes`)."""
        return sum(k.itemsize for k in self.kinds if not k.block)

    def state_bytes(self, numel: int) -> int:
        """Bytes of every kind of one unit of ``numel`` elements."""
        per_block = sum(n * self.kind(k).itemsize for k, n in self.numels([numel]).items())
        return numel * self.bytes_per_parameter + per_block

    # -- compact states (``[optimizer] state_dtype``) -------------------------------------------
    def with_state_dtype(self, state_dtype: str) -> Algorithm:
        """This algorithm with its own kinds stored as ``state_dtype`` (fp32, bf16, int8)."""
        if state_dtype == self.state_dtype:
            return self
        if state_dtype != "fp32" and not self.states:
            raise ValueError(f"optimizer.state_dtype={state_dtype!r}: the {self.name!r} optimizer keeps no state of "
                             "the engine's to store compact (a torch optimizer run as it is keeps its own, in fp32); "
                             "use state_dtype = 'fp32' or optimizer type adamw, adam, sgd or adagrad")  # fmt: skip
        return type(self)(state_dtype, self.start)

    def starting_at(self, **values) -> Algorithm:
        """This algorithm with its states starting at ``values`` in every group (`start`)."""
        return type(self)(self.state_dtype, {**self.start, **values})

    @property
    def stored(self) -> tuple[StateKind, ...]:
        """Its own kinds as stored: `states` itself in fp32, else the codec's codes and scales."""
        if self.codec is None:
            return self.states
        by_name = {k.name: k for k in self.states}
        out = []
        for name, dtype, per_block in self.codec.stored():
            base = by_name.get(name)
            if per_block:
                out.append(StateKind(name=name, dtype=dtype, block=_compact.BLOCK))
            else:
                out.append(dataclasses.replace(base, dtype=dtype))
        return tuple(out)

    @property
    def saved_kinds(self) -> tuple[StateKind, ...]:
        """What a checkpoint keeps per unit: the master weights and the own kinds, fp32 whatever
        the state dtype ([Note: compact state format]; docs/formats.md)."""
        return (MASTER, *self.states)

    def initial_states(self, master: torch.Tensor, per_group: dict, param_groups: list[dict],
                       slices: dict[int, slice]) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
        """(kind, value) of each stored kind before the first step, for a sub-group whose master
        weights are ``master`` and units' parts ``slices``."""
        values = [k.initial(master, per_group, param_groups, self.start) for k in self.states]
        return self.encoded(values, slices)

    def encoded(self, values: list[torch.Tensor], slices: dict[int, slice]) -> list[tuple[str, torch.Tensor]]:
        """(kind, tensor) of each stored kind for a sub-group whose own kinds are ``values``
        (fp32, flat), rounded to nearest."""
        stored = values if self.codec is None else self.codec.encode_group(values, slices)
        return [(k.name, t) for k, t in zip(self.stored, stored)]

    def unpacked(self, states: list, group, stepped, steps: dict):
        """A context that gives the kernel its own kinds of sub-group ``group`` in fp32 from the
        stored ``states``, and stores back the parts of the units in ``stepped`` when it ends
        (the others untouched): ``states`` itself when they are fp32. ``steps``: unit -> its
        step count (this update's)."""
        if self.codec is None:
            return contextlib.nullcontext(states)
        base = {u.index: u.shard.start for u in group.units}
        return self.codec.unpacked(states, group.slices, stepped, steps, base)

    def update(self, group, per_group: dict[int, list], param_groups: list[dict], master: torch.Tensor, states: list,
               grads: dict, grad_scale, steps: dict, first: set, cut: Cut | None = None,
               resident: bool = False) -> None:  # fmt: skip
        """One update in place of sub-group ``group``'s ``master`` weights and stored ``states``
        from ``grads`` (unit -> its gradient shard; only those units step): the kernel once per
        parameter group (``per_group``: group index -> entries (unit, slice of the sub-group,
        slice of the unit's gradient, parameter index)), on fp32 copies of compact states.
        ``steps``: unit -> its step count (this update's); ``first``: the units stepping for the
        first time; ``grad_scale``: what the gradients are divided by (None: 1); ``cut``:
        ``per_group``'s `Cut`, which makes the views of the flat tensors in one call each;
        ``resident``: ``master`` and ``states`` are a resident tier's own tensors, whose views the
        cut keeps (not the fp32 copies of compact states, made afresh)."""
        with self.unpacked(states, group, grads, steps) as fp32:
            flat = (master, *fp32)
            keep = [resident and (k == 0 or fp32 is states) for k in range(len(flat))]
            pieces = [None if cut is None else cut.pieces(t, k if keep[k] else None) for k, t in enumerate(flat)]
            for gi, entries in per_group.items():
                chosen = [k for k, e in enumerate(entries) if e[0].index in grads]
                if not chosen:
                    continue
                at = cut.at[gi] if cut is not None else None
                views = [[p[at[k]] for k in chosen] if p is not None else [t[entries[k][1]] for k in chosen]
                         for t, p in zip(flat, pieces)]  # fmt: skip
                self.step(
                    param_groups[gi],
                    views[0],
                    [_part(grads[entries[k][0].index], entries[k][2]) for k in chosen],
                    views[1:],
                    [steps[entries[k][0].index] for k in chosen],
                    [entries[k][0].index in first for k in chosen],
                    grad_scale,
                )

    def defaults(self, cfg) -> dict:
        """The hyperparameters ``[optimizer]`` (``cfg``) gives every group of this algorithm."""
        every = _config_values(cfg)
        return {k: every[k] for k in self.hyperparameters}

    def step(self, hp: dict, params: list, grads: list, states: list[list], steps: list, first: list[bool],
             grad_scale) -> None:  # fmt: skip
        """One update in place of ``params`` (fp32 master-weight views) from ``grads``, with one
        parameter group's hyperparameters ``hp``: ``states[k]`` holds the views of this
        algorithm's k-th own kind, ``steps`` the step counts (already counting this step),
        ``first`` whether each steps for the first time, ``grad_scale`` what the gradients are
        divided by (None: 1)."""
        raise NotImplementedError(f"the {self.name} algorithm has no kernel of its own")


class _Adam(Algorithm):
    states = (StateKind(name="exp_avg"), StateKind(name="exp_avg_sq", signed=False))
    hyperparameters = ("lr", "betas", "eps", "weight_decay")
    _kernel: ClassVar[str]

    def update(self, group, per_group, param_groups, master, states, grads, grad_scale, steps, first,
               cut=None, resident=False) -> None:  # fmt: skip
        # int8 moments: one pass over them where the extension serves (`_adam_int8`)
        if self.state_dtype == "int8" and _adam_int8.served(master, states, grads):
            _adam_int8.update(master, states, group.slices, per_group, param_groups, grads, steps, grad_scale,
                              adamw=self._kernel == "_fused_adamw_")  # fmt: skip
            return
        super().update(group, per_group, param_groups, master, states, grads, grad_scale, steps, first, cut,
                       resident)  # fmt: skip

    def step(self, hp, params, grads, states, steps, first, grad_scale) -> None:
        beta1, beta2 = hp["betas"]
        getattr(torch, self._kernel)(
            params, grads, states[0], states[1], [], steps, lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2),
            weight_decay=float(hp["weight_decay"]), eps=float(hp["eps"]), amsgrad=False, maximize=False,
            grad_scale=grad_scale, found_inf=None,
        )  # fmt: skip


class AdamW(_Adam):
    name = "adamw"
    torch_class = torch.optim.AdamW
    _kernel = "_fused_adamw_"


class Adam(_Adam):
    name = "adam"
    torch_class = torch.optim.Adam
    _kernel = "_fused_adam_"


class SGD(Algorithm):
    name = "sgd"
    torch_class = torch.optim.SGD
    states = (StateKind(name="momentum_buffer", first_step=True),)
    hyperparameters = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

    def step(self, hp, params, grads, states, steps, first, grad_scale) -> None:
        momentum = float(hp["momentum"])
        for is_first in (True, False):  # the kernel starts a momentum buffer at a unit's first step
            part = [i for i, f in enumerate(first) if f == is_first]
            if not part:
                continue
            bufs = [] if momentum == 0 else [states[0][i] for i in part]
            torch._fused_sgd_([params[i] for i in part], [grads[i] for i in part], bufs,
                              weight_decay=float(hp["weight_decay"]), momentum=momentum, lr=float(hp["lr"]),
                              dampening=float(hp["dampening"]), nesterov=bool(hp["nesterov"]), maximize=False,
                              is_first_step=is_first and momentum != 0, grad_scale=grad_scale, found_inf=None)  # fmt: skip


class Adagrad(Algorithm):
    name = "adagrad"
    torch_class = torch.optim.Adagrad
    states = (StateKind(name="sum", init="initial_accumulator_value", signed=False),)
    hyperparameters = ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value")

    def step(self, hp, params, grads, states, steps, first, grad_scale) -> None:
        torch._fused_adagrad_(params, grads, states[0], steps, lr=float(hp["lr"]), lr_decay=float(hp["lr_decay"]),
                              weight_decay=float(hp["weight_decay"]), eps=float(hp["eps"]), maximize=False,
                              grad_scale=grad_scale, found_inf=None)  # fmt: skip


class TorchOptimizer(Algorithm):
    """Any other torch optimizer, every tier on the device: its state is its own (stepped on
    views of the master weights, `_update.StreamedUpdate`), the engine keeps only the master weights."""

    name = "torch"


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (AdamW(), Adam(), SGD(), Adagrad(), TorchOptimizer())}
_BY_TORCH_CLASS = {a.torch_class: a for a in ALGORITHMS.values() if a.torch_class is not None}
# Options of the torch classes the fused kernels here do not run: refused when set.
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}


def refuse_flags(algo: Algorithm, groups: list[dict]) -> None:
    """At each step: a torch option set in a group by hand since (``maximize``, ``amsgrad``,
    ``decoupled_weight_decay``), which the kernels here do not read, is refused by name."""
    if algo.torch_class is None:
        return  # a torch optimizer run as it is reads its own groups
    for i, g in enumerate(groups):
        for key, allowed in _UNSUPPORTED.items():
            if g.get(key, allowed) != allowed:
                raise ValueError(f"engine.optimizer.param_groups[{i}][{key!r}] = {g[key]!r}: the engine's {algo.name} "
                                 f"does not run it on offloaded state (set {key}={allowed!r})")  # fmt: skip
        if "decoupled_weight_decay" in g and bool(g["decoupled_weight_decay"]) != (algo.name == "adamw"):
            raise ValueError(f"engine.optimizer.param_groups[{i}]['decoupled_weight_decay'] = "
                             f"{g['decoupled_weight_decay']!r}: the engine's optimizer is {algo.name} for the whole "
                             "run (AdamW is Adam with decoupled weight decay): choose it at initialize")  # fmt: skip


def algorithm(name: str) -> Algorithm:
    """The algorithm ``[optimizer] type = name`` (or a saved state's "type") names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"no optimizer algorithm {name!r}; the engine runs {', '.join(ALGORITHMS)}") from None


def _adagrad_start(algo: Algorithm, spec: torch.optim.Adagrad) -> Algorithm:
    """``algo`` with every sum starting where torch's Adagrad starts it: at the constructor's
    ``initial_accumulator_value``, which torch puts in every parameter's state and never reads
    from a group again (a group's own value does nothing there; said, naming it)."""
    value = spec.defaults["initial_accumulator_value"]
    ignored = [i for i, g in enumerate(spec.param_groups) if g.get("initial_accumulator_value", value) != value]
    if ignored:
        logger.warning("Adagrad: param_groups %s set initial_accumulator_value %s, which torch's Adagrad does not use: "
                       "it starts every sum at the constructor's, %s, and so does the engine; pass the value to "
                       "the constructor", ignored,
                       ", ".join(str(spec.param_groups[i]["initial_accumulator_value"]) for i in ignored), value)  # fmt: skip
    return algo.starting_at(initial_accumulator_value=value)


def resolve(spec, model_params: list, cfg, *, all_device: bool = False):
    """(algorithm, parameter groups, defaults, the torch optimizer to run as it is or None)
    from what `initialize` was given.

    ``spec``: None (``[optimizer]`` over every trainable parameter), parameters or parameter
    groups (``[{"params": [...], "weight_decay": 0.0}, ...]``: ``[optimizer]`` fills in the
    rest), a ``torch.optim`` optimizer, its class, ``(class, kwargs)``, or a callable that
    builds one from the parameters (``functools.partial(torch.optim.SGD, lr=0.1)``)."""
    algo, groups, defaults, foreign = _resolve(spec, model_params, cfg, all_device=all_device)
    if cfg.state_dtype != "fp32" and foreign is not None:
        raise ValueError(f"optimizer.state_dtype={cfg.state_dtype!r}: {type(foreign).__name__} runs as it is in torch "
                         "(every tier on the device), with its own fp32 state; compact states need the engine's own "
                         "adamw, adam, sgd or adagrad: use one of those, or state_dtype = 'fp32'")  # fmt: skip
    return algo.with_state_dtype(cfg.state_dtype), groups, defaults, foreign


def _wrapped(spec) -> str:
    """What to say of an optimizer that wraps a torch one (accelerate's AcceleratedOptimizer,
    after accelerator.prepare: the user's AdamW inside it was refused as an unknown class)."""
    inner = getattr(spec, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer) or inner is spec:
        return ""
    return (f". This one wraps {type(inner).__name__} (accelerate's accelerator.prepare wraps the optimizer so): "
            f"give initialize the optimizer before it is prepared, then prepare engine.optimizer (the README's "
            f"accelerate recipe)")


def _resolve(spec, model_params: list, cfg, *, all_device: bool):
    trainable = [p for p in model_params if p.requires_grad]
    configured = algorithm(cfg.type)
    if spec is None:
        return configured, [{"params": trainable}], configured.defaults(cfg), None
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
        algo = _BY_TORCH_CLASS.get(type(spec))
        decoupled = [bool(g.get("decoupled_weight_decay", False)) for g in spec.param_groups]
        if algo is ALGORITHMS["adam"] and all(decoupled):
            algo = ALGORITHMS["adamw"]  # torch's Adam(decoupled_weight_decay=True) is AdamW
        elif algo is ALGORITHMS["adam"] and any(decoupled):
            algo = None  # groups of both: torch's own class runs them, where it can
        if algo is None or any(g.get(k, v) != v for g in spec.param_groups for k, v in _UNSUPPORTED.items()):
            if all_device:  # nothing offloaded: the optimizer runs as it is, on fp32 master weights
                groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                          for g in spec.param_groups]  # fmt: skip
                return ALGORITHMS["torch"], groups, dict(spec.defaults), spec
        if algo is None:
            raise ValueError(
                f"optimizer {type(spec).__name__} cannot run on offloaded state: the engine runs "
                f"{', '.join(c.__name__ for c in _BY_TORCH_CLASS)} (torch.optim), or [optimizer] type = "
                f"{' | '.join(repr(k) for k, a in ALGORITHMS.items() if a.torch_class is not None)}; with every "
                f"tier on the device, any torch optimizer runs{_wrapped(spec)}"
            )
        for group in spec.param_groups:
            for key, allowed in _UNSUPPORTED.items():
                if group.get(key, allowed) != allowed:
                    raise ValueError(f"{type(spec).__name__}({key}={group[key]!r}) is not supported on offloaded "
                                     f"state; use {key}={allowed!r} (with every tier on the device, it runs)")  # fmt: skip
        keys = algo.hyperparameters
        # The optimizer's own group dicts: a schedule made on it (LambdaLR(opt) before
        # initialize), or a change by hand to its param_groups, reaches the engine's steps.
        groups = spec.param_groups
        if algo.name == "adagrad":
            algo = _adagrad_start(algo, spec)
        return algo, groups, {k: spec.defaults[k] for k in keys}, None
    groups = list(spec)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    defaults = configured.defaults(cfg)
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(f"optimizer parameter group {i} must be a dict with 'params', got {type(g).__name__}")
        unknown = set(g) - {"params", *defaults}
        if unknown:
            raise ValueError(f"optimizer parameter group {i}: {sorted(unknown)} are not hyperparameters of "
                             f"{cfg.type!r} ({', '.join(defaults)})")  # fmt: skip
    return configured, [dict(g, params=list(g["params"])) for g in groups], defaults, None
