"""What a managed parameter says about itself: its size, and where its gradient's norm is.

Owns: the size attributes of the parameters an engine manages, what ``numel()`` of a placeholder
answers, and torch.nn.utils' gradient clipping and nn.Module.zero_grad over managed parameters.
Touches: attributes of those parameters (set once, by `mark`, where the engine is built), the
clipping functions of ``torch.nn.utils`` and ``nn.Module.zero_grad`` (wrapped once, at import).

[Note: sizes of placeholders]
A released parameter is an empty placeholder (see [Note: reads outside a module] in `_gather`):
its storage is empty and its shape ``torch.Size([0])``. Code that counts parameters would count
nothing: transformers' ``model.num_parameters()``, the "Number of trainable parameters" Trainer
logs (``get_model_param_count``), the FLOPs it logs, peft's ``print_trainable_parameters()``
(which divides by the count) and nanoGPT's ``sum(p.numel() for p in model.parameters())``. So
every parameter an engine manages carries

- ``ds_numel`` and ``ds_shape``: its full element count and shape, whatever its state (the
  names DeepSpeed's ZeRO-3 parameters carry, which peft and transformers read where they know
  of them: peft when ``numel()`` is 0, transformers only under its own DeepSpeed check);
- and ``numel()`` / ``nelement()`` / ``torch.numel`` of a placeholder answer ``ds_numel``:
  transformers' ``num_parameters()`` reads nothing else, and a count is what those calls are
  for. The shape stays ``[0]``: it describes the storage that kernels index, which is empty.
  Only a call from Python sees the full count; within torch's own ops (under the placeholder's
  ``__torch_function__``) and in C++, the tensor's size is 0. A parameter that holds its values
  (its module running, or every tier on the device) answers the same count, its own.

[Note: clipping managed parameters]
A managed parameter has no ``.grad``: its gradient is in the engine's grads tier. So
``torch.nn.utils.clip_grad_norm_(engine.module.parameters(), n)``, and accelerate's
``clip_grad_norm_`` which calls it, would find no gradient, return 0.0 and clip nothing, with
the engine's true norm elsewhere. torch has no hook for clipping, and the parameters of an
all-device engine are plain parameters (no ``__torch_function__`` sees their ``.grad`` read);
so torch.nn.utils' functions are wrapped, once, and given managed parameters they:

- ``clip_grad_norm_`` (and the deprecated ``clip_grad_norm``): clip by the engine's global L2
  norm at its next step (`Engine.clip_grad_norm_`) and return that norm, when the parameters are
  one engine's and hold every parameter it trains (the norm is of all its gradients); otherwise
  raise, naming ``engine.clip_grad_norm_``. A ``max_norm`` of inf returns the norm and asks
  nothing of the step, whose ``[optimizer] max_grad_norm`` then still applies;
- ``clip_grad_value_`` and ``clip_grads_with_norm_``: raise (the engine clips by norm only).

Other parameters go to torch's functions unchanged. A reference to ``clip_grad_norm_`` taken
before ``import infinity`` reaches torch's own, which clips through torch.nn.utils.clip_grad's
module-level ``_clip_grads_with_norm_``: wrapped too, it raises rather than let the 0.0 pass.

[Note: a module's zero_grad]
For the same reason ``nn.Module.zero_grad`` found no ``.grad`` on a managed parameter and
dropped nothing: ``model.zero_grad()`` between a backward and the step (a micro-batch thrown
away) left its gradients in the tiers, and the step trained on them (1.5e-2 off plain SGD's
update of the same size; an audit helper's repro). ``nn.Module.zero_grad`` is wrapped, once:
torch's runs for the parameters no engine manages, and an engine whose trained parameters are
all under the module drops its gradients (``engine.optimizer.zero_grad``, as
``engine.zero_grad``). Under a module that holds part of them (a submodule), the engine has no
way to drop some gradients and keep others: with gradients this step that is refused, naming
``engine.zero_grad``; without, there is nothing to drop. The Trainer's ``model.zero_grad()``
after each step finds none.

[Note: .grad of a managed parameter]
Beyond clipping and zero_grad, a loop of the user's own over ``p.grad`` between backward and
the step finds None on every managed parameter. ``p.grad = None`` to drop a parameter's
gradient (or the whole step's, parameter by parameter) did nothing, silently: the step then
trained on what the loop meant to drop. So while an engine holds gradients of a finished
backward for its step, setting a managed parameter's ``.grad`` raises (`refuse_grad_set`),
naming the parameter and the engine's calls; at other times (before the first backward, after
the step or ``zero_grad``) ``p.grad = None`` is torch's no-op, and a tensor set there is
refused at the next forward or step (`_wrap.hand_set_grad`). Reads cannot be refused:
accelerate's ``clip_grad_norm_`` and the Trainer's read every parameter's ``.grad`` (to find
DTensors) before clipping through torch's function, which is the engine's; so a hand clamp or
norm over ``p.grad`` sees None and does nothing (README: clip with `engine.clip_grad_norm_`,
change a gradient with a hook). The bound parameter's class (`_placeholder._Bound`) has a
``grad`` property whose setter asks, the released one asks in its ``__torch_function__``; the
engine's own reads and writes of ``.grad`` (its hooks take what autograd put there) go past
both (`grad_of`, `set_grad`).
"""

