"""`build`: construct a model with its parameters on the meta device, initialise it at
`initialize`, one unit at a time, with the model's own initialisation (DeepSpeed's zero.Init).

Owns: the parameter-registration hook that puts every parameter made inside
``with infinity.build(...)`` on the meta device (no memory, no initialisation work; buffers
stay real, since models compute them in their constructors), and `materialize`, which
`initialize` calls for one unit at a time: allocate its parameters, run the model's own
initialisation for them, hand them over to the tiers, free them. Touches: module hooks, the
units; nothing of the I/O.

[Note: meta initialisation]
What runs for a unit owned by module M is what ``post_init`` runs over the whole model, for
M's parameters: transformers' ``_init_weights`` of the nearest ``PreTrainedModel`` at or above
each module, on M and then each of its ancestors (``post_init`` goes children first, so a
parent's init, such as GPT-2's scaled ``c_proj``, has the last word); the other units'
parameters are still on the meta device meanwhile, where an init is a no-op. A model without
transformers' ``_init_weights`` gets, per parameter, what its own code did to it in the block
(recorded: [Note: recorded initialisation] in `_init_record`), and a parameter it did nothing
recordable to gets ``M.reset_parameters()``. A module with such a parameter and no
``reset_parameters()`` is an error at `initialize` naming it: initialise it in the block, give
it a ``reset_parameters()``, or construct the model outside ``build()``. A transformers model
whose whole-model init does more than per-module inits (a custom ``post_init``) must do that
again after `initialize`, for instance through ``engine.module.load_state_dict``.
Only what `build` put on the meta device is filled: a parameter with values of its own (a
wrapper's adapter, a module made outside the block) is hidden from the inits and keeps them,
and a meta parameter `build` did not make (peft on a built model) is refused, since nothing
knows its initialisation (see [Note: wrapping a built model] in `_wrap`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
from torch import nn

from . import _resources
from . import _init_record
from ._units import swap_contents


@contextlib.contextmanager
def build(config=None, *, init: bool = True):
    """Construct a model inside ``with infinity.build():`` and its parameters take no memory
    and no time until `initialize` fills them, one unit at a time, with the model's own
    initialisation (see [Note: meta initialisation]), straight into the tiers. ``config`` is
    accepted for symmetry with `initialize` and not needed. ``init=False``: the values are
    zeros, for weights that a checkpoint overwrites anyway (`from_pretrained`)."""

    # The random streams `initialize` draws the initial values from: [Note: random streams of a build].
    _resources.pin_malloc_threshold()  # before the parameters made and dropped here (see [Note: malloc threshold])

    made = []
    recorder = _init_record.Recorder() if init else None

    def on_parameter(module, name, param):
        if param is None:
            return None
        meta = param  # made on the meta device in the block (torchtitan's way): build's all the same
        computed = recorder.computed_from(param) if recorder is not None and param.is_meta else None
        if computed is not None:
            recorder.errors.append(
                f"parameter '{type(module).__name__}.{name}' {tuple(param.shape)} is registered with values "
                f"computed from another built parameter ({computed}), which exist only once initialize has made "
                "them, and build does not record the computation: register it with torch.empty and write it with "
                "an nn.init function or an in-place method (p.copy_(...) of a real tensor)"
            )
        if param.device.type != "meta":
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            if init:
                _init_record.keep_value(meta, param, recorder)
        if recorder is not None:  # (an init call in the block may give it the stream current then)
            meta._infinity_rng = recorder.rng.current()
        meta._infinity_init = init
        made.append(meta)
        meta._infinity_where = f"{type(module).__name__}.{name}"
        if isinstance(module, nn.RNNBase):  # its weak references to its weights: see `_units.swap_contents`
            meta._infinity_rnn = weakref.ref(module)
        return meta if meta is not param else None

    handle = nn.modules.module.register_module_parameter_registration_hook(on_parameter)
    restore = _refuse_hf_from_pretrained()
    try:
        with _init_record.recording(recorder) if init else contextlib.nullcontext():
            yield
    finally:
        handle.remove()
        restore()
    if recorder is not None and recorder.errors:  # see [Note: recorded initialisation]
        raise ValueError(
            "infinity.build() cannot initialise the model as its own code does: "
            + "; ".join(dict.fromkeys(recorder.errors))
            + ". Construct the model outside build(), or initialise it in a way build records"
        )
    if recorder is not None and made:
        recorder.move_on()


def _refuse_hf_from_pretrained():
    """Inside `build`, transformers' own ``from_pretrained`` would load weights into parameters
    on the meta device: make it a clear error that names the way that works."""
    transformers = sys.modules.get("transformers")
    cls = getattr(transformers, "PreTrainedModel", None)
    if cls is None:
        return lambda: None
    original = cls.__dict__["from_pretrained"]

    def refuse(model_cls, *args, **kwargs):
        raise ValueError(
            f"{model_cls.__name__}.from_pretrained inside infinity.build(): the weights would go to parameters "
            "on the meta device. Use infinity.from_pretrained(ModelClass, path, config), which streams the "
            "checkpoint into the tiers, outside build()"
        )

    cls.from_pretrained = classmethod(refuse)

    def restore():
        cls.from_pretrained = original

    return restore


def on_meta(unit) -> bool:
    return any(p.device.type == "meta" for p in unit.params)


@contextlib.contextmanager
def _drawing(params):
    """Draw the values of ``params`` (a unit's built ones) from the random stream of the first,
    on from where the last unit drawn from it left it (the global random state as it was is
    back after `initialize`: torch.random.fork_rng)."""
    stream = next((p._infinity_rng for p in params if getattr(p, "_infinity_rng", None) is not None), None)
    if stream is None:
        yield
        return
    torch.set_rng_state(stream.state)
    try:
        yield
    finally:
        stream.state = torch.get_rng_state()


def materialize(model: nn.Module, unit, modules: dict[str, nn.Module]) -> None:
    """Give ``unit``'s parameters memory (host) and their initial values, as the model's
    initialisation would (see [Note: meta initialisation])."""
    path = "" if unit.path == "<root>" else unit.path
    owner = modules[path]
    if unit.is_tile and not on_meta(unit):  # an earlier tile of the module made its values
        return
    # Only what build put on the meta device gets values here; a parameter with values of its
    # own (a wrapper's adapter beside a built base) keeps them.
    empty = [p for p in unit.params if p.is_meta]
    _refuse_foreign_meta(unit, modules)
    if not all(getattr(p, "_infinity_init", True) for p in empty):  # a checkpoint will fill them
        for p in empty:  # zeros that take no memory (stride 0): only read, then replaced
            _swap(p, torch.zeros((), dtype=p.dtype, device="cpu").expand(p.shape))
        return
    for p in empty:  # the Parameter objects stay (groups, ties hold them): their contents change
        _swap(p, torch.empty(p.shape, dtype=p.dtype, device="cpu"))
    chain = [path]  # the module, then its ancestors up to the root: post_init's order
    while chain[-1]:
        chain.append(chain[-1].rpartition(".")[0])
    with _drawing(empty):
        _initialise(unit, owner, chain, empty, modules, _hf_init(model, chain, modules))


def _initialise(unit, owner, chain, empty, modules, init) -> None:
    """``unit``'s built parameters (``empty``, real now) get the model's initialisation: ``init``
    (where -> transformers' ``_init_weights``) or the calls recorded in the block, else
    ``owner.reset_parameters()``."""
    if init is None:  # the model's own calls, recorded in the block (see [Note: recorded initialisation])
        for p in empty:
            if _init_record.replayable(p):
                _init_record.replay(p)
        empty = [p for p in empty if not _init_record.replayable(p)]
        if not empty:
            return
        for i, p in enumerate(unit.params):
            if any(p is q for q in empty) and _init_record.lost(p):
                raise ValueError(
                    f"parameter {unit.qualified_name(i)!r} {tuple(p.shape)} was registered inside infinity.build "
                    f"with values its module's constructor computed (more than {_init_record.KEEP_BYTES} bytes, not "
                    "kept) and nothing in the block initialised it again: initialise it with a torch.nn.init call "
                    "(or an in-place normal_/fill_/copy_) in the model's code, or construct the model outside build()"
                )
    filling = {id(p) for p in empty}
    with torch.no_grad(), _guard(), _hidden(modules, filling):
        if init is not None:
            for where in chain:
                fn = init(where)
                if fn is not None:
                    fn(modules[where])
        elif hasattr(owner, "reset_parameters"):
            owner.reset_parameters()
        else:
            raise ValueError(
                f"module {unit.path!r} ({type(owner).__name__}) was built on the meta device by infinity.build and "
                "has no reset_parameters() to initialise its parameters: give it one, or construct the model "
                "outside build()"
            )


def _refuse_foreign_meta(unit, modules) -> None:
    """A parameter on the meta device that `build` did not put there has no values anywhere and
    no initialisation of its own to run: peft's ``get_peft_model`` on a built model moves each
    adapter to its base layer's device, the meta device, and the model's init would then give
    it the base's distribution (lora_B not zero). Refuse it, naming the way that keeps them."""
    for i, p in enumerate(unit.params):
        if p.is_meta and not hasattr(p, "_infinity_init") and _built_model(modules):
            raise ValueError(
                f"parameter {unit.qualified_name(i)!r} is on the meta device but infinity.build did not put it "
                "there (a wrapper such as peft.get_peft_model applied to a built model moves what it adds to the meta "
                "device, losing its initialisation): pass the wrapper to infinity.from_pretrained(ModelClass, "
                "path, config, wrap=fn), which streams the base in and keeps the wrapper's values, or apply it "
                "to a model constructed outside infinity.build()"
            )


def _built_model(modules) -> bool:
    """Whether `build` made any of the model's parameters (a model put on the meta device some
    other way is initialised by its own init, all of it)."""
    return any(hasattr(p, "_infinity_init") for m in modules.values() for p in m._parameters.values() if p is not None)


@contextlib.contextmanager
def _hidden(modules: dict[str, nn.Module], filling: set[int]):
    """Every parameter with values, other than those being filled (``filling``: ids), on the
    meta device while the model's inits run: a parent's init reaches its whole subtree (GPT-2's
    ``c_proj`` pass), and would overwrite the values of units that did not come from `build`
    (a wrapper's adapters, a module made outside the block). Their contents come back after."""
    kept, seen = [], set()
    for m in modules.values():
        for p in m._parameters.values():
            if p is None or id(p) in seen or id(p) in filling or p.is_meta:
                continue
            seen.add(id(p))
            holder = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, holder)  # p is meta now; holder has its contents and attributes
            kept.append((p, holder))
    try:
        yield
    finally:
        for p, holder in kept:
            torch.utils.swap_tensors(p, holder)


def release(unit) -> None:
    """The unit's parameters back on the meta device (their values are in the tiers now), where
    the initialisation of a later unit's ancestors leaves them alone. A tile's stay until its
    module's last tile has taken its rows."""
    if not unit.last_tile:
        return
    for p in unit.params:
        _swap(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))


def _swap(p: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``p`` the contents of ``value`` in place, keeping its attributes (``.data`` cannot
    move a tensor off the meta device)."""
    swap_contents(p, value)


def _hf_init(model, chain, modules):
    """where -> the ``_init_weights`` of the nearest transformers PreTrainedModel at or above
    it, or None when the model has none."""
    transformers = sys.modules.get("transformers")  # a transformers model means it is imported already
    PreTrainedModel = getattr(transformers, "PreTrainedModel", None)
    if PreTrainedModel is None:
        return None
    if not any(isinstance(modules[w], PreTrainedModel) for w in chain):
        return None

    def init(where):
        for above in chain[chain.index(where):]:
            m = modules[above]
            if isinstance(m, PreTrainedModel):
                return m._init_weights
        return None

    return init


def _guard():
    if "transformers" not in sys.modules:  # not a transformers model: nothing to guard (and no import)
        return contextlib.nullcontext()
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:
        return contextlib.nullcontext()
    return guard_torch_init_functions()
