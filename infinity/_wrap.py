"""Wrappers that add parameters to a model (peft's ``get_peft_model``): applied to a model built
on the meta device before the engine is made, so that the base streams in from a checkpoint and
the added parameters keep the wrapper's own initialisation; and the refusal of a module changed
after the engine was made.

Owns: the stand-ins the built parameters wear while the wrapper runs, the names the base's
parameters and buffers had before wrapping (what the checkpoint calls them), and the check that
``engine.module`` holds only the parameters the engine manages. Touches: the module's
parameters (in place, through ``torch.utils.swap_tensors``); nothing of the tiers.

[Note: wrapping a built model]
A wrapper that sees its base on the meta device puts what it adds there too (peft moves each
adapter to its base layer's device), and the adapters' initialisation is lost. So while ``fn``
runs, each built parameter wears an `_Unloaded` stand-in: it reports the parameter's shape,
dtype and the CPU, takes no memory, and any computation on it (a read, a copy, an in-place
init) raises, naming the parameter: a wrapper whose initialisation reads the base weights
(peft's PiSSA, OLoRA, LoftQ, or ``modules_to_save``, which copies them) cannot run before they
are loaded, and is refused instead of seeing zeros. The parameters the wrapper adds are
ordinary tensors with the wrapper's own values (peft's lora_A from its RNG, lora_B zeros);
`initialize` keeps them as they are (see [Note: meta initialisation] in `_build`).
Afterwards the stand-ins are meta again, the same Parameter objects, wherever the wrapper put
their modules: the module objects it kept give each one the name it had before.
"""

from __future__ import annotations

import torch
from torch import nn

from ._sizes import GRAD, grad_of

_STANDIN_KEYS = ("_is_param", "_infinity_unloaded")  # what only the stand-in carries