from __future__ import annotations

import types
import weakref

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _clip_grad

# What a placeholder's element count is asked through (``nelement`` is ``numel`` there).
COUNTS = frozenset({torch.Tensor.numel, torch.numel})


def mark(units, engine) -> None:
    """Give every parameter of ``units`` its full size and its engine (see [Note: sizes of
    placeholders]); before they become placeholders."""
    ref = weakref.ref(engine)
    for unit in units:
        for r in unit.records:  # a tiled parameter: each tile has it whole
            p = r.param
            p.ds_shape = torch.Size(r.full_shape)
            p.ds_numel = p.ds_shape.numel()
            p._infinity_engine = ref


def count(p: torch.Tensor) -> int:
    """``p.numel()`` of a placeholder: the parameter's full element count."""
    n = getattr(p, "ds_numel", None)
    if n is not None:
        return n
    with torch._C.DisableTorchFunctionSubclass():
        return p.numel()


# -- .grad ([Note: .grad of a managed parameter]) -------------------------------------------------
GRAD = torch._C.TensorBase.__dict__["grad"]  # the ``.grad`` descriptor, past any subclass's property
_has_torch_function = torch._C._has_torch_function_unary


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` as autograd left it, without the refusal: the engine's own read."""
    if _has_torch_function(p):  # a released placeholder's class
        with torch._C.DisableTorchFunctionSubclass():
            return GRAD.__get__(p)
    return GRAD.__get__(p)


def set_grad(p: torch.Tensor, value: torch.Tensor | None) -> None:
    """``p.grad = value`` without the refusal: the engine's own write."""
    if _has_torch_function(p):
        with torch._C.DisableTorchFunctionSubclass():
            GRAD.__set__(p, value)
    else:
        GRAD.__set__(p, value)


def clear_grads(params) -> None:
    """``p.grad = None`` for each of ``params`` that has one, without the refusal: the engine's
    own drop (in one pass with the placeholders' ``__torch_function__`` off)."""
    get, put = GRAD.__get__, GRAD.__set__
    with torch._C.DisableTorchFunctionSubclass():
        for p in params:
            if get(p) is not None:
                put(p, None)


def refuse_grad_set(p: torch.Tensor) -> None:
    """Raise while ``p``'s engine holds gradients of a finished backward for its step: setting
    ``p.grad`` would drop or replace nothing (see the note)."""
    ref = getattr(p, "_infinity_engine", None)
    engine = ref() if ref is not None else None
    if engine is None or not engine._accumulation.passes:
        return
    raise RuntimeError(
        f"parameter {getattr(p, '_infinity_name', '?')!r}: .grad set while its infinity engine holds this step's "
        "gradients in its tiers, not in .grad, so this would drop or replace nothing: engine.zero_grad() (or the "
        "root module's zero_grad()) drops them all, engine.clip_grad_norm_(max_norm) clips them, and a gradient is "
        "changed as backward makes it with a hook (p.register_hook)"
    )


# -- gradient clipping ([Note: clipping managed parameters]) ------------------------------------
_torch_clip_grad_norm_ = _clip_grad.clip_grad_norm_
_torch_clip_grad_value_ = _clip_grad.clip_grad_value_
_torch_clip_grads_with_norm_ = _clip_grad._clip_grads_with_norm_


def _listed(parameters):
    """``parameters`` as a list, and what to give torch in their place (a generator stays one:
    torch warns about an empty generator)."""
    if isinstance(parameters, torch.Tensor):
        return [parameters], parameters
    if isinstance(parameters, types.GeneratorType):
        params = list(parameters)
        return params, (p for p in params)
    params = list(parameters)
    return params, params


def _engine_of(params, call: str):
    """The engine managing ``params``, or None when none is managed; raises for parameters of
    several engines, or managed ones beside others that have gradients."""
    managed = [p for p in params if getattr(p, "_infinity_managed", False)]
    if not managed:
        return None
    engines = {id(e): e for e in (getattr(p, "_infinity_engine", lambda: None)() for p in managed)}
    if None in engines.values():
        raise RuntimeError(f"torch.nn.utils.{call} over parameters of an infinity engine that was dropped: their "
                           "gradients went with it; there is nothing to clip")  # fmt: skip
    if len(engines) != 1:
        raise RuntimeError(f"torch.nn.utils.{call} over parameters of {len(engines)} infinity engines: each "
                           "engine clips its own gradients, with engine.clip_grad_norm_")  # fmt: skip
    others = [p for p in params if not getattr(p, "_infinity_managed", False) and p.grad is not None]
    if others:
        raise RuntimeError(
            f"torch.nn.utils.{call} over parameters that an infinity engine manages and {len(others)} that it "
            "does not, with gradients: the engine's gradients are in its tiers, not in .grad, and one norm over "
            "both cannot be had; clip the engine's with engine.clip_grad_norm_(max_norm) and the others apart"
        )
    return next(iter(engines.values()))


def _trained(engine) -> dict[int, str]:
    """id -> name of every parameter ``engine`` trains (the gradients its norm covers)."""
    return {id(r.param): u.qualified_name(i) for u in engine.units for i, r in enumerate(u.records) if r.requires_grad}


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``torch.nn.utils.clip_grad_norm_``; over an engine's parameters, `Engine.clip_grad_norm_`
    (see [Note: clipping managed parameters])."""
    params, given = _listed(parameters)
    engine = _engine_of(params, "clip_grad_norm_")
    if engine is None:
        return _torch_clip_grad_norm_(given, max_norm, norm_type, error_if_nonfinite, foreach)
    if float(norm_type) != 2.0:
        raise ValueError(f"torch.nn.utils.clip_grad_norm_ with {norm_type=} over an infinity engine's parameters: "
                         "the engine clips by the L2 norm only (engine.clip_grad_norm_(max_norm))")  # fmt: skip
    ids = {id(p) for p in params}
    missing = [name for key, name in _trained(engine).items() if key not in ids]
    if missing:
        raise ValueError(
            f"torch.nn.utils.clip_grad_norm_ over part of an infinity engine's trained parameters ({len(missing)} "
            f"missing, e.g. {missing[0]!r}): the engine clips all its gradients by their one global norm; call "
            "engine.clip_grad_norm_(max_norm), or pass every parameter (engine.module.parameters())"
        )
    norm = None
    if error_if_nonfinite:
        norm = engine.grad_norm()
        if not torch.isfinite(torch.tensor(norm)):
            raise RuntimeError(f"the total norm of the gradients of an infinity engine is {norm} "
                               "(error_if_nonfinite=True); the engine skips a step on them")  # fmt: skip
    if max_norm == float("inf"):
        # The norm alone (Trainer and accelerate ask it so): a clip to inf asked of the step
        # would replace the clipping [optimizer] max_grad_norm configures.
        return torch.tensor(engine.grad_norm() if norm is None else norm)
    return engine.clip_grad_norm_(max_norm)


def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_``; refused over an engine's parameters."""
    params, given = _listed(parameters)
    if _engine_of(params, "clip_grad_value_") is not None:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_value_(..., {clip_value}) over parameters that an infinity engine manages: "
            "their gradients are in its tiers, not in .grad, so this would clip nothing; the engine clips by "
            "norm only: engine.clip_grad_norm_(max_norm), or [optimizer] max_grad_norm"
        )
    return _torch_clip_grad_value_(given, clip_value, foreach)


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``; refused over an engine's parameters."""
    params, given = _listed(parameters)
    if _engine_of(params, "clip_grads_with_norm_") is not None:
        raise RuntimeError(
            "gradient clipping over parameters that an infinity engine manages, through torch.nn.utils' "
            "clip_grads_with_norm_ (or a clip_grad_norm_ imported before infinity): their gradients are in its "
            "tiers, not in .grad, so it would clip nothing and its norm would read 0.0; call "
            "engine.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_ after import infinity"
        )
    return _torch_clip_grads_with_norm_(given, max_norm, total_norm, foreach)


_torch_module_zero_grad = torch.nn.Module.zero_grad


def module_zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
    """``nn.Module.zero_grad``; the gradients of engines whose parameters are under the module
    dropped too ([Note: a module's zero_grad]). A refusal comes before anything is dropped."""
    engines = {}
    for p in self.parameters():
        if getattr(p, "_infinity_managed", False):
            engine = p._infinity_engine()
            if engine is not None:  # (a dropped engine's gradients went with it)
                engines.setdefault(id(engine), (engine, set()))[1].add(id(p))
    whole = []
    for engine, ids in engines.values():
        missing = [name for key, name in _trained(engine).items() if key not in ids]
        if not missing:
            whole.append(engine)
        elif engine.grads.has_grad or any(u.arrived or u.grad is not None for u in engine.units):
            raise RuntimeError(
                f"{type(self).__name__}.zero_grad() over part of an infinity engine's trained parameters "
                f"({len(missing)} not under it, e.g. {missing[0]!r}) while it has gradients this step: the engine "
                "keeps one gradient per step for all of them and cannot drop part; call engine.zero_grad() (or the "
                "root module's zero_grad()) to drop them all"
            )
    for engine in whole:
        engine.optimizer.zero_grad(set_to_none)
    # The parameters no engine manages (managed ones have no .grad; read after their engines
    # dropped theirs: [Note: .grad of a managed parameter]).
    _torch_module_zero_grad(self, set_to_none)


def _install() -> None:
    """Wrap torch.nn.utils' clipping (see [Note: clipping managed parameters]) and
    ``nn.Module.zero_grad`` ([Note: a module's zero_grad]), once."""
    if getattr(_clip_grad.clip_grad_norm_, "_infinity", False):
        return
    torch.nn.Module.zero_grad = module_zero_grad
    clip_grad_norm_._infinity = True
    for where in (torch.nn.utils, _clip_grad):
        where.clip_grad_norm_ = clip_grad_norm_
        where.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
    _clip_grad._clip_grads_with_norm_ = clip_grads_with_norm_  # what torch's own clip_grad_norm_ calls


_install()
