"""A released parameter's placeholder class: every read of its data refused, naming it.

Owns: the class a released parameter has while its unit is released (a subclass of its own
class, made once per class), the class a bound one has (another, which notes ``p.data`` taken:
[Note: in-place writes to bound parameters] in `_inplace`), and the refusal it raises ([Note: reads outside a module] in
`_gather`: the first part). Touches: the parameters' class and a name on them. `_units` makes
a parameter a placeholder and back (`release_param`, `bind_param`); the saved-tensor hook refuses
to save one (`refuse_placeholder`); `_gather` gathers them for reads outside a module.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from . import _sizes
from ._wrap import dtype_refusal

# Reading these is reading metadata, or registering hooks: allowed on a placeholder.
_META = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "storage_offset",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "is_pinned", "is_shared", "get_device",
    "data_ptr", "untyped_storage", "_typed_storage", "storage", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "retain_grad", "detach", "detach_", "_is_view", "__hash__",
    "__repr__", "__format__", "__dir__", "__sizeof__", "_has_compatible_shallow_copy_type",
})  # fmt: skip
# Properties that are views of the data, not metadata.
_DATA_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Conversions `nn.Module._apply` runs under no_grad (``model.to(device)``: Trainer, accelerate).
_CONVERSIONS = frozenset({"to", "cpu", "cuda", "float", "half", "bfloat16", "double", "type"})


class _Released:
    """Mixed into a released parameter's class: see [Note: reads outside a module] in `_gather`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and getattr(func, "__name__", "") in _GUARDED:
            if _sets_grad(func) and type(args[0]) in _RELEASED_CLASSES:  # see [Note: .grad of a managed parameter]
                _sizes.refuse_grad_set(args[0])
            elif func.__name__ in _HOOKS:
                refuse_tiled_hook(args[0])
        if func in _sizes.COUNTS:  # the full count: see [Note: sizes of placeholders]
            return _sizes.count(args[0])
        if _sets_data(func) and args:  # ``p.data = t``: allowed (the engine binds so), noted
            _NOTED.add(id(args[0]))
        elif not _allowed(func):
            for t in tree_leaves((args, kwargs)):
                if type(t) in _RELEASED_CLASSES:
                    raise _refusal(t, f"by {getattr(func, '__name__', func)}")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if (getattr(func, "__name__", "") in _CONVERSIONS and isinstance(out, torch.Tensor) and args
                and type(args[0]) in _RELEASED_CLASSES and out.dtype != args[0].dtype):  # fmt: skip
            # ``model.to(torch.bfloat16)``: the placeholder would take the dtype, its unit's next
            # fetch would bind the parameter in the engine's again, and the cast be dropped unsaid.
            raise dtype_refusal(args[0]._infinity_name, out.dtype, args[0].dtype)
        if _shares_data(func) and isinstance(out, torch.Tensor) and args and type(args[0]) in _RELEASED_CLASSES:
            # ``p.data`` and ``p.detach()`` are the placeholder's empty memory too: a read or
            # write through them is refused as one through ``p`` is (the values are not there).
            release_param(out, args[0]._infinity_name)
        return out


_HOOKS = frozenset({"register_hook", "register_post_accumulate_grad_hook"})
_GUARDED = _HOOKS | {"__set__"}  # the names of what `_Released` checks before anything else


def refuse_tiled_hook(p: torch.Tensor) -> None:
    """A hook on a parameter cut into tiles would never run: each tile's gradient is made by the
    tiled Function and never passes through the parameter. (A hook registered before
    `initialize` keeps the module whole: `_units.tileable`.)"""
    if getattr(p, "_infinity_tiled", False):
        raise RuntimeError(
            f"parameter {getattr(p, '_infinity_name', '?')!r} is cut into tiles (memory.tile_size): its gradient is "
            "made tile by tile and never passes through the parameter, so a hook on it would never run. Register "
            "the hook before infinity.initialize (the module then stays whole), or raise memory.tile_size above the "
            "module's fp32 size"
        )


