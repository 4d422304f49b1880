"""What a model's own code does to its parameters while they are on the meta device inside
``infinity.build()``, kept so that `initialize` can do it again to the real tensors, one unit at
a time (see [Note: recorded initialisation]).

Owns: the recording (``torch.nn.init.*`` patched for the block, a TorchFunctionMode for the
in-place tensor methods) and `replay`. Touches: the parameters' ``_infinity_ops`` and
``_infinity_value`` attributes; nothing of the units or the I/O.

[Note: recorded initialisation]
On the meta device an init is a no-op, so a model that initialises itself after construction
(nanoGPT's ``self.apply(self._init_weights)`` and scaled ``c_proj``; torchtitan's
``init_weights()`` called in the block) would otherwise get torch's defaults at `initialize`.
Each call that writes a built parameter is recorded on it: an ``nn.init`` function, or an
in-place method (``normal_``, ``fill_``, ``copy_``, ``p[...] = v``, ...) on it or on its ``.data``.
A small parameter (at most `KEEP_BYTES`) keeps the values it was registered with (LayerNorm's
``torch.ones``), as the start the calls apply to. At `initialize` the calls from the last one
that overwrites the whole tensor on are run again, in order, on the real tensor, drawing from
the random state the first recorded call saw (a ``torch.manual_seed`` in the block counts). Values are bit-equal to a plain build when the model
draws them parameter by parameter in unit order (each module's constructor initialising its
own, as ``nn.Linear`` does); a second pass over the model (``apply(init)``) draws in a
different order, so the values are other draws of the same distributions. A call that cannot
be done again (its arguments include another tensor on the meta device, or it writes a view
of a parameter that build could not follow) is an error when the ``build()`` block ends,
naming the parameter and the call. A larger parameter registered with values the constructor
computed (not ``torch.empty``) that nothing in the block overwrites is refused at `initialize`,
naming it: its values are gone, and another init in their place would be silent.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

KEEP_BYTES = 1 << 16  # a LayerNorm's weight of 16k floats: kept whole, small beside its layer

# Calls after which the tensor's earlier contents no longer matter.
_OVERWRITE = {"normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "bernoulli_", "exponential_",
              "geometric_", "log_normal_", "cauchy_"}  # fmt: skip
_INIT_FNS = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
# What torch.empty and its kin make holds no values a parameter could lose (see `keep_value`).
_EMPTY = {"empty", "empty_like", "new_empty", "empty_strided"}
_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor whose __get__ is `p.data`


def _name(func) -> str:
    return getattr(func, "__name__", repr(func))


def _where(p) -> str:
    return f"{getattr(p, '_infinity_where', '?')!r} {tuple(p.shape)}"


def built(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta and hasattr(t, "_infinity_init")


class _OnView:
    """An in-place call on a view of a parameter (Embedding's ``weight[padding_idx].fill_(0)``):
    the view is made again from the real parameter, then the call runs on it."""

    def __init__(self, chain, func):
        self.chain, self.func = chain, func
        self.__name__ = f"{_name(func)} on a view"

    def __call__(self, p, *rest, **kwargs):
        view = p
        for func, vrest, vkwargs in self.chain:
            view = func(view, *vrest, **vkwargs)
        return self.func(view, *rest, **kwargs)


def _meta_args(args, kwargs) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values()))


class Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        # id(tensor) -> (weakref to it, its parameter, the view calls that make it from the
        # parameter): `p.data` (no calls), `p[0]`, `p.data.view(-1)`, ...
        self.aliases = {}
        self.errors = []
        self.rng = None  # the random state at the first recorded call: see `build`
        # data_ptr -> True for the tensors torch.empty made in the block: a parameter registered
        # with one of those has no values of its own to lose (nn.Linear's, before its init).
        self.empties = {}

    def made_empty(self, t) -> bool:
        return self.empties.pop(t.data_ptr(), False)

    def target(self, t):
        """(parameter, view calls) when ``t`` is a built parameter or a view of one made in the block."""
        if built(t):
            return t, ()
        if isinstance(t, torch.Tensor):
            entry = self.aliases.get(id(t))
            if entry is not None and entry[0]() is t:
                return entry[1], entry[2]
        return None

    def record(self, found, func, args, kwargs, what):
        param, chain = found
        if _meta_args(args[1:], kwargs):
            self.errors.append(
                f"{what} writes parameter {_where(param)} from another tensor on "
                "the meta device, whose values do not exist until initialize"
            )
            return
        if self.rng is None:
            self.rng = torch.get_rng_state()
        ops = param.__dict__.setdefault("_infinity_ops", [])
        if not chain and (_name(func) in _OVERWRITE or what.startswith("torch.nn.init")):
            ops.clear()  # what came before is overwritten: not run again (and not kept)
            param.__dict__.pop("_infinity_value", None)
            param.__dict__.pop("_infinity_lost", None)
        ops.append((_OnView(chain, func) if chain else func, tuple(args[1:]), dict(kwargs), _generator_states(args, kwargs)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        if name in _EMPTY and isinstance(out, torch.Tensor) and not out.is_meta:
            if len(self.empties) > 4096:  # only the latest matter: a parameter is registered right after
                self.empties.clear()
            self.empties[out.data_ptr()] = True
            return out
        if not args:
            return out
        found = self.target(args[0])
        if found is not None and name == "__get__" and getattr(func, "__self__", None) is not _DATA:
            return out  # p.shape, p.is_meta, ...: not a tensor of the parameter's values
        writes = name.endswith("_") and not name.startswith("_") or name == "__setitem__"
        if writes and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            if found is not None:
                self.record(found, func, args, kwargs, f"Tensor.{name}")
            elif args[0]._base is not None and built(args[0]._base):
                self.errors.append(
                    f"Tensor.{name} on a view of parameter {_where(args[0]._base)} that build could not follow: "
                    "write the parameter itself (p[...] = v, or an nn.init function on it)"
                )
            return out
        aliased = name in ("__get__", "detach") or isinstance(out, torch.Tensor) and out._base is not None
        if found is not None and isinstance(out, torch.Tensor) and out.is_meta and aliased:
            if not _meta_args(args[1:], kwargs):  # the view can be made again from the real parameter
                param, chain = found
                step = () if name in ("__get__", "detach") else ((func, tuple(args[1:]), dict(kwargs)),)
                self.aliases[id(out)] = (weakref.ref(out), param, (*chain, *step))
        return out


def _generator_states(args, kwargs):
    """A generator passed to the call is cloned as it is now, so the replay draws what the call
    would have drawn from it."""
    gen = kwargs.get("generator")
    return None if not isinstance(gen, torch.Generator) else gen.get_state()


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Record, for the block, what the model's code does to its built parameters."""
    originals = {name: getattr(nn.init, name) for name in _INIT_FNS}

    def wrap(name, fn):
        def init_fn(tensor, *args, **kwargs):
            found = recorder.target(tensor)
            if found is None:
                return fn(tensor, *args, **kwargs)
            recorder.record(found, fn, (tensor, *args), kwargs, f"torch.nn.init.{name}")
            return tensor

        init_fn.__name__ = name
        return init_fn

    for name, fn in originals.items():
        setattr(nn.init, name, wrap(name, fn))
    try:
        with recorder:
            yield recorder
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


def keep_value(meta: torch.Tensor, value: torch.Tensor, recorder) -> None:
    """A small parameter's registered values are its start (nanoGPT's LayerNorm: torch.ones); a
    larger one's are dropped, and marked, unless torch.empty made them: if nothing in the block
    overwrites them, `initialize` refuses the parameter rather than put another init in their place."""
    empty = recorder is not None and recorder.made_empty(value)
    if value.numel() * value.element_size() <= KEEP_BYTES:
        meta._infinity_value = value.detach().clone()
    elif not empty and recorder is not None:
        meta._infinity_lost = True


def lost(p) -> bool:
    """Registered with values build could not keep, and nothing in the block overwrote them."""
    return getattr(p, "_infinity_lost", False)


def replayable(p) -> bool:
    return bool(getattr(p, "_infinity_ops", None)) or hasattr(p, "_infinity_value") or hasattr(p, "_infinity_replayed")


def replay(p: torch.Tensor) -> None:
    """``p`` (real now, its contents undefined) gets what the model's code did to it."""
    with torch.no_grad():
        value = getattr(p, "_infinity_value", None)
        if value is not None:
            p.copy_(value)
        for func, rest, kwargs, gen_state in getattr(p, "_infinity_ops", ()):
            if gen_state is not None:
                gen = torch.Generator()
                gen.set_state(gen_state)
                kwargs = {**kwargs, "generator": gen}
            func(p, *rest, **kwargs)
    # Done once (a tiled module's first tile makes it whole): the copies and call arguments go.
    p.__dict__.pop("_infinity_value", None)
    p.__dict__.pop("_infinity_ops", None)
    p._infinity_replayed = True