class _Unloaded(torch.Tensor):
    """A built parameter's stand-in while a wrapper runs (see [Note: wrapping a built model])."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device="cpu")
        t._infinity_unloaded = name
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):  # nn.Parameter(...) detaches
            return _Unloaded(args[0], args[0]._infinity_unloaded)
        name = next((a._infinity_unloaded for a in args if isinstance(a, _Unloaded)), "?")
        raise ValueError(
            f"the wrapper computed with the base parameter {name!r} ({func}), which is not loaded yet: the "
            "checkpoint streams in after wrapping. A wrapper whose initialisation reads or copies the base "
            "weights (peft's PiSSA, OLoRA, LoftQ, modules_to_save) needs the model in memory: load it whole "
            "(transformers' from_pretrained), wrap it, then infinity.initialize"
        )


def apply(model: nn.Module, fn) -> tuple[nn.Module, dict[str, str]]:
    """``fn(model)`` for a model built on the meta device (`infinity.build`), with the parameters
    ``fn`` adds keeping ``fn``'s own values. Returns the wrapped model and, for each of its
    parameters and buffers that ``model`` had, key in the wrapped model -> key in ``model``
    (see [Note: wrapping a built model])."""
    if not callable(fn):
        raise TypeError(f"wrap must be a callable taking the model and returning the wrapped one, got "
                        f"{type(fn).__name__}")  # fmt: skip
    before = {id(m): (name, m) for name, m in model.named_modules(remove_duplicate=False)}
    built = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and id(p) not in built:
            built[id(p)] = (name, p)
    for name, p in built.values():
        _swap(p, _Unloaded(p, name))
    try:
        wrapped = fn(model)
    finally:
        for _, p in built.values():
            _swap(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
    if not isinstance(wrapped, nn.Module):
        raise TypeError(f"wrap(model) returned a {type(wrapped).__name__}, not the wrapped torch.nn.Module")
    names = {}
    for path, m in wrapped.named_modules(remove_duplicate=False):
        if id(m) not in before or before[id(m)][1] is not m:
            continue  # a module the wrapper made: its parameters are its own
        old = before[id(m)][0]
        for key in (*m._parameters, *m._buffers):
            names[f"{path}.{key}" if path else key] = f"{old}.{key}" if old else key
    _refuse_lost_base(wrapped, names, built)
    return wrapped, names


def _refuse_lost_base(wrapped: nn.Module, names: dict[str, str], built: dict) -> None:
    """Every parameter of the base must be in ``wrapped``, in a module the base had (so that
    the checkpoint's key for it is known): otherwise the checkpoint would load into nothing,
    or the parameter would train from no values at all, with nothing said."""
    named = {id(p) for key, p in wrapped.named_parameters(remove_duplicate=False) if key in names}
    lost = [name for i, (name, _) in built.items() if i not in named]
    if not lost:
        return
    shown = ", ".join(repr(n) for n in lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
    raise ValueError(
        f"wrap(model) returned a {type(wrapped).__module__}.{type(wrapped).__qualname__} that does not hold "
        f"{len(lost)} of the base's {len(built)} parameters in the modules the base had them in ({shown}): the "
        "checkpoint would not load into them. wrap must return the base itself, or a wrapper around it that "
        "keeps its modules (as peft.get_peft_model does)"
    )


def _swap(p: nn.Parameter, value: torch.Tensor) -> None:
    """``p`` takes ``value``'s contents and class, keeping its own attributes but the stand-in's."""
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    new.__dict__.update({k: v for k, v in p.__dict__.items() if k not in _STANDIN_KEYS})
    torch.utils.swap_tensors(p, new)


def _unchanged(module: nn.Module, managed: dict[int, tuple[bool, torch.dtype]], requires_grad: bool = True) -> bool:
    """Whether every parameter under ``module`` is in ``managed`` with its requires_grad (where
    ``requires_grad``) and dtype, and without a ``.grad`` (plain loops: about a third of the time of any() over
    generators, for the ~300 modules of a 24-layer Llama: 80 us). Read with the placeholders'
    ``__torch_function__`` off, each attribute straight from the tensor (``.grad`` past the
    bound class's property: [Note: .grad of a managed parameter] in `_sizes`)."""
    stack = [module]
    get, pop, extend, grad = managed.get, stack.pop, stack.extend, GRAD.__get__
    with torch._C.DisableTorchFunctionSubclass():
        while stack:
            m = pop()
            if m is None:
                continue
            for p in m._parameters.values():
                if p is not None:
                    kept = get(id(p))
                    if (kept is None or (requires_grad and kept[0] is not p.requires_grad) or kept[1] is not p.dtype
                            or grad(p) is not None):  # fmt: skip
                        return False
            extend(m._modules.values())
    return True



class ParameterCast(RuntimeError):
    """A managed parameter's dtype changed, or was about to (`_placeholder` refuses the cast)."""


def dtype_refusal(name: str, now: torch.dtype, kept: torch.dtype) -> ParameterCast:
    return ParameterCast(
        f"parameter {name!r} cast to {now} ({kept} at infinity.initialize): a module.to(dtype) (the Trainer's "
        f"bf16_full_eval and fp16_full_eval run one before evaluating) cannot change what the engine keeps and "
        f"computes in, precision.param_dtype ({kept}): a released parameter would drop the cast at its next "
        "fetch, a bound one would train apart from the engine's weights. The module's parameters are the "
        f"engine's again, in {kept}. Set precision.param_dtype at infinity.initialize, or evaluate under "
        "torch.autocast"
    )


def refuse_changed(module: nn.Module, managed: dict[int, tuple[bool, torch.dtype]], *, requires_grad: bool = True) -> None:
    """``module`` holds a parameter the engine does not manage (``managed``: the ids of its
    units' parameters, each with its requires_grad and dtype at `initialize`): one added or
    replaced after `initialize`, which the engine would never give a gradient or an update;
    or one whose requires_grad or dtype changed since, or that holds a ``.grad`` (set by hand:
    the engine's hooks take the ones backward makes). Runs before each forward and step: a
    plain walk of the modules' own dicts (cheaper than named_parameters, which names each),
    named only on a find. Without ``requires_grad`` (a forward without grad, which gives no
    parameter a gradient) requires_grad is not compared: peft's ``disable_adapter()`` and
    ``set_adapter()`` turn it off and on around the forwards they run, as TRL's reference
    log-probabilities do under no_grad (those were refused)."""
    if _unchanged(module, managed, requires_grad):
        return
    for name, p in module.named_parameters():
        if id(p) not in managed:
            raise RuntimeError(
                f"parameter {name!r} of engine.module is not one the engine manages: the module was changed "
                "after infinity.initialize (peft.get_peft_model(engine.module) adds adapters the engine never "
                "sees, so they would never train). Wrap the model before the engine is made: "
                "infinity.from_pretrained(ModelClass, path, config, wrap=fn) streams the base from a "
                "checkpoint, or apply fn to a model in memory before infinity.initialize"
            )
    for name, p in module.named_parameters(remove_duplicate=False):
        kept_grad, dtype = managed[id(p)]
        if p.dtype is not dtype:
            raise dtype_refusal(name, p.dtype, dtype)
        if requires_grad and kept_grad is not p.requires_grad:
            raise RuntimeError(
                f"parameter {name!r}: requires_grad is {p.requires_grad} now, {kept_grad} at "
                "infinity.initialize. The engine steps a module's parameters together (as DeepSpeed's ZeRO "
                "and FSDP's flat parameters do), so one frozen after initialize would still move (a zero "
                "gradient under momentum and weight decay), and one unfrozen would have no optimizer state: "
                "set requires_grad before initialize, or make a new engine (save_checkpoint, then load it "
                "into the new one)"
            )
        if grad_of(p) is not None:  # the engine's hooks take every gradient backward makes
            raise hand_set_grad(name)


def hand_set_grad(name: str) -> RuntimeError:
    """The refusal of a managed parameter holding a ``.grad``: the engine's hooks take every
    gradient backward makes, so one there was set by hand, and the step would leave it unused
    while the next backward added into it (an audit helper's repro: no update, then 9e-4 off
    plain PyTorch). Checked at each step (`refuse_hand_set_grads`) and in the walk before a
    forward (`refuse_changed`)."""
    return RuntimeError(
        f"parameter {name!r} has a .grad the engine's backward did not make (set by hand, as p.grad = g after "
        "torch.autograd.grad(loss, params) in a custom clipper or a MAML-style update): the engine takes "
        "gradients only from backward, so its step would leave this one unused, and the next backward would add "
        "into it. Give gradients through engine.backward(loss), or call engine.zero_grad() to drop it"
    )


def refuse_hand_set_grads(units) -> None:
    """Before a step: no managed parameter holds a ``.grad`` (`hand_set_grad`)."""
    grad = GRAD.__get__
    with torch._C.DisableTorchFunctionSubclass():  # (as in `_unchanged`)
        found = next(((unit, i) for unit in units for i, r in enumerate(unit.records) if grad(r.param) is not None), None)
    if found is not None:
        raise hand_set_grad(found[0].qualified_name(found[1]))
