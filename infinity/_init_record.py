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
the parameter's random stream ([Note: random streams of a build]). Values are bit-equal to a
plain build when the model draws them parameter by parameter in unit order (each module's constructor initialising its
own, as ``nn.Linear`` does); a second pass over the model (``apply(init)``) draws in a
different order, so the values are other draws of the same distributions. A call that cannot
be done again (its arguments include another tensor on the meta device, it writes a view
of a parameter that build could not follow, or writes through ``out=`` or a ``torch._foreach_``
call), and a parameter registered with values computed from a built one
(``nn.Parameter(w.data * 0.1)``), are errors when the ``build()`` block ends, naming the
parameter and the call. A larger parameter registered with values the constructor
computed (not ``torch.empty``) that nothing in the block overwrites is refused at `initialize`,
naming it: its values are gone, and another init in their place would be silent.

[Note: random streams of a build]
On the meta device nothing is drawn: the global random generator, and a torch.Generator the
model's code passes to its init calls, stay where they were while the block runs. So a change
of one's state in the block is a reseed (``torch.manual_seed`` in a constructor) or a real
draw, and starts a new stream (`Stream`): its state then. A parameter's values are drawn at
`initialize` from the global stream current at the recorded call they start from (the last
that overwrites it whole, else its first; its registration where it has none), a call given
a generator from that generator's stream; the units of one
stream draw from it in unit order, each on from where the one before left it, across engines
too. So a model built after ``torch.manual_seed(s)`` gets the same values on every run; one
whose constructor draws them parameter by parameter in unit order gets a plain build's values,
after a reseed between its layers and for calls that share a generator too; and models built
one after another in a block, initialised in that order, get a plain build's values each. At
the end of the block each generator it drew from (`Recorder.move_on`) goes on from a stream
apart from the one the values come from, seeded from a hash of that one's state (the same on
every run): numbers drawn after the block (data, dropout) are not those the weights are made
of, as they were when it stayed where it began, and a model in a second block gets other
values than the first. They are not the numbers a plain build leaves it at, which exist only
once the values are drawn, at `initialize`. A real draw in the block (a buffer from
``torch.rand``) still takes the numbers the parameters before it are drawn from.
"""

from __future__ import annotations

import contextlib
import hashlib
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


class Stream:
    """A random stream the initial values are drawn from at `initialize`, one per segment of the
    block's draws: the state a random generator had when the segment began (see [Note: random
    streams of a build]), moved on as each unit's values are drawn from it."""

    __slots__ = ("state", "_generator")

    def __init__(self, state: torch.Tensor):
        self.state = state
        self._generator = None

    def generator(self) -> torch.Generator:
        """A generator of its own, drawing on where the last call that used it left off (a
        torch.Generator the model's code passed to its init calls)."""
        if self._generator is None:
            self._generator = torch.Generator()
            self._generator.set_state(self.state)
        return self._generator


def derived_seed(state: torch.Tensor) -> int:
    """A seed for a stream apart from the one ``state`` starts (see [Note: random streams of a build])."""
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8, person=b"infinity.build").digest()
    return int.from_bytes(digest, "little") >> 1


class _Source:
    """The streams of one random generator in the block: a new one each time its state changed
    since the last look (a reseed, or a real draw), since nothing drawn on the meta device moves it."""

    def __init__(self, get_state):
        self.get_state = get_state
        self.stream = None

    def current(self) -> Stream:
        now = self.get_state()
        if self.stream is None or not torch.equal(now, self.stream.state):
            self.stream = Stream(now)
        return self.stream


class Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        # id(tensor) -> (weakref to it, its parameter, the view calls that make it from the
        # parameter): `p.data` (no calls), `p[0]`, `p.data.view(-1)`, ...
        self.aliases = {}
        self.errors = []
        # The global random state's streams ([Note: random streams of a build]), and those of
        # each torch.Generator the model's code passed (id -> (the generator, its streams)).
        self.rng = _Source(torch.get_rng_state)
        self.generators: dict[int, tuple[torch.Generator, _Source]] = {}
        # data_ptr -> True for the tensors torch.empty made in the block: a parameter registered
        # with one of those has no values of its own to lose (nn.Linear's, before its init).
        self.empties = {}
        # The meta tensors computed from a built parameter's values, by storage (a Parameter
        # made of one shares it): storage id -> (the storage, kept for the block, so that its id
        # is not another's; the call and the parameter, for the error). See `computed_from`.
        self.computed = {}

    def computed_from(self, t) -> str | None:
        """What a meta tensor registered as a parameter was computed from, where it was computed
        from a built parameter (``nn.Parameter(layer.weight.data * 0.1)``): its values would
        exist only at `initialize`, and nothing records the computation."""
        entry = self.computed.get(t.untyped_storage()._cdata)
        return None if entry is None else entry[1]

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
        overwrites = not chain and (_name(func) in _OVERWRITE or what.startswith("torch.nn.init"))
        ops = param.__dict__.setdefault("_infinity_ops", [])
        if overwrites or not ops:  # its values are drawn from the stream current at the call they start from
            param._infinity_rng = self.rng.current()
        if overwrites:
            ops.clear()  # what came before is overwritten: not run again (and not kept)
            param.__dict__.pop("_infinity_value", None)
            param.__dict__.pop("_infinity_lost", None)
        ops.append((_OnView(chain, func) if chain else func, tuple(args[1:]), dict(kwargs), self._stream_of(kwargs)))

    def _stream_of(self, kwargs) -> Stream | None:
        """The stream of the generator passed to the call (None: the global one's, the
        parameter's). Calls that share a generator draw on from one another at `initialize`."""
        gen = kwargs.get("generator")
        if not isinstance(gen, torch.Generator):
            return None
        if id(gen) not in self.generators:
            self.generators[id(gen)] = (gen, _Source(gen.get_state))
        return self.generators[id(gen)][1].current()

    def move_on(self) -> None:
        """At the end of the block: each generator the block drew from on the meta device (the
        global one, and those passed to init calls) goes on from a stream apart from the one
        `initialize` draws the values from, not from where it began ([Note: random streams of a build])."""
        if self.rng.stream is not None:
            torch.default_generator.manual_seed(derived_seed(self.rng.stream.state))
        for gen, source in self.generators.values():
            gen.manual_seed(derived_seed(source.stream.state))

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
        self._unrecorded_writes(name, args, kwargs)
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
        elif isinstance(out, torch.Tensor) and out.is_meta and not aliased:
            source = found or next((f for a in (*args[1:], *kwargs.values()) if (f := self.target(a)) is not None), None)
            if source is None and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                storage = self.computed.get(args[0].untyped_storage()._cdata)  # computed on from a computed one
                source = None if storage is None else (None, storage[1])
            if source is not None:
                what = source[1] if source[0] is None else f"{name} of parameter {_where(source[0])}"
                storage = out.untyped_storage()
                self.computed[storage._cdata] = (storage, what)
        return out

    def _unrecorded_writes(self, name, args, kwargs) -> None:
        """Writes into a built parameter build cannot do again (the values would be the
        registered ones, or torch.empty's, with nothing said): through ``out=``, and torch's
        ``_foreach_`` in-place calls over lists of tensors."""
        outs = kwargs.get("out")
        for t in outs if isinstance(outs, (list, tuple)) else (outs,):
            found = self.target(t) if isinstance(t, torch.Tensor) else None
            if found is not None:
                self.errors.append(f"torch.{name}(..., out=...) writes parameter {_where(found[0])}, which build "
                                   "does not record: write it with an nn.init function or an in-place method "
                                   "(p.normal_(...), p.copy_(...))")  # fmt: skip
        if name.startswith("_foreach_") and name.endswith("_") and isinstance(args[0], (list, tuple)):
            for t in args[0]:
                found = self.target(t)
                if found is not None:
                    self.errors.append(f"torch.{name} writes parameter {_where(found[0])}, which build does not "
                                       "record: write each parameter with its in-place method (p.mul_(...))")  # fmt: skip
                    break


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
        for func, rest, kwargs, stream in getattr(p, "_infinity_ops", ()):
            if stream is not None:  # the generator the call was given: the values it would draw
                kwargs = {**kwargs, "generator": stream.generator()}
            func(p, *rest, **kwargs)
    # Done once (a tiled module's first tile makes it whole): the copies and call arguments go.
    p.__dict__.pop("_infinity_value", None)
    p.__dict__.pop("_infinity_ops", None)
    p._infinity_replayed = True