def _sets_grad(func) -> bool:
    """Whether ``func`` is the ``grad`` property's setter."""
    return getattr(func, "__name__", "") == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "grad"


def _sets_data(func) -> bool:
    """Whether ``func`` is the ``data`` property's setter."""
    return getattr(func, "__name__", "") == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data"


def _shares_data(func) -> bool:
    """Whether ``func`` gives a tensor of the same data without a copy: ``detach`` or the
    ``data`` property (`_META` lets both through as metadata)."""
    name = getattr(func, "__name__", "")
    return name == "detach" or (name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data")


def _allowed(func) -> bool:
    if func is torch.autograd.grad or func is torch.autograd.backward:
        return True  # a parameter as a graph input (``inputs=``): its gradient asked for, its values not read
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: metadata, unless a view of the data
        return getattr(getattr(func, "__self__", None), "__name__", "") not in _DATA_PROPERTIES
    return name in _META or (name in _CONVERSIONS and not torch.is_grad_enabled())


def mark_closed(p: nn.Parameter) -> None:
    """``p``'s engine was closed: a read of its placeholder says so, not that it was read
    outside its module (an audit helper: ``generate`` after ``close()`` was sent to
    GatheredParameters)."""
    p.__dict__["_infinity_closed"] = True


def _refusal(p: torch.Tensor, what: str) -> RuntimeError:
    name = getattr(p, "_infinity_name", "?")
    if p.__dict__.get("_infinity_closed"):
        return RuntimeError(
            f"parameter {name!r} was read ({what}) after its infinity engine was closed (engine.close()): its weights "
            "went with the engine's tiers, and it is an empty placeholder. Save them before closing "
            "(engine.save_pretrained, engine.export or engine.save_checkpoint) and load them into a new model or "
            "engine"
        )
    return RuntimeError(
        f"parameter {name!r} was read outside the forward of the module that holds it ({what}), but an infinity "
        f"engine keeps it in its tiers and it is an empty placeholder there (shape {tuple(p.shape)}; such a read can "
        "run while its unit happens to be still in memory from its module's call, kept for backward, and fails "
        "once it is not: other settings, a fuller pool): gather it for the "
        f"read with `with infinity.GatheredParameters([param]): ...` (as deepspeed.zero.GatheredParameters), "
        "inside the model's forward to train through it; TRL's trainers gather the LM head they read through "
        "infinity.integrations.trl (InfinitySFTTrainer installs it), but not what they read elsewhere "
        "(DistillationTrainer's divergence kernel), which needs tiers.params = 'device'. To "
        "change its values (an in-place write, p.data.normal_()), load them with engine.module.load_state_dict: "
        "changes made inside GatheredParameters are not written back"
    )


_RELEASED_CLASSES: set[type] = set()
_released_of: dict[type, type] = {}  # a parameter class -> its released subclass
_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor of ``p.data``


# Ids of the parameters whose ``.data`` was taken or replaced since `take_noted` (a write into
# ``p.data`` bumps no version counter of ``p``'s: [Note: in-place writes to bound parameters]
# in `_inplace`). The engine's own binds and releases take theirs out.
_NOTED: set[int] = set()
# Id -> the ``p.data`` tensors taken from a bound parameter and alive since, each weakly with
# its own version counter as `take_noted` last saw it (None: not seen yet). A write through one
# held across looks (``d = p.data`` kept by a helper, written steps later) moves its counter,
# not ``p``'s: such a parameter is noted again. Dropped when the parameter is bound or released
# (a tensor of the data it had then is not its data any more, as in plain PyTorch).
_HELD: dict[int, list[tuple[weakref.ref, int | None]]] = {}


def take_noted(ids: set[int]) -> set[int]:
    """Those of ``ids`` (one engine's parameters) noted since they were last taken, or one of
    whose ``.data`` tensors still held was written since; they are noted no more (another
    engine's stay noted for it)."""
    mine = _NOTED & ids if _NOTED else set()
    _NOTED.difference_update(mine)
    for pid in [pid for pid in _HELD if pid in ids] if _HELD else ():
        alive = []
        for ref, seen in _HELD[pid]:
            t = ref()
            if t is None:
                continue
            if seen is not None and t._version != seen:
                mine.add(pid)
            alive.append((ref, t._version))
        if alive:
            _HELD[pid] = alive
        else:
            del _HELD[pid]
    return mine


def _forget_data(p: torch.Tensor) -> None:
    """The engine's own ``p.data = ...`` (a bind or a release): nothing of ``p``'s is noted."""
    _NOTED.discard(id(p))
    _HELD.pop(id(p), None)


class _Bound:
    """Mixed into a bound parameter's class: taking or replacing ``p.data`` is noted
    (`_NOTED`); setting ``.grad`` asks first ([Note: .grad of a managed parameter] in `_sizes`),
    and a hook on a tiled one is refused (`refuse_tiled_hook`). Everything else is its own
    class's: no ``__torch_function__`` of its own, so nothing on the forward's path changes."""

    @property
    def data(self):
        _NOTED.add(id(self))
        data = _DATA.__get__(self)
        _HELD.setdefault(id(self), []).append((weakref.ref(data), None))
        return data

    @data.setter
    def data(self, value):
        _DATA.__set__(self, value)
        _NOTED.add(id(self))

    def register_hook(self, hook):  # a tiled parameter bound whole for a gather of it
        refuse_tiled_hook(self)
        return super().register_hook(hook)

    def register_post_accumulate_grad_hook(self, hook):
        refuse_tiled_hook(self)
        return super().register_post_accumulate_grad_hook(hook)

    @property
    def grad(self):  # see [Note: .grad of a managed parameter] in `_sizes`
        return _sizes.GRAD.__get__(self)

    @grad.setter
    def grad(self, value):
        _sizes.refuse_grad_set(self)
        _sizes.GRAD.__set__(self, value)


_BOUND_CLASSES: set[type] = set()
_bound_of: dict[type, type] = {}  # a parameter class -> its bound subclass


def _base(cls: type) -> type:
    """The user's own class of a parameter whose class is one of ours (released or bound)."""
    return cls._infinity_base if cls in _RELEASED_CLASSES or cls in _BOUND_CLASSES else cls


def release_param(p: torch.Tensor, name: str) -> None:
    """``p`` is a placeholder now (its data empty): reads of its data are refused, naming it (a
    parameter, or a plain tensor of its data: ``p.data``, ``p.detach()``)."""
    p._infinity_name = name
    _forget_data(p)  # (the engine's own ``p.data = empty``)
    cls = type(p)
    if cls in _RELEASED_CLASSES:
        return
    cls = _base(cls)
    released = _released_of.get(cls)
    if released is None:
        released = type(f"Released{cls.__name__}", (_Released, cls), {"_infinity_base": cls})
        _released_of[cls] = released
        _RELEASED_CLASSES.add(released)
    p.__class__ = released


def bind_param(p: nn.Parameter) -> None:
    """``p`` holds its values: its own class again, with the bound class's note of ``p.data``
    taken (`_Bound`); named as its own class is."""
    _forget_data(p)  # (the engine's own ``p.data = view``)
    cls = type(p)
    if cls in _BOUND_CLASSES:
        return
    cls = _base(cls)
    if not isinstance(p, nn.Parameter):  # (a tensor of a parameter's data, released with it)
        p.__class__ = cls
        return
    bound = _bound_of.get(cls)
    if bound is None:
        bound = type(cls.__name__, (_Bound, cls), {"_infinity_base": cls, "__qualname__": cls.__qualname__})
        _bound_of[cls] = bound
        _BOUND_CLASSES.add(bound)
    p.__class__ = bound


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a released parameter's placeholder."""
    return type(t) in _RELEASED_CLASSES


def refuse_placeholder(t: torch.Tensor) -> None:
    """Raise if autograd is saving a placeholder for backward (the saved-tensor hook)."""
    if type(t) in _RELEASED_CLASSES:
        raise _refusal(t, "saved for backward")
